// oneDNN's fused post-ops and its layer normalization and log-softmax
// against meshtrain's own kernels, on a GPT-2 step's shapes: whether a
// fusion (bias, GELU, residual add folded into the GEMM) or a oneDNN kernel
// would save time where meshtrain runs separate passes (docs/benchmarks.md
// records the answer; meshtrain keeps its kernels where they win).
//
//   bench::FusionBenchOptions o;  // 256 rows, width 768, vocabulary 50257, 1 thread
//   fmt::print("{}", bench::format_fusion_bench(bench::run_fusion_bench(o), o));
//
// Each row times the same work both ways on the same inputs (median of
// `reps` after two warm-ups) and gives the largest difference between the
// two results. meshtrain's side is what a training step runs:
// functional::linear_forward (bias rows, then the GEMM adds onto them),
// activation_forward, core add, layer_norm_forward/backward_*,
// cross_entropy_forward (softmax and loss in one pass). oneDNN's side: a
// matmul primitive with a bias and post-ops (eltwise_gelu_tanh, sum),
// layer_normalization forward (training) and backward, logsoftmax forward.
// A fused GELU writes only the activation: a training step also needs the
// pre-activation for GELU's backward, which the fused form does not keep.
// Needs a build with oneDNN (run_fusion_bench throws Unsupported otherwise).
// A GEMM row oneDNN has no kernel for on this CPU (bf16 below AVX-512 in
// oneDNN 2.x) is skipped, with the reason, instead of failing the run.
// Thread-safety: call from one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::bench {

struct FusionBenchOptions {
  int64_t rows = 256;     // tokens in the step (batch x T)
  int64_t width = 768;    // model width C (the MLP is C -> 4C -> C)
  int64_t vocab = 50257;  // log-softmax rows are (rows, vocab)
  int threads = 1;
  int reps = 20;
};

struct FusionBenchRow {
  std::string name;   // "fc + bias + GELU"
  std::string shape;  // "(256, 768) x (768, 3072)"
  std::string dtype;  // GEMM operand dtype: "f32", "bf16"; "f32" for the rest
  double ours_ms = 0, onednn_ms = 0;
  double max_abs_diff = 0;
  std::string skipped = {};  // why the row was not timed ("oneDNN has no bf16 kernel ..."); "" when it was
};

std::vector<FusionBenchRow> run_fusion_bench(const FusionBenchOptions& options);
std::string format_fusion_bench(const std::vector<FusionBenchRow>& rows, const FusionBenchOptions& options);

}  // namespace meshtrain::bench
