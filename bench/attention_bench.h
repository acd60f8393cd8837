// The attention kernel against the plain reference: time of the blockwise
// forward and backward (nn::functional::attention_*) and of the reference
// forward, and the bytes each keeps between forward and backward, per
// sequence length.
//
//   bench::AttentionBenchOptions o;                  // heads 12, head_dim 64, T = 64, 256, 1024
//   fmt::print("{}", bench::format_attention_bench(bench::run_attention_bench(o), o));
//
// Memory is by construction, not sampled: the blockwise kernel keeps q, k,
// v, out (4 T D floats per head) and the log-sum-exp (T floats); the
// reference also keeps the T x T probabilities a plain backward needs.
// Times are medians over `reps` runs after one warm-up, single-threaded
// BLAS (the process setting).
// Thread-safety: call from one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::bench {

struct AttentionBenchOptions {
  int64_t batch = 1;
  int64_t heads = 12;
  int64_t head_dim = 64;
  std::vector<int64_t> lengths = {64, 256, 1024};
  bool causal = true;
  int reps = 10;
};

struct AttentionBenchRow {
  int64_t t = 0;
  double forward_ms = 0, backward_ms = 0, reference_ms = 0;
  double gflops_forward = 0;        // useful FLOPs (causal: half the tiles) / forward time
  double kept_bytes = 0, reference_kept_bytes = 0;
  double max_abs_diff = 0;          // blockwise vs reference outputs
};

std::vector<AttentionBenchRow> run_attention_bench(const AttentionBenchOptions& options);
std::string format_attention_bench(const std::vector<AttentionBenchRow>& rows, const AttentionBenchOptions& options);

}  // namespace meshtrain::bench
