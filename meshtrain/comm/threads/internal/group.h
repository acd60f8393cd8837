// The threads engine's shared state: a World (every rank of one
// create_world) and a Group per communicator (its members' slots, scratch
// memory and mailboxes). Internal to comm/threads.
//
// Slots: each rank publishes, per collective, its fingerprint and buffer
// pointers (two publications, indexed by seq % 2, so a rank may publish
// collective k+1 while slower peers still read k) and advances its `phase`
// to arrive at a barrier (barrier.h). A phase of kAborted marks a rank its
// peers gave up on. Mailboxes match send/recv per (source, destination).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/internal/futex.h"
#include "meshtrain/comm/threads/communicator.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::threads::internal {

using namespace std::chrono_literals;

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
  const size_t* send_counts = nullptr;  // all_to_all_v's, n each
  const size_t* recv_counts = nullptr;
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

  Group(uint64_t id, std::shared_ptr<World> w, std::vector<int> ranks);

  void notify() {
    epoch.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) comm::internal::futex_wake_all(epoch);
  }

  // "rank 3", or "rank 3 (world rank 5)" in a sub-communicator.
  std::string name(int r) const;
  std::string names(const std::vector<int>& ranks) const;
  // Records the first error; later calls and waits of every member fail fast.
  void abort(const std::string& reason, const std::vector<int>& ranks, bool timed_out);
  // Why a wait for `missing` should stop early: a missing rank failed or
  // returned (the reason and the ranks it is about).
  std::optional<std::pair<std::string, std::vector<int>>> lost(const std::vector<int>& missing);
};

// Aborts the group (later calls fail fast) and throws e with its own type.
template <typename E>
[[noreturn]] void fail(Group& g, E e) {
  g.abort(e.what(), e.ranks(), std::is_same_v<E, TimeoutError>);
  throw e;
}

}  // namespace meshtrain::comm::threads::internal
