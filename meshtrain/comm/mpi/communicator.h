// The OpenMPI engine: a Communicator over an MPI communicator, for programs
// started by mpirun/srun (one process per rank, any number of nodes).
//
//   meshtrain::comm::mpi::initialize();      // optional: create_world does it
//   auto world = meshtrain::comm::mpi::create_world();
//   world->set_timeout(std::chrono::seconds(30));
//   world->all_reduce(g.data(), g.data(), n, DType::f32, ReduceOp::avg);
//
// Every contract of comm/communicator.h holds, with these engine specifics:
//
// - Collectives run as MPI non-blocking collectives (MPI_Iallreduce,
//   MPI_Iallgather, MPI_Ibcast, MPI_Ialltoall, MPI_Ibarrier, and
//   MPI_Ireduce_scatter_block or a ring, see ReduceScatterAlgorithm); send/recv
//   are MPI_Isend/MPI_Irecv with the caller's tag (at most MPI_TAG_UB).
//   OpenMPI advances non-blocking operations only inside MPI calls, so the
//   engine runs one progress thread per process: while operations are in
//   flight it polls them every 50 us (and answers peers' liveness probes,
//   see Deadlines), so an async operation moves while the caller computes.
//   Collectives finish in issue order: waiting for one first finishes the
//   earlier ones; a send or recv finishes once its data moved. A collective with count 0 posts no MPI call (with checks
//   on, its fingerprints are still exchanged).
// - Fingerprints (Options::check_fingerprints, on by default): before a
//   collective's data moves, every rank sends its fingerprint to every peer on
//   a private duplicate of the communicator (n-1 small messages per rank) and
//   posts the data only once all peers' fingerprints arrived and agree; then
//   a barrier needs no further message. A disagreement raises MismatchError on
//   every rank with the same sentence ("rank 0 called all_reduce #5 (f32 x
//   1000, sum) but rank 1 called broadcast #5 (f32 x 1000, root 0)"); a peer
//   missing at the deadline raises TimeoutError naming it. With checks off, a
//   timeout cannot say who is missing.
// - Deadlines: each wait (Work::wait, a blocking call, split) lasts at most
//   timeout() from the moment it begins. Then the waiting rank asks every
//   peer process where it is on this communicator (a liveness probe on a
//   private duplicate of MPI_COMM_WORLD, answered by the peer's progress
//   thread) and waits up to a quarter of the timeout (20 ms to 1 s) for the
//   answers; the oldest unfinished operation then gets a TimeoutError that
//   names the ranks that did not arrive (no fingerprint, or a peer that says
//   it has not issued that collective) or do not answer (stopped, killed, or
//   hung with its progress thread starved), with or without fingerprint
//   checks and also when the stall began in the middle of a transfer. A
//   rank that fails (timeout, mismatch, MPI error) aborts the communicator,
//   calls Options::on_error and sends every peer a notice, so their pending
//   and later calls fail at once (AbortedError naming it; MismatchError if
//   they are in the mismatched collective) instead of at their own deadline.
//   A notice can cross a late rank's arrival within one message latency;
//   that rank then times out on its own.
// - Operations MPI cannot cancel (a non-blocking collective a peer never
//   joined, a send in flight) keep using their buffers after the error that
//   ended them, and the progress thread keeps MPI progressing: keep those
//   buffers alive until the communicator is destroyed, or end the job from
//   Options::on_error (abort_job) so that nothing is freed under MPI.
//   Destroying an aborted communicator waits up to timeout() for them to
//   finish (a late peer may still join), then leaves them to MPI (leaked).
//   In a process whose communicator failed, the MPI_Finalize at exit may
//   wait for a peer that never comes: it is given twice the failed deadline
//   (30 s to 10 min), then the process exits with status 1 without it and
//   mpirun ends the job.
// - Reductions: f32, f64 and integers use MPI's built-in ops. bf16 and f16
//   travel as 16-bit words with user-defined MPI ops that widen each pair to
//   f32 and round the result, so MPI's reduction tree rounds once per step,
//   not once overall as communicator.h states for engines that can: results
//   are deterministic for a given rank count and count, but may differ in the
//   last bit from the threads engine. The ring reduce-scatter keeps 16-bit
//   partial sums in f32 and does round once. avg is sum, then a local
//   division by size() (integers: truncated toward zero; bf16/f16: the
//   rounded sum is divided in f32 and rounded again).
// - Counts: MPI counts are int. Operations handed to MPI whole throw
//   Unsupported for more than INT_MAX (2^31-1) elements per block (the
//   communicator stays usable); the ring reduce-scatter moves 1 MiB chunks
//   and takes any count.
// - Several communicators used from different threads need
//   MPI_THREAD_MULTIPLE, which initialize() asks for.
//
// Thread-safety: as Communicator (one thread at a time per communicator).
// Determinism: bit-identical results for the same rank count, count, dtype,
// op and Options.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string_view>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/engine_registry.h"

namespace meshtrain::comm::mpi {

// How reduce_scatter moves data.
enum class ReduceScatterAlgorithm : uint8_t {
  // MPI_Ireduce_scatter_block. OpenMPI's implementation reduces the whole
  // buffer and then scatters it, moving about twice the data of a ring.
  native,
  // Ring over MPI_Isend/MPI_Irecv in 1 MiB chunks: n-1 steps, each rank sends
  // and receives (n-1)/n of the buffer once. Block b is reduced in the fixed
  // rank order b+1, b+2, ..., b (mod n). bf16/f16 partial sums travel as f32
  // after the first step (twice the bytes of the later steps) and are rounded
  // once. It progresses only inside calls on this communicator (start, test,
  // wait) and holds later operations until it completes. Scratch memory: up
  // to 2/n of the send buffer (f32-sized for bf16/f16) plus 4 chunks.
  ring,
  // ring when the input (size() * count elements) is at least
  // kRingMinBytes, else native: below that the ring's n-1 rounds of
  // messages cost more than the extra bytes native moves (measured in
  // docs/benchmarks.md).
  automatic,
};
inline constexpr size_t kRingMinBytes = size_t{1} << 20;
std::string_view reduce_scatter_algorithm_name(ReduceScatterAlgorithm a);

struct Options {
  // Exchange and compare every collective's fingerprint before its data moves
  // (catches mismatched calls; lets timeouts name the ranks that did not
  // arrive). Costs n-1 small messages per rank and collective.
  bool check_fingerprints = true;
  ReduceScatterAlgorithm reduce_scatter = ReduceScatterAlgorithm::automatic;
  // Called once when the communicator fails (timeout, mismatch, MPI error,
  // a peer's abort notice), with the error and this process's rank in
  // MPI_COMM_WORLD, before the error
  // reaches any caller and before anything is unwound. It may run on the
  // engine's progress thread, holds the communicator's lock (so it must not
  // call into it) and must not throw. For a job that cannot go on
  // without the communicator: report and call abort_job(), so mpirun
  // returns at once and no buffer of an operation MPI could not cancel is
  // ever freed (what `meshtrain` does; comm::LaunchOptions::abort_on_error).
  // Empty: only the throw.
  std::function<void(const std::exception& error, int rank)> on_error = nullptr;
};

// Ends every process of the job: MPI_Abort(MPI_COMM_WORLD, code), so mpirun
// returns `code`. For on_error handlers and programs that decide to stop;
// the engine never calls it on its own.
[[noreturn]] void abort_job(int code);

// An on_error handler: prints "meshtrain: error on rank R: <what>" to stderr
// and calls abort_job(1). For an AbortedError (a peer failed first) it
// waits half a second before aborting, so the peer that found the cause
// prints it first.
[[noreturn]] void report_and_abort(const std::exception& error, int world_rank);

// Initializes MPI with MPI_THREAD_MULTIPLE unless it is already initialized;
// if this call initialized it, MPI_Finalize runs at process exit (std::atexit).
// Throws EngineError if MPI was already finalized or MPI_Init_thread fails.
void initialize();

// True between MPI_Init and MPI_Finalize (whoever called them).
bool is_initialized();

// A communicator over a duplicate of MPI_COMM_WORLD (rank and size as in
// MPI_COMM_WORLD). Initializes MPI if needed. Collective over MPI_COMM_WORLD:
// every process must call it. Sub-communicators from split() inherit options.
std::unique_ptr<Communicator> create_world(Options options = {});

// Adds the engine "mpi" to `registry`, with OpenMPI's own collectives as
// its native peer and the reduce-scatter algorithms as bench variants
// (comm::engines() calls it; see comm/builtin_engines.cc.in). mpi/launch.cc.
void register_engine(EngineRegistry& registry);

}  // namespace meshtrain::comm::mpi
