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
//     working: the transient unsharded copies while a block is in backward
//     (the block's f32 value copy unless values persist in f32, its f32
//     gradient unless gradients persist in f32, zero3's prefetched next
//     unit, zero2/3's reductions in flight: parallel/fully_sharded.h).
//   activations: plan::estimate_activations (activation_memory.h) for one
//     micro-batch, times the micro-batches a pipeline stage holds at once
//     (1F1B: min(p - s, m) on stage s; GPipe: m), plus two loaded batches
//     (the trainer prefetches the next).
// The total is the sum. That is exact where nothing but the activations
// varies (plain data, tensor, sequence, pipeline and context parallelism,
// zero1: within 1% of the measured peaks, tests/memory_model_test.cc). For
// zero2/zero3 it is an upper bound (11-13% over on the test's GPT): the
// activations peak in the backward's input pass, the working memory in its
// weight pass (gathered units, gradients being reduced), and the sum counts
// both peaks at once; a model of the two passes is the next step
// (docs/planner.md).
// Thread-safety: pure functions. Errors: InvalidArgument naming the value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/plan/activation_memory.h"

namespace meshtrain::plan {

// Fully sharded data parallelism's stages, as the trainer's --fsdp names
// them (full = zero3, shard_grad_op = zero2; hybrid_*: the same over the
// fsdp axis, replicated over data).
enum class Sharding : uint8_t { none, no_shard, zero1, zero2, zero3 };

struct TrainingLayout {
  int data = 1, fsdp = 1, tensor = 1, pipeline = 1, context = 1;
  Sharding sharding = Sharding::none;  // none: plain data parallelism
  bool hybrid = false;                 // shard over fsdp only, replicate over data
  bool sequence_parallel = false;
  std::string schedule = "1f1b";       // pipeline: gpipe | 1f1b | interleaved | zb
  int virtual_stages = 1;
  int micro_batches = 1;
  std::string cp_comm = "ring";
  bool recompute = false;
  DType param_dtype = DType::f32;      // mixed precision (fully sharded only)
  DType reduce_dtype = DType::f32;     // gradient reductions (defaults to param_dtype in the trainer)
  int64_t min_weight_size = 1024;
  int64_t batch = 1;                   // global batch, samples per optimizer step
  double dropout = 0.0;
  bool adamw = true;                   // else SGD with momentum
  int data_ranks() const { return data * fsdp; }
  int devices() const { return data * fsdp * tensor * pipeline * context; }
};

// One device's prediction, bytes per category (core/memory.h's names).
struct DeviceMemory {
  int stage = 0, tensor_rank = 0;
  double parameters = 0, gradients = 0, optimizer = 0, working = 0, activations = 0, comm_buffers = 0;
  int64_t elements = 0;   // parameters this device holds a part of (its stage and tensor rank)
  int in_flight = 1;      // micro-batches whose activations it holds at once
  double total() const { return parameters + gradients + optimizer + working + activations + comm_buffers; }
};

struct MemoryPrediction {
  std::vector<DeviceMemory> devices;  // per (stage, tensor rank), stage-major
  const DeviceMemory& worst() const;  // the largest total
};

// Checks the layout against the shape (divisibility of heads, layers,
// batch and sequence) with messages naming the value and how to fix it.
void check_layout(const GptShape& shape, const TrainingLayout& layout);

MemoryPrediction predict_memory(const GptShape& shape, const TrainingLayout& layout);

// Parses --fsdp's names: "" (none), full, shard_grad_op, no_shard, zero1,
// zero2, zero3, hybrid_full, hybrid_shard_grad_op (sets hybrid).
void parse_sharding(const std::string& name, TrainingLayout& layout);

}  // namespace meshtrain::plan
