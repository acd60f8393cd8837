#include "meshtrain/comm/tcp_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "meshtrain/comm/internal/tcp_store_server.h"
#include "meshtrain/comm/internal/tcp_store_wire.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm {

using internal::FrameReader;
using internal::FrameWriter;
using internal::IoResult;
using internal::StoreOp;
using internal::StoreStatus;
using Clock = std::chrono::steady_clock;

namespace {

// How much longer than a get/wait's own deadline the client waits for the
// server's answer (the server answers at the deadline; this covers the
// network and a busy server) before it calls the server unresponsive.
std::chrono::milliseconds answer_grace(std::chrono::milliseconds timeout) {
  return std::chrono::milliseconds(1000) + timeout / 10;
}

// One non-blocking connect attempt, at most until `deadline`. Returns the
// connected socket or -1 with *err set.
int try_connect(const addrinfo& a, Clock::time_point deadline, int* err) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a.ai_protocol);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  // An attempt waits at most a second: the caller retries with backoff.
  const auto attempt = std::min(deadline, Clock::now() + std::chrono::seconds(1));
  const internal::IoResult r = internal::connect_within(fd, a.ai_addr, a.ai_addrlen, attempt, err);
  if (r != internal::IoResult::ok) {
    if (r == internal::IoResult::timeout) *err = ETIMEDOUT;
    ::close(fd);
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

}  // namespace

struct TcpStore::Answer {
  StoreStatus status = StoreStatus::ok;
  std::string body;  // after the status byte
};

TcpStore::TcpStore(TcpStoreOptions options) : Store(options.timeout), options_(std::move(options)) {
  check_timeout("TcpStore connect_timeout", options_.connect_timeout);
  if (!options_.is_server && options_.host.empty())
    throw InvalidArgument("TcpStore", "empty host", "give the store server's address (MASTER_ADDR)");
  if (options_.token.size() > internal::kMaxTokenBytes)
    throw InvalidArgument("TcpStore", fmt::format("job token of {} bytes", options_.token.size()),
                          fmt::format("use a token of at most {} bytes (e.g. 32 hex digits)", internal::kMaxTokenBytes));
  if (!options_.is_server && options_.port == 0)
    throw InvalidArgument("TcpStore", "port 0 on a client",
                          "only the server may pick any free port; clients need the port it reports (port())");
  port_ = options_.port;
  if (options_.is_server) {
    server_ = std::make_unique<internal::TcpStoreServer>(options_.host, options_.port, options_.token);
    port_ = server_->port();
  }
  std::lock_guard l(mu_);
  connect_locked("TcpStore");
}

TcpStore::~TcpStore() {
  disconnect_locked();
  server_.reset();
}

std::string TcpStore::where() const {
  return fmt::format("the store server at {}:{}", options_.host.empty() ? "127.0.0.1" : options_.host, port_);
}

void TcpStore::disconnect_locked() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void TcpStore::connect_locked(std::string_view op) {
  // The server's own client connects to it over loopback when it listens
  // on every interface.
  std::string host = options_.host;
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port_);
  const auto deadline = Clock::now() + options_.connect_timeout;
  auto backoff = std::chrono::milliseconds(5);
  int err = 0;
  for (;;) {
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
    if (rc != 0 && rc != EAI_AGAIN)
      throw InvalidArgument(std::string(op), fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc)),
                            "give the store server's host name or address (MASTER_ADDR)");
    for (addrinfo* a = res; a && fd_ < 0; a = a->ai_next) fd_ = try_connect(*a, deadline, &err);
    if (res) ::freeaddrinfo(res);
    if (fd_ >= 0) {
      if (!options_.token.empty()) {
        FrameWriter w;
        w.u8(static_cast<uint8_t>(StoreOp::hello)).str(options_.token);
        exchange_locked(op, w.finish(op), timeout());  // throws (and disconnects) when refused
      }
      return;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    // The server may not be up yet (rank 0 starts it): retry, more slowly
    // as time goes on, and once more at the deadline.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(250));
  }
  throw TimeoutError(std::string(op),
                     fmt::format("could not connect to {} within {} ms (last error: {})", where(),
                                 options_.connect_timeout.count(), err ? std::strerror(err) : "name lookup failed"),
                     "the server is started by the process with is_server (rank 0); check that it runs, that "
                     "MASTER_ADDR and MASTER_PORT name its host and port on every process, and that no firewall "
                     "blocks the port");
}

TcpStore::Answer TcpStore::call(std::string_view op, const std::string& request, std::chrono::milliseconds wait_for) {
  std::lock_guard l(mu_);
  if (fd_ < 0) connect_locked(op);
  return exchange_locked(op, request, wait_for);
}

TcpStore::Answer TcpStore::exchange_locked(std::string_view op, const std::string& request,
                                           std::chrono::milliseconds wait_for) {
  int err = 0;
  const auto send_deadline = Clock::now() + timeout();
  IoResult r = internal::send_all(fd_, request, send_deadline, &err);
  std::string body;
  if (r == IoResult::ok) r = internal::recv_frame(fd_, body, Clock::now() + wait_for + answer_grace(wait_for), &err);
  if (r != IoResult::ok) {
    // The connection may hold half a request or a late answer: start over
    // on the next call.
    disconnect_locked();
    switch (r) {
      case IoResult::closed:
        throw AbortedError(std::string(op), fmt::format("{} closed the connection", where()),
                           "the process that runs the server (rank 0) exited or failed; see its error");
      case IoResult::timeout:
        throw TimeoutError(std::string(op),
                           fmt::format("{} did not answer within {} ms", where(),
                                       (wait_for + answer_grace(wait_for)).count()),
                           "the server process is stopped or overloaded, or the network drops packets");
      default:
        throw EngineError(std::string(op), fmt::format("talking to {}: {}", where(), std::strerror(err)),
                          err == EMSGSIZE ? "the peer on that port is not a meshtrain store server"
                                          : "check the network between this host and the server");
    }
  }
  Answer a;
  a.status = static_cast<StoreStatus>(static_cast<uint8_t>(body[0]));
  a.body = body.substr(1);
  if (a.status == StoreStatus::error) {
    FrameReader reader(a.body);
    std::string why;
    try {
      why = reader.str(internal::kMaxFrameBytes);
    } catch (const internal::WireError& e) {
      why = "unreadable error message: " + e.what;
    }
    if (why == internal::kRefusedToken) {
      disconnect_locked();  // the server closes it
      throw InvalidArgument(std::string(op), fmt::format("{} refused the connection: {}", where(), why),
                            options_.token.empty()
                                ? "the server wants the job's token: pass TcpStoreOptions::token (export the job's "
                                  "MESHTRAIN_JOB_TOKEN; `meshtrain launch` sets it in every worker)"
                                : "every process of the job must use the same token: export the same "
                                  "MESHTRAIN_JOB_TOKEN on every node");
    }
    throw InvalidArgument(std::string(op), fmt::format("{} refused the request: {}", where(), why),
                          "see the store limits in comm/store.h");
  }
  if (a.status != StoreStatus::ok && a.status != StoreStatus::timeout) {
    disconnect_locked();
    throw EngineError(std::string(op), fmt::format("{} answered with unknown status {}", where(), static_cast<int>(a.status)),
                      "client and server must be the same meshtrain version");
  }
  return a;
}

void TcpStore::set(std::string_view key, std::string_view value) {
  check_key("TcpStore::set", key);
  check_value("TcpStore::set", key, value);
  FrameWriter w;
  w.u8(static_cast<uint8_t>(StoreOp::set)).str(key).str(value);
  call("TcpStore::set", w.finish("TcpStore::set"), timeout());
}

std::string TcpStore::get(std::string_view key, std::chrono::milliseconds timeout) {
  check_key("TcpStore::get", key);
  check_timeout("TcpStore::get", timeout);
  FrameWriter w;
  w.u8(static_cast<uint8_t>(StoreOp::get)).str(key).u64(static_cast<uint64_t>(timeout.count()));
  const auto start = Clock::now();
  Answer a = call("TcpStore::get", w.finish("TcpStore::get"), timeout);
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  if (a.status == StoreStatus::timeout) internal::throw_store_timeout("TcpStore::get", {std::string(key)}, waited, where());
  try {
    FrameReader r(a.body);
    std::string value = r.str(kMaxStoreValueBytes);
    r.expect_end();
    return value;
  } catch (const internal::WireError& e) {
    throw EngineError("TcpStore::get", fmt::format("malformed answer from {}: {}", where(), e.what),
                      "client and server must be the same meshtrain version");
  }
}

int64_t TcpStore::add(std::string_view key, int64_t delta) {
  check_key("TcpStore::add", key);
  FrameWriter w;
  w.u8(static_cast<uint8_t>(StoreOp::add)).str(key).u64(static_cast<uint64_t>(delta));
  Answer a = call("TcpStore::add", w.finish("TcpStore::add"), timeout());
  try {
    FrameReader r(a.body);
    const auto v = static_cast<int64_t>(r.u64());
    r.expect_end();
    return v;
  } catch (const internal::WireError& e) {
    throw EngineError("TcpStore::add", fmt::format("malformed answer from {}: {}", where(), e.what),
                      "client and server must be the same meshtrain version");
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  check_keys("TcpStore::check", keys);
  FrameWriter w;
  w.u8(static_cast<uint8_t>(StoreOp::check)).u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  Answer a = call("TcpStore::check", w.finish("TcpStore::check"), timeout());
  return !a.body.empty() && a.body[0] != 0;
}

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  check_keys("TcpStore::wait", keys);
  check_timeout("TcpStore::wait", timeout);
  FrameWriter w;
  w.u8(static_cast<uint8_t>(StoreOp::wait)).u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  w.u64(static_cast<uint64_t>(timeout.count()));
  const auto start = Clock::now();
  Answer a = call("TcpStore::wait", w.finish("TcpStore::wait"), timeout);
  if (a.status != StoreStatus::timeout) return;
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  std::vector<std::string> missing;
  try {
    FrameReader r(a.body);
    missing = r.keys();
  } catch (const internal::WireError&) {
    missing = keys;  // the answer said timeout; name every key rather than none
  }
  internal::throw_store_timeout("TcpStore::wait", missing, waited, where());
}

bool TcpStore::delete_key(std::string_view key) {
  check_key("TcpStore::delete_key", key);
  FrameWriter w;
  w.u8(static_cast<uint8_t>(StoreOp::delete_key)).str(key);
  Answer a = call("TcpStore::delete_key", w.finish("TcpStore::delete_key"), timeout());
  return !a.body.empty() && a.body[0] != 0;
}

}  // namespace meshtrain::comm
