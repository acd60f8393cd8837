// Matrix products over Tensor: oneDNN for f32 and half precision (bf16
// operands with f32 accumulation run as real bf16 GEMMs: AVX512-BF16 where
// the CPU has it), OpenBLAS for f64 and as the fallback of a build without
// oneDNN. Included by core/ops.h.
//
//   Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
//   Tensor b = Tensor::full({3, 2}, 0.5, DType::f32);
//   Tensor c = matmul(a, b);                          // (2, 2): [[3, 3], [7.5, 7.5]]
//   matmul(a, b, c, false, false, 1.0, 1.0);          // c += a @ b
//   matmul(a.to(DType::bf16), b.to(DType::bf16), c);  // bf16 x bf16 -> f32 (f32 accumulation)
//   set_blas_threads(1);                              // one GEMM thread per calling thread
//
// dtypes: a and b have one dtype; f32 and f64 products write an out of that
// dtype; bf16 and f16 operands write an f32 out (f32 accumulation, like a
// tensor core or AVX512-BF16's dot product) or one of their own dtype
// (accumulated in f32, rounded once). oneDNN has bf16 kernels from AVX-512 on
// and f16 ones with AVX512-FP16 (cpu_isa.h); elsewhere, and without oneDNN,
// the operands are widened to f32 (exact) block by block and the f32 GEMM
// runs on each block: the same products and f32 accumulation, at f32 speed,
// in a bounded per-thread workspace (at most 4 MiB of widened rows of op(a),
// 512 widened columns of op(b) and one f32 block of a half out) that, like
// oneDNN's scratchpad and OpenBLAS's packing buffers, no MemoryTracker is
// charged for: what a product charges is the same on every CPU. Which
// backend a build uses: matmul_backend() and CMake's configure summary. One exception to oneDNN, measured
// (`meshtrain bench gemm`, docs/benchmarks.md): f32 products whose first
// operand is transposed and second is not (weight gradients x^T dy) run on
// OpenBLAS, which reaches 83-89% of the FMA peak there against oneDNN's
// 79-83%; a MatmulBackendScope overrides this too.
//
// Layout: 2-D operands with unit stride in one dim (row-major, narrowed
// columns, transpose() views) go to the backend directly; others are copied
// to contiguous first. out must not overlap a or b (InvalidArgument).
// When beta == 0, out's old values are ignored (NaN in out does not propagate).
//
// Threads: set_blas_threads(n) sets the GEMM thread count of both backends:
// OpenBLAS's (one pool per process) and oneDNN's, whose OpenMP runtime keeps
// the count per calling thread: each thread applies the latest n at its next
// matmul, so ranks running as threads of one process (the threads engine)
// each use n threads. With N ranks per process, n = cores / N avoids
// oversubscription (train/trainer.cc does this). Thread-safety: concurrent
// calls on disjoint outputs are safe; oneDNN primitives are created once per
// shape and shared (a process-wide cache), their memory handles per thread.
#pragma once

#include <string>

#include "meshtrain/core/tensor.h"

namespace meshtrain {

// Sets the GEMM thread count (n >= 1) of OpenBLAS (process-wide) and of
// oneDNN (each calling thread picks it up at its next matmul). Call it at
// start-up (the CLI, a benchmark or a test main), before kernels run.
void set_blas_threads(int n);
// The thread count set by set_blas_threads (OpenBLAS's current count before
// any call).
int blas_threads();

// out = alpha * op(a) @ op(b) + beta * out, where op(x) is x or x^T.
// a, b, out: 2-D; op(a) (M, K), op(b) (K, N), out (M, N); dtypes as above.
void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a = false,
            bool trans_b = false, double alpha = 1.0, double beta = 0.0);
// a @ b as a new contiguous (M, N) tensor: a's dtype for f32/f64, f32 for bf16/f16.
Tensor matmul(const Tensor& a, const Tensor& b);
// matmul for each index of a leading batch dim: a (B, ., .), b (B, ., .),
// out (B, M, N); same rules as matmul per batch.
void batched_matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a = false,
                    bool trans_b = false, double alpha = 1.0, double beta = 0.0);

// Which library runs f32 and half-precision products.
enum class MatmulBackend : uint8_t { onednn, openblas };
// oneDNN when the build has it, else OpenBLAS (the calling thread's
// MatmulBackendScope, if any, overrides).
MatmulBackend matmul_backend();
// Whether this build can run `b` (OpenBLAS always; oneDNN when CMake found it).
bool matmul_backend_available(MatmulBackend b);
// "oneDNN 2.6.3 (OpenMP runtime, CPU ISA avx512_core_bf16)" or "OpenBLAS 0.3.21 ...".
std::string matmul_backend_description(MatmulBackend b);

// Whether products of dtype `t` run on this CPU's own instructions for it
// (cpu_isa(), so MESHTRAIN_CPU_ISA lowers it): f32 and f64 always; bf16 with
// AVX512-BF16 or AMX and oneDNN; f16 never (no CPU level here has
// AVX512-FP16: its operands are widened to f32).
bool native_gemm_dtype(DType t);
// "" when native_gemm_dtype(t); else one line for a start-up dump saying
// that t's products are slower than f32's on this CPU, and why.
std::string gemm_dtype_note(DType t);

// Runs the calling thread's products on `b` while it lives (benchmarks and
// tests put the two backends side by side). Unsupported when the build
// lacks `b`. Not copyable; scopes nest.
class MatmulBackendScope {
 public:
  explicit MatmulBackendScope(MatmulBackend b);
  ~MatmulBackendScope();
  MatmulBackendScope(const MatmulBackendScope&) = delete;
  MatmulBackendScope& operator=(const MatmulBackendScope&) = delete;

 private:
  int previous_;
};

}  // namespace meshtrain
