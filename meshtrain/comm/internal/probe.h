// Liveness probes, shared by the engines that have them (mpi, gloo): what a
// peer process says about one of its communicators when a wait passed its
// deadline, and what those answers say about who is at fault. Each engine
// carries the question and answer its own way (mpi: a control communicator;
// gloo: the rendezvous store). Pure; thread-safe.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::comm::internal {

// What a peer said about one of its channels.
struct PeerStatus {
  enum class State : uint8_t { no_answer, unknown_channel, answered };
  State state = State::no_answer;
  uint64_t issued = 0;    // sequence number of the last collective it issued
  uint64_t finished = 0;  // ... and of the last one that finished there
  uint8_t last_op = 0;    // CollectiveOp of the last issued collective
  bool waiting = false;   // a thread of it is inside a wait on the channel
  bool aborted = false;   // the channel already failed there
};

// A channel's state as its process reports it.
struct ChannelStatus {
  uint64_t issued = 0, finished = 0;
  uint8_t last_op = 0;
  bool waiting = false, aborted = false;
};

// How long a timing-out rank waits for the peers' answers.
inline std::chrono::milliseconds probe_grace(std::chrono::milliseconds timeout) {
  return std::clamp(timeout / 4, std::chrono::milliseconds(20), std::chrono::milliseconds(1000));
}

// What the peers' answers to a liveness probe say about collective `seq`
// (0: a send/recv, which has no sequence number).
struct ProbeFindings {
  std::vector<int> silent;  // no answer: stopped, killed, or hung without its engine's progress
  std::vector<int> behind;  // alive, but have not issued collective `seq`
  std::vector<int> gone;    // no longer have this communicator
  std::string text;         // "; rank 1 does not answer ..." (empty if nothing to say)
  std::vector<int> blamed() const {
    std::vector<int> all = silent;
    all.insert(all.end(), behind.begin(), behind.end());
    all.insert(all.end(), gone.begin(), gone.end());
    std::sort(all.begin(), all.end());
    return all;
  }
};

// `peers` is indexed by rank (self ignored; empty: nobody could be asked,
// `why_no_probe` says why). `starved` completes "stopped, killed, or ..."
// for ranks that did not answer within `grace`.
ProbeFindings read_probe(const std::vector<PeerStatus>& peers, int self, uint64_t seq,
                         std::chrono::milliseconds grace, std::string_view starved,
                         std::string_view why_no_probe);

}  // namespace meshtrain::comm::internal
