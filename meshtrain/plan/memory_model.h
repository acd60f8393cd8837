// Memory per device of training the GPT under a layout: parameters,
// gradients, optimizer state, fully sharded data parallelism's gathered
// units, data parallelism's gradient buckets, activations and the batch,
// by formula from what meshtrain's runtime allocates (the categories of
// core/memory.h). Pure arithmetic: no devices, no communication.
//
//   plan::GptShape g{.vocab = 8192, .seq = 64, .layers = 4, .heads = 4, .width = 256};
//   plan::TrainingLayout l{.data = 2, .tensor = 2, .batch = 32};
//   plan::MemoryPrediction m = plan::predict_memory(g, l);
//   m.worst().total();            // bytes on the device that needs the most
//   for (const auto& d : m.devices) ...   // one per pipeline stage and tensor rank
//
// What each category holds, per device (P: the parameters the device holds
// for its pipeline stage and tensor rank; d: ranks sharding them, data x
// fsdp, or fsdp alone for the hybrid strategies):
//   plain data parallelism: parameters 4 P (f32), comm_buffers 4 P (the
//     gradient buckets, which the gradients view), optimizer 8 P (AdamW's
//     two moments; SGD with momentum 4 P).
//   fully sharded: each unit (a block, wte when two pipeline stages hold it,
//     the rest of the stage) flattens its parameters of at least
//     min_weight_size elements into N elements padded to Np = ceil(N / d) d;
//     per rank (p, g: bytes of the parameter and reduce dtypes; the f32
//     master shard 4 Np / d when p < 4):
//       zero1                 parameters p Np, gradients g Np
//       zero2 / shard_grad_op  parameters p Np, gradients g Np / d
//       zero3 / full           parameters p Np / d, gradients g Np / d
//       optimizer (master + 8) Np / d; no_shard: d = 1.
//     Smaller parameters stay replicated in f32: 4 + 4 + 8 bytes each.
//     working (MemoryCategory::working), by parallel/fully_sharded.cc's
//     rules at every hook call of the micro-batch (units: each block, on a
//     pipeline's first and last stage wte, and the GPT, which keeps the
//     rest: wpe, ln_f): zero3 gathers a
//     unit's padded param_dtype copy p Np before its use (the GPT's around
//     the whole forward and the whole backward; backward_prefetch pre: the
//     next block's too while a block's input pass runs; post: after it;
//     forward_prefetch: the next unit's in forward) and frees it after
//     (reshard_after_forward; in backward after the block's input pass);
//     values that are not f32 under zero1/2 view the persistent copy
//     (nothing); a unit's backward (the GPT's from the start of the
//     backward, on a pipeline its weight pass; a block's and wte's weight
//     pass) holds a padded f32 gradient 4 Np
//     unless gradients persist in f32 (zero1/no_shard with f32
//     reductions), which zero2/3 round to reduce_dtype (g Np beside the
//     f32 for a moment) and reduce-scatter, holding the buffer until the
//     reduction is done; launching one beyond max_reductions_in_flight
//     waits for the oldest.
//   activations: plan::estimate_activations (activation_memory.h) for one
//     micro-batch, over the micro-batches a pipeline stage holds at once
//     (below), plus two loaded batches (the trainer prefetches the next).
// The total. Without a pipeline it is taken moment by moment: the
// activations' timeline (ActivationEstimate::timeline: the bytes at every
// FSDP hook call and the most between two) beside the working memory then,
// over two steps of the trainer's micro-batches (the first cold, the
// others warm), and the largest sum of model state, activations and
// working is the peak; `activations` and `working` are what they hold
// then (as MemoryTracker::at_total_peak measures them) and `peak_at` names
// the moment. Exact on the test's GPT (tests/memory_model_test.cc: within
// 0.2% for one device, data, zero1/2/3 in f32 and bf16, hybrid_full,
// zero3's other schedules, tensor, sequence and context parallelism; the
// rest is the batch, below).
// When a reduction is done is up to the communication threads (the runtime
// frees the buffer at the first hook that finds it done): the prediction
// takes the deterministic bound, done only once it must be (waited for by
// the rate limit or finish(), or a later collective on the shard
// communicator was waited for: zero3's next gather; collectives complete in
// issue order). Where the peak comes with a reduction in flight, a run
// measures between that and the prediction with eager_reductions: in the
// test, zero2 with 2 micro-batches 0-7% under the bound (eager: 12.6%
// under it), zero3 bf16 with 4 micro-batches 0-3.5% (eager: 3.5%). Two
// loaded batches are counted; a run's last step has no next one (512
// bytes to 2 KiB on the test's GPT).
// On a pipeline the same walk runs over each stage's schedule: rank r's
// compute actions in parallel/pipeline_schedule.cc's order (GPipe, 1F1B,
// ZB-H1 with its split backward, interleaved over its chunks), two steps.
// Every micro-batch has a fresh Saved: its cold timeline, cut into the
// forward (F), the input pass (I, or the first part of a fused B) and the
// weight pass (W, or B's rest), with the hooks a stage adds (the GPT's
// part runs its backward as two scopes, so the root's f32 gradient lives
// in the weight pass only; wte's own unit, used inside the embedding's
// passes on the first stage and by the tied head on the last: after the
// blocks in forward, first in each backward pass); at those added hooks the
// activations are taken as the most of the stretch they fall in (exact
// without dropout). A micro-batch holds saved_per_micro_batch from its F
// to its I, what the input pass left until its W (ZB-H1 defers W: rank r
// holds r more), nothing after (the executor frees the Saved); a stage
// that is not the last also holds each F's output until the end of its
// next action (the next stage posts its receive after its own work: 1F1B's
// steady state; a slower next stage under GPipe can keep more). Each
// chunk's FSDP (one wrapper per stage) sees its hook calls in that order,
// the weight pass starting its micro-batch window. `peak_at` names the
// action and the moment ("B1 backward_weight wte (before_use), in the
// hook"); `in_flight` counts the micro-batches holding activations at
// once. In the test (pipeline=2, 4 micro-batches unless said): 1F1B,
// ZB-H1, zero1 in f32 and bf16 and the 3-D mesh (2 micro-batches) exact
// or within 0.5%; GPipe's first stage 0.4-0.9% under (outputs still being
// sent); zero2 (f32, bf16, ZB-H1, recompute with 2 micro-batches) peaks
// in a weight pass beside the previous one's last reduce-scatters, which
// nothing waits for under zero2 (no gathers) before the next rate limit:
// measured within 0.6% of the bound with 1F1B in f32 and bf16 over 8 runs
// (eager in f32: 10% under it on stage 0, 21% on stage 1), at times down
// to the eager prediction elsewhere (ZB-H1's last stage, recompute's
// first: up to 12% under the bound).
// Thread-safety: pure functions. Errors: InvalidArgument naming the value.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/layout/training_layout.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/plan/activation_memory.h"
#include "meshtrain/plan/mesh_planning.h"

namespace meshtrain::plan {

// The axes the planner models, slowest first in the runtime's default
// order (mesh::kMeshAxisOrder with expert, which splits the data-parallel
// ranks, after fsdp, as mesh::kKnownAxes has it).
inline constexpr std::array<std::string_view, 6> kPlannedAxes = {mesh::kPipeline, mesh::kData,    mesh::kFsdp,
                                                                 mesh::kExpert,   mesh::kContext, mesh::kTensor};

struct TrainingLayout {
  int data = 1, fsdp = 1, tensor = 1, pipeline = 1, context = 1;
  // A mixture-of-experts model's expert axis: splits the batch like data;
  // each rank holds experts / expert of every MoE layer's experts, the
  // rest alike (fsdp shards within the ranks holding the same experts).
  int expert = 1;
  // Over it, the rows the fullest rank's experts run over the even share
  // (ActivationLayout::expert_imbalance; the trainer's reported imbalance
  // bounds it): its activations, all-to-all bytes and expert GEMMs.
  double expert_imbalance = 1.0;
  // The stage fully sharded data parallelism runs at (layout::FsdpMode's;
  // the optional's order, nullopt < no_shard < zero1 < zero2 < zero3, is
  // how much is sharded); nullopt: plain data parallelism.
  std::optional<layout::ZeroStage> sharding = std::nullopt;
  bool hybrid = false;                 // shard over fsdp only, replicate over data
  bool sequence_parallel = false;
  layout::ScheduleKind schedule = layout::ScheduleKind::one_f_one_b;
  int virtual_stages = 1;
  int micro_batches = 1;
  layout::ContextComm cp_comm = layout::ContextComm::ring;
  bool recompute = false;
  DType param_dtype = DType::f32;      // mixed precision (fully sharded only)
  DType reduce_dtype = DType::f32;     // gradient reductions (defaults to param_dtype in the trainer)
  int64_t min_weight_size = 1024;
  // Fully sharded scheduling (parallel::FullyShardedOptions; the trainer's
  // defaults): what is gathered when, and how many gradient reductions may
  // be in flight.
  bool forward_prefetch = false;
  layout::BackwardPrefetch backward_prefetch = layout::BackwardPrefetch::pre;
  bool reshard_after_forward = true;
  int max_reductions_in_flight = 2;
  // When a gradient reduction's buffer is freed. false (the default): only
  // when it must be done (the deterministic bound: see the top);
  // true: at the first poll after its launch, as if every reduction
  // finished at once (a lower bound; a run lies between the two).
  bool eager_reductions = false;
  int64_t batch = 1;                   // global batch, samples per optimizer step
  double bucket_bytes = 25 << 20;      // plain data parallelism's gradient buckets (--bucket-mb)
  double dropout = 0.0;
  bool adamw = true;                   // else SGD with momentum
  // The mesh's axes, slowest first, as the runtime numbers the ranks (the
  // order --mesh lists them); empty: kPlannedAxes. Only which ranks share
  // a node depends on it (plan/time_model.h's links).
  std::vector<std::string> axis_order = {};
  // Sets the axis sizes and order from a mesh (absent axes: 1);
  // InvalidArgument for an axis not in kPlannedAxes.
  void set_mesh(const mesh::NamedShape& mesh);
  // Sets the mesh (set_mesh) and every strategy choice from the run's
  // layout (train::ResolvedTraining::layout): fsdp's stage and hybrid,
  // min_weight_size, precisions, sequence parallelism, the pipeline's
  // schedule, chunks and micro-batches, context parallelism's exchange.
  // The batch, scheduling options and the model's own settings stay.
  void set_layout(const layout::TrainingLayout& layout);
  // Every axis, slowest first: axis_order, then the others in kPlannedAxes.
  std::vector<std::string> rank_order() const;
  // The size of mesh axis `name` (one of kPlannedAxes); InvalidArgument for
  // another name.
  int axis_size(std::string_view name) const;
  // The ranks the batch is split over.
  int data_ranks() const { return data * fsdp * expert; }
  // The ranks fully sharded data parallelism shards over: fsdp (hybrid), or
  // every rank that sums the gradients (data x fsdp x context).
  int shard_ranks() const { return hybrid ? fsdp : data * fsdp * context; }
  int devices() const { return data * fsdp * expert * tensor * pipeline * context; }
};

// One device's prediction, bytes per category (core/memory.h's names).
struct DeviceMemory {
  int stage = 0, tensor_rank = 0;
  double parameters = 0, gradients = 0, optimizer = 0, working = 0, activations = 0, comm_buffers = 0;
  int64_t elements = 0;   // parameters this device holds a part of (its stage and tensor rank)
  int in_flight = 1;      // micro-batches whose activations it holds at once (pipelines)
  // Where the total peaks ("backward_input h.1 (before_use)": the stretch
  // after that hook call; "..., in the hook": during it; on a pipeline the
  // action first: "B1 backward_weight wte (before_use)", "F2 of stage 3
  // start" with several chunks per rank).
  std::string peak_at;
  double total() const { return parameters + gradients + optimizer + working + activations + comm_buffers; }
};

struct MemoryPrediction {
  std::vector<DeviceMemory> devices;  // per (stage, tensor rank), stage-major
  const DeviceMemory& worst() const;  // the largest total
};

// Checks the layout against the shape (divisibility of heads, layers,
// batch and sequence) and the pipeline schedule (its name; virtual stages
// only with interleaved, which takes at least 2 as the trainer resolves it
// and a multiple of the pipeline's size of micro-batches) with messages
// naming the value and how to fix it. Without a pipeline axis
// virtual_stages is ignored (the trainer runs the whole model).
void check_layout(const GptShape& shape, const TrainingLayout& layout);

MemoryPrediction predict_memory(const GptShape& shape, const TrainingLayout& layout);

// What the models count a device (pipeline rank, tensor rank) holding of
// the GPT, parameter by parameter in the model's order over its stages (r,
// r + p, ...): the elements of its tensor-parallel block, and whether every
// tensor rank holds the parameter whole. tests/placement_property_test.cc
// checks it against what training holds.
struct ParamElements {
  int64_t numel = 0;
  bool replicated = false;
};
std::vector<ParamElements> device_parameters(const GptShape& shape, const TrainingLayout& layout, int pipeline_rank,
                                             int tensor_rank);

}  // namespace meshtrain::plan
