// What `meshtrain bench collectives --engine gloo` times beside the engine in
// the same run: Gloo's own algorithms, called directly on contexts of their
// own, and the raw TCP rate between the ranks, the ceiling of any
// collective over this network.
//
//   auto peers = meshtrain::comm::gloo::native_peers(world);   // collective over world
//   for (auto& p : peers)
//     if (p->supports(CollectiveOp::all_reduce, DType::f32))
//       p->run(CollectiveOp::all_reduce, send, recv, n, DType::f32);
//
// The peers, in this order (rows labelled so; f32 only, sum, layouts as in
// comm/engine_registry.h's PeerCollectives):
//
//   gloo-ring     all_reduce: gloo::allreduce, algorithm RING (reduce-scatter
//                 and all-gather around a ring, 1 MiB segments, two in flight)
//                 all_gather: gloo::allgather (a ring, two halves of a block in flight)
//   gloo-bcube    all_reduce: gloo::allreduce, algorithm BCUBE
//   gloo-chunked  all_reduce: gloo::AllreduceRingChunked (the legacy ring, 2n chunks)
//   gloo-hd       all_reduce: gloo::AllreduceHalvingDoubling
//                 reduce_scatter: gloo::ReduceScatterHalvingDoubling (equal blocks)
//   gloo-tree     broadcast: gloo::broadcast from rank 0 (a binomial tree), in place in recv
//   gloo-direct   all_to_all: gloo::alltoall (every pair directly)
//   tcp           not a collective: the network's rate. broadcast: rank 0
//                 writes recv to every peer over plain sockets and waits for
//                 a 1-byte acknowledgement from each; all_to_all: every rank
//                 sends block p of send to rank p and reads block p of recv
//                 from rank p at once (its own block is not copied). Any dtype.
//
// Each Gloo peer has its own Gloo context (one TCP connection per pair of
// ranks); the tcp peer its own sockets (TCP_NODELAY, the address Gloo
// listens on, ports exchanged through the store). The legacy classes
// (gloo-chunked, gloo-hd) work in place and register their buffers with
// every pair when built, so a peer copies the input into the output (or its
// own scratch) first and keeps the built algorithm for the same buffer and
// count (the benchmark reuses its buffers). Blocks until done; Gloo's
// timeout is the communicator's (it closes the peer's connections), the tcp
// peer's waits end with TimeoutError after it. For benchmarks only.
//
// Thread-safety: one thread at a time per peer.
#pragma once

#include <memory>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/engine_registry.h"

namespace meshtrain::comm::gloo {

// Collective over `world`, a communicator of this engine (InvalidArgument
// for another engine's). Empty for one rank (nothing moves between ranks).
std::vector<std::unique_ptr<PeerCollectives>> native_peers(Communicator& world);

}  // namespace meshtrain::comm::gloo
