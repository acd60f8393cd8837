// The threads engine: N ranks as threads of one process, exchanging data
// through shared memory. It is meshtrain's default engine ("simulated devices").
//
//   auto comms = meshtrain::comm::threads::create_world(4);
//   // hand comms[r] to the thread that runs rank r (comm::launch does this)
//
// Algorithms (see docs/comm.md for the traffic derivation):
// - Small operations (<= kSmallBytes per rank) copy their input into a
//   persistent, pre-faulted per-rank scratch slot, cross one barrier, and
//   read the peers' slots: one synchronization per collective.
// - Large ones publish their buffer pointers, cross a barrier, and each rank
//   works on its 1/n share directly in the peers' buffers (all_reduce: rank r
//   reduces share r of every input and writes it to every output, so each
//   byte is read once and written once), then cross a completion barrier.
// - Reductions run in rank order 0..n-1: results are bit-identical on every
//   rank and across runs.
// - Waits spin briefly when ranks do not outnumber cores, then sleep on a
//   futex; they never spin when ranks outnumber cores.
// - Every collective's fingerprint is checked on every rank. A wait that
//   passes the deadline names the ranks that did not arrive, and marks them
//   so that a late rank fails instead of touching buffers of a rank that left.
// - async operations run in order on one progress thread per communicator;
//   send/recv are matched directly between the two ranks (rendezvous: the
//   second side to arrive copies) and do not queue behind collectives.
// Thread-safety: each communicator belongs to one rank's thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/engine_registry.h"

namespace meshtrain::comm::threads {

// Per-rank scratch for the one-barrier path: operations whose per-rank input
// is at most this many bytes use it.
inline constexpr size_t kSmallBytes = 16 * 1024;

struct Options {
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Cores this process may use; spinning is allowed only when ranks <= cores.
  // 0: read the affinity mask.
  int cores = 0;
};

// Creates the communicators of an n-rank world; element r belongs to rank r.
std::vector<std::unique_ptr<Communicator>> create_world(int n, const Options& options = {});

// For launchers. Marks world rank `rank` as failed: every wait of every
// communicator of that world that still needs it fails at once with
// AbortedError carrying `reason`. `comm` is any communicator of the world.
void mark_failed(Communicator& comm, int rank, const std::string& reason);
// Marks world rank `rank` as returned: waits that still need it fail at once.
void mark_exited(Communicator& comm, int rank);

// Adds the engine "threads" to `registry` (comm::engines() calls it; see
// comm/builtin_engines.cc.in). threads/launch.cc.
void register_engine(EngineRegistry& registry);

}  // namespace meshtrain::comm::threads
