// The oneDNN side of core's matmul (core/matmul.cc): one row-major GEMM
// through a cached oneDNN matmul primitive. Private to core; built only when
// CMake found oneDNN (MESHTRAIN_HAVE_ONEDNN), else every call returns false
// and matmul uses OpenBLAS.
//
//   internal::GemmCall g{.in = DType::bf16, .out = DType::f32, .m = 256, .n = 512, .k = 784,
//                        .a = x, .lda = 784, .b = w, .ldb = 512, .c = y, .ldc = 512};
//   if (!internal::onednn_gemm(g, /*threads=*/1)) { /* no oneDNN kernel: use the fallback */ }
//
// Primitives are created once per (dtypes, shape, leading dims, transposes,
// alpha == 1 or not, beta, thread count) and shared by every thread (a
// process-wide cache behind a shared mutex); each thread keeps its own
// memory objects, stream and scratchpad, so N rank threads may call
// concurrently. alpha is a runtime output scale (any alpha, one primitive);
// beta != 0 is a sum post-op (one primitive per beta value).
//
// Threads: oneDNN's runtime here is OpenMP (Debian's build), whose thread
// count is per calling thread: `threads` > 0 is applied to the calling
// thread (omp_set_num_threads) before the call, once per change; 0 leaves
// the runtime's default. A sequential build ignores it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "meshtrain/core/dtype.h"

namespace meshtrain::internal {

// c (m, n) = alpha * op(a) @ op(b) + beta * c, row-major: op(a) is a (m, k)
// with leading dim lda, or a (k, m) stored transposed when trans_a (same
// for b). in: a's and b's dtype (f32, bf16, f16); out: c's (f32, or in).
struct GemmCall {
  DType in = DType::f32, out = DType::f32;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  void* c = nullptr;
  int64_t ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
};

// True when this build has oneDNN.
bool onednn_built();
// Runs g; false (nothing written) when oneDNN has no kernel for its dtypes
// on this CPU (f16 without AVX512-FP16) or the build has no oneDNN. Errors
// from oneDNN while running are Error("matmul", ...) naming the shapes.
bool onednn_gemm(const GemmCall& g, int threads);
// "oneDNN 2.6.3 (OpenMP runtime, CPU ISA avx512_core_bf16)", or "" without oneDNN.
std::string onednn_description();
// The kernel oneDNN picked for g ("brg:avx512_core_bf16"), "" when none.
std::string onednn_kernel_name(const GemmCall& g, int threads);
// The thread count oneDNN would use for a call from this thread now.
int onednn_threads_here(int threads);
// Primitives in the process-wide cache.
size_t onednn_cached_primitives();

}  // namespace meshtrain::internal
