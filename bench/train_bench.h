// Training benchmark: the MLP 784-512-512-10 at batch 256, fp32 and bf16.
//
//   auto r = bench::run_train_bench({.steps = 100});
//   fmt::print("{}", bench::format_train_bench(r));
//
// - step: median time of forward + cross-entropy + backward + AdamW step on
//   one GEMM thread, synthetic data (as bench/torch_mlp.py does for PyTorch);
//   fp32, and bf16 (Linear layers in the bf16 compute dtype, f32 masters),
//   and with `deterministic` fp32 in the deterministic mode (blocks of 32
//   samples), interleaved in blocks of 10 steps.
// - gemm: median time of the same 8 GEMMs alone (3 forward, 3 weight
//   gradients, 2 input gradients: the first layer needs none), in f32 and on
//   bf16 operands, and the speed they reach; gemm / step is the share of the
//   step spent in GEMMs.
// - data parallel: samples/s with 1 and with 2 ranks of the threads engine
//   at a fixed per-rank batch (weak scaling), gradients all-reduced in
//   buckets of bucket_mb overlapped with backward, and how much of that
//   communication was hidden (DataParallelStats over the timed steps:
//   1 - exposed / in flight). run_train_bench_mpi measures the same on the
//   mpi engine (call it on every rank under mpirun).
// Thread-safety: call from one thread; it launches its own ranks.
#pragma once

#include <string>
#include <vector>

#include "bench/gemm_bench.h"

#include "meshtrain/core/dtype.h"

namespace meshtrain::bench {

struct TrainBenchOptions {
  int steps = 100;
  int warmup = 10;
  int batch = 256;
  bool sharded = true;  // also time FullyShardedDataParallel on 2 ranks
  double bucket_mb = 0.25;  // DataParallel bucket size
  // Also the fp32 step in the deterministic mode (docs/determinism.md),
  // interleaved with the others: the mode's cost.
  bool deterministic = false;
};

// One data-parallel measurement (rank 0's view).
struct DataParallelRun {
  int ranks = 0;
  double samples_per_s = 0;
  double comm_ms = 0;     // per step: time with at least one bucket all-reduce in flight
  double exposed_ms = 0;  // per step: the part of it after backward ended
  double hidden_fraction = 0;
  int buckets = 0;
  bool exact_timing = false;
};

struct ShardedThroughput {
  std::string strategy;  // no_shard, zero1, zero2, zero3
  DType dtype = DType::f32;
  double samples_per_s = 0;
};

struct TrainBenchResult {
  FmaPeak peak;  // 1 thread, measured in the same run: the rates' 100%
  double step_flops = 0;  // the MLP step's 8 GEMMs (forward and weight gradients of 3 layers, 2 input gradients)
  double step_ms = 0;
  double gemm_ms = 0;
  double gemm_gflops = 0;
  double step_bf16_ms = 0;  // the Linear layers computing in bf16
  double step_deterministic_ms = 0;  // fp32 in the deterministic mode (0: not run)
  double gemm_bf16_ms = 0;  // the 8 GEMMs on bf16 operands
  double gemm_bf16_gflops = 0;
  DataParallelRun dp1, dp2;
  std::vector<ShardedThroughput> sharded;  // 2 ranks
};

TrainBenchResult run_train_bench(const TrainBenchOptions& options);
std::string format_train_bench(const TrainBenchResult& r, const TrainBenchOptions& options);
DataParallelRun run_train_bench_mpi(const TrainBenchOptions& options);
std::string format_train_bench_mpi(const DataParallelRun& r, const TrainBenchOptions& options);

}  // namespace meshtrain::bench
