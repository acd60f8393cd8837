// The GPT training step against the machine and against PyTorch: median time
// of one step (forward, cross-entropy, backward, AdamW) of a GPT-2 (default:
// the 124M shape, T = 64, batch 4) in fp32 and/or bf16 (every Linear's and
// the head's GEMMs on bf16 operands, f32 masters, logits and attention;
// PyTorch: autocast) on one rank with `threads` BLAS
// threads and synthetic tokens; tokens/s; the model FLOPs it reaches beside
// the sgemm rate measured in the same run on the step's own largest GEMM
// shape; the same model and step in PyTorch (bench/torch_gpt.py, run by the
// benchmark as a child process when python3 with torch is present); and
// where the step's time goes, per kernel (nn::functional's op profile over
// the timed steps; "other" is the rest: embedding bookkeeping, residual
// adds, copies, gradient zeroing).
//
//   bench::GptBenchOptions o;                      // 124M shape
//   fmt::print("{}", bench::format_gpt_bench(bench::run_gpt_bench(o), o));
//
// FLOPs per step: 6 N B T for the matrix products (N: the block matrices
// and the tied vocabulary projection) plus 12 L B T^2 C for attention
// (counted in full, as PaLM's MFU does; the causal kernel skips half).
// Thread-safety: call from one thread; it sets the process's BLAS threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::bench {

struct GptBenchOptions {
  int64_t layers = 12, heads = 12, width = 768, vocab = 50257, context = 64, batch = 4;
  int steps = 10;
  int warmup = 2;
  int threads = 2;
  std::vector<std::string> precisions = {"fp32"};  // "fp32", "bf16"
  // PyTorch peer: the script to run with /usr/bin/python3 ("" skips it).
  std::string torch_script;
};

struct GptBenchOp {
  std::string op;
  int64_t calls_per_step = 0;
  double ms_per_step = 0;
};

// One precision's measurements.
struct GptBenchRun {
  std::string precision;
  double step_ms = 0;               // median
  double tokens_per_s = 0;
  double gflops = 0;                // flops_per_step / step
  double torch_step_ms = 0;         // 0: not measured
  std::string torch_note;           // the version, or why it was not measured
  std::vector<GptBenchOp> profile;  // per step over the timed steps, largest first, then "other"
};

struct GptBenchResult {
  int64_t parameters = 0;
  double flops_per_step = 0;
  double sgemm_gflops = 0;          // measured now: (B T, C) x (C, 4C) through core matmul, f32
  std::string sgemm_shape;
  std::vector<GptBenchRun> runs;    // one per precision, in the order asked
};

GptBenchResult run_gpt_bench(const GptBenchOptions& options);
std::string format_gpt_bench(const GptBenchResult& r, const GptBenchOptions& options);

}  // namespace meshtrain::bench
