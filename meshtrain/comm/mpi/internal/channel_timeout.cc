// Channel's timeout diagnosis: asking the peers where they are (liveness
// probes through the Runtime) and turning their answers, the fingerprints
// that arrived and the ring's state into a TimeoutError that names the
// ranks at fault. Split from channel.cc; the life cycle is in channel.h.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <vector>

#include "meshtrain/comm/mpi/internal/channel.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::mpi::internal {

std::vector<PeerStatus> Channel::probe_peers(std::chrono::milliseconds timeout) {
  Runtime* rt = Runtime::get();
  if (!rt || !rt->has_thread() || size_ == 1) return {};
  std::vector<int> peers;
  for (int p = 0; p < size_; ++p)
    if (p != rank_) peers.push_back(world_ranks_[static_cast<size_t>(p)]);
  std::vector<PeerStatus> answers = rt->probe(id_, peers, probe_grace(timeout));
  std::vector<PeerStatus> out(static_cast<size_t>(size_));  // indexed by rank; self: answered
  out[static_cast<size_t>(rank_)].state = PeerStatus::State::answered;
  for (int p = 0, i = 0; p < size_; ++p)
    if (p != rank_) out[static_cast<size_t>(p)] = answers[static_cast<size_t>(i++)];
  return out;
}

std::exception_ptr Channel::timeout_error(Task& t, std::chrono::milliseconds timeout,
                                          const std::vector<PeerStatus>& peers) {
  const Op& op = t.op;
  const bool p2p = is_p2p(op.kind);
  const std::string what = p2p ? fmt::format("{} (tag {}, {} x {}) with rank {}",
                                             collective_op_name(op.kind), op.tag,
                                             dtype_name(op.dtype), op.count, op.peer)
                               : op.fingerprint().to_string();
  const std::string waited = fmt::format("{} did not complete within {} ms", what, timeout.count());
  const ProbeFindings found = read_probe(peers, rank_, p2p ? 0 : op.seq, probe_grace(timeout),
                                            "hung with its MPI progress starved",
                                            "no progress thread: MPI was initialized without MPI_THREAD_MULTIPLE");
  const char* kKeepBuffers =
      "MPI cannot cancel the posted collective: keep its buffers alive until this communicator "
      "is destroyed, or end the job (mpi::abort_job)";
  try {
    if (t.stage == Stage::fingerprints) {
      std::vector<int> arrived, missing;
      for (size_t i = 0; i < t.fp_recv.size(); ++i) {
        int flag = 0;
        check(MPI_Test(&t.fp_recv[i], &flag, MPI_STATUS_IGNORE), "MPI_Test",
              collective_op_name(op.kind));
        (flag ? arrived : missing).push_back(t.peers[i]);
      }
      std::sort(missing.begin(), missing.end());
      for (int p : arrived) {
        const size_t i = static_cast<size_t>((p - rank_ - 1 + size_) % size_);
        if (check_from(op, rank_, p, t.theirs[i].to()) != t.mine->to()) throw_mismatch(t, arrived);
      }
      if (missing.empty()) missing = t.peers;  // cannot happen: Testall would have completed
      throw TimeoutError(
          op_name(op),
          fmt::format("{}; ranks that did not arrive: [{}]{}", waited, fmt::join(missing, ", "),
                      found.text),
          fmt::format("{} {} slow or stuck before this collective (see its log or stack), or "
                      "issued fewer collectives than this rank; if it is only slow, raise the "
                      "timeout with set_timeout",
                      format_ranks(missing), missing.size() == 1 ? "is" : "are"),
          missing);
    }
    if (p2p) {
      const bool silent = std::find(found.silent.begin(), found.silent.end(), op.peer) !=
                          found.silent.end();
      throw TimeoutError(op_name(op), waited + found.text,
                         silent ? fmt::format("rank {} is stopped or hung (it does not answer)",
                                              op.peer)
                                : fmt::format("rank {} has not posted the matching {} (same tag, "
                                              "count and dtype)",
                                              op.peer,
                                              op.kind == CollectiveOp::send ? "recv" : "send"),
                         {op.peer});
    }
    std::vector<int> blamed = found.blamed();
    if (t.ring) {
      if (blamed.empty()) blamed = {t.ring->waiting_on()};
      throw TimeoutError(op_name(op), fmt::format("{}; {}{}", waited, t.ring->describe(), found.text),
                         fmt::format("{} stopped making progress: it must be alive and inside a "
                                     "call on this communicator (wait/test) for the ring to move",
                                     format_ranks(blamed)),
                         blamed);
    }
    // With checks, every fingerprint arrived: everyone entered. Without,
    // a peer that answers and has issued this collective is inside it.
    const bool all_inside = !peers.empty() && blamed.empty();
    if (options_.check_fingerprints || all_inside) {
      throw TimeoutError(
          op_name(op),
          fmt::format("{}; every rank arrived, but the data transfer did not finish{}", waited,
                      all_inside ? "; every rank answers and is inside it" : found.text),
          fmt::format("{}. {}",
                      blamed.empty() ? "the network or MPI's transport is stalled; raise the "
                                       "timeout if the buffer is huge"
                                     : fmt::format("{} stopped in the middle of the transfer",
                                                   format_ranks(blamed)),
                      kKeepBuffers),
          blamed);
    }
    if (!peers.empty()) {
      const std::string arrived =
          found.behind.empty() ? ""
                               : fmt::format("; ranks that did not arrive: [{}]",
                                             fmt::join(found.behind, ", "));
      throw TimeoutError(op_name(op), fmt::format("{}{}{}", waited, arrived, found.text),
                         fmt::format("{} {} slow, stuck or stopped (before or inside this "
                                     "collective), or issued fewer collectives than this rank. {}",
                                     format_ranks(blamed), blamed.size() == 1 ? "is" : "are",
                                     kKeepBuffers),
                         blamed);
    }
    throw TimeoutError(op_name(op),
                       fmt::format("{}; ranks that did not arrive: unknown (fingerprint checks "
                                   "are off){}",
                                   waited, found.text),
                       fmt::format("enable mpi::Options::check_fingerprints to name the missing "
                                   "ranks, or raise the timeout with set_timeout. {}",
                                   kKeepBuffers),
                       {});
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace meshtrain::comm::mpi::internal
