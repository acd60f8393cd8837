// Context parallelism: the sequence split over a `context` mesh axis, and
// attention over the whole sequence computed from the pieces, exactly.
//
//   nn::ContextParallelGroup cp{&mesh.comm("context")};        // ring, load-balanced
//   Tensor mine = nn::shard_sequence(tokens, cp);              // (B, T) -> (B, T / n)
//   nn::ContextAttentionSaved saved;
//   Tensor out = nn::context_attention_forward(cp, q, k, v, /*causal=*/true, scale, saved);
//   nn::context_attention_backward(cp, dout, true, scale, saved, dq, dk, dv);
//
// The layout. The sequence of T steps is cut into chunks of equal length:
// with load balancing (default, the zig-zag layout of Megatron-LM and
// ring-flash-attention) 2n chunks, rank r holding chunks r and 2n-1-r, so
// under a causal mask every rank does the same attention work (without it
// the last rank does about twice the average); without, n chunks, rank r
// holding chunk r. T must be divisible by chunks() (InvalidArgument naming
// both otherwise: no padding, so positions and the loss need no masks).
// A rank's local sequence is its chunks in that order (chunk_ids).
//
// Attention operands are chunk-major: q, k, v, out (P, B, H, c, D)
// contiguous f32, P = local_chunks(), c = T / chunks(), H = this rank's
// heads (all of them, or its tensor-parallel share). Two ways to compute:
//
// - ring (kind = ring): each rank keeps its queries; the key/value chunks
//   travel around the ring (rank r sends to r+1, receives from r-1), n
//   steps, the next block's send/recv (batch_isend_irecv) in flight while
//   the block in hand is attended. Each (query chunk, key chunk) pair is
//   one blockwise-attention call (functional::attention_forward): the
//   diagonal pair causal, pairs below it full, pairs above it skipped
//   (fully masked); the partial outputs merge by the log-sum-exp rule
//   (functional::attention_merge). Backward sends the key/value chunks
//   around again with their dK/dV accumulators: each rank adds its
//   queries' share (attention_backward given the merged out and lse is
//   that pair's exact share) and passes them on; a last step hands each
//   accumulator to its owner. Saved: this rank's q, k, v, out and lse,
//   never a T x T matrix.
// - all_to_all (DeepSpeed Ulysses): an all-to-all turns (all heads, local
//   chunks) into (H / n heads, the whole sequence); attention runs locally
//   over the whole sequence; a second all-to-all returns the output.
//   Backward mirrors it. H must be divisible by n (InvalidArgument naming
//   both otherwise: use ring). Saved: the gathered q, k, v, out, lse of
//   this rank's heads (the same size as the ring's).
//
// Numbers: both equal one device's attention over the whole sequence to
// f32 rounding (nn/parallel/context_parallel_test.cc: within 1e-5 for n = 2, 4, 8,
// causal and full, load-balanced or not). The merge order differs from one
// device's online softmax, so results are not bit-identical.
//
// Collective: every rank of the group calls each function with the same
// shapes and options, in the same order. Communication shows in the op
// profile (functional::ProfileScope) as "cp ring send/recv wait" and "cp
// all_to_all". A group of one rank (comm null or size 1) computes locally.
// Thread-safety: one thread per rank.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/layout/vocabulary.h"

namespace meshtrain::nn {

// The exchange's names are the layout vocabulary's (layout/vocabulary.h).
using layout::context_comm_name;
using layout::ContextComm;
using layout::parse_context_comm;

// The ranks the sequence is split over (the mesh's context axis).
struct ContextParallelGroup {
  comm::Communicator* comm = nullptr;  // null: one rank
  ContextComm kind = ContextComm::ring;
  bool load_balance = true;  // zig-zag: chunks r and 2n-1-r

  int size() const { return comm == nullptr ? 1 : comm->size(); }
  int rank() const { return comm == nullptr ? 0 : comm->rank(); }
  bool active() const { return size() > 1; }
  // Chunks the sequence is cut into, and how many each rank holds.
  int64_t chunks() const { return load_balance ? 2 * int64_t{size()} : size(); }
  int64_t local_chunks() const { return load_balance ? 2 : 1; }
  // The global chunk indexes rank `r` holds, in its local order.
  std::vector<int64_t> chunk_ids(int r) const;
  // Throws InvalidArgument (naming `what`, e.g. "--seq-len") unless t is
  // divisible by chunks().
  void check_length(int64_t t, std::string_view what) const;
};

// ContextParallelGroup::check_length before the group exists: `ranks`
// context ranks, zig-zag or not (the start-up checks).
void check_context_length(int64_t t, int ranks, bool load_balance, std::string_view what);

// This rank's chunks of x along `dim` (x holds the whole sequence there):
// a new contiguous tensor with x.size(dim) / size() entries along dim.
Tensor shard_sequence(const Tensor& x, const ContextParallelGroup& g, int dim = 1);
// The inverse, collective: every rank's chunks gathered in sequence order
// (an all-gather over the group).
Tensor unshard_sequence(const Tensor& local, const ContextParallelGroup& g, int dim = 1);
// The global positions of this rank's local steps, t the whole length.
std::vector<int64_t> sequence_positions(const ContextParallelGroup& g, int64_t t);

// What context_attention_backward needs (see above).
struct ContextAttentionSaved {
  Tensor q, k, v, out, lse;
};

// Attention over the group's whole sequence: q, k, v (P, B, H, c, D) of
// this rank's chunks; returns out of the same shape. Fills `saved`.
Tensor context_attention_forward(const ContextParallelGroup& g, const Tensor& q, const Tensor& k, const Tensor& v,
                                 bool causal, double scale, ContextAttentionSaved& saved);
// dq, dk, dv (P, B, H, c, D), written, from dout of that shape.
void context_attention_backward(const ContextParallelGroup& g, const Tensor& dout, bool causal, double scale,
                                const ContextAttentionSaved& saved, const Tensor& dq, const Tensor& dk,
                                const Tensor& dv);

}  // namespace meshtrain::nn
