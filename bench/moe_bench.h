// Expert parallelism against data parallelism on the same mixture-of-experts
// model: `meshtrain bench moe`. A Llama-style GPT whose MLPs are MoE layers
// (nn/moe.h; default 4 blocks of width 256, 8 experts of 512 hidden
// features, top-2, T = 64, a global batch of 16) trains with synthetic
// tokens and AdamW on ranks of the threads engine, for each mesh:
//   none      one rank, every expert local;
//   data=D    every rank holds every expert, DataParallel sums all gradients;
//   expert=E  rank r holds experts [r 8/E, (r+1) 8/E); tokens travel to them
//             by all_to_all_v and back; ExpertParallel sums the replicated
//             parameters' gradients over the axis.
// Per mesh: rank 0's median step, tokens/s, the rate against data=D's (the
// same rank count), the share of rank 0's mean step in the experts' token
// exchange (the op profile's "ep all_to_all": the counts' all_to_all and
// the rows' all_to_all_v, dispatch and combine, forward and backward) and
// in the gradient reductions left after backward (the strategy's finish():
// DataParallel's last buckets, or ExpertParallel's replicated gradients), and
// the parameters each rank holds. On the threads engine an exchange's time
// includes waiting for the slowest rank. The FMA peak measured in the same
// run and the CPU are printed beside the table.
//
//   bench::MoeBenchOptions o;
//   fmt::print("{}", bench::format_moe_bench(bench::run_moe_bench(o), o));
//
// Thread-safety: call from one thread; it sets the process's BLAS threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/gemm_bench.h"

namespace meshtrain::bench {

struct MoeBenchOptions {
  int64_t layers = 4, heads = 4, kv_heads = 2, width = 256, vocab = 4096, context = 64, batch = 16;
  int experts = 8, top_k = 2;
  int64_t expert_hidden = 512;
  double capacity_factor = 0.0;  // 0: no dropping
  int ranks = 2;                 // the data=N and expert=N meshes
  int steps = 10, warmup = 2;
  int threads = 2;               // GEMM threads in all, split over the ranks
};

struct MoeBenchRow {
  std::string mesh;             // "none", "data=2", "expert=2"
  double step_ms = 0;           // rank 0's median
  double mean_step_ms = 0;
  double tokens_per_s = 0;
  double all_to_all_ms = 0;     // rank 0, per step: "ep all_to_all"
  double gradient_ms = 0;       // rank 0, per step: the strategy's finish()
  int64_t parameters_per_rank = 0;
};

struct MoeBenchResult {
  int64_t parameters = 0;        // the whole model
  int64_t active_parameters = 0; // per token: dense parts + top_k experts per layer
  FmaPeak peak;
  std::string cpu;
  std::vector<MoeBenchRow> rows;
};

MoeBenchResult run_moe_bench(const MoeBenchOptions& options);
std::string format_moe_bench(const MoeBenchResult& result, const MoeBenchOptions& options);

}  // namespace meshtrain::bench
