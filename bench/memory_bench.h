// Memory per rank of fully sharded data parallelism (ZeRO-1/2/3, no_shard):
// for each strategy and rank count, a few real AdamW training steps of an
// MLP on the threads engine (synthetic Fashion-MNIST-shaped data), each rank
// with its own MemoryTracker, against parallel::predicted_model_state.
//
//   bench::MemoryBenchOptions o;                  // 784 -> 8 x 1024 -> 10, zero1..3, d = 1, 2, 4, 8
//   auto rows = bench::run_memory_bench(o);
//   fmt::print("{}", bench::format_memory_bench(rows, o));
//
// Measured: the largest peak over the ranks of each category (parameters,
// gradients, optimizer = AdamW state + f32 master, working) and of their
// sum (model state = parameters + gradients + optimizer, whose parts are
// persistent, so its peak is their sum), over `steps` steps after one
// warm-up step; each step starts at a barrier. The warm-up step's working
// peak is reported too: ranks that start apart (more ranks than cores) keep
// a rank's reduce-scatters queued until its peers arrive.
// Predicted: predicted_model_state(stage, P, d, ...) with AdamW's 8 bytes of
// state per element, plus the replicated parameters' f32 value, gradient and
// AdamW state (4 + 4 + 8 bytes per element: every rank holds them whole).
// Working: the transient unsharded copies, against the largest unit's
// padded size times the bytes alive at once (working_prediction()).
// Thread-safety: call from one thread; it launches its own ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/parallel/fully_sharded.h"

namespace meshtrain::bench {

struct MemoryBenchOptions {
  std::vector<int64_t> hidden = {1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024};  // 784 -> hidden -> 10
  std::vector<std::string> strategies = {"zero1", "zero2", "zero3"};  // parse_fsdp_mode names
  std::vector<int> ranks = {1, 2, 4, 8};
  std::vector<DType> precisions = {DType::bf16};  // parameter dtype: f32, bf16 or f16
  int steps = 2;             // training steps measured, after one warm-up step
  int batch = 256;           // samples per rank per step
  int64_t min_weight_size = 1024;
  double timeout_s = 300;
};

// The working-memory prediction: the largest unit's padded size Np times
// the bytes per element alive at once while that unit is in backward, with
// comm keeping up with compute (one reduction in flight):
//   in_use     the unit's f32 value copy (4; none when values are persistent
//              f32: f32 and stage < 3) + its f32 gradient (4; none for f32
//              gradients of stage <= 1, which accumulate in place)
//   prefetch   zero3 with backward_prefetch pre: the next unit's gathered
//              buffer (param_dtype bytes)
//   reducing   zero2/3: the previous unit's reduce-scatter buffer (the
//              reduce_dtype copy of its gradient, or the f32 gradient itself)
// Measured above it means reductions queue (the reduce-scatter of a unit is
// slower than the next unit's backward).
struct WorkingPrediction {
  int64_t largest_unit = 0;  // Np of the largest unit
  double in_use = 0, prefetch = 0, reducing = 0;  // bytes per element
  double bytes() const { return static_cast<double>(largest_unit) * (in_use + prefetch + reducing); }
};
WorkingPrediction working_prediction(parallel::ZeroStage stage, DType param_dtype, int64_t largest_unit);

struct MemoryBenchRow {
  std::string strategy;
  int ranks = 1;
  DType precision = DType::f32;
  int64_t sharded_elements = 0, replicated_elements = 0;
  // Measured peaks (max over ranks), bytes.
  uint64_t parameters = 0, gradients = 0, optimizer = 0, working = 0, model_state = 0;
  uint64_t working_first_step = 0;  // the warm-up step's working peak (rank skew included)
  // Predicted bytes per rank (replicated parameters included).
  parallel::ModelStateBytes predicted;
  WorkingPrediction working_predicted;
  double seconds = 0;  // wall time of the run
};

// Runs every (precision, ranks, strategy) combination in that order.
std::vector<MemoryBenchRow> run_memory_bench(const MemoryBenchOptions& options);
// One table per (precision, rank count), then the footnotes.
std::string format_memory_bench(const std::vector<MemoryBenchRow>& rows, const MemoryBenchOptions& options);

}  // namespace meshtrain::bench
