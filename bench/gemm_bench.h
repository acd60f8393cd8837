// GEMM benchmark: the matrix products of a training step on each backend and
// dtype, against the core's FMA peak measured in the same run.
//
//   auto r = bench::run_gemm_bench({.sets = {"mlp", "gpt"}, .reps = 10});
//   fmt::print("{}", bench::format_gemm_bench(r));
//
// - sets: "mlp" (784-512-512-10 at batch M: 3 forward GEMMs, 3 weight
//   gradients, 2 input gradients, as a step runs them) and "gpt" (one GPT-2
//   124M block at M tokens: qkv 768 -> 2304, attention projection 768 -> 768,
//   fc 768 -> 3072, fc projection 3072 -> 768, and the tied head 768 -> 50257;
//   forward, input gradient and weight gradient of each).
// - variants: OpenBLAS sgemm (f32), oneDNN f32, oneDNN bf16 (bf16 operands,
//   f32 accumulation and output); the oneDNN ones only in a build with it.
//   Every variant runs on the same operands through core's matmul
//   (MatmulBackendScope), weight gradients accumulate (beta = 1) as in training.
//   A fourth, "auto f32", runs core's own choice (core/matmul.h: the backend
//   measured per shape, or read from MESHTRAIN_GEMM_CACHE); the table shows
//   which it chose and its rate against the better of the two f32 columns.
// - peak: a register-only loop of independent 512-bit FMAs (vfmadd231ps,
//   AVX-512F) and of bf16 dot products (vdpbf16ps, AVX512-BF16), on `threads`
//   threads, best of 15 runs of ~10 ms: what the cores can issue. Each kernel is
//   compiled for its ISA (target attribute) and runs only when the CPU has it;
//   an AVX2 FMA loop stands in without AVX-512 (then no bf16 peak).
// Timing: rounds interleave every (shape, variant); each entry is the median
// over `reps` rounds, so slow phases of a shared machine hit all variants alike.
// Thread-safety: call from one thread; it sets the GEMM thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::bench {

struct GemmBenchOptions {
  std::vector<std::string> sets = {"mlp", "gpt"};
  int64_t m = 256;     // batch rows (MLP) / tokens per step (GPT)
  int reps = 10;       // timed rounds (median)
  int warmup = 1;      // untimed rounds first
  int threads = 1;     // GEMM threads (set_blas_threads) and peak-loop threads
  int64_t vocab = 50257;  // the GPT head's output size (smaller for quick runs)
};

struct GemmShape {
  std::string set, name;  // "gpt", "fc fwd"
  int64_t m = 0, k = 0, n = 0;
  bool trans_a = false, trans_b = false;
  double beta = 0;
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n); }
};

// Median seconds per call of one shape on each variant (0: not run).
struct GemmRow {
  GemmShape shape;
  double openblas_f32 = 0, onednn_f32 = 0, onednn_bf16 = 0, auto_f32 = 0;
  std::string chosen;  // the auto policy's backend for the f32 product ("onednn"; "" when not run)
  bool chosen_from_cache = false;
};

// What the cores can issue (the peak loops above), on `threads` threads.
struct FmaPeak {
  double f32_gflops = 0;   // FMA loop
  double bf16_gflops = 0;  // vdpbf16ps loop (0: the CPU has no AVX512-BF16)
  std::string isa;         // "avx512f" / "avx2+fma" / "none"
  // The peak a product of `bf16` operands is held to: the bf16 loop's where
  // the CPU has one, else f32's (what such products then run at).
  double for_dtype(bool bf16) const { return bf16 && bf16_gflops > 0 ? bf16_gflops : f32_gflops; }
};
// The peak loops of the widest FMA the kernels may use (cpu_isa():
// MESHTRAIN_CPU_ISA caps it), best of 15 runs; `bench gpt` and `bench train`
// measure it too, so their rates are against the machine's limit.
FmaPeak measure_fma_peak(int threads);

struct GemmBenchResult {
  double f32_peak_gflops = 0;   // FMA loop
  double bf16_peak_gflops = 0;  // vdpbf16ps loop (0: the CPU has no AVX512-BF16)
  std::string peak_isa;         // "avx512f" / "avx2+fma" / "none"
  std::string onednn;           // matmul_backend_description, "" without oneDNN
  std::string openblas_note;    // openblas_core_note(): "" unless OPENBLAS_CORETYPE slows OpenBLAS
  std::vector<GemmRow> rows;
};

// The shapes of the given sets (InvalidArgument naming an unknown set).
std::vector<GemmShape> gemm_bench_shapes(const GemmBenchOptions& options);
GemmBenchResult run_gemm_bench(const GemmBenchOptions& options);
std::string format_gemm_bench(const GemmBenchResult& r, const GemmBenchOptions& options);

}  // namespace meshtrain::bench
