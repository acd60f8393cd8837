// One rank's side of its group's barriers: arriving at a phase and waiting
// for every peer (spinning, yielding or sleeping on a futex, see the
// constants in group.h), with a deadline that names the missing ranks and
// marks them late, and the fingerprint check that follows the first barrier
// of every collective. Internal to comm/threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "meshtrain/comm/threads/internal/group.h"

namespace meshtrain::comm::threads::internal {

class Barrier {
 public:
  Barrier(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {
    missing_.reserve(static_cast<size_t>(g_->n));
    gone_.reserve(static_cast<size_t>(g_->n));
  }

  // Arrives at barrier phase (op.seq, k) and waits for every peer. With a
  // deadline, giving up marks the missing ranks' slots kAborted (by CAS, so a
  // rank either arrived in time or learns it is late; never both) and throws
  // TimeoutError (or AbortedError for a rank that failed or returned) naming
  // them; `timeout` is the deadline's length, for the message. Any error
  // aborts the group.
  void sync(const Op& op, int k, bool with_deadline, Clock::time_point deadline, std::chrono::milliseconds timeout);
  // Throws MismatchError (and aborts the group) unless every member
  // published op's fingerprint. Call after the first sync of op.
  void check_fingerprints(const Op& op);

 private:
  // A peer gave up on `gone` (their slots are kAborted) before this rank did:
  // report the same cause, from this rank's side.
  [[noreturn]] void fail_poisoned(const Op& op, const std::vector<int>& gone, std::chrono::milliseconds timeout);
  // Marks each missing rank's slot kAborted unless it arrived meanwhile.
  // Returns false if every missing rank turned out to have arrived.
  bool give_up(const std::vector<int>& missing, uint64_t target);

  std::shared_ptr<Group> g_;
  int rank_;
  uint64_t my_phase_ = 0;
  std::vector<int> missing_, gone_;  // sync()'s lists of ranks, reused: no allocation per barrier
};

}  // namespace meshtrain::comm::threads::internal
