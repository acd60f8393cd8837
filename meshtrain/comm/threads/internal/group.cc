#include "meshtrain/comm/threads/internal/group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

namespace meshtrain::comm::threads::internal {

Group::Group(uint64_t id_, std::shared_ptr<World> w, std::vector<int> ranks)
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

std::string Group::name(int r) const {
  if (world_ranks.size() == static_cast<size_t>(world->n) && world_ranks[r] == r)
    return fmt::format("rank {}", r);
  return fmt::format("rank {} (world rank {})", r, world_ranks[r]);
}
std::string Group::names(const std::vector<int>& ranks) const {
  std::vector<std::string> s;
  for (int r : ranks) s.push_back(name(r));
  return fmt::format("{}", fmt::join(s, ", "));
}

void Group::abort(const std::string& reason, const std::vector<int>& ranks, bool timed_out) {
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

std::optional<std::pair<std::string, std::vector<int>>> Group::lost(const std::vector<int>& missing) {
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

}  // namespace meshtrain::comm::threads::internal
