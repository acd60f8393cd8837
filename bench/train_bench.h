// Training benchmark: the MLP 784-512-512-10 at batch 256, fp32.
//
//   auto r = bench::run_train_bench({.steps = 100});
//   fmt::print("{}", bench::format_train_bench(r));
//
// - step: median time of forward + cross-entropy + backward + AdamW step on
//   one BLAS thread, synthetic data (as bench/torch_mlp.py does for PyTorch).
// - gemm: median time of the same 8 GEMMs alone (3 forward, 3 weight
//   gradients, 2 input gradients: the first layer needs none), and the sgemm
//   speed they reach; gemm / step is the share of the step spent in GEMMs.
// - data parallel: samples/s with 1 and with 2 ranks of the threads engine
//   at a fixed per-rank batch (weak scaling), gradients all-reduced in
//   buckets overlapped with backward.
// Thread-safety: call from one thread; it launches its own ranks.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/core/dtype.h"

namespace meshtrain::bench {

struct TrainBenchOptions {
  int steps = 100;
  int warmup = 10;
  int batch = 256;
  bool sharded = true;  // also time FullyShardedDataParallel on 2 ranks
};

struct ShardedThroughput {
  std::string strategy;  // no_shard, zero1, zero2, zero3
  DType dtype = DType::f32;
  double samples_per_s = 0;
};

struct TrainBenchResult {
  double step_ms = 0;
  double gemm_ms = 0;
  double gemm_gflops = 0;
  double dp1_samples_per_s = 0;
  double dp2_samples_per_s = 0;
  std::vector<ShardedThroughput> sharded;  // 2 ranks
};

TrainBenchResult run_train_bench(const TrainBenchOptions& options);
std::string format_train_bench(const TrainBenchResult& r, const TrainBenchOptions& options);

}  // namespace meshtrain::bench
