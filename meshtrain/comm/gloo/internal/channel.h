// One Gloo communicator's engine: its two Gloo contexts (one per direction:
// see Directions below), the operations in flight, and the failure
// protocol. Internal.
//
// Life of an operation (a Task):
// - start() numbers nothing (Communicator did) and either queues a
//   collective for the worker thread, which runs collectives one at a time
//   in issue order (fingerprints, then the data movement of
//   collectives.cc), or runs a blocking collective on the caller's thread
//   when nothing else is queued or running (the worker then watches its
//   deadline), or posts a send/recv to Gloo at once (every unbound
//   transfer is posted by Gloo's event-loop thread: LoopPoster in
//   channel.cc) and queues its completion for a waiter thread (one per
//   send/recv in flight, reused), so that sends and receives complete on
//   their own.
// - wait() blocks on the task until it is done or the caller's deadline
//   passes; test() looks without blocking.
// - Every blocking step inside Gloo (a transfer's completion) is an
//   abortable wait: fail() interrupts it, so no engine thread outlives a
//   failure in a Gloo call.
//
// Failure (fail(), first cause wins): the channel is aborted, every wait
// inside Gloo is interrupted, every queued task fails with the cause, the
// peers are told through the World's agent (unless the cause was their
// notice), and Options::on_error runs. A wait that passes its deadline
// first probes the peers (World::probe) and fails the channel with a
// TimeoutError about the oldest unfinished operation, naming the ranks that
// did not arrive or do not answer. A Gloo I/O error on a transfer (the
// peer's process died, its connection closed) fails it naming that peer.
//
// Transfers that Gloo had posted when the channel failed keep their
// UnboundBuffers (kept here until the contexts are destroyed), so Gloo never
// writes through a freed handle.
//
// Small messages (up to Eager::kMessageBytes, in slots of up to
// Eager::kMaxBytes) take the eager path (eager.cc):
// each pair of ranks has a ring of Eager::kSlots message slots per
// direction in Gloo bound buffers, registered once when the channel is
// made, so a send writes its data at once instead of waiting for the
// receiver's "recv ready" notice (a round trip per message on Gloo's
// unbound buffers: 40 against 80 us per 4 KiB exchange on loopback). The
// receiver copies a message out of its slot and returns the slots to the
// sender in batches (a credit message every Eager::kCreditEvery); a sender
// that ran out of slots waits for one. Each slot's header names the
// message (its number in the direction, the collective and phase, the
// byte count), so ranks that called different collectives fail with an
// error instead of reading each other's data. Gloo's bound waits have no
// abort and time out on their own after the contexts' timeout (closing the
// pair): fail() wakes them by completing them itself, and a watchdog
// thread re-arms the ones that wait longer than half of that timeout.
//
// Closing (goodbye()): Gloo fails every wait on a pair once the peer closed
// its end, even for data that had already arrived. A rank that finished its
// last collective and closed would fail a peer still reading that
// collective's data from it ("Connection closed by peer"). So before the
// connections close, each rank sends every peer an eager goodbye and waits,
// up to the communicator's timeout, for every peer's: a rank closes only
// after each peer finished all its collectives with it.
#pragma once

#include <gloo/context.h>
#include <gloo/transport/buffer.h>
#include <gloo/transport/unbound_buffer.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/gloo/internal/world.h"
#include "meshtrain/comm/internal/fingerprint.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo::internal {

inline std::string op_name(CollectiveOp kind) { return "gloo::" + std::string(collective_op_name(kind)); }

// Gloo slots: collectives use (seq, phase), send/recv their tag; each
// communicator has its own contexts, so slots never collide across them.
inline uint64_t collective_slot(uint64_t seq, uint64_t phase) {
  return (uint64_t{1} << 63) | (seq << 8) | phase;
}
inline uint64_t p2p_slot(int tag) { return (uint64_t{1} << 62) | static_cast<uint64_t>(tag); }

struct Task {
  Op op;
  bool done = false;  // guarded by Channel::mu_
  std::exception_ptr error;
  std::unique_ptr<::gloo::transport::UnboundBuffer> p2p;  // send/recv: the posted transfer
  // split: every rank's (color, key), filled by the collective.
  std::vector<int32_t> split_table;
};

class Channel;

// A channel's two Gloo contexts, each one TCP connection per pair of ranks:
// [0] carries what a lower rank sends to a higher one, [1] the other way,
// so every message from `from` to `to` travels on at(from, to) (Gloo's
// control notices of a transfer, "recv ready", travel back on the same
// connection). Why two: Gloo writes a message in place while holding its
// pair's lock, and its event loop, finding that lock taken, skips the
// pair's readable socket and polls again at once, a busy spin until the
// write ends (pytorch/gloo#246). On one connection per pair, the peer's
// data for this rank arrives on the very pair this rank is writing to, and
// a writer preempted by the event loop's own wake-up leaves the loop
// spinning for a whole scheduler slice (measured: 93% of the loop's
// skipped events came while a send on the same pair was preempted; 4 ms
// stalls on 2 vCPUs). With a connection per direction, a rank writes on
// one pair while its loop reads the peer's data from the other.
struct Directions {
  std::shared_ptr<::gloo::Context> up, down;  // lower -> higher rank, higher -> lower
  ::gloo::Context& at(int from, int to) const { return from < to ? *up : *down; }
};

// The eager path's constants and one peer's state (see the top).
struct Eager {
  static constexpr size_t kMaxBytes = size_t{64} << 10;  // largest payload of a slot
  // Largest message taken eager, in consecutive slots of kMaxBytes (2 ranks,
  // 128 KiB per peer: all_gather 103 against 144-148 us, all_to_all 99-112
  // against 125-134; 4 ranks, 128 KiB blocks: 5-25% faster; 256 KiB
  // messages were 1.5-2.3x slower on 4 ranks, the copies in and out of the
  // slots costing more than the round trip they save).
  static constexpr size_t kMessageBytes = size_t{128} << 10;
  static constexpr size_t kHeaderBytes = 64;              // a slot's header (EagerHeader, padded)
  static constexpr size_t kSlotBytes = kHeaderBytes + kMaxBytes;
  static constexpr uint64_t kSlots = 8;        // slots in flight per direction
  static constexpr uint64_t kCreditEvery = 4;  // slots a credit message returns
  std::unique_ptr<std::byte[]> out, in;        // kSlots x kSlotBytes each
  std::byte credit_out[8] = {}, credit_in[8] = {};
  std::unique_ptr<::gloo::transport::Buffer> send, recv, credit_send, credit_recv;
  uint64_t sent = 0, credits = 0;                   // messages sent, credit messages received
  uint64_t arrived = 0, consumed = 0, credited = 0;  // messages arrived, read, returned
  bool credit_pending = false;   // the last credit's send is not waited for yet
  uint64_t unsettled = 0;        // sends not waited for yet (message 1, see eager_connect)
  bool credit_broken = false;   // a credit failed: the peer closed (it ended), no more credits
};

// Memory a collective's transfers land in, and its size.
struct Scratch {
  std::unique_ptr<std::byte[]> memory;
  size_t bytes = 0;
};

// The transfers of one step of a collective, run by the worker thread.
class Transfers {
 public:
  // The transfers of phase `phase` (1..255; 0 is the fingerprints') of
  // collective `op`.
  Transfers(Channel& channel, const Op& op, uint64_t phase)
      : channel_(channel), op_(op), phase_(phase), slot_(collective_slot(op.seq, phase)) {}
  ~Transfers();
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  // Post one transfer of `bytes` bytes with `peer`; returns its index.
  size_t send(int peer, const void* data, size_t bytes);
  size_t recv(int peer, void* data, size_t bytes);
  // Blocks until transfer i completed; throws the channel's error.
  void wait(size_t i);
  void wait_all();
  // Memory for this collective's own transfers (fingerprints, partial
  // contributions), from the channel's spares. It lives as long as Gloo may
  // still write into it: if a failure leaves transfers unfinished, the
  // channel keeps it until the contexts are gone; else it goes back to the
  // spares.
  std::byte* scratch(size_t bytes);

 private:
  // An unbound transfer (buf) or an eager one: an eager send copied its
  // data out when posted; an eager receive copies it in when waited for,
  // after the earlier eager receives from the same peer (they arrive in
  // order).
  struct Pending {
    std::unique_ptr<::gloo::transport::UnboundBuffer> buf;
    int peer = -1;
    bool is_send = false;
    bool waited = false;
    void* eager_into = nullptr;  // an eager receive's destination
    size_t eager_bytes = 0;      // > 0: eager
  };
  Channel& channel_;
  const Op& op_;
  uint64_t phase_;
  uint64_t slot_;
  std::vector<Pending> pending_;
  std::vector<Scratch> scratch_;
};

class Channel final : public Listener {
 public:
  Channel(std::shared_ptr<World> world, Directions contexts, std::string uid, std::vector<int> world_ranks,
          int rank);
  ~Channel() override;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& uid() const { return uid_; }
  const std::shared_ptr<World>& world() const { return world_; }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  const Options& options() const { return world_->config().options; }

  // Throws AbortedError when the channel failed earlier. A blocking
  // collective (the caller waits for it at once) issued while no other is
  // queued or running runs on the caller's thread, and the idle worker
  // watches its deadline (`timeout`): two thread hand-offs fewer per call.
  std::shared_ptr<Task> start(const Op& op, std::chrono::milliseconds timeout, bool blocking);
  // split's agreement: a collective that gathers every rank's (color, key)
  // into the task's split_table.
  std::shared_ptr<Task> start_split(const Op& op, int color, int key);
  void wait(Task& t, std::chrono::milliseconds timeout);
  bool test(Task& t);

  // Fails the channel with `error` unless it failed already (see above).
  void fail(std::exception_ptr error, bool tell_peers);
  // eager.cc: the goodbye before the communicator goes (see the top). Not
  // said when the channel failed or has operations in flight. Never throws
  // and never fails the channel for the peers: a peer that closed without
  // it (it failed; its own error tells) is let go, and a peer that does not
  // answer within `timeout` is reported on stderr, as is one still in a
  // collective when its message comes before its abort notice (it fails
  // with a MismatchError naming this rank). Every rank must destroy its
  // communicators in the same order.
  void goodbye(std::chrono::milliseconds timeout) noexcept;

  // Listener.
  ChannelStatus status() const override;
  void on_notice(std::string_view notice, int from) override;

  // For Transfers: a Gloo buffer over `data` for a transfer with `peer`,
  // on the context of its direction.
  std::unique_ptr<::gloo::transport::UnboundBuffer> buffer(void* data, size_t bytes, bool is_send, int peer);
  // Posts a transfer to Gloo, from Gloo's event-loop thread (LoopPoster,
  // channel.cc): returns at once; a closed pair fails the transfer's wait.
  void post(::gloo::transport::UnboundBuffer& buf, bool is_send, int peer, uint64_t slot);
  // Waits for one posted transfer, interruptible by fail(); throws the
  // channel's error when interrupted and an EngineError naming `peer` when
  // Gloo reports an I/O error (posting it included).
  void await(::gloo::transport::UnboundBuffer& buf, bool is_send, int peer, const Op& op);
  // eager.cc: a message of at most Eager::kMaxBytes to or from `peer` in
  // phase `phase` of `op` (see the top). eager_send returns once the data
  // is copied into a slot and written to Gloo (after waiting for a free
  // slot); eager_recv blocks until the peer's next message arrived and
  // checks that it is this one. Both run on the thread running the
  // collective; waits are abortable like await's.
  void eager_send(int peer, const Op& op, uint64_t phase, const void* data, size_t bytes);
  void eager_recv(int peer, const Op& op, uint64_t phase, void* data, size_t bytes);
  // Keeps buffers Gloo may still hold until the contexts are gone.
  void orphan(std::unique_ptr<::gloo::transport::UnboundBuffer> buf);
  void orphan(std::unique_ptr<std::byte[]> memory);
  // Scratch memory of at least `bytes`, reused across collectives: a fresh
  // allocation of a few MiB costs page faults on every call (glibc returns
  // it to the system when freed). Spares are kept up to kSpareBytes.
  Scratch take_scratch(size_t bytes);
  void give_back(Scratch s);
  static constexpr size_t kSpareBytes = size_t{64} << 20;

 private:
  std::shared_ptr<Task> submit(std::shared_ptr<Task> t, std::chrono::milliseconds timeout = {},
                               bool blocking = false);
  void run_inline(const std::shared_ptr<Task>& t);
  // Runs a collective; on an error, fails the channel and returns it.
  std::exception_ptr execute(Task& t);
  void worker_loop();
  void waiter_loop();
  void finish(Task& t, std::exception_ptr error);
  // Under mu_: a collective queued or running, or a send/recv not done.
  bool in_flight() const { return running_ || !queue_.empty() || !p2p_live_.empty(); }
  EngineError connection_error(int peer, const Op& op, const std::string& what);
  // collectives.cc: the fingerprint check and the data movement.
  void run_collective(Task& t);
  void check_fingerprints(const Op& op);
  void all_reduce(const Op& op);
  void reduce_scatter_blocks(const Op& op, const std::byte* send, std::byte* out, const std::vector<size_t>& offset,
                             uint64_t phase);
  void all_gather_blocks(const Op& op, std::byte* buf, const std::vector<size_t>& offset, uint64_t phase);
  void broadcast(const Op& op);
  void all_to_all(const Op& op);
  void all_to_all_v(const Op& op);
  void barrier(const Op& op);
  void split_exchange(Task& t);
  // eager.cc: the bound buffers of every peer (constructor), a wait on one
  // (see the top), the watchdog thread, and the teardown.
  void eager_connect();
  void bound_wait(::gloo::transport::Buffer& b, bool is_send, int peer, const Op& op);
  void watchdog_loop();
  void complete_bound_waits();  // under mu_: fail()'s wake-up of every bound wait
  void eager_close();
  // timeout.cc: the error of a wait that passed its deadline.
  std::exception_ptr timeout_error(const Task& waited, std::chrono::milliseconds timeout);

  std::shared_ptr<World> world_;
  Directions contexts_;
  // Posts the unbound transfers from Gloo's event-loop thread (channel.cc).
  class LoopPoster;
  std::unique_ptr<LoopPoster> poster_;
  const std::string uid_;
  const std::vector<int> world_ranks_;
  const int rank_, size_;

  mutable std::mutex mu_;
  std::condition_variable cv_;         // a task done, the channel failed, stop: for wait()
  std::condition_variable worker_cv_;  // queue non-empty, an inline deadline before worker_wake_, stop
  std::condition_variable waiter_cv_;  // p2p_ non-empty, stop
  // When the idle worker wakes by itself next (max: only when notified;
  // min: it is awake), and the timeout of an inline call since it last
  // planned (zero: none, so it may sleep until notified).
  Clock::time_point worker_wake_ = Clock::time_point::min();
  std::chrono::milliseconds recent_timeout_{};
  std::deque<std::shared_ptr<Task>> queue_;     // collectives not started
  std::deque<std::shared_ptr<Task>> p2p_;       // send/recv posted, completion not taken
  std::shared_ptr<Task> running_;               // the collective running (worker or caller)
  std::shared_ptr<Task> inline_;                // ... when the caller runs it: the worker watches
  Clock::time_point inline_deadline_{};
  std::chrono::milliseconds inline_timeout_{};
  std::vector<std::shared_ptr<Task>> p2p_live_;  // send/recv not done (for timeout messages)
  std::set<::gloo::transport::UnboundBuffer*> inflight_;  // inside a Gloo wait
  // Eager path: by peer rank (empty for this rank); the bound waits in
  // progress (fail() completes them; the watchdog re-arms old ones).
  struct BoundWait {
    ::gloo::transport::Buffer* buf;
    bool is_send;
    Clock::time_point since;
    int rearmed = 0;  // completions the watchdog made, not Gloo
  };
  std::vector<Eager> eager_;
  std::vector<BoundWait> bound_waits_;  // guarded by mu_
  std::chrono::milliseconds pair_timeout_{};
  Clock::time_point goodbye_deadline_ = Clock::time_point::max();  // the watchdog ends the goodbye then
  std::condition_variable watchdog_cv_;  // stop, goodbye_deadline_ set
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> orphans_;
  std::vector<std::unique_ptr<std::byte[]>> orphan_memory_;  // what orphans_ point into
  std::vector<Scratch> spares_;                               // guarded by mu_
  std::map<int, std::deque<std::shared_ptr<Task>>> self_sends_, self_recvs_;  // by tag
  comm::internal::FingerprintTable mismatch_table_;  // set before a MismatchError is thrown
  std::exception_ptr error_;
  std::string abort_reason_;
  bool stop_ = false;
  int idle_waiters_ = 0;
  int waiting_ = 0;  // user threads inside wait()
  uint64_t issued_ = 0, finished_ = 0;
  uint8_t last_op_ = 0;

  std::thread worker_;
  std::thread watchdog_;
  std::vector<std::thread> waiters_;
};

// The channel of a communicator of this engine; nullptr for another
// engine's. communicator.cc.
Channel* channel_of(Communicator& comm);

// Connects a new Gloo context for `rank` of `size` ranks of `world`,
// meeting through the store under a prefix of its own ("<name>/ctx/<uid>/"):
// collective over those ranks. communicator.cc.
std::shared_ptr<::gloo::Context> connect(World& world, const std::string& uid, int rank, int size,
                                         std::chrono::milliseconds timeout);
// A channel's two contexts (uids "<uid>.up" and "<uid>.down").
Directions connect_directions(World& world, const std::string& uid, int rank, int size,
                              std::chrono::milliseconds timeout);

}  // namespace meshtrain::comm::gloo::internal
