// The eager path: messages up to Eager::kMaxBytes in a slot of Gloo bound
// buffers, registered once per peer (channel.h says how and why). Runs on
// the thread running the collective, one collective at a time, so the
// per-peer counters need no lock; the waits are registered under mu_ for
// fail() and the watchdog.
#include <fmt/format.h>
#include <gloo/transport/buffer.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>

#include "meshtrain/comm/gloo/internal/channel.h"
#include "meshtrain/core/error.h"

// Gloo's TCP bound buffer (the class behind every ::gloo::transport::Buffer
// of this engine, which uses only the TCP transport), reduced to the two
// public members the engine calls: they complete a receive or a send as
// Gloo's device thread does, which is how fail() and the watchdog wake a
// thread inside waitRecv()/waitSend() (Gloo gives those waits no abort).
// Declared here because libgloo-dev's <gloo/transport/tcp/buffer.h>
// includes <gloo/common/memory.h>, which the package does not ship. The
// class has one base, so its address is the transport::Buffer's.
namespace gloo::transport::tcp {
class Buffer {
 public:
  void handleRecvCompletion();
  void handleSendCompletion();
};
}  // namespace gloo::transport::tcp

namespace meshtrain::comm::gloo::internal {
namespace {

// A slot's header. `message` numbers the messages of one direction 1, 2,
// ...; a slot that still holds an older one shows it.
struct EagerHeader {
  uint64_t message;
  uint64_t seq;
  uint32_t phase;
  uint32_t kind;
  uint64_t bytes;
};
static_assert(sizeof(EagerHeader) <= Eager::kHeaderBytes);

constexpr size_t kRingBytes = Eager::kSlots * Eager::kSlotBytes;

// Bound-buffer slots of a pair: the data and the credits rank r sends use
// 2r and 2r + 1 (registered by the receiver; the sender's buffers carry
// the same numbers), on the context of that direction (Directions).
int data_slot(int from) { return 2 * from; }
int credit_slot(int from) { return 2 * from + 1; }

// The phase of a goodbye message (collectives use 0..2).
constexpr uint32_t kGoodbyePhase = 255;

::gloo::transport::tcp::Buffer* tcp(::gloo::transport::Buffer& b) {
  return reinterpret_cast<::gloo::transport::tcp::Buffer*>(&b);
}

}  // namespace

void Channel::eager_connect() {
  if (size_ == 1) return;
  pair_timeout_ = contexts_.up->getTimeout();
  eager_.resize(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Eager& e = eager_[static_cast<size_t>(p)];
    e.out = std::make_unique_for_overwrite<std::byte[]>(kRingBytes);
    e.in = std::make_unique_for_overwrite<std::byte[]>(kRingBytes);
    auto& in = contexts_.at(p, rank_).getPair(p);    // what p sends here: its data, the credits it returns
    auto& out = contexts_.at(rank_, p).getPair(p);   // what this rank sends p
    e.recv = in->createRecvBuffer(data_slot(p), e.in.get(), kRingBytes);
    e.credit_recv = in->createRecvBuffer(credit_slot(p), e.credit_in, sizeof e.credit_in);
    e.send = out->createSendBuffer(data_slot(rank_), e.out.get(), kRingBytes);
    e.credit_send = out->createSendBuffer(credit_slot(rank_), e.credit_out, sizeof e.credit_out);
  }
  // Message 1 of each direction spans the whole ring. Gloo sizes a
  // connection's socket send buffer (SO_SNDBUF) to the largest message sent
  // so far, and only ever raises it: after a first message of a few KiB, a
  // second small one in flight (the next collective's, a credit) waited
  // for the receiver's delayed ACK (40 ms stalls in 8-20% of 4 KiB calls,
  // gloo_latency_probe); after one slot (64 KiB), 128 KiB transfers no
  // longer fit and wrote in pieces (2-3x slower at 256 KiB to 1 MiB).
  // The ring's size leaves every message up to 512 KiB room.
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Eager& e = eager_[static_cast<size_t>(p)];
    const EagerHeader h{.message = 1, .seq = 0, .phase = 0, .kind = 0, .bytes = Eager::kMaxBytes};
    std::memset(e.out.get(), 0, kRingBytes);
    std::memcpy(e.out.get(), &h, sizeof h);
    e.send->send(0, kRingBytes, 0);  // later messages overwrite their slots after it (TCP keeps the order)
    e.sent = e.unsettled = 1;
  }
}

void Channel::eager_send(int peer, const Op& op, uint64_t phase, const void* data, size_t bytes) {
  Eager& e = eager_[static_cast<size_t>(peer)];
  // Every slot holds a message the peer has not read: wait for a credit.
  while (e.sent >= Eager::kSlots + e.credits * Eager::kCreditEvery) {
    bound_wait(*e.credit_recv, /*is_send=*/false, peer, op);
    ++e.credits;
  }
  const size_t at = (e.sent % Eager::kSlots) * Eager::kSlotBytes;
  const EagerHeader h{.message = e.sent + 1,
                      .seq = op.seq,
                      .phase = static_cast<uint32_t>(phase),
                      .kind = static_cast<uint32_t>(op.kind),
                      .bytes = bytes};
  std::memcpy(e.out.get() + at, &h, sizeof h);
  std::memcpy(e.out.get() + at + Eager::kHeaderBytes, data, bytes);
  try {
    e.send->send(at, Eager::kHeaderBytes + bytes, at);
  } catch (const std::exception& ex) {  // gloo::IoException: the pair is closed
    std::lock_guard lock(mu_);
    if (error_) std::rethrow_exception(error_);
    throw connection_error(peer, op, ex.what());
  }
  ++e.sent;
  // Settle Gloo's count of completed sends (this one and message 1): they
  // were written in place nearly always, so this does not wait.
  for (++e.unsettled; e.unsettled > 0; --e.unsettled) bound_wait(*e.send, /*is_send=*/true, peer, op);
}

void Channel::eager_recv(int peer, const Op& op, uint64_t phase, void* data, size_t bytes) {
  Eager& e = eager_[static_cast<size_t>(peer)];
  if (e.consumed == 0) {  // the peer's first message sized the socket buffer (eager_connect): skip it
    bound_wait(*e.recv, /*is_send=*/false, peer, op);
    e.arrived = e.consumed = 1;
  }
  if (e.arrived == e.consumed) {
    bound_wait(*e.recv, /*is_send=*/false, peer, op);
    ++e.arrived;
  }
  const std::byte* slot = e.in.get() + (e.consumed % Eager::kSlots) * Eager::kSlotBytes;
  EagerHeader h;
  std::memcpy(&h, slot, sizeof h);
  // Different collectives at the same point: the fingerprints (phase 0)
  // are compared by check_fingerprints, which names every rank's call.
  if (h.message != e.consumed + 1 || h.seq != op.seq || h.phase != phase || h.bytes != bytes ||
      (phase > 0 && h.kind != static_cast<uint32_t>(op.kind)))
    throw MismatchError(
        op_name(op.kind),
        h.phase == kGoodbyePhase && phase != kGoodbyePhase
            ? fmt::format("rank {} destroyed the communicator after {} collective(s) where rank {} expects "
                          "its part of {}",
                          peer, h.seq - 1, rank_, op.fingerprint().to_string())
            : fmt::format("rank {} sent message {} of {} bytes (collective #{}, {}, phase {}) where rank {} "
                          "expects message {} of {} bytes for {} (phase {})",
                          peer, h.message, h.bytes, h.seq,
                          h.kind <= static_cast<uint32_t>(CollectiveOp::split)
                              ? collective_op_name(static_cast<CollectiveOp>(h.kind))
                              : "?",
                          h.phase, rank_, e.consumed + 1, bytes, op.fingerprint().to_string(), phase),
        "every rank must call the same collectives in the same order with the same counts and dtypes; turn on "
        "fingerprint checks (check_fingerprints) to name the first call that differs",
        {peer});
  std::memcpy(data, slot + Eager::kHeaderBytes, bytes);
  ++e.consumed;
  if (e.consumed - e.credited < Eager::kCreditEvery) return;
  // Return kCreditEvery slots. The peer may have finished its last
  // collective and closed the connection already (it needs no credit
  // then): a failed credit is not this collective's error, and a peer that
  // is really gone fails the next transfer.
  e.credited += Eager::kCreditEvery;
  if (e.credit_broken) return;
  try {
    if (e.credit_pending) {  // the previous credit, written in place long ago: settles Gloo's count
      e.credit_pending = false;
      bound_wait(*e.credit_send, /*is_send=*/true, peer, op);
    }
    e.credit_send->send(0, sizeof e.credit_out, 0);
    e.credit_pending = true;
  } catch (...) {
    {
      std::lock_guard lock(mu_);
      if (error_) std::rethrow_exception(error_);
    }
    e.credit_broken = true;
  }
}

void Channel::bound_wait(::gloo::transport::Buffer& buf, bool is_send, int peer, const Op& op) {
  {
    std::lock_guard lock(mu_);
    if (error_) std::rethrow_exception(error_);
    bound_waits_.push_back({.buf = &buf, .is_send = is_send, .since = Clock::now()});
  }
  for (;;) {
    std::string io_error;
    try {
      if (is_send) buf.waitSend();
      else buf.waitRecv();
    } catch (const std::exception& e) {  // gloo::IoException: the pair broke
      io_error = e.what();
    }
    std::lock_guard lock(mu_);
    auto it = std::find_if(bound_waits_.begin(), bound_waits_.end(), [&](const BoundWait& w) { return w.buf == &buf; });
    if (io_error.empty() && !error_ && it->rearmed > 0) {  // the watchdog's completion, not a message
      --it->rearmed;
      continue;
    }
    bound_waits_.erase(it);
    if (error_) std::rethrow_exception(error_);  // fail() completed it (or the failure closed the pair)
    if (!io_error.empty()) throw connection_error(peer, op, io_error);
    return;
  }
}

void Channel::goodbye(std::chrono::milliseconds timeout) noexcept {
  if (size_ == 1) return;
  Op op{.kind = CollectiveOp::barrier};
  {
    std::lock_guard lock(mu_);
    if (error_ || in_flight()) return;
    op.seq = issued_ + 1;
    goodbye_deadline_ = Clock::now() + timeout;
  }
  watchdog_cv_.notify_all();
  int peer = -1;  // the one waited for
  try {
    const std::byte token{1};
    for (peer = 0; peer < size_; ++peer)
      if (peer != rank_) eager_send(peer, op, kGoodbyePhase, &token, 1);
    std::byte in{};
    for (peer = 0; peer < size_; ++peer)
      if (peer != rank_) eager_recv(peer, op, kGoodbyePhase, &in, 1);
  } catch (const TimeoutError&) {
    fmt::print(stderr,
               "meshtrain: rank {} closed communicator {} without rank {}'s goodbye after waiting {} ms (hint: "
               "every rank must destroy its communicators, in the same order)\n",
               world_->rank(), uid_, world_ranks_[static_cast<size_t>(peer)], timeout.count());
    std::fflush(stderr);
  } catch (const MismatchError& e) {
    fmt::print(stderr, "meshtrain: rank {} closed communicator {} while a peer was not done with it: {}\n",
               world_->rank(), uid_, e.what());
    std::fflush(stderr);
  } catch (...) {
    // The peer closed its end: after its goodbye (Gloo fails the wait even
    // when the message arrived), or because it failed (its error tells).
  }
  std::lock_guard lock(mu_);
  goodbye_deadline_ = Clock::time_point::max();
}

void Channel::watchdog_loop() {
  // Gloo fails a bound receive that waits longer than the pair's timeout
  // (the communicator's timeout when it was made; set_timeout may have
  // raised it since, and an async collective may wait unwatched): complete
  // the ones waiting for half of that, marked, so they wait again. Sends
  // are not re-armed: a peer that reads nothing for that long is stopped.
  // At the goodbye's deadline, end its waits with a TimeoutError of its own
  // (not fail(): nothing to tell the peers, no on_error).
  const auto half = pair_timeout_ / 2;
  std::unique_lock lock(mu_);
  while (!stop_) {
    Clock::time_point wake = goodbye_deadline_;
    if (half > std::chrono::milliseconds::zero()) wake = std::min(wake, Clock::now() + half / 2);
    if (wake == Clock::time_point::max()) watchdog_cv_.wait(lock);
    else watchdog_cv_.wait_until(lock, wake);
    if (stop_ || error_) continue;
    const Clock::time_point now = Clock::now();
    if (now >= goodbye_deadline_) {
      error_ = std::make_exception_ptr(TimeoutError("gloo::goodbye", "a peer did not say goodbye", ""));
      complete_bound_waits();
      continue;
    }
    if (half <= std::chrono::milliseconds::zero()) continue;
    for (BoundWait& w : bound_waits_) {
      if (w.is_send || now - w.since < half) continue;
      ++w.rearmed;
      w.since = now;
      tcp(*w.buf)->handleRecvCompletion();
    }
  }
}

void Channel::complete_bound_waits() {
  for (const BoundWait& w : bound_waits_) {
    if (w.is_send) tcp(*w.buf)->handleSendCompletion();
    else tcp(*w.buf)->handleRecvCompletion();
  }
}

void Channel::eager_close() {
  bool failed;
  {
    std::lock_guard lock(mu_);
    failed = error_ != nullptr;
  }
  // After a failure a slot's send may still sit in Gloo's queue, naming
  // its buffer: close the pairs first so Gloo never touches it again.
  if (failed)
    for (int p = 0; p < size_; ++p)
      if (p != rank_) {
        contexts_.up->getPair(p)->close();
        contexts_.down->getPair(p)->close();
      }
  eager_.clear();  // unregisters the receive buffers before their memory goes
}

}  // namespace meshtrain::comm::gloo::internal
