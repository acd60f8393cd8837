// The communication of one optimizer step of the GPT under a layout, per
// device: every collective and point-to-point call the runtime makes, with
// its communicator, bytes and count, derived from what meshtrain's
// strategies do (not a generic formula). Pure arithmetic, like
// memory_model.h; the time model (time_model.h) prices these calls.
//
//   plan::TrainingLayout l{.data = 2, .tensor = 2, .batch = 32};
//   for (const plan::DeviceTraffic& d : plan::predict_traffic(g, l))
//     for (const plan::CommCall& c : d.calls)
//       fmt::print("{} {} {} x {} bytes ({})\n", c.group, comm_kind_name(c.kind), c.calls, c.bytes, c.what);
//
// Bytes are counted the way comm::Communicator::traffic counts them: this
// rank's buffer of the call (an all_gather's send block, a reduce_scatter's
// received block, a send's message). Per step, with m micro-batches of B
// samples, t = T / context tokens each (sequence parallelism: s = t' / k,
// t' = t rounded up to a multiple of k), a = B t C f32 activations:
//   loss            all_reduce of 3 f64 (the loss, the parameter check,
//                   the stop request) over the gradient axes; pipeline:
//                   the same over pipeline plus grads_finite's i32
//   data parallel   DataParallel's buckets (reverse parameter order, at most
//                   bucket_bytes each), one all_reduce each per step
//   fully sharded   per unit of padded size Np over d ranks: reduce_scatter
//                   of Np / d gradients (zero2/3 every micro-batch, zero1
//                   once), all_gather of Np / d values (zero3: before each
//                   micro-batch's forward and, resharded, its backward;
//                   zero1/2: once after the optimizer step); the replicated
//                   small parameters' gradients in one all_reduce and an
//                   i32 overflow flag; hybrid: both again over data, with
//                   every unit's gradient shard
//   tensor          per block and micro-batch 2 all_reduces of a forward
//                   and 2 backward (sequence parallel: an all_gather and a
//                   reduce_scatter of a / k each instead), the embedding's
//                   forward and the head's backward likewise; the
//                   vocabulary-parallel loss's max and sums (B t f32 and
//                   2 B t f64); two f64 flags per step; sequence parallel:
//                   the replicated parameters' gradients once per step
//   pipeline        per micro-batch and stage boundary a send and a recv
//                   of the activations (sequence parallel: a / k) each
//                   way; the tied wte's gradient all_reduce between the
//                   first and the last stage ("tied")
//   context (ring)  per block and micro-batch 3 n - 2 sends and recvs of
//                   this rank's K and V (2 B t C / k f32): n - 1 forward,
//                   n - 1 K/V and n dK/dV backward (recompute: n - 1 more)
//   context         (all_to_all, Ulysses) per block and micro-batch 4
//                   all_to_alls a pass (forward: q, k, v to heads, out
//                   back; backward: dout, then dq, dk, dv; recompute: a
//                   third pass), each of B t C / (k n) f32 per peer
//   Llama's blocks  the same with q, k, v and the SwiGLU's gate and up as
//                   column-parallel Linears of their own: per block and
//                   micro-batch 2 all_reduces a forward and 5 backward (3
//                   when key/value heads are replicated over the axis: k's
//                   and v's run over sub-communicators the counters do not
//                   see); sequence parallel: 5 all_gathers and 2
//                   reduce_scatters a forward, 2 and 5 backward (replicated
//                   key/value heads: 4 and 2, 2 and 3)
//   experts         per MoE layer and micro-batch (routing taken as even:
//                   each of this rank's E / P experts gets n top_k / E of
//                   the rows of every rank, n = B t; expert_imbalance
//                   scales what this rank's experts run): an all_to_all of the
//                   row counts (E / P i64 per peer) a forward, 4
//                   all_to_all_vs of the rows (dispatch and combine, forward
//                   and backward; a recomputed forward 2 more); with a
//                   tensor axis each expert's down (forward) and gate and up
//                   (backward) all_reduce their rows, the shared experts'
//                   theirs; per step the replicated parameters' gradients
//                   (all but the routed experts', as the strategy holds them)
//                   summed over the expert axis, an f64 gradient check, and
//                   the load (E + 4 f64 per block) over the data-parallel
//                   axes (and the pipeline)
// tests/traffic_model_test.cc checks every (communicator, operation)'s calls
// and bytes against the counters of real runs, exactly; for MoE layers the
// rows' bytes within the routing's unevenness.
// Thread-safety: pure functions. Errors: check_layout's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/plan/memory_model.h"

namespace meshtrain::plan {

// The operations, named as comm::collective_op_name names them.
// all_to_all_v's bytes are everything the rank sends (comm::Communicator's
// count), the others' as CommCall::bytes says.
enum class CommKind : uint8_t { all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_v, send, recv };
std::string_view comm_kind_name(CommKind kind);

// What may run under computation (time_model.h decides how much does).
enum class CommOverlap : uint8_t {
  none,      // on the critical path (tensor parallelism, the loss, pipeline sends)
  backward,  // launched during backward, waited for at the end (buckets, reduce-scatters)
  forward,   // prefetchable ahead of its use (zero3's gathers)
  step,      // after the optimizer step (zero1/2's gathers)
  attention, // ring attention's exchanges, under the block's attention
};

struct CommCall {
  // The communicator: its axes of size > 1 in mesh order (kMeshAxisOrder)
  // joined by '+' ("data+context"), or "tied" (the first and last pipeline
  // stages).
  std::string group;
  int ranks = 1;
  CommKind kind = CommKind::all_reduce;
  // Per call, as Communicator::traffic counts it (all_gather,
  // reduce_scatter, all_to_all: one rank's block; all_to_all_v: all it sends).
  double bytes = 0;
  int64_t calls = 0;    // per optimizer step
  std::string what;     // "gradient buckets", "block activations", ...
  CommOverlap overlap = CommOverlap::none;
  // On every micro-batch's critical path (tensor, context and pipeline
  // calls of the forward and backward), not once per step.
  bool per_micro_batch = false;
};

struct DeviceTraffic {
  int stage = 0, tensor_rank = 0;
  std::vector<CommCall> calls;  // only communicators of more than one rank
};

// Per (pipeline stage, tensor rank), stage-major, as predict_memory.
std::vector<DeviceTraffic> predict_traffic(const GptShape& shape, const TrainingLayout& layout);

}  // namespace meshtrain::plan
