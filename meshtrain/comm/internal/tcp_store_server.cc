#include "meshtrain/comm/internal/tcp_store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <vector>

#include "meshtrain/comm/internal/tcp_store_wire.h"
#include "meshtrain/comm/store.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::internal {
namespace {

using Clock = std::chrono::steady_clock;

// Connections beyond this are accepted and closed at once: a job has one
// client per process, and each costs a pollfd and buffers.
constexpr size_t kMaxClients = 16384;
constexpr size_t kReadChunk = 64 * 1024;
// Connections that have not yet shown themselves (with a token: sent their
// hello; without one: a first request) are held at most this long and at
// most this many in all and per peer address; past a limit the oldest such
// connection is closed for the new one, so idle or slow connections never
// keep a job's own clients (which send their hello at once) out.
constexpr auto kHelloTimeout = std::chrono::seconds(10);
constexpr size_t kMaxPending = 1024;
constexpr size_t kMaxPendingPerAddress = 128;
// What a connection may send before its hello is checked: one hello frame.
constexpr size_t kMaxHelloFrameBytes = 1 + 4 + kMaxTokenBytes;

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

// "ip:port" ("[ip]:port" for IPv6) of an accepted peer.
std::string peer_name(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
    ::inet_ntop(AF_INET6, &a.sin6_addr, text, sizeof(text));
    return fmt::format("[{}]:{}", text, ntohs(a.sin6_port));
  }
  const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
  ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof(text));
  return fmt::format("{}:{}", text, ntohs(a.sin_port));
}

struct Client {
  int fd = -1;
  std::string peer;        // "ip:port", for the refusal's log line
  std::string address;     // the peer's address without the port
  Clock::time_point accepted;
  bool greeted = false;    // sent a hello with the server's token (no token: any first request)
  std::string in;          // bytes received, not yet handled
  std::string out;         // answers not yet sent
  bool parked = false;     // a get/wait of this client waits for keys
  bool closing = false;    // refused a malformed request: close once `out` is sent
};

struct Waiter {
  uint64_t client = 0;
  StoreOp op = StoreOp::get;
  std::vector<std::string> keys;
  Clock::time_point deadline;
};

// The server thread's state. Nothing here is shared with other threads.
class Loop {
 public:
  Loop(int listen_fd, int wake_fd, std::string token)
      : listen_fd_(listen_fd), wake_fd_(wake_fd), token_(std::move(token)) {}
  ~Loop() {
    for (auto& [id, c] : clients_) ::close(c.fd);
    if (spare_fd_ >= 0) ::close(spare_fd_);
  }

  void run() {
    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;
    for (;;) {
      fds.clear();
      ids.clear();
      fds.push_back({wake_fd_, POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& [id, c] : clients_) {
        // A client with a parked request (or a full buffer) is still polled
        // for input, so that its hang-up is seen at once; handle() leaves
        // its later requests in the buffer.
        short ev = c.in.size() < read_limit(c) ? POLLIN : 0;
        if (!c.out.empty()) ev |= POLLOUT;
        fds.push_back({c.fd, ev, 0});
        ids.push_back(id);
      }
      const int rc = ::poll(fds.data(), fds.size(), poll_timeout_ms());
      if (rc < 0 && errno != EINTR) return;  // cannot go on: closing every connection tells the clients
      if (fds[0].revents) return;            // the owner is stopping the server
      if (fds[1].revents & POLLIN) accept_all();
      for (size_t i = 2; i < fds.size(); ++i) {
        auto it = clients_.find(ids[i - 2]);
        if (it == clients_.end()) continue;
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
          if (!read_from(it->second)) {
            drop(it->first);
            continue;
          }
        }
        handle(it->first);
        if (!flush(it->second)) drop(it->first);
        resume();
      }
      expire_waiters();
      expire_pending();
      resume();
    }
  }

 private:
  // Whether the connection has shown itself (see kHelloTimeout).
  bool pending(const Client& c) const { return !c.greeted; }
  // The most bytes buffered from a connection before they are handled.
  size_t read_limit(const Client& c) const {
    return pending(c) && !token_.empty() ? 4 + kMaxHelloFrameBytes : kMaxFrameBytes + 4;
  }

  // Closes pending connections older than kHelloTimeout (logged once per
  // sweep, not per connection: a scan of the port should not flood stderr).
  void expire_pending() {
    const auto now = Clock::now();
    size_t closed = 0;
    std::string some;
    for (auto it = clients_.begin(); it != clients_.end();) {
      auto next = std::next(it);
      if (pending(it->second) && now - it->second.accepted >= kHelloTimeout) {
        if (some.empty()) some = it->second.peer;
        ++closed;
        drop(it->first);
      }
      it = next;
    }
    if (closed > 0) {
      fmt::print(stderr, "meshtrain store: closed {} connection(s) (the first from {}) that sent no {} within {} s\n",
                 closed, some, token_.empty() ? "request" : "job token", kHelloTimeout.count());
      std::fflush(stderr);
    }
  }

  // Closes the oldest pending connection (of `address`, if given); false
  // when there is none.
  bool evict_pending(const std::string* address) {
    auto oldest = clients_.end();
    for (auto it = clients_.begin(); it != clients_.end(); ++it)
      if (pending(it->second) && (!address || it->second.address == *address) &&
          (oldest == clients_.end() || it->second.accepted < oldest->second.accepted))
        oldest = it;
    if (oldest == clients_.end()) return false;
    drop(oldest->first);
    return true;
  }

  // The connection has shown itself: no longer pending.
  void mark_shown(Client& c) {
    if (c.greeted) return;
    c.greeted = true;
    forget_pending(c.address);
  }
  void forget_pending(const std::string& address) {
    --pending_;
    auto it = pending_at_.find(address);
    if (it != pending_at_.end() && --it->second == 0) pending_at_.erase(it);
  }

  int poll_timeout_ms() const {
    auto next = Clock::time_point::max();
    for (const auto& w : waiters_) next = std::min(next, w.deadline);
    for (const auto& [id, c] : clients_)
      if (pending(c)) next = std::min(next, c.accepted + kHelloTimeout);
    if (next == Clock::time_point::max()) return -1;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(left + 1, 0, 60'000));
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors: a pending connection makes room, else the
        // spare descriptor lets this one in to be closed (the listening
        // socket would stay readable and poll() spin otherwise).
        const int err = errno;
        if (err != EMFILE && err != ENFILE) return;  // EAGAIN: no more; other errors: the client retries
        if (!evict_pending(nullptr) && !shed_one()) return;
        continue;
      }
      Client c;
      c.fd = fd;
      c.peer = peer_name(addr);
      c.address = c.peer.substr(0, c.peer.rfind(':'));
      c.accepted = Clock::now();
      if (clients_.size() >= kMaxClients && !evict_pending(nullptr)) {
        ::close(fd);
        continue;
      }
      const auto here = pending_at_.find(c.address);
      if (here != pending_at_.end() && here->second >= kMaxPendingPerAddress) evict_pending(&c.address);
      else if (pending_ >= kMaxPending) evict_pending(nullptr);
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ++pending_;
      ++pending_at_[c.address];
      clients_[next_id_++] = std::move(c);
    }
  }

  // Takes one connection off the backlog and closes it, with the spare
  // descriptor kept for the purpose.
  // False when nothing was taken.
  bool shed_one() {
    if (spare_fd_ < 0) return false;
    ::close(spare_fd_);
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) ::close(fd);
    spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    return fd >= 0;
  }

  // Returns false when the client is gone (closed, reset, or error). Reads
  // through one buffer of the loop's: a connection's own buffer holds only
  // what it sent (a pending one at most a hello).
  bool read_from(Client& c) {
    for (;;) {
      const size_t limit = read_limit(c);
      if (c.in.size() >= limit) return true;  // handle() first
      const size_t want = std::min(chunk_.size(), limit - c.in.size());
      const ssize_t n = ::recv(c.fd, chunk_.data(), want, MSG_DONTWAIT);
      if (n > 0) {
        c.in.append(chunk_.data(), static_cast<size_t>(n));
        continue;
      }
      if (n == 0) return false;
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
  }

  // Returns false when the client must be dropped.
  bool flush(Client& c) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      return false;
    }
    return !c.closing;
  }

  void drop(uint64_t id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    if (pending(it->second)) forget_pending(it->second.address);
    ::close(it->second.fd);
    clients_.erase(it);
    waiters_.remove_if([&](const Waiter& w) { return w.client == id; });
  }

  // Handles every complete request in the client's buffer, in order, until
  // one is parked.
  void handle(uint64_t id) {
    Client& c = clients_.at(id);
    while (!c.parked && !c.closing && c.in.size() >= 4) {
      const auto* p = reinterpret_cast<const unsigned char*>(c.in.data());
      const uint32_t n = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
      if (n == 0 || n > kMaxFrameBytes) {
        refuse(c, fmt::format("message of {} bytes (at most {})", n, kMaxFrameBytes));
        return;
      }
      // Before its hello is checked a connection sends nothing larger.
      if (pending(c) && !token_.empty() && n > kMaxHelloFrameBytes) return refuse_token(c);
      if (c.in.size() < 4 + size_t{n}) return;  // wait for the rest
      const std::string body = c.in.substr(4, n);
      c.in.erase(0, 4 + size_t{n});
      try {
        request(id, c, body);
      } catch (const WireError& e) {
        refuse(c, fmt::format("malformed request: {}", e.what));
      }
    }
  }

  // Answers with an error and closes the connection once it is sent: after
  // a malformed message the stream cannot be trusted to be in step.
  void refuse(Client& c, const std::string& why) {
    answer_error(c, why);
    c.closing = true;
    c.in.clear();
  }

  // A connection that did not start with a hello carrying the server's
  // token: told so, closed, and logged (someone is knocking on the port).
  void refuse_token(Client& c) {
    fmt::print(stderr, "meshtrain store: refused a connection from {}: wrong or missing job token\n", c.peer);
    std::fflush(stderr);
    refuse(c, std::string(kRefusedToken));
  }

  static void answer(Client& c, FrameWriter& w) { c.out += w.finish("TcpStore server"); }
  static void answer_ok(Client& c) {
    FrameWriter w;
    w.u8(static_cast<uint8_t>(StoreStatus::ok));
    answer(c, w);
  }
  static void answer_error(Client& c, std::string_view why) {
    FrameWriter w;
    w.u8(static_cast<uint8_t>(StoreStatus::error)).str(why);
    answer(c, w);
  }

  static Clock::time_point deadline_of(uint64_t timeout_ms) {
    const auto t = std::min<uint64_t>(timeout_ms, static_cast<uint64_t>(kMaxStoreTimeout.count()));
    return Clock::now() + std::chrono::milliseconds(t);
  }

  void request(uint64_t id, Client& c, const std::string& body) {
    FrameReader r(body);
    const uint8_t op = r.u8();
    if (static_cast<StoreOp>(op) == StoreOp::hello) {
      const std::string token = r.str(kMaxTokenBytes);
      r.expect_end();
      // A server without a token takes any: one client option works with both.
      if (!token_.empty() && !tokens_equal(token, token_)) return refuse_token(c);
      mark_shown(c);
      answer_ok(c);
      return;
    }
    if (!token_.empty() && !c.greeted) return refuse_token(c);
    mark_shown(c);  // without a token: a first request shows the client
    switch (static_cast<StoreOp>(op)) {
      case StoreOp::hello: break;  // handled above
      case StoreOp::set: {
        std::string key = r.str(kMaxStoreKeyBytes);
        std::string value = r.str(kMaxStoreValueBytes);
        r.expect_end();
        if (key.empty()) throw WireError{"empty key"};
        data_.insert_or_assign(std::move(key), std::move(value));
        answer_ok(c);
        wake_waiters();
        return;
      }
      case StoreOp::get:
      case StoreOp::wait: {
        Waiter w;
        w.client = id;
        w.op = static_cast<StoreOp>(op);
        if (w.op == StoreOp::get) {
          w.keys.push_back(r.str(kMaxStoreKeyBytes));
          if (w.keys.back().empty()) throw WireError{"empty key"};
        } else {
          w.keys = r.keys();
        }
        w.deadline = deadline_of(r.u64());
        r.expect_end();
        if (!try_answer(c, w)) {
          c.parked = true;
          waiters_.push_back(std::move(w));
        }
        return;
      }
      case StoreOp::add: {
        const std::string key = r.str(kMaxStoreKeyBytes);
        const auto delta = static_cast<int64_t>(r.u64());
        r.expect_end();
        if (key.empty()) throw WireError{"empty key"};
        auto it = data_.find(key);
        int64_t v;
        try {
          v = add_to_counter("TcpStore::add", key, it == data_.end() ? nullptr : &it->second, delta);
        } catch (const InvalidArgument& e) {
          answer_error(c, e.detail());  // the caller's mistake: the connection stays usable
          return;
        }
        data_.insert_or_assign(key, std::to_string(v));
        FrameWriter w;
        w.u8(static_cast<uint8_t>(StoreStatus::ok)).u64(static_cast<uint64_t>(v));
        answer(c, w);
        wake_waiters();
        return;
      }
      case StoreOp::check: {
        const std::vector<std::string> keys = r.keys();
        r.expect_end();
        const bool all = std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return data_.contains(k); });
        FrameWriter w;
        w.u8(static_cast<uint8_t>(StoreStatus::ok)).u8(all ? 1 : 0);
        answer(c, w);
        return;
      }
      case StoreOp::delete_key: {
        const std::string key = r.str(kMaxStoreKeyBytes);
        r.expect_end();
        const bool existed = data_.erase(key) > 0;
        FrameWriter w;
        w.u8(static_cast<uint8_t>(StoreStatus::ok)).u8(existed ? 1 : 0);
        answer(c, w);
        return;
      }
    }
    refuse(c, fmt::format("unknown opcode {}", op));
  }

  // Answers a get/wait whose keys all exist; false if some are missing.
  bool try_answer(Client& c, const Waiter& w) {
    for (const auto& k : w.keys)
      if (!data_.contains(k)) return false;
    FrameWriter out;
    out.u8(static_cast<uint8_t>(StoreStatus::ok));
    if (w.op == StoreOp::get) out.str(data_.at(w.keys.front()));
    answer(c, out);
    return true;
  }

  // After a set or add: answers every parked request whose keys now exist.
  // Their clients' next requests are handled later, by resume(): handling
  // them here could set keys and re-enter this loop.
  void wake_waiters() {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      Client& c = clients_.at(it->client);
      if (try_answer(c, *it)) {
        unpark(*it);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void expire_waiters() {
    const auto now = Clock::now();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      Client& c = clients_.at(it->client);
      FrameWriter w;
      w.u8(static_cast<uint8_t>(StoreStatus::timeout));
      std::vector<std::string> missing;
      for (const auto& k : it->keys)
        if (!data_.contains(k)) missing.push_back(k);
      w.u32(static_cast<uint32_t>(missing.size()));
      for (const auto& k : missing) w.str(k);
      answer(c, w);
      unpark(*it);
      it = waiters_.erase(it);
    }
  }

  void unpark(const Waiter& w) {
    clients_.at(w.client).parked = false;
    resumed_.push_back(w.client);
  }

  // Sends the answers of unparked clients and handles the requests they
  // queued meanwhile (which may unpark others in turn).
  void resume() {
    while (!resumed_.empty()) {
      const uint64_t id = resumed_.back();
      resumed_.pop_back();
      auto it = clients_.find(id);
      if (it == clients_.end()) continue;
      handle(id);
      if (!flush(it->second)) drop(id);
    }
  }

  int listen_fd_, wake_fd_;
  int spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // see shed_one()
  size_t pending_ = 0;  // connections that have not shown themselves, in all and per address
  std::map<std::string, size_t, std::less<>> pending_at_;
  std::string chunk_ = std::string(kReadChunk, '\0');  // read_from's buffer
  const std::string token_;  // empty: no token needed
  std::map<uint64_t, Client> clients_;
  uint64_t next_id_ = 1;
  std::list<Waiter> waiters_;
  std::vector<uint64_t> resumed_;  // clients unparked since the last resume()
  std::map<std::string, std::string, std::less<>> data_;
};

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, std::string token)
    : token_(std::move(token)) {
  // Room for kMaxClients connections: the soft descriptor limit (often 1024)
  // raised toward the hard one, as far as this process may.
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < kMaxClients + 256 &&
                   rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, kMaxClients + 256);
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  const std::string where = fmt::format("{}:{}", host.empty() ? "*" : host, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const bool any = host.empty() || host == "0.0.0.0";
  if (any) hints.ai_family = AF_INET;
  if (int rc = ::getaddrinfo(any ? nullptr : host.c_str(), service.c_str(), &hints, &res); rc != 0)
    throw InvalidArgument("TcpStore server", fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc)),
                          "give the server a local host name or address (MASTER_ADDR on rank 0)");
  int last_errno = 0;
  for (addrinfo* a = res; a && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    // A restarted job may reuse the port while the old connections linger
    // in TIME_WAIT.
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      listen_fd_ = fd;
    } else {
      last_errno = errno;
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0)
    throw IoError("TcpStore server", fmt::format("cannot listen on {}: {}", where, std::strerror(last_errno)),
                  last_errno == EADDRINUSE ? "another process uses this port: pick another MASTER_PORT, or 0 for any "
                                             "free port"
                                           : "give rank 0 an address of its own host");
  set_nonblocking(listen_fd_);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (::pipe2(wake_, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(listen_fd_);
    throw IoError("TcpStore server", fmt::format("pipe: {}", std::strerror(e)), "the process is out of descriptors");
  }
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  const char b = 1;
  // The thread exits on any byte; the pipe is empty, so this write succeeds.
  [[maybe_unused]] const ssize_t n = ::write(wake_[1], &b, 1);
  thread_.join();
  ::close(wake_[0]);
  ::close(wake_[1]);
  ::close(listen_fd_);
}

void TcpStoreServer::run() {
  Loop loop(listen_fd_, wake_[0], token_);
  loop.run();
}  // ~Loop closes every client connection

}  // namespace meshtrain::comm::internal
