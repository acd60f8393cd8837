#include "meshtrain/comm/threads/internal/barrier.h"

#include <fmt/format.h>
#include <sched.h>

#include <string>
#include <thread>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::threads::internal {

void Barrier::fail_poisoned(const Op& op, const std::vector<int>& gone, std::chrono::milliseconds timeout) {
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
                                   g_->names(gone), timeout.count()),
                       "a rank is stuck, slow, or skipped this collective; every rank must call the same "
                       "collectives in the same order",
                       gone);
  throw AbortedError(opname, fmt::format("{}: {}", op.fingerprint().to_string(), reason),
                     "see the first error of the run for the cause", ranks);
}

// Arrives at barrier phase (seq, k) and waits for every peer. With a
// deadline, giving up marks the missing ranks' slots kAborted (by CAS, so a
// rank either arrived in time or learns it is late; never both).
void Barrier::sync(const Op& op, int k, bool with_deadline, Clock::time_point deadline,
                   std::chrono::milliseconds timeout) {
  const uint64_t target = op.seq * 2 + static_cast<uint64_t>(k);
  Slot& mine = g_->slots[rank_];
  uint64_t expected = my_phase_;
  if (!mine.phase.compare_exchange_strong(expected, target, std::memory_order_acq_rel)) {
    fail(*g_, AbortedError("threads::" + std::string(collective_op_name(op.kind)),
                      fmt::format("{}: this rank ({}) arrived after its peers gave up waiting for it",
                                  op.fingerprint().to_string(), g_->name(rank_)),
                      "this rank was slower than the deadline; raise the timeout or find the stall"));
  }
  my_phase_ = target;
  g_->notify();

    const auto spin_until = Clock::now() + (g_->spin ? Clock::duration(kSpinTime) : Clock::duration(kYieldTime));
  std::vector<int>& missing = missing_;
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
    if (!gone.empty()) fail_poisoned(op, gone, timeout);
    if (missing.empty()) return;
    // Spinning: read the clock (as costly as a poll) and look for lost
    // ranks only every 16th poll, well under a microsecond apart.
    if (g_->spin && (++polls & 15) != 0) {
      for (int i = 0; i < kPausesPerPoll; ++i) comm::internal::cpu_relax();
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
            fail(*g_, AbortedError(opname,
                              fmt::format("{}: {}", op.fingerprint().to_string(), lost->first),
                              "a rank that fails or returns early leaves its peers waiting", lost->second));
          fail(*g_, TimeoutError(opname,
                            fmt::format("{}: {} did not arrive within {} ms", op.fingerprint().to_string(),
                                        g_->names(missing), timeout.count()),
                            "a rank is stuck, slow, or skipped this collective; every rank must call the "
                            "same collectives in the same order",
                            missing));
        }
        continue;  // they arrived just in time
      }
    }
    if (Clock::now() < spin_until) {
      if (g_->spin) {
        for (int i = 0; i < kPausesPerPoll; ++i) comm::internal::cpu_relax();
      } else {
        sched_yield();
      }
      continue;
    }
    auto rem = with_deadline ? std::min<Clock::duration>(deadline - Clock::now(), kMaxSleep)
                             : Clock::duration(kMaxSleep);
    g_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    comm::internal::futex_wait(g_->epoch, ep, rem);
    g_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

bool Barrier::give_up(const std::vector<int>& missing, uint64_t target) {
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

void Barrier::check_fingerprints(const Op& op) {
  const Fingerprint mine = op.fingerprint();
  for (int p = 0; p < g_->n; ++p) {
    const Fingerprint& theirs = g_->slots[p].pub[op.seq % 2].fp;
    if (theirs == mine) continue;
    fail(*g_, MismatchError("threads::" + std::string(collective_op_name(op.kind)),
                       fmt::format("{} called {} but {} called {}", g_->name(rank_), mine.to_string(),
                                   g_->name(p), theirs.to_string()),
                       "every rank must call the same collectives, with the same dtype, count and root, "
                       "in the same order",
                       {rank_, p}));
  }
}

}  // namespace meshtrain::comm::threads::internal
