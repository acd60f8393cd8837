// Gloo's own algorithms and the raw TCP rate as benchmark peers (native.h).
#include "meshtrain/comm/gloo/native.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "meshtrain/comm/gloo/internal/channel.h"
#include "meshtrain/comm/gloo/internal/peer_listener.h"
#include "meshtrain/comm/gloo/internal/world.h"
#include "meshtrain/comm/internal/tcp_store_wire.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo {
namespace {

using Clock = std::chrono::steady_clock;
using internal::Fd;
using GlooAlgorithm = ::gloo::AllreduceOptions::Algorithm;

constexpr const char* kOp = "gloo::native";

bool has(const std::vector<CollectiveOp>& ops, CollectiveOp op) {
  return std::find(ops.begin(), ops.end(), op) != ops.end();
}

// --- Gloo's algorithms -------------------------------------------------------

class GlooPeer : public PeerCollectives {
 public:
  GlooPeer(std::string label, std::shared_ptr<::gloo::Context> context, std::vector<CollectiveOp> ops)
      : context_(std::move(context)), label_(std::move(label)), ops_(std::move(ops)) {}

  std::string label() const override { return label_; }
  bool supports(CollectiveOp op, DType dtype) const override { return dtype == DType::f32 && has(ops_, op); }

  void run(CollectiveOp op, const void* send, void* recv, size_t count, DType dtype) override {
    if (!supports(op, dtype))
      throw Unsupported(kOp, fmt::format("{} does not run {} on {}", label_, collective_op_name(op), dtype_name(dtype)),
                        "ask supports() first");
    // The legacy classes count elements in an int.
    if (count * static_cast<size_t>(size()) > static_cast<size_t>(INT_MAX))
      throw Unsupported(kOp, fmt::format("{} elements is above Gloo's int counts", count), "split the buffer");
    if (count == 0) return;
    run_f32(op, static_cast<const float*>(send), static_cast<float*>(recv), count);
  }

 protected:
  virtual void run_f32(CollectiveOp op, const float* send, float* recv, size_t count) = 0;
  int size() const { return context_->size; }

  std::shared_ptr<::gloo::Context> context_;

 private:
  std::string label_;
  std::vector<CollectiveOp> ops_;
};

// Gloo's current API (gloo/allreduce.h, allgather.h, broadcast.h,
// alltoall.h): options built per call, as a program calling Gloo does.
class ApiPeer final : public GlooPeer {
 public:
  ApiPeer(std::string label, std::shared_ptr<::gloo::Context> context, std::vector<CollectiveOp> ops,
          GlooAlgorithm algorithm = GlooAlgorithm::RING)
      : GlooPeer(std::move(label), std::move(context), std::move(ops)), algorithm_(algorithm) {}

 protected:
  void run_f32(CollectiveOp op, const float* send, float* recv, size_t count) override {
    float* in = const_cast<float*>(send);  // Gloo only reads its inputs
    const size_t n = static_cast<size_t>(size());
    switch (op) {
      case CollectiveOp::all_reduce: {
        ::gloo::AllreduceOptions o(context_);
        o.setAlgorithm(algorithm_);
        o.setInput(in, count);
        o.setOutput(recv, count);
        o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&::gloo::sum<float>));
        return ::gloo::allreduce(o);
      }
      case CollectiveOp::all_gather: {
        ::gloo::AllgatherOptions o(context_);
        o.setInput(in, count);
        o.setOutput(recv, count * n);
        return ::gloo::allgather(o);
      }
      case CollectiveOp::broadcast: {  // in place in recv, as MPI_Bcast
        ::gloo::BroadcastOptions o(context_);
        o.setOutput(recv, count);
        o.setRoot(0);
        return ::gloo::broadcast(o);
      }
      case CollectiveOp::all_to_all: {
        ::gloo::AlltoallOptions o(context_);
        o.setInput(in, count * n);
        o.setOutput(recv, count * n);
        return ::gloo::alltoall(o);
      }
      default: throw Unsupported(kOp, "not a collective of this peer", "");
    }
  }

 private:
  GlooAlgorithm algorithm_;
};

// Gloo's legacy algorithm classes: built for one buffer (registered with
// every pair), then run in place as often as wanted. Built again when the
// buffer or count changes; the previous one is destroyed first (the
// benchmark synchronizes the ranks between sizes, so no transfer of it is
// in flight).
class LegacyPeer final : public GlooPeer {
 public:
  enum class AllReduce { ring_chunked, halving_doubling };
  LegacyPeer(std::string label, std::shared_ptr<::gloo::Context> context, AllReduce kind)
      : GlooPeer(std::move(label), std::move(context),
                 kind == AllReduce::halving_doubling
                     ? std::vector<CollectiveOp>{CollectiveOp::all_reduce, CollectiveOp::reduce_scatter}
                     : std::vector<CollectiveOp>{CollectiveOp::all_reduce}),
        kind_(kind) {}

 protected:
  void run_f32(CollectiveOp op, const float* send, float* recv, size_t count) override {
    const int n = size();
    if (op == CollectiveOp::all_reduce) {
      std::memcpy(recv, send, count * sizeof(float));  // in place on recv
      if (!all_reduce_ || all_reduce_key_ != std::pair{recv, count}) {
        all_reduce_.reset();
        const std::vector<float*> ptrs = {recv};
        const int c = static_cast<int>(count);
        if (kind_ == AllReduce::ring_chunked)
          all_reduce_ = std::make_unique<::gloo::AllreduceRingChunked<float>>(context_, ptrs, c);
        else
          all_reduce_ = std::make_unique<::gloo::AllreduceHalvingDoubling<float>>(context_, ptrs, c);
        all_reduce_key_ = {recv, count};
      }
      return all_reduce_->run();
    }
    // reduce_scatter: in place on a scratch copy of the input; this rank's
    // block lands at its start.
    const size_t total = count * static_cast<size_t>(n);
    if (!reduce_scatter_ || reduce_scatter_count_ != count) {
      reduce_scatter_.reset();
      scratch_ = std::make_unique_for_overwrite<float[]>(total);
      reduce_scatter_ = std::make_unique<::gloo::ReduceScatterHalvingDoubling<float>>(
          context_, std::vector<float*>{scratch_.get()}, static_cast<int>(total),
          std::vector<int>(static_cast<size_t>(n), static_cast<int>(count)));
      reduce_scatter_count_ = count;
    }
    std::memcpy(scratch_.get(), send, total * sizeof(float));
    reduce_scatter_->run();
    std::memcpy(recv, scratch_.get(), count * sizeof(float));
  }

 private:
  AllReduce kind_;
  std::unique_ptr<::gloo::Algorithm> all_reduce_;
  std::pair<float*, size_t> all_reduce_key_{nullptr, 0};
  std::unique_ptr<float[]> scratch_;
  std::unique_ptr<::gloo::Algorithm> reduce_scatter_;
  size_t reduce_scatter_count_ = 0;
};

// --- the raw TCP rate --------------------------------------------------------

[[noreturn]] void throw_errno(const std::string& what) {
  throw EngineError(kOp, fmt::format("tcp peer: {}: {}", what, std::strerror(errno)),
                    "check that the ranks can reach each other on the address Gloo uses");
}

std::string to_hex(const void* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += fmt::format("{:02x}", static_cast<const unsigned char*>(p)[i]);
  return s;
}

std::string from_hex(std::string_view h) {
  std::string s(h.size() / 2, '\0');
  for (size_t i = 0; i < s.size(); ++i)
    s[i] = static_cast<char>(std::stoi(std::string(h.substr(2 * i, 2)), nullptr, 16));
  return s;
}

// One transfer on a non-blocking socket.
struct Io {
  int fd = -1;
  bool out = false;
  std::byte* p = nullptr;
  size_t left = 0;
  int peer = -1;
};

// Moves every transfer to its end: tries each until the socket would
// block, then poll()s the ones left.
void pump(std::vector<Io>& ios, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<pollfd> pfds;
  std::vector<size_t> which;
  for (;;) {
    pfds.clear();
    which.clear();
    for (size_t i = 0; i < ios.size(); ++i) {
      Io& io = ios[i];
      while (io.left > 0) {
        const ssize_t k = io.out ? ::send(io.fd, io.p, io.left, MSG_NOSIGNAL) : ::recv(io.fd, io.p, io.left, 0);
        if (k > 0) {
          io.p += k;
          io.left -= static_cast<size_t>(k);
          continue;
        }
        if (k == 0)
          throw EngineError(kOp, fmt::format("tcp peer: rank {} closed its connection", io.peer),
                            fmt::format("see rank {}'s log", io.peer), {io.peer});
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
          throw_errno(fmt::format("{} rank {}", io.out ? "sending to" : "receiving from", io.peer));
        pfds.push_back({.fd = io.fd, .events = static_cast<short>(io.out ? POLLOUT : POLLIN), .revents = 0});
        which.push_back(i);
        break;
      }
    }
    if (pfds.empty()) return;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const int r = ::poll(pfds.data(), pfds.size(), static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX)));
    if (r < 0 && errno != EINTR) throw_errno("poll");
    if (r == 0) {
      std::vector<int> late;
      for (size_t i : which) late.push_back(ios[i].peer);
      throw TimeoutError(kOp, fmt::format("tcp peer: no progress within {} ms", timeout.count()),
                         "the peers named did not send or receive", late);
    }
  }
}

void set_int_option(int fd, int level, int name, int value, const char* what) {
  if (::setsockopt(fd, level, name, &value, sizeof(value)) != 0) throw_errno(what);
}

void write_all(int fd, const void* p, size_t n, int peer, std::chrono::milliseconds timeout) {
  std::vector<Io> ios = {{.fd = fd, .out = true, .p = static_cast<std::byte*>(const_cast<void*>(p)), .left = n,
                          .peer = peer}};
  pump(ios, timeout);
}

void read_all(int fd, void* p, size_t n, int peer, std::chrono::milliseconds timeout) {
  std::vector<Io> ios = {{.fd = fd, .out = false, .p = static_cast<std::byte*>(p), .left = n, .peer = peer}};
  pump(ios, timeout);
}

class TcpPeer final : public PeerCollectives {
 public:
  // Collective over the `size` ranks: listens on Gloo's address (port 0),
  // publishes the address and a secret under `prefix` in the store,
  // connects to the lower ranks and accepts the higher ones, taking only
  // connections that show the secret (internal/peer_listener.h).
  TcpPeer(internal::World& world, const std::string& prefix, int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), timeout_(timeout), fds_(static_cast<size_t>(size)) {
    const WorldConfig& c = world.config();
    ::gloo::transport::tcp::attr want;
    if (!c.hostname.empty())
      want.hostname = c.hostname;
    else
      want.iface = c.iface;
    const ::gloo::transport::tcp::attr a = ::gloo::transport::tcp::CreateDeviceAttr(want);  // Gloo's own address

    Fd listener(::socket(a.ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (listener.get() < 0) throw_errno("socket");
    sockaddr_storage addr = a.ai_addr;
    socklen_t len = static_cast<socklen_t>(a.ai_addrlen);
    if (addr.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&addr)->sin_port = 0;
    if (addr.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = 0;
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) throw_errno("bind");
    if (::listen(listener.get(), SOMAXCONN) != 0) throw_errno("listen");
    if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) throw_errno("getsockname");

    // What a connecting rank must show: its rank and this rank's secret,
    // which only the job's (authenticated) store hands out. Anything else
    // on the port is closed and does not count.
    const internal::PeerSecret mine = internal::random_peer_secret();

    auto store = world.connect_store();
    auto key = [&](int r) { return fmt::format("{}/{}", prefix, r); };
    store->set(key(rank), to_hex(mine.data(), mine.size()) + to_hex(&addr, len));
    for (int p = 0; p < rank; ++p) {  // connect to the lower ranks
      const std::string value = from_hex(store->get(key(p), timeout));
      if (value.size() <= sizeof(internal::PeerSecret))
        throw EngineError(kOp, fmt::format("tcp peer: rank {}'s address in the store is malformed", p), "");
      internal::PeerHello hello{.rank = rank, .secret = {}};
      std::memcpy(hello.secret.data(), value.data(), hello.secret.size());
      Fd fd(::socket(a.ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (fd.get() < 0) throw_errno("socket");
      int err = 0;
      const comm::internal::IoResult r = comm::internal::connect_within(
          fd.get(), reinterpret_cast<const sockaddr*>(value.data() + hello.secret.size()),
          static_cast<socklen_t>(value.size() - hello.secret.size()), Clock::now() + timeout, &err);
      if (r != comm::internal::IoResult::ok) {
        errno = r == comm::internal::IoResult::timeout ? ETIMEDOUT : err;
        throw_errno(fmt::format("connecting to rank {}", p));
      }
      write_all(fd.get(), &hello, sizeof(hello), p, timeout);
      fds_[static_cast<size_t>(p)] = std::move(fd);
    }
    std::vector<Fd> higher = internal::accept_peers(listener.get(), mine, rank, size, timeout);
    for (int k = rank + 1; k < size; ++k) fds_[static_cast<size_t>(k)] = std::move(higher[static_cast<size_t>(k)]);
    for (int p = 0; p < size; ++p) {
      const int fd = fds_[static_cast<size_t>(p)].get();
      if (p == rank) continue;
      set_int_option(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY");
      if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK) != 0) throw_errno("O_NONBLOCK");
    }
  }

  std::string label() const override { return "tcp"; }
  bool supports(CollectiveOp op, DType) const override {
    return op == CollectiveOp::broadcast || op == CollectiveOp::all_to_all;
  }

  void run(CollectiveOp op, const void* send, void* recv, size_t count, DType dtype) override {
    if (!supports(op, dtype)) throw Unsupported(kOp, "the tcp peer runs broadcast and all_to_all", "");
    const size_t bytes = count * dtype_size(dtype);
    const int n = static_cast<int>(fds_.size());
    if (bytes == 0 || n == 1) return;
    std::vector<Io> ios;
    if (op == CollectiveOp::broadcast) {
      auto* buf = static_cast<std::byte*>(recv);
      if (rank_ == 0) {
        for (int p = 1; p < n; ++p) ios.push_back({.fd = fd(p), .out = true, .p = buf, .left = bytes, .peer = p});
        pump(ios, timeout_);
        ios.clear();
        acks_.resize(static_cast<size_t>(n));
        for (int p = 1; p < n; ++p)
          ios.push_back({.fd = fd(p), .out = false, .p = &acks_[static_cast<size_t>(p)], .left = 1, .peer = p});
        return pump(ios, timeout_);
      }
      read_all(fd(0), buf, bytes, 0, timeout_);
      const std::byte ack{1};
      return write_all(fd(0), &ack, 1, 0, timeout_);
    }
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      const size_t at = static_cast<size_t>(p) * bytes;
      ios.push_back({.fd = fd(p), .out = true, .p = const_cast<std::byte*>(static_cast<const std::byte*>(send)) + at,
                     .left = bytes, .peer = p});
      ios.push_back({.fd = fd(p), .out = false, .p = static_cast<std::byte*>(recv) + at, .left = bytes, .peer = p});
    }
    pump(ios, timeout_);
  }

 private:
  int fd(int p) const { return fds_[static_cast<size_t>(p)].get(); }

  int rank_;
  std::chrono::milliseconds timeout_;
  std::vector<Fd> fds_;  // by rank; none for this one
  std::vector<std::byte> acks_;
};

}  // namespace

std::vector<std::unique_ptr<PeerCollectives>> native_peers(Communicator& world) {
  internal::Channel* channel = internal::channel_of(world);
  if (!channel)
    throw InvalidArgument("gloo::native_peers", "not a communicator of the gloo engine",
                          "pass the communicator gloo::create_world or launch() gave");
  std::vector<std::unique_ptr<PeerCollectives>> peers;
  const int rank = channel->rank(), size = channel->size();
  if (size == 1) return peers;
  // The contexts' names: this communicator's uid and a number rank 0 picks
  // (peers may be made more than once per communicator).
  static std::atomic<int64_t> made{0};
  int64_t nonce = rank == 0 ? ++made : 0;
  world.broadcast(&nonce, 1, DType::i64, 0);
  const std::chrono::milliseconds timeout = world.timeout();
  auto context = [&](const std::string& label) {
    return internal::connect(*channel->world(), fmt::format("{}.bench{}.{}", channel->uid(), nonce, label), rank,
                             size, timeout);
  };
  using Op = CollectiveOp;
  peers.push_back(std::make_unique<ApiPeer>("gloo-ring", context("ring"), std::vector{Op::all_reduce, Op::all_gather},
                                            GlooAlgorithm::RING));
  peers.push_back(
      std::make_unique<ApiPeer>("gloo-bcube", context("bcube"), std::vector{Op::all_reduce}, GlooAlgorithm::BCUBE));
  peers.push_back(
      std::make_unique<LegacyPeer>("gloo-chunked", context("chunked"), LegacyPeer::AllReduce::ring_chunked));
  peers.push_back(std::make_unique<LegacyPeer>("gloo-hd", context("hd"), LegacyPeer::AllReduce::halving_doubling));
  peers.push_back(std::make_unique<ApiPeer>("gloo-tree", context("tree"), std::vector{Op::broadcast}));
  peers.push_back(std::make_unique<ApiPeer>("gloo-direct", context("direct"), std::vector{Op::all_to_all}));
  peers.push_back(std::make_unique<TcpPeer>(
      *channel->world(), fmt::format("{}/ctx/{}.bench{}.tcp", channel->world()->config().name, channel->uid(), nonce),
      rank, size, timeout));
  return peers;
}

}  // namespace meshtrain::comm::gloo
