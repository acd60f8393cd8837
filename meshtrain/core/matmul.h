// Matrix products over Tensor: oneDNN or OpenBLAS for f32 and half
// precision, whichever was measured faster for the shape (below; bf16
// operands with f32 accumulation run as real bf16 GEMMs on oneDNN where the
// CPU has AVX512-BF16), OpenBLAS for f64 and in a build without oneDNN.
// Included by core/ops.h.
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
// charged for: what a product charges is the same on every CPU.
//
// Which backend runs a product (f32 and half precision; f64 is OpenBLAS's):
// the first time a process meets a (dtypes, M, N, K, transposes, GEMM
// threads), it times oneDNN and OpenBLAS on it (scratch output, interleaved
// runs: about 50 ms for a small product, three runs each of a large one)
// and keeps the faster for the rest of the process; half
// precision's OpenBLAS candidate is the widened path below. Neither library
// wins everywhere: on an AVX2 EPYC OpenBLAS ran the GPT-2 step's GEMMs 15%
// faster, on a Zen 5 with AVX-512 oneDNN ran most of them faster and
// OpenBLAS the weight gradients (docs/benchmarks.md, GEMM section). Every
// thread of the process gets the same choice (threads asking while a shape
// is measured wait for it). MESHTRAIN_GEMM_BACKEND=auto (default), onednn,
// openblas or fixed (oneDNN with f32 weight gradients x^T dy on OpenBLAS,
// the rule before the choice was measured) sets the policy; set_gemm_policy
// overrides it in-process, a MatmulBackendScope per thread.
// MESHTRAIN_GEMM_CACHE=FILE keeps the measured choices in a JSON file, per
// machine (CPU model, ISA level, the two libraries' versions), read at the
// first product and updated after each new measurement. The backends differ
// in the last bits of f32 sums only (the order of additions): separate
// processes that measure can choose differently, so two runs that must give
// the same bits share a cache file or force a backend.
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
#include <string_view>
#include <vector>

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

// ---- Deterministic products (the deterministic mode, docs/determinism.md) ----
// A row's result depends on its own operands only: not on how many rows
// share the call, the GEMM threads, the policy or a measurement. out is cut
// into blocks of `row_block` rows by kFixedColumns columns, each computed by
// one single-threaded call of one fixed backend (oneDNN when built, else
// OpenBLAS, whose blocks then run one after another), the blocks spread over
// the rank's threads; K is never split. f32 only.
inline constexpr int64_t kFixedColumns = 256;
// While set on a thread (and in the parallel_for ranges it starts), every
// f32 matmul and batched_matmul of that thread is one single-threaded call
// of the fixed backend: its bits depend on the operands and the shape
// only (no measurement, no GEMM threads).
void set_deterministic_products(bool on);
bool deterministic_products();
// out (M, N) = a (M, K) @ op(b) + beta * out, op(b) = b (K, N), or b^T for
// a b (N, K) when trans_b.
void matmul_fixed_blocks(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_b, double beta,
                         int64_t row_block);
// out (M, N) += the tree sum (core/reduction_tree.h) over the blocks l of
// `row_block` rows of a_l^T @ b_l, for a (R, M), b (R, N) and R a multiple
// of row_block: a weight gradient x^T dy whose sum over samples follows the
// canonical tree over fixed blocks of rows. Each block's product is a
// single-threaded call on a tile of out; the tiles are spread over the
// rank's threads.
void matmul_tn_tree(const Tensor& a, const Tensor& b, const Tensor& out, int64_t row_block);

// Which library runs f32 and half-precision products.
enum class MatmulBackend : uint8_t { onednn, openblas };
// The calling thread's MatmulBackendScope's backend, else the policy's when
// it forces one, else oneDNN when the build has it (auto and fixed run
// some shapes on each), else OpenBLAS.
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

// "onednn" or "openblas".
std::string_view matmul_backend_name(MatmulBackend b);

// How products choose their backend (see the top of this file).
enum class GemmPolicy : uint8_t { automatic, onednn, openblas, fixed };
// "auto", "onednn", "openblas", "fixed".
std::string_view gemm_policy_name(GemmPolicy p);
// A policy by its name; InvalidArgument naming `source` and the choices
// otherwise.
GemmPolicy parse_gemm_policy(std::string_view text, std::string_view source);
// The process's policy: set_gemm_policy's, else MESHTRAIN_GEMM_BACKEND's
// (read once; InvalidArgument on a bad value, or onednn in a build without
// it), else auto.
GemmPolicy gemm_policy();
// Sets the process's policy (benchmarks put the policies side by side).
// Choices measured so far are kept for a later return to auto.
void set_gemm_policy(GemmPolicy p);
// One line for start-up dumps and benchmark headers: the policy and the two
// libraries, "auto: oneDNN or OpenBLAS per shape, the faster measured (cache
// gemm.json, 14 shapes read) [oneDNN 2.6.3 (...); OpenBLAS (...)]".
std::string gemm_policy_summary();

// One product shape the process has chosen a backend for: the first shape
// of its size class (the choice serves every shape of the class; see
// gemm_covers).
struct GemmChoice {
  DType in = DType::f32, out = DType::f32;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;  // as the memory lies
  int threads = 1;
  MatmulBackend backend = MatmulBackend::onednn;
  double onednn_seconds = 0, openblas_seconds = 0;  // fastest run of each; 0 for none
  bool from_cache = false;                          // read from MESHTRAIN_GEMM_CACHE, not measured here
};
// The auto policy's table so far, in the order the shapes were first seen.
std::vector<GemmChoice> gemm_choices();
// Whether `choice` decides a product of these sizes: the same dtypes,
// transposes and thread count, and m, n, k in its size classes (each
// size exact up to 16, then rounded up to a quarter octave: a model's
// changing sizes, such as a mixture of experts' rows per expert, share one
// measurement).
bool gemm_covers(const GemmChoice& choice, DType in, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b,
                 int threads);

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
