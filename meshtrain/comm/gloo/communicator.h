// The Gloo engine: a Communicator over TCP between processes (Debian's
// libgloo-dev, its TCP transport), for jobs started by `meshtrain launch`,
// torchrun-style environments, or by hand on machines that share only a
// network (no MPI).
//
//   // every process, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set:
//   auto world = meshtrain::comm::gloo::create_world(gloo::Rendezvous::from_env());
//   world->all_reduce(g.data(), g.data(), n, DType::f32, ReduceOp::avg);
//
// Every contract of comm/communicator.h holds, with these engine specifics:
//
// - Rendezvous: the processes meet in a TcpStore (comm/tcp_store.h) at
//   MASTER_ADDR:MASTER_PORT, hosted by the launcher (MESHTRAIN_AGENT_STORE=1)
//   or else by rank 0, and protected by the job token (MESHTRAIN_JOB_TOKEN)
//   when one is set. Each process publishes its Gloo address there and
//   Gloo connects every pair (two TCP connections per pair and
//   communicator, one per direction: internal/channel.h says why).
// - Data moves with Gloo's point-to-point transfers (UnboundBuffer
//   send/recv, which Gloo pairs by slot, in order), and messages of at
//   most 128 KiB in slots of Gloo bound buffers registered once per peer
//   (an eager path: the data goes out without waiting for the receiver's
//   "ready" notice; internal/channel.h); the collectives are
//   built on them here, not taken from Gloo's algorithm classes, so every
//   dtype and reduction works and results follow meshtrain's rules:
//   all_reduce is a reduce-scatter and an all-gather (a direct exchange of
//   the whole buffer when direct_all_reduce says so); reduce_scatter sends
//   each peer its block and reduces the n contributions of a block in rank
//   order 0, 1, ..., n-1 (so every algorithm gives the same bits, bf16/f16
//   are summed in f32 and rounded once, and results do not depend on the
//   rank that computes them); all_gather and all_to_all send each block
//   directly (all_gather on more than 2 ranks, above kRingAllGatherBytes
//   per block, passes the blocks around a pipelined ring); broadcast sends
//   from the root to each peer, or above kChunkBytes on more than 2 ranks
//   passes the buffer down a pipelined chain of chunks (every rank sends it
//   once). Large blocks move in chunks of kChunkBytes, with the reduction
//   of one chunk overlapping the transfer of the next (a direct all_reduce:
//   chunks of kOverlapBytes). Every rank sends and receives (n-1)/n of the
//   buffer per reduce-scatter or all-gather, the bandwidth optimum; apart
//   from the ring and the chain, each transfer is direct, so a collective
//   is one round of messages (suited to the tens of processes a TCP job
//   has, not thousands).
// - Collectives run on one worker thread per communicator, in issue order,
//   so async ones overlap the caller's compute. A send or recv is posted at
//   once (by Gloo's event-loop thread) and completes on its own (a waiter
//   thread takes its completion); Gloo moves its data when both sides have
//   posted.
// - Fingerprints (Options::check_fingerprints, on by default): before a
//   collective's data moves, each rank sends its fingerprint to every peer
//   and compares the n it holds; a disagreement raises MismatchError on
//   every rank with the same sentence.
// - Deadlines: each wait lasts at most timeout(). Then the waiting rank
//   asks every peer process where it is on this communicator, through the
//   store (each process runs an agent thread that answers; see
//   internal/agent.h), and fails with a TimeoutError naming the ranks that
//   did not arrive (alive but behind) or do not answer (stopped, killed).
//   A peer process that dies closes its connections: the ranks that were
//   exchanging data with it fail at once, naming it. A rank that fails
//   aborts the communicator, tells every peer through the store (their
//   pending and later calls fail with AbortedError naming it), and calls
//   Options::on_error.
// - After a failure, transfers Gloo had already posted may still write into
//   their buffers until the communicator is destroyed: keep the buffers of
//   failed operations alive until then, or end the process (on_error).
// - Destruction is collective, as MPI_Comm_free: every rank must destroy
//   its communicators, in the same order. A communicator waits (at most
//   its timeout) until every peer destroyed its own, so that no rank
//   closes a connection a peer still reads its last collective's data from
//   (Gloo fails every wait on a closed connection). A peer that does not
//   come in time is reported on stderr; destruction never throws.
// - SIGPIPE: create_world sets it to SIG_IGN when it has the default action
//   (a write to a peer that died would otherwise end the process before
//   the error names the peer); a handler the program installed stays.
// - Interface: Gloo listens on the address given by Rendezvous::hostname,
//   or on the interface Rendezvous::iface names (GLOO_SOCKET_IFNAME), else
//   on the local address the route to MASTER_ADDR leaves from.
//
// Thread-safety: as Communicator (one thread at a time per communicator).
// Determinism: bit-identical results for the same rank count, count, dtype
// and op, whatever the algorithm.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/store.h"

namespace meshtrain::comm::gloo {

// all_reduce moves the whole buffer to every peer (one round, (n-1) x the
// bytes) up to kDirectAllReduceBytes, and on 2 ranks up to
// kDirectAllReduceTwoRankBytes (there the direct exchange moves the same
// bytes as a reduce-scatter plus an all-gather, in one round instead of
// two); else it is a reduce-scatter plus an all-gather.
inline constexpr size_t kDirectAllReduceBytes = size_t{64} << 10;
inline constexpr size_t kDirectAllReduceTwoRankBytes = size_t{1} << 20;
inline bool direct_all_reduce(size_t bytes, int ranks) {
  return bytes <= kDirectAllReduceBytes || (ranks == 2 && bytes <= kDirectAllReduceTwoRankBytes);
}
// Transfers of a block larger than this move in chunks of this size.
inline constexpr size_t kChunkBytes = size_t{1} << 20;
// On more than 2 ranks, an all-gather whose blocks are larger than this
// passes them around a pipelined ring (each rank talks to two peers, not
// n - 1; measured at 4 ranks, 64-256 MiB: 0.92-0.99x Gloo's ring against
// 1.01-1.14x for the direct exchange).
inline constexpr size_t kRingAllGatherBytes = size_t{4} << 20;
// A direct all_reduce above this moves in chunks of this size (measured on
// 2 ranks at 1 MiB: 256 KiB chunks 790-990 us, 512 KiB 420-570, none
// 620-780; docs/benchmarks.md).
inline constexpr size_t kOverlapBytes = size_t{512} << 10;

struct Options {
  // Exchange and compare every collective's fingerprint before its data
  // moves (n-1 small messages per rank and collective).
  bool check_fingerprints = true;
  // Called once when the communicator fails (timeout, mismatch, a peer's
  // death or abort notice), with the error and this process's world rank,
  // after the peers were told. It may run on an engine thread, must not
  // call into the communicator and must not throw. For a job that cannot go
  // on: report_and_exit (what `meshtrain` does).
  std::function<void(const std::exception& error, int rank)> on_error = nullptr;
};

// Flushes stdout, prints "meshtrain: error on rank R: <what>" to stderr and
// ends the process with status 1 (std::_Exit: no destructor waits on a dead peer),
// so a launcher sees the failure at once. For an AbortedError (a peer
// failed first) it waits half a second, so the peer's cause prints first.
[[noreturn]] void report_and_exit(const std::exception& error, int world_rank);

// Where this process meets the others.
struct Rendezvous {
  std::string master_addr = "127.0.0.1";  // the store's host
  uint16_t master_port = 29500;
  int rank = 0;
  int world_size = 1;
  std::string token;              // the job token the store requires ("" = none)
  bool launcher_store = false;    // the launcher hosts the store; else rank 0 does
  std::string iface;              // network interface for Gloo's connections
  std::string hostname;           // address for Gloo's connections (wins over iface)
  int restart = 0;                // the launcher's restart round (keys of each round apart)
  std::chrono::milliseconds timeout = kDefaultTimeout;  // store, connection and every wait

  // From the environment torchrun and `meshtrain launch` set: RANK,
  // WORLD_SIZE, MASTER_ADDR, MASTER_PORT (required), MESHTRAIN_JOB_TOKEN,
  // MESHTRAIN_AGENT_STORE, GLOO_SOCKET_IFNAME, MESHTRAIN_GLOO_HOSTNAME,
  // MESHTRAIN_RESTART_COUNT (optional). Throws InvalidArgument naming a missing or malformed
  // variable and how to start the job.
  static Rendezvous from_env();
};

// Connects the job: collective over every process of it. The returned
// communicator holds the store (and, as its host, the store server) until
// it and every communicator split from it are destroyed.
std::unique_ptr<Communicator> create_world(const Rendezvous& rendezvous, Options options = {});

// Lower level, for tests and programs with their own store: `store` makes a
// new connection to the job's store per call (the engine keeps two), `name`
// keeps the keys of different worlds on one store apart.
using StoreFactory = std::function<std::unique_ptr<Store>()>;
struct WorldConfig {
  StoreFactory store;
  int rank = 0;
  int size = 1;
  std::string name = "world";
  std::string iface;
  std::string hostname = "127.0.0.1";
  std::chrono::milliseconds timeout = kDefaultTimeout;
  Options options;
};
std::unique_ptr<Communicator> create_world(WorldConfig config);

// Adds the engine "gloo" to `registry` (comm::engines() calls it; see
// comm/builtin_engines.cc.in). gloo/launch.cc.
void register_engine(EngineRegistry& registry);

}  // namespace meshtrain::comm::gloo
