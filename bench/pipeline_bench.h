// Pipeline schedules on real stages: the idle share (bubble) of each
// schedule measured on the threads engine, beside its theory.
//
//   bench::PipelineBenchOptions o;                    // 2 ranks, 8 micro-batches, every schedule
//   fmt::print("{}", bench::format_pipeline_bench(bench::run_pipeline_bench(o), o));
//
// Stages of equal cost: every stage is the same number of GPT blocks
// (nn::GPT parts without embeddings or head: width, heads, T and rows per
// micro-batch from the options; 1 GEMM thread per rank, each rank bound to a
// core when there are enough). Stage 0 reads a fixed random input, the last
// stage's loss is sum(y * w) with a fixed random w, so every forward and
// backward does the same work. Each schedule runs `warmup` steps and then
// `steps` timed steps through parallel::PipelineExecutor; the timelines are
// gathered to rank 0 (parallel/pipeline_timeline.h), the measured bubble is
// the median over the timed steps, and the theory is
// parallel::theoretical_bubble (F = 1, B = 2 or I = W = 1 time units). With
// out_dir set, the median step's timeline is written there as
// pipeline_<schedule>.json (Chrome trace, opens in Perfetto) and .svg.
// Thread-safety: call from one thread; it sets the process's BLAS threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/layout/vocabulary.h"

namespace meshtrain::bench {

struct PipelineBenchOptions {
  int ranks = 2;
  int micro_batches = 8;
  int virtual_stages = 2;  // chunks per rank for "interleaved"
  std::vector<std::string> schedules{layout::kScheduleNames.begin(), layout::kScheduleNames.end()};  // every one
  int64_t blocks_per_stage = 1;
  int64_t width = 256, heads = 4, context = 64, rows = 4;  // rows: sequences per micro-batch
  int steps = 5;
  int warmup = 1;
  std::string out_dir;  // "" writes no files
};

struct PipelineBenchRow {
  std::string schedule;
  int stages = 0;                 // ranks x chunks
  double step_ms = 0;             // median makespan of a step (rank 0's clock)
  double measured = 0;            // median idle share
  double theory = 0;
  double forward_ms = 0;          // median time of one stage's forward (the unit of the theory)
  double backward_ms = 0;         // and of its fused backward (or input + weight passes)
  std::vector<std::string> files;  // written pictures and traces
};

std::vector<PipelineBenchRow> run_pipeline_bench(const PipelineBenchOptions& options);
std::string format_pipeline_bench(const std::vector<PipelineBenchRow>& rows, const PipelineBenchOptions& options);

}  // namespace meshtrain::bench
