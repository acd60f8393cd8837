// Runs one SPMD function on every rank of an engine, chosen by name.
//
//   meshtrain::comm::LaunchOptions opt{.engine = "threads", .ranks = 4};  // or Engine::threads
//   meshtrain::comm::launch(opt, [](Communicator& world) { ... });
//
// The engine is looked up in engines() (engine_registry.h): an unknown name,
// or one this build does not have, throws InvalidArgument listing the
// engines it has.
// threads: `ranks` threads in this process, one communicator each; launch()
//   returns when all have returned. If any rank throws, the others' pending and
//   later waits fail at once with AbortedError naming that rank, and launch()
//   rethrows the first error by time (the cause, not its echoes).
// mpi: the function runs once in this process on MPI_COMM_WORLD (start the
//   program under mpirun); `ranks` must be 0 or equal the MPI world size.
//   MPI is initialized on first use and finalized at process exit. See
//   abort_on_error for ending the whole job on the first error.
// Thread-safety: call from one thread at a time.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::comm {

// The threads engine runs at most this many ranks (threads of one process):
// beyond it a simulated mesh costs more in threads and memory than it tells.
inline constexpr int kMaxThreadsRanks = 1024;
// Every wait's deadline lies in [kMinTimeout, kMaxTimeout]: a zero or
// negative one would time out at once and blame a healthy rank, and one past
// a week is no deadline (and overflows the clock arithmetic near 2^63 ns).
inline constexpr std::chrono::milliseconds kMinTimeout{1};
inline constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 7);

// An engine's registry name. Converts from the Engine enum (its
// engine_name()), so `.engine = Engine::threads` and `.engine = "threads"`
// select the same engine, and compares with either.
class EngineName {
 public:
  EngineName(Engine e) : name_(engine_name(e)) {}  // NOLINT: implicit by design
  EngineName(std::string_view name) : name_(name) {}  // NOLINT
  EngineName(const char* name) : name_(name) {}  // NOLINT
  EngineName(const std::string& name) : name_(name) {}  // NOLINT
  const std::string& str() const { return name_; }
  bool operator==(const EngineName&) const = default;

 private:
  std::string name_;
};

struct LaunchOptions {
  EngineName engine = Engine::threads;
  int ranks = 1;  // threads: 1..kMaxThreadsRanks; mpi: 0 (take mpirun's) or the expected size
  std::chrono::milliseconds timeout = kDefaultTimeout;  // in [kMinTimeout, kMaxTimeout]
  bool check_fingerprints = true;  // mpi: exchange fingerprints (costs one small message per peer)
  // threads: bind rank r to the r-th allowed core when ranks <= cores (the
  // threads that rank starts, e.g. BLAS's, inherit the binding).
  bool bind_to_cores = true;
  // mpi, more than one rank: any error on this rank (a communicator failure,
  // as it is detected, or an exception out of fn) is printed to stderr with
  // the rank and ends the whole job (mpi::abort_job(1)), so mpirun returns
  // at once instead of the other ranks waiting for their deadlines or
  // hanging in MPI_Finalize, and nothing MPI may still write to is freed.
  // What the meshtrain command does; a library caller that wants to catch
  // errors leaves it off. threads: no effect (errors are rethrown).
  bool abort_on_error = false;
};

// Throws InvalidArgument before starting anything when the engine is not
// in engines(), or ranks or timeout is outside its range.
void launch(const LaunchOptions& options, const std::function<void(Communicator&)>& fn);

class EngineRegistry;
// The engines of this program: every engine CMake built in, registered on
// the first call (by the generated register_builtin_engines, see
// builtin_engines.cc.in), plus any a program adds.
EngineRegistry& engines();

}  // namespace meshtrain::comm
