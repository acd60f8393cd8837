#include "meshtrain/comm/internal/probe.h"

#include <fmt/format.h>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/internal/fingerprint.h"

namespace meshtrain::comm::internal {

ProbeFindings read_probe(const std::vector<PeerStatus>& peers, int self, uint64_t seq,
                         std::chrono::milliseconds grace, std::string_view starved,
                         std::string_view why_no_probe) {
  ProbeFindings f;
  if (peers.empty()) {
    f.text = fmt::format("; the peers could not be asked where they are ({})", why_no_probe);
    return f;
  }
  std::vector<std::string> notes;
  for (int p = 0; p < static_cast<int>(peers.size()); ++p) {
    if (p == self) continue;
    const PeerStatus& s = peers[static_cast<size_t>(p)];
    switch (s.state) {
      case PeerStatus::State::no_answer: f.silent.push_back(p); break;
      case PeerStatus::State::unknown_channel:
        f.gone.push_back(p);
        notes.push_back(fmt::format("rank {} no longer has this communicator (it returned or "
                                    "destroyed it)",
                                    p));
        break;
      case PeerStatus::State::answered:
        if (seq > 0 && s.issued < seq) {
          f.behind.push_back(p);
          notes.push_back(
              s.issued == 0
                  ? fmt::format("rank {} is alive but has issued no collective here yet", p)
                  : fmt::format("rank {} is alive but its last collective here is {} #{}{}", p,
                                collective_op_name(static_cast<CollectiveOp>(s.last_op)),
                                s.issued, s.waiting ? " (it is waiting)" : " (it is not waiting)"));
        }
        break;
    }
  }
  if (!f.silent.empty())
    notes.insert(notes.begin(),
                 fmt::format("{} {} not answer a liveness probe within {} ms: stopped, killed, or {}",
                             format_ranks(f.silent), f.silent.size() == 1 ? "does" : "do",
                             grace.count(), starved));
  for (const std::string& n : notes) f.text += "; " + n;
  return f;
}

}  // namespace meshtrain::comm::internal
