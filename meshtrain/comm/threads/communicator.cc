#include "meshtrain/comm/threads/communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include "meshtrain/comm/internal/futex.h"
#include "meshtrain/comm/internal/reduce.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::threads {
namespace {

using namespace std::chrono_literals;
using internal::cpu_relax;
using internal::futex_wait;
using internal::futex_wake_all;

// A slot's phase after a peer gave up waiting for it: the owner must not join
// that collective any more (its peers may have left and freed their buffers).
constexpr uint64_t kAborted = ~uint64_t{0};
// Longest single sleep: bounds how fast a wait notices a failed or exited rank.
constexpr auto kMaxSleep = 10ms;
// How long a wait spins before it sleeps (only when ranks <= cores).
constexpr auto kSpinTime = 50us;
// PAUSEs between two polls of the peers' phases while spinning. One PAUSE is
// ~34 ns on Zen 4: 64 of them made every barrier up to 2 us late; polling
// after every one slowed the threads being waited for (under ThreadSanitizer
// a bucket all-reduce took twice as long).
constexpr int kPausesPerPoll = 4;
// With more ranks than cores, how long a wait yields its core to a runnable
// peer (sched_yield) before it sleeps: a futex wake-up costs tens of us.
constexpr auto kYieldTime = 200us;

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

struct Group;

struct World {
  int n = 0;
  int cores = 1;
  std::atomic<bool> failed{false};
  std::mutex mu;  // guards failed_rank, reason, splits
  int failed_rank = -1;
  std::string reason;
  std::unique_ptr<std::atomic<bool>[]> exited;
  std::atomic<uint64_t> next_group_id{1};

  // Groups being made by split, keyed (parent id, seq, color), with how many
  // members have yet to pick theirs up.
  std::map<std::tuple<uint64_t, uint64_t, int>, std::pair<std::shared_ptr<Group>, int>> splits;
};

// What a rank publishes for one collective. Two of them per slot, indexed by
// seq % 2: a peer may publish collective k+1 while others still read k.
struct Publication {
  Fingerprint fp;
  const void* send = nullptr;
  void* recv = nullptr;
};

struct alignas(64) Slot {
  std::atomic<uint64_t> phase{0};
  Publication pub[2];
  std::byte* scratch[2] = {nullptr, nullptr};
};

// One pending send or recv, matched in order per (source, destination, tag).
struct P2PEntry {
  int tag = 0;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DType dtype = DType::u8;
  std::atomic<uint32_t> done{0};
  std::string error;  // set (before done) when the two sides disagree
};

struct Mailbox {
  std::mutex mu;
  std::deque<std::shared_ptr<P2PEntry>> sends, recvs;
};

struct Group {
  uint64_t id = 0;
  int n = 0;
  std::shared_ptr<World> world;
  std::vector<int> world_ranks;
  bool spin = false;
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<std::byte[]> scratch;
  std::unique_ptr<Mailbox[]> mailboxes;  // [src * n + dst]
  alignas(64) std::atomic<uint32_t> epoch{0};
  std::atomic<int> sleepers{0};
  alignas(64) std::atomic<bool> aborted{false};
  std::mutex mu;  // guards the abort_* fields
  std::string abort_reason;
  std::vector<int> abort_ranks;  // the ranks the first error was about
  bool abort_timed_out = false;  // the first error was a timeout

  Group(uint64_t id_, std::shared_ptr<World> w, std::vector<int> ranks)
      : id(id_), n(static_cast<int>(ranks.size())), world(std::move(w)), world_ranks(std::move(ranks)) {
    spin = world->n <= world->cores;
    slots = std::make_unique<Slot[]>(n);
    // Pre-faulted: the first collective must not pay for page faults.
    scratch = std::make_unique<std::byte[]>(2 * kSmallBytes * n);
    std::memset(scratch.get(), 0, 2 * kSmallBytes * n);
    for (int r = 0; r < n; ++r)
      for (int b = 0; b < 2; ++b) slots[r].scratch[b] = scratch.get() + (2 * r + b) * kSmallBytes;
    mailboxes = std::make_unique<Mailbox[]>(static_cast<size_t>(n) * n);
  }

  void notify() {
    epoch.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(epoch);
  }

  std::string name(int r) const {
    if (world_ranks.size() == static_cast<size_t>(world->n) && world_ranks[r] == r)
      return fmt::format("rank {}", r);
    return fmt::format("rank {} (world rank {})", r, world_ranks[r]);
  }
  std::string names(const std::vector<int>& ranks) const {
    std::vector<std::string> s;
    for (int r : ranks) s.push_back(name(r));
    return fmt::format("{}", fmt::join(s, ", "));
  }

  // Records the first error; later calls and waits of every member fail fast.
  void abort(const std::string& reason, const std::vector<int>& ranks, bool timed_out) {
    {
      std::lock_guard l(mu);
      if (aborted.load()) return;
      abort_reason = reason;
      abort_ranks = ranks;
      abort_timed_out = timed_out;
      aborted.store(true);
    }
    notify();
  }

  // Why a wait for `missing` should stop early: a missing rank failed or returned.
  std::optional<std::pair<std::string, std::vector<int>>> lost(const std::vector<int>& missing) {
    std::vector<int> gone;
    for (int r : missing)
      if (world->exited[world_ranks[r]].load(std::memory_order_relaxed)) gone.push_back(r);
    if (!gone.empty()) return std::pair{fmt::format("{} already returned from its function", names(gone)), gone};
    if (world->failed.load(std::memory_order_relaxed)) {
      std::lock_guard l(world->mu);
      std::vector<int> who;
      for (int r = 0; r < n; ++r)
        if (world_ranks[r] == world->failed_rank) who.push_back(r);
      return std::pair{fmt::format("world rank {} failed: {}", world->failed_rank, world->reason), who};
    }
    return std::nullopt;
  }
};

// State of one queued async collective.
struct AsyncState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

class QueuedWork final : public internal::WorkState {
 public:
  explicit QueuedWork(std::shared_ptr<AsyncState> s) : s_(std::move(s)) {}
  void wait() override {
    std::unique_lock l(s_->mu);
    s_->cv.wait(l, [&] { return s_->done; });
    if (s_->error) std::rethrow_exception(s_->error);
  }
  bool test() override {
    std::lock_guard l(s_->mu);
    return s_->done;
  }

 private:
  std::shared_ptr<AsyncState> s_;
};

class ThreadsCommunicator;

class P2PWork final : public internal::WorkState {
 public:
  P2PWork(std::shared_ptr<Group> g, std::shared_ptr<P2PEntry> e, Mailbox* mb, bool is_send, int peer,
          Clock::time_point deadline, std::chrono::milliseconds timeout)
      : g_(std::move(g)), e_(std::move(e)), mb_(mb), is_send_(is_send), peer_(peer),
        deadline_(deadline), timeout_(timeout) {}

  void wait() override {
    for (;;) {
      if (e_->done.load(std::memory_order_acquire)) break;
      auto lost = g_->lost({peer_});
      const bool late = Clock::now() >= deadline_;
      if (late || lost) {
        std::lock_guard l(mb_->mu);
        if (e_->done.load(std::memory_order_acquire)) break;  // matched meanwhile
        auto& q = is_send_ ? mb_->sends : mb_->recvs;
        q.erase(std::find(q.begin(), q.end(), e_));
        const std::string what = fmt::format("{} {} {} (tag {}, {} x {})", is_send_ ? "send to" : "recv from",
                                             g_->name(peer_), "", e_->tag, dtype_name(e_->dtype), e_->count);
        if (lost)
          throw AbortedError("threads::" + std::string(is_send_ ? "send" : "recv"), what + ": " + lost->first,
                             "the peer stopped before posting the matching call", lost->second);
        throw TimeoutError("threads::" + std::string(is_send_ ? "send" : "recv"),
                           fmt::format("{}: {} did not post the matching {} within {} ms", what, g_->name(peer_),
                                       is_send_ ? "recv" : "send", timeout_.count()),
                           "check that the peer calls the matching send/recv with the same tag", {peer_});
      }
      auto rem = std::min<Clock::duration>(deadline_ - Clock::now(), kMaxSleep);
      futex_wait(e_->done, 0, rem);
    }
    if (!e_->error.empty())
      throw MismatchError(is_send_ ? "threads::send" : "threads::recv", e_->error,
                          "send and recv must agree on count and dtype", {peer_});
  }
  bool test() override { return e_->done.load(std::memory_order_acquire) != 0; }

 private:
  std::shared_ptr<Group> g_;
  std::shared_ptr<P2PEntry> e_;
  Mailbox* mb_;
  bool is_send_;
  int peer_;
  Clock::time_point deadline_;
  std::chrono::milliseconds timeout_;
};

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<Group> g, int rank, std::chrono::milliseconds timeout)
      : g_(std::move(g)), rank_(rank), ins_(static_cast<size_t>(g_->n)), outs_(static_cast<size_t>(g_->n)) {
    set_timeout(timeout);
    missing_.reserve(static_cast<size_t>(g_->n));
    gone_.reserve(static_cast<size_t>(g_->n));
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
    // Exchange (color, key) through the scratch slots: one barrier.
    const int32_t mine[2] = {color, key};
    Slot& s = g_->slots[rank_];
    std::memcpy(s.scratch[seq % 2], mine, sizeof(mine));
    s.pub[seq % 2] = {op.fingerprint(), nullptr, nullptr};
    sync(op, 0, true);
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

  // Aborts the group (later calls fail fast) and throws e with its own type.
  template <typename E>
  [[noreturn]] void fail(E e) {
    g_->abort(e.what(), e.ranks(), std::is_same_v<E, TimeoutError>);
    throw e;
  }

  // A peer gave up on `gone` (their slots are kAborted) before this rank did:
  // report the same cause, from this rank's side.
  [[noreturn]] void fail_poisoned(const Op& op, const std::vector<int>& gone) {
    const std::string opname = "threads::" + std::string(collective_op_name(op.kind));
    // The rank that marked the slots records why right after it did so.
    while (!g_->aborted.load(std::memory_order_acquire)) std::this_thread::yield();
    std::string reason;
    std::vector<int> ranks;
    bool timed_out;
    {
      std::lock_guard l(g_->mu);
      reason = g_->abort_reason;
      ranks = g_->abort_ranks;
      timed_out = g_->abort_timed_out;
    }
    if (timed_out)
      throw TimeoutError(opname,
                         fmt::format("{}: {} did not arrive within {} ms", op.fingerprint().to_string(),
                                     g_->names(gone), timeout().count()),
                         "a rank is stuck, slow, or skipped this collective; every rank must call the same "
                         "collectives in the same order",
                         gone);
    throw AbortedError(opname, fmt::format("{}: {}", op.fingerprint().to_string(), reason),
                       "see the first error of the run for the cause", ranks);
  }

  // Arrives at barrier phase (seq, k) and waits for every peer. With a
  // deadline, giving up marks the missing ranks' slots kAborted (by CAS, so a
  // rank either arrived in time or learns it is late; never both).
  void sync(const Op& op, int k, bool with_deadline) {
    const uint64_t target = op.seq * 2 + static_cast<uint64_t>(k);
    Slot& mine = g_->slots[rank_];
    uint64_t expected = my_phase_;
    if (!mine.phase.compare_exchange_strong(expected, target, std::memory_order_acq_rel)) {
      fail(AbortedError("threads::" + std::string(collective_op_name(op.kind)),
                        fmt::format("{}: this rank ({}) arrived after its peers gave up waiting for it",
                                    op.fingerprint().to_string(), g_->name(rank_)),
                        "this rank was slower than the deadline; raise the timeout or find the stall"));
    }
    my_phase_ = target;
    g_->notify();

    const auto deadline = op_deadline_;
    const auto spin_until = Clock::now() + (g_->spin ? Clock::duration(kSpinTime) : Clock::duration(kYieldTime));
    std::vector<int>& missing = missing_;  // reused: no allocation per barrier
    std::vector<int>& gone = gone_;
    unsigned polls = 0;
    for (;;) {
      const uint32_t ep = g_->epoch.load(std::memory_order_acquire);
      missing.clear();
      gone.clear();
      for (int p = 0; p < g_->n; ++p) {
        const uint64_t v = g_->slots[p].phase.load(std::memory_order_acquire);
        if (v == kAborted) {
          // In the completion wait a kAborted slot (even ours) means its owner
          // finished this collective and was later marked late for the next.
          if (with_deadline && p != rank_) gone.push_back(p);
        } else if (v < target) {
          missing.push_back(p);
        }
      }
      if (!gone.empty()) fail_poisoned(op, gone);
      if (missing.empty()) return;
      // Spinning: read the clock (as costly as a poll) and look for lost
      // ranks only every 16th poll, well under a microsecond apart.
      if (g_->spin && (++polls & 15) != 0) {
        for (int i = 0; i < kPausesPerPoll; ++i) cpu_relax();
        continue;
      }
      if (with_deadline) {
        const auto now = Clock::now();
        auto lost = g_->lost(missing);
        if (lost || now >= deadline) {
          // Mark only the ranks at fault: a lost rank never arrives, so the
          // others (merely not here yet) cannot pass this barrier anyway.
          if (lost && !lost->second.empty()) missing = lost->second;
          if (give_up(missing, target)) {
            const std::string opname = "threads::" + std::string(collective_op_name(op.kind));
            if (lost)
              fail(AbortedError(opname,
                                fmt::format("{}: {}", op.fingerprint().to_string(), lost->first),
                                "a rank that fails or returns early leaves its peers waiting", lost->second));
            fail(TimeoutError(opname,
                              fmt::format("{}: {} did not arrive within {} ms", op.fingerprint().to_string(),
                                          g_->names(missing), timeout().count()),
                              "a rank is stuck, slow, or skipped this collective; every rank must call the "
                              "same collectives in the same order",
                              missing));
          }
          continue;  // they arrived just in time
        }
      }
      if (Clock::now() < spin_until) {
        if (g_->spin) {
          for (int i = 0; i < kPausesPerPoll; ++i) cpu_relax();
        } else {
          sched_yield();
        }
        continue;
      }
      auto rem = with_deadline ? std::min<Clock::duration>(deadline - Clock::now(), kMaxSleep)
                               : Clock::duration(kMaxSleep);
      g_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      futex_wait(g_->epoch, ep, rem);
      g_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Marks each missing rank's slot kAborted unless it arrived meanwhile.
  // Returns false if every missing rank turned out to have arrived.
  bool give_up(const std::vector<int>& missing, uint64_t target) {
    bool marked = false;
    for (int p : missing) {
      uint64_t v = g_->slots[p].phase.load(std::memory_order_acquire);
      while (v < target) {
        if (g_->slots[p].phase.compare_exchange_weak(v, kAborted, std::memory_order_acq_rel)) {
          marked = true;
          break;
        }
      }
      if (v == kAborted) marked = true;
    }
    return marked;
  }

  void check_fingerprints(const Op& op) {
    const Fingerprint mine = op.fingerprint();
    for (int p = 0; p < g_->n; ++p) {
      const Fingerprint& theirs = g_->slots[p].pub[op.seq % 2].fp;
      if (theirs == mine) continue;
      fail(MismatchError("threads::" + std::string(collective_op_name(op.kind)),
                         fmt::format("{} called {} but {} called {}", g_->name(rank_), mine.to_string(),
                                     g_->name(p), theirs.to_string()),
                         "every rank must call the same collectives, with the same dtype, count and root, "
                         "in the same order",
                         {rank_, p}));
    }
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
    if (input_bytes(op) <= kSmallBytes) run_small(op);
    else run_large(op);
  }

  // One barrier: inputs go through the persistent scratch slots.
  void run_small(const Op& op) {
    const int n = g_->n, b = static_cast<int>(op.seq % 2);
    Slot& me = g_->slots[rank_];
    me.pub[b] = {op.fingerprint(), op.send, op.recv};
    const bool has_input = op.kind != CollectiveOp::broadcast || op.root == rank_;
    if (has_input && op.send) std::memcpy(me.scratch[b], op.send, input_bytes(op));
    sync(op, 0, true);
    check_fingerprints(op);
    const size_t bytes = op.bytes();
    auto in = [&](int p) { return static_cast<const std::byte*>(g_->slots[p].scratch[b]); };
    auto out = static_cast<std::byte*>(op.recv);
    switch (op.kind) {
      case CollectiveOp::all_reduce: {
        std::vector<const void*>& ins = ins_;
        for (int p = 0; p < n; ++p) ins[p] = in(p);
        void* outs[1] = {op.recv};
        internal::reduce(outs, 1, ins.data(), n, op.count, op.dtype, op.reduce, n);
        break;
      }
      case CollectiveOp::reduce_scatter: {
        std::vector<const void*>& ins = ins_;
        for (int p = 0; p < n; ++p) ins[p] = in(p) + rank_ * bytes;
        void* outs[1] = {op.recv};
        internal::reduce(outs, 1, ins.data(), n, op.count, op.dtype, op.reduce, n);
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
    sync(op, 0, true);
    check_fingerprints(op);
    const size_t es = dtype_size(op.dtype), bytes = op.bytes();
    const bool nt = input_bytes(op) >= internal::kStreamingBytes;
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
        internal::reduce(outs.data(), n, ins.data(), n, hi - lo, op.dtype, op.reduce, n, nt);
        break;
      }
      case CollectiveOp::reduce_scatter: {
        std::vector<const void*>& ins = ins_;
        for (int p = 0; p < n; ++p) ins[p] = static_cast<const std::byte*>(pub(p).send) + rank_ * bytes;
        void* outs[1] = {op.recv};
        internal::reduce(outs, 1, ins.data(), n, op.count, op.dtype, op.reduce, n, nt);
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
            if (dst != src) internal::copy(dst + off, src + off, len, nt);
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
          if (p != op.root && hi > lo) internal::copy(static_cast<std::byte*>(pub(p).recv) + lo, src + lo, hi - lo, nt);
        break;
      }
      case CollectiveOp::all_to_all:
        for (int p = 0; p < n; ++p)
          internal::copy(static_cast<std::byte*>(pub(p).recv) + rank_ * bytes,
                         static_cast<const std::byte*>(op.send) + p * bytes, bytes, nt);
        break;
      default:
        break;
    }
    sync(op, 1, false);
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
      futex_wake_all(e->done);
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
  // Per-call pointer lists, reused (run() never runs twice at once: blocking
  // calls drain the async queue first).
  std::vector<const void*> ins_;
  std::vector<void*> outs_;
  std::vector<int> missing_, gone_;  // sync()'s lists of ranks
  uint64_t my_phase_ = 0;
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
