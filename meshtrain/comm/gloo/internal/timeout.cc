// Channel's timeout diagnosis: ask the peers where they are (World::probe,
// through the store) and name the ranks at fault. Split from channel.cc;
// the life cycle is in channel.h.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/comm/gloo/internal/channel.h"
#include "meshtrain/comm/internal/fingerprint.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo::internal {

std::exception_ptr Channel::timeout_error(const Task& waited, std::chrono::milliseconds timeout) {
  Op op = waited.op;
  const bool p2p = op.kind == CollectiveOp::send || op.kind == CollectiveOp::recv;
  if (!p2p) {  // the collective that holds the queue up is the one to explain
    std::lock_guard lock(mu_);
    if (running_) op = running_->op;
  }
  const std::chrono::milliseconds grace = comm::internal::probe_grace(timeout);
  std::vector<PeerStatus> peers;
  std::string why_not;
  try {
    std::vector<int> ask;
    for (int p = 0; p < size_; ++p)
      if (p != rank_) ask.push_back(world_ranks_[static_cast<size_t>(p)]);
    const std::vector<PeerStatus> answers = world_->probe(uid_, ask, grace);
    peers.resize(static_cast<size_t>(size_));
    peers[static_cast<size_t>(rank_)].state = PeerStatus::State::answered;
    for (int p = 0, i = 0; p < size_; ++p)
      if (p != rank_) peers[static_cast<size_t>(p)] = answers[static_cast<size_t>(i++)];
  } catch (const std::exception& e) {
    peers.clear();
    why_not = fmt::format("the store cannot be reached: {}", e.what());
  }
  const auto found = comm::internal::read_probe(peers, rank_, p2p ? 0 : op.seq, grace,
                                                "its agent thread starved", why_not);
  const std::string what = p2p ? fmt::format("{} (tag {}, {} x {}) with rank {}", collective_op_name(op.kind),
                                             op.tag, dtype_name(op.dtype), op.count, op.peer)
                               : op.fingerprint().to_string();
  const std::string waited_text = fmt::format("{} did not complete within {} ms", what, timeout.count());
  try {
    if (p2p) {
      const bool silent =
          std::find(found.silent.begin(), found.silent.end(), op.peer) != found.silent.end();
      throw TimeoutError(op_name(op.kind), waited_text + found.text,
                         silent ? fmt::format("rank {} is stopped or hung (it does not answer)", op.peer)
                                : fmt::format("rank {} has not posted the matching {} (same tag, count and dtype)",
                                              op.peer, op.kind == CollectiveOp::send ? "recv" : "send"),
                         {op.peer});
    }
    const std::vector<int> blamed = found.blamed();
    if (!blamed.empty())
      throw TimeoutError(
          op_name(op.kind),
          fmt::format("{}; ranks that did not arrive or do not answer: [{}]{}", waited_text,
                      fmt::join(blamed, ", "), found.text),
          fmt::format("{} {} slow, stuck or stopped (before or inside this collective), or issued fewer "
                      "collectives than this rank; if it is only slow, raise the timeout",
                      comm::internal::format_ranks(blamed), blamed.size() == 1 ? "is" : "are"),
          blamed);
    if (peers.empty())
      throw TimeoutError(op_name(op.kind), waited_text + found.text,
                         "check the store's host (the launcher or rank 0) and raise the timeout if the "
                         "transfer is only slow",
                         {});
    throw TimeoutError(op_name(op.kind),
                       fmt::format("{}; every rank answers and has issued it, but the data transfer did not "
                                   "finish",
                                   waited_text),
                       "the network between the ranks is stalled or slow; raise the timeout if the buffer is "
                       "huge",
                       {});
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace meshtrain::comm::gloo::internal
