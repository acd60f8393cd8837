#include "meshtrain/comm/threads/communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <tuple>

#include "meshtrain/comm/internal/futex.h"
#include "meshtrain/comm/internal/reduce.h"
#include "meshtrain/comm/threads/internal/barrier.h"
#include "meshtrain/comm/threads/internal/group.h"
#include "meshtrain/comm/threads/internal/work.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/parallel_for.h"

// The engine's shared state (World, Group, slots, mailboxes):
// internal/group.h; its barriers and fingerprint checks: internal/barrier.h;
// its Work states: internal/work.h. This file holds the Communicator: issue
// order, the async queue, the collectives' data movement, send/recv
// matching and split.

namespace meshtrain::comm::threads {
namespace {

using internal::AsyncState;
using internal::Group;
using internal::kAborted;
using internal::Mailbox;
using internal::P2PEntry;
using internal::P2PWork;
using internal::Publication;
using internal::QueuedWork;
using internal::Slot;
using internal::World;

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<Group> g, int rank, std::chrono::milliseconds timeout)
      : g_(std::move(g)), rank_(rank), barrier_(g_, rank), ins_(static_cast<size_t>(g_->n)),
        outs_(static_cast<size_t>(g_->n)) {
    set_timeout(timeout);
  }
  ~ThreadsCommunicator() override {
    {
      std::lock_guard l(qmu_);
      stop_ = true;
    }
    qcv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return g_->n; }
  Capabilities capabilities() const override {
    return {.engine = Engine::threads, .async = true, .send_recv = true, .split = true,
            .checks_fingerprints = true, .names_missing_ranks = true, .device_memory = false,
            .wait_from_any_thread = true};  // a Work is a condition variable
  }
  Group& group() { return *g_; }

 protected:
  Work start(const Op& op, Completion completion) override {
    check_not_aborted(op);
    if (op.kind == CollectiveOp::send || op.kind == CollectiveOp::recv) return start_p2p(op);
    if (completion == Completion::blocking) {
      drain();
      run(op);
      return Work{};
    }
    auto st = std::make_shared<AsyncState>();
    {
      std::lock_guard l(qmu_);
      if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
      queue_.push_back({op, st});
      ++pending_;
    }
    qcv_.notify_all();
    return Work(std::make_unique<QueuedWork>(st));
  }

  std::unique_ptr<Communicator> do_split(int color, int key, uint64_t seq) override {
    Op op{.kind = CollectiveOp::split, .seq = seq};
    check_not_aborted(op);
    drain();
    // The exchange's deadline runs from now (run() sets it for collectives).
    op_deadline_ = Clock::now() + timeout();
    // Exchange (color, key) through the scratch slots: one barrier.
    const int32_t mine[2] = {color, key};
    Slot& s = g_->slots[rank_];
    std::memcpy(s.scratch[seq % 2], mine, sizeof(mine));
    s.pub[seq % 2] = {op.fingerprint(), nullptr, nullptr};
    barrier_.sync(op, 0, true, op_deadline_, timeout());
    std::vector<std::pair<int, int>> members;  // (key, old rank)
    for (int p = 0; p < g_->n; ++p) {
      int32_t theirs[2];
      std::memcpy(theirs, g_->slots[p].scratch[seq % 2], sizeof(theirs));
      if (theirs[0] == color) members.emplace_back(theirs[1], p);
    }
    if (color < 0) return nullptr;
    std::sort(members.begin(), members.end());
    std::vector<int> world_ranks;
    int new_rank = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      world_ranks.push_back(g_->world_ranks[members[i].second]);
      if (members[i].second == rank_) new_rank = static_cast<int>(i);
    }
    // The first member to get here creates the group; the others find it.
    std::shared_ptr<Group> child;
    {
      World& w = *g_->world;
      std::lock_guard l(w.mu);
      auto k = std::make_tuple(g_->id, seq, color);
      auto it = w.splits.find(k);
      if (it == w.splits.end()) {
        auto grp = std::make_shared<Group>(w.next_group_id++, g_->world, world_ranks);
        it = w.splits.emplace(k, std::pair{grp, static_cast<int>(members.size())}).first;
      }
      child = it->second.first;
      if (--it->second.second == 0) w.splits.erase(it);
    }
    return std::make_unique<ThreadsCommunicator>(std::move(child), new_rank, timeout());
  }

 private:
  struct Task {
    Op op;
    std::shared_ptr<AsyncState> state;
  };

  void worker_loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock l(qmu_);
        qcv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr err;
      try {
        check_not_aborted(t.op);
        run(t.op);
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard l(t.state->mu);
        t.state->done = true;
        t.state->error = err;
      }
      t.state->cv.notify_all();
      {
        std::lock_guard l(qmu_);
        --pending_;
      }
      qcv_.notify_all();
    }
  }

  // Waits until every queued async operation has run (they are bounded by
  // their own deadlines), so blocking calls keep issue order.
  void drain() {
    std::unique_lock l(qmu_);
    qcv_.wait(l, [&] { return pending_ == 0; });
  }

  void check_not_aborted(const Op& op) {
    if (!g_->aborted.load(std::memory_order_acquire)) return;
    const bool late = g_->slots[rank_].phase.load(std::memory_order_acquire) == kAborted;
    std::lock_guard l(g_->mu);
    throw AbortedError("threads::" + std::string(collective_op_name(op.kind)),
                       fmt::format("{}: {}: {}", op.fingerprint().to_string(),
                                   late ? fmt::format("this rank ({}) arrived after its peers gave up waiting for it",
                                                      g_->name(rank_))
                                        : "communicator aborted earlier",
                                   g_->abort_reason),
                       "a communicator is unusable after an error; create a new world", g_->abort_ranks);
  }

  size_t input_bytes(const Op& op) const {
    switch (op.kind) {
      case CollectiveOp::reduce_scatter:
      case CollectiveOp::all_to_all: return op.bytes() * g_->n;
      default: return op.bytes();
    }
  }

  void run(const Op& op) {
    op_deadline_ = Clock::now() + timeout();
    if (op.kind == CollectiveOp::all_to_all_v) run_v(op);
    else if (input_bytes(op) <= kSmallBytes) run_small(op);
    else run_large(op);
  }

  // One barrier: inputs go through the persistent scratch slots.
  void run_small(const Op& op) {
    const int n = g_->n, b = static_cast<int>(op.seq % 2);
    Slot& me = g_->slots[rank_];
    me.pub[b] = {op.fingerprint(), op.send, op.recv};
    const bool has_input = op.kind != CollectiveOp::broadcast || op.root == rank_;
    if (has_input && op.send) std::memcpy(me.scratch[b], op.send, input_bytes(op));
    barrier_.sync(op, 0, true, op_deadline_, timeout());
    barrier_.check_fingerprints(op);
    const size_t bytes = op.bytes();
    auto in = [&](int p) { return static_cast<const std::byte*>(g_->slots[p].scratch[b]); };
    auto out = static_cast<std::byte*>(op.recv);
    switch (op.kind) {
      case CollectiveOp::all_reduce: {
        std::vector<const void*>& ins = ins_;
        for (int p = 0; p < n; ++p) ins[p] = in(p);
        void* outs[1] = {op.recv};
        comm::internal::reduce(outs, 1, ins.data(), n, op.count, op.dtype, op.reduce, n);
        break;
      }
      case CollectiveOp::reduce_scatter: {
        std::vector<const void*>& ins = ins_;
        for (int p = 0; p < n; ++p) ins[p] = in(p) + rank_ * bytes;
        void* outs[1] = {op.recv};
        comm::internal::reduce(outs, 1, ins.data(), n, op.count, op.dtype, op.reduce, n);
        break;
      }
      case CollectiveOp::all_gather:
        for (int p = 0; p < n; ++p)
          if (bytes) std::memcpy(out + p * bytes, in(p), bytes);
        break;
      case CollectiveOp::broadcast:
        if (rank_ != op.root && bytes) std::memcpy(out, in(op.root), bytes);
        break;
      case CollectiveOp::all_to_all:
        for (int p = 0; p < n; ++p)
          if (bytes) std::memcpy(out + p * bytes, in(p) + rank_ * bytes, bytes);
        break;
      default:
        break;
    }
  }

  // Two barriers: publish pointers, work directly in the peers' buffers,
  // then wait until every peer finished touching ours. The second wait has
  // no deadline: past the first barrier peers run only bounded copy loops.
  void run_large(const Op& op) {
    const int n = g_->n, b = static_cast<int>(op.seq % 2);
    Slot& me = g_->slots[rank_];
    me.pub[b] = {op.fingerprint(), op.send, op.recv};
    barrier_.sync(op, 0, true, op_deadline_, timeout());
    barrier_.check_fingerprints(op);
    const size_t es = dtype_size(op.dtype), bytes = op.bytes();
    const bool nt = input_bytes(op) >= comm::internal::kStreamingBytes;
    auto pub = [&](int p) -> const Publication& { return g_->slots[p].pub[b]; };
    switch (op.kind) {
      case CollectiveOp::all_reduce: {
        // Rank r owns elements [lo, hi): it reads them from every input and
        // writes the result to every output. Boundaries on 64-element lines.
        auto bound = [&](int r) {
          if (r == n) return op.count;
          return std::min(op.count, (op.count * r / n) & ~size_t{63});
        };
        const size_t lo = bound(rank_), hi = bound(rank_ + 1);
        std::vector<const void*>& ins = ins_;
        std::vector<void*>& outs = outs_;
        for (int p = 0; p < n; ++p) {
          ins[p] = static_cast<const std::byte*>(pub(p).send) + lo * es;
          outs[p] = static_cast<std::byte*>(pub(p).recv) + lo * es;
        }
        comm::internal::reduce(outs.data(), n, ins.data(), n, hi - lo, op.dtype, op.reduce, n, nt);
        break;
      }
      case CollectiveOp::reduce_scatter: {
        std::vector<const void*>& ins = ins_;
        for (int p = 0; p < n; ++p) ins[p] = static_cast<const std::byte*>(pub(p).send) + rank_ * bytes;
        void* outs[1] = {op.recv};
        comm::internal::reduce(outs, 1, ins.data(), n, op.count, op.dtype, op.reduce, n, nt);
        break;
      }
      case CollectiveOp::all_gather: {
        // Chunk by chunk, so the input is read from memory once and copied
        // from cache to every output.
        constexpr size_t kChunk = 256 * 1024;
        const auto* src = static_cast<const std::byte*>(op.send);
        for (size_t off = 0; off < bytes; off += kChunk) {
          const size_t len = std::min(kChunk, bytes - off);
          for (int p = 0; p < n; ++p) {
            auto* dst = static_cast<std::byte*>(pub(p).recv) + rank_ * bytes;
            if (dst != src) comm::internal::copy(dst + off, src + off, len, nt);
          }
        }
        break;
      }
      case CollectiveOp::broadcast: {
        // Every rank, the root included, copies piece rank_ of the root's
        // buffer into each other rank's: all cores share the (n-1) S bytes.
        auto bound = [&](int r) { return r == n ? bytes : std::min(bytes, (bytes * r / n) & ~size_t{63}); };
        const size_t lo = bound(rank_), hi = bound(rank_ + 1);
        const auto* src = static_cast<const std::byte*>(pub(op.root).send);
        for (int p = 0; p < n; ++p)
          if (p != op.root && hi > lo) comm::internal::copy(static_cast<std::byte*>(pub(p).recv) + lo, src + lo, hi - lo, nt);
        break;
      }
      case CollectiveOp::all_to_all:
        for (int p = 0; p < n; ++p)
          comm::internal::copy(static_cast<std::byte*>(pub(p).recv) + rank_ * bytes,
                         static_cast<const std::byte*>(op.send) + p * bytes, bytes, nt);
        break;
      default:
        break;
    }
    barrier_.sync(op, 1, false, op_deadline_, timeout());
  }

  // all_to_all_v: publish buffers and counts, check every pair's counts
  // (every rank reads the same n x n table, so all reach the same verdict
  // before any data moves), copy this rank's blocks into the peers' recv
  // buffers, then wait until every peer finished with ours. The counts go
  // through the scratch slot: a rank that finds a mismatch throws at once,
  // and its Op's vectors die while its peers may still be reading them.
  void run_v(const Op& op) {
    const int n = g_->n, b = static_cast<int>(op.seq % 2);
    if (2 * sizeof(size_t) * static_cast<size_t>(n) > kSmallBytes)
      throw Unsupported("threads::all_to_all_v", fmt::format("{} ranks", n),
                        fmt::format("the threads engine runs all_to_all_v on up to {} ranks",
                                    kSmallBytes / (2 * sizeof(size_t))));
    Slot& me = g_->slots[rank_];
    auto* counts = reinterpret_cast<size_t*>(me.scratch[b]);
    std::copy(op.send_counts.begin(), op.send_counts.end(), counts);
    std::copy(op.recv_counts.begin(), op.recv_counts.end(), counts + n);
    me.pub[b] = {op.fingerprint(), op.send, op.recv, counts, counts + n};
    barrier_.sync(op, 0, true, op_deadline_, timeout());
    barrier_.check_fingerprints(op);
    auto pub = [&](int p) -> const Publication& { return g_->slots[p].pub[b]; };
    for (int p = 0; p < n; ++p)
      for (int q = 0; q < n; ++q)
        if (pub(p).send_counts[q] != pub(q).recv_counts[p])
          internal::fail(*g_, MismatchError("threads::all_to_all_v",
                                            fmt::format("{}: {} sends {} elements to {}, which expects {}",
                                                        op.fingerprint().to_string(), g_->name(p),
                                                        pub(p).send_counts[q], g_->name(q), pub(q).recv_counts[p]),
                                            "rank r's send_counts[p] must equal rank p's recv_counts[r]: "
                                            "exchange the counts first (all_to_all_counts)",
                                            {p, q}));
    const size_t es = dtype_size(op.dtype);
    size_t sent = 0;
    for (int p = 0; p < n; ++p) {
      const size_t bytes = op.send_counts[p] * es;
      size_t at = 0;  // where rank_'s block starts in p's recv
      for (int s = 0; s < rank_; ++s) at += pub(p).recv_counts[s];
      if (bytes)
        comm::internal::copy(static_cast<std::byte*>(pub(p).recv) + at * es,
                             static_cast<const std::byte*>(op.send) + sent, bytes,
                             bytes >= comm::internal::kStreamingBytes);
      sent += bytes;
    }
    barrier_.sync(op, 1, false, op_deadline_, timeout());
  }

  Work start_p2p(const Op& op) {
    const bool is_send = op.kind == CollectiveOp::send;
    const int src = is_send ? rank_ : op.peer, dst = is_send ? op.peer : rank_;
    Mailbox& mb = g_->mailboxes[static_cast<size_t>(src) * g_->n + dst];
    std::lock_guard l(mb.mu);
    auto& others = is_send ? mb.recvs : mb.sends;
    auto it = std::find_if(others.begin(), others.end(), [&](auto& e) { return e->tag == op.tag; });
    if (it != others.end()) {
      // The peer is waiting: copy now (under the mailbox lock, so a timing-out
      // peer either sees its entry matched and done, or removes it first).
      std::shared_ptr<P2PEntry> e = *it;
      others.erase(it);
      std::string error;
      if (e->count != op.count || e->dtype != op.dtype) {
        error = fmt::format("send from {} ({} x {}) and recv at {} ({} x {}) with tag {} disagree", g_->name(src),
                            dtype_name(is_send ? op.dtype : e->dtype), is_send ? op.count : e->count, g_->name(dst),
                            dtype_name(is_send ? e->dtype : op.dtype), is_send ? e->count : op.count, op.tag);
      } else if (op.count) {
        std::memcpy(is_send ? e->recv : op.recv, is_send ? op.send : e->send, op.bytes());
      }
      e->error = error;
      e->done.store(1, std::memory_order_release);
      comm::internal::futex_wake_all(e->done);
      if (!error.empty())
        throw MismatchError(is_send ? "threads::send" : "threads::recv", error,
                            "send and recv must agree on count and dtype", {op.peer});
      return Work{};
    }
    auto e = std::make_shared<P2PEntry>();
    e->tag = op.tag;
    e->send = op.send;
    e->recv = op.recv;
    e->count = op.count;
    e->dtype = op.dtype;
    (is_send ? mb.sends : mb.recvs).push_back(e);
    return Work(std::make_unique<P2PWork>(g_, e, &mb, is_send, op.peer, Clock::now() + timeout(), timeout()));
  }

  std::shared_ptr<Group> g_;
  int rank_;
  internal::Barrier barrier_;
  // Per-call pointer lists, reused (run() never runs twice at once: blocking
  // calls drain the async queue first).
  std::vector<const void*> ins_;
  std::vector<void*> outs_;
  Clock::time_point op_deadline_{};

  std::thread worker_;
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<Task> queue_;
  size_t pending_ = 0;
  bool stop_ = false;
};

World& world_of(Communicator& comm) {
  auto* t = dynamic_cast<ThreadsCommunicator*>(&comm);
  if (!t)
    throw InvalidArgument("threads::world_of", "communicator is not a threads-engine communicator",
                          "pass a communicator made by threads::create_world");
  return *t->group().world;
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> create_world(int n, const Options& options) {
  if (n < 1)
    throw InvalidArgument("threads::create_world", fmt::format("{} ranks", n), "a world needs at least one rank");
  auto world = std::make_shared<World>();
  world->n = n;
  world->cores = options.cores > 0 ? options.cores : available_cores();
  world->exited = std::make_unique<std::atomic<bool>[]>(n);
  std::vector<int> ranks(n);
  for (int r = 0; r < n; ++r) ranks[r] = r;
  auto group = std::make_shared<Group>(0, world, ranks);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(std::make_unique<ThreadsCommunicator>(group, r, options.timeout));
  return comms;
}

void mark_failed(Communicator& comm, int rank, const std::string& reason) {
  World& w = world_of(comm);
  {
    std::lock_guard l(w.mu);
    if (w.failed.load()) return;  // keep the first cause
    w.failed_rank = rank;
    w.reason = reason;
  }
  w.failed.store(true);
}

void mark_exited(Communicator& comm, int rank) {
  World& w = world_of(comm);
  if (rank >= 0 && rank < w.n) w.exited[rank].store(true);
}

}  // namespace meshtrain::comm::threads
