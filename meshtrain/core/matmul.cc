#include "meshtrain/core/matmul.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <limits>
#include <mutex>
#include <vector>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/convert.h"
#include "meshtrain/core/internal/gemm_choice.h"
#include "meshtrain/core/internal/onednn_gemm.h"
#include "meshtrain/core/internal/operands.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/reduction_tree.h"

namespace meshtrain {
namespace {

using internal::check_operand;

// The count set_blas_threads last set (0: never; each backend's default).
std::atomic<int> g_threads{0};
// The calling thread's MatmulBackendScope: -1 none, else a MatmulBackend.
thread_local int t_backend = -1;
// The calling thread's set_deterministic_products.
thread_local bool t_deterministic = false;


bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }

// A 2-D operand as a GEMM sees it: row-major storage with leading dim `ld`,
// transposed or not.
struct GemmOperand {
  Tensor t;  // holds the memory (possibly a contiguous copy)
  bool trans;
  int64_t ld;
};

GemmOperand as_gemm(const Tensor& x, bool trans) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  if ((s1 == 1 || cols <= 1) && (rows <= 1 || s0 >= std::max<int64_t>(cols, 1)))
    return {x, trans, rows <= 1 ? std::max<int64_t>(cols, 1) : s0};
  // A transpose() view of a row-major matrix: hand over the storage and flip.
  if ((s0 == 1 || rows <= 1) && (cols <= 1 || s1 >= std::max<int64_t>(rows, 1)))
    return {x, !trans, cols <= 1 ? std::max<int64_t>(rows, 1) : s1};
  return {x.contiguous(), trans, std::max<int64_t>(cols, 1)};
}

void check_matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a, bool trans_b,
                  int batch_dims, const char* op) {
  check_operand(a, op, "a");
  check_operand(b, op, "b");
  check_operand(out, op, "out");
  const int nd = 2 + batch_dims;
  for (const Tensor* t : {&a, &b, &out}) {
    if (t->dim() != nd)
      throw InvalidArgument(op, fmt::format("operand of shape {} is {}-d", shape_to_string(t->shape()), t->dim()),
                            fmt::format("{} takes {}-d tensors", op, nd));
  }
  const DType in = a.dtype(), o = out.dtype();
  const bool full = (in == DType::f32 || in == DType::f64) && o == in;
  const bool half = is_half(in) && (o == DType::f32 || o == in);
  if (b.dtype() != in || !(full || half))
    throw InvalidArgument(op, fmt::format("dtypes a {}, b {}, out {}", dtype_name(in), dtype_name(b.dtype()),
                                          dtype_name(o)),
                          "use all f32, all f64, or bf16/f16 a and b (one dtype) with an f32 out or one of "
                          "their dtype");
  const int64_t m = trans_a ? a.size(-1) : a.size(-2);
  const int64_t ka = trans_a ? a.size(-2) : a.size(-1);
  const int64_t kb = trans_b ? b.size(-1) : b.size(-2);
  const int64_t n = trans_b ? b.size(-2) : b.size(-1);
  const bool batch_ok = batch_dims == 0 || (a.size(0) == b.size(0) && a.size(0) == out.size(0));
  if (ka != kb || out.size(-2) != m || out.size(-1) != n || !batch_ok)
    throw InvalidArgument(op,
                          fmt::format("a {}{} @ b {}{} does not give out {}", shape_to_string(a.shape()),
                                      trans_a ? "^T" : "", shape_to_string(b.shape()), trans_b ? "^T" : "",
                                      shape_to_string(out.shape())),
                          "need op(a) (M, K), op(b) (K, N), out (M, N), and equal batch sizes");
  if (may_overlap(out, a) || may_overlap(out, b))
    throw InvalidArgument(op, "out overlaps an input", "write the product to a separate tensor");
}

void blas_gemm(const GemmOperand& pa, const GemmOperand& pb, const Tensor& c, int64_t m, int64_t n, int64_t k,
               int64_t ldc, double alpha, double beta) {
  constexpr int64_t kMax = std::numeric_limits<blasint>::max();
  for (int64_t v : {m, n, k, pa.ld, pb.ld, ldc}) {
    if (v > kMax)
      throw InvalidArgument("matmul", fmt::format("size or leading dimension {} exceeds BLAS's {}", v, kMax),
                            "split the product into smaller blocks");
  }
  const auto ta = pa.trans ? CblasTrans : CblasNoTrans;
  const auto tb = pb.trans ? CblasTrans : CblasNoTrans;
  const auto bm = static_cast<blasint>(m), bn = static_cast<blasint>(n), bk = static_cast<blasint>(k);
  if (c.dtype() == DType::f32) {
    cblas_sgemm(CblasRowMajor, ta, tb, bm, bn, bk, static_cast<float>(alpha),
                static_cast<const float*>(pa.t.data_ptr()), static_cast<blasint>(pa.ld),
                static_cast<const float*>(pb.t.data_ptr()), static_cast<blasint>(pb.ld),
                static_cast<float>(beta), static_cast<float*>(c.data_ptr()), static_cast<blasint>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, bm, bn, bk, alpha, static_cast<const double*>(pa.t.data_ptr()),
                static_cast<blasint>(pa.ld), static_cast<const double*>(pb.t.data_ptr()),
                static_cast<blasint>(pb.ld), beta, static_cast<double*>(c.data_ptr()),
                static_cast<blasint>(ldc));
  }
}

void matmul_2d(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a, bool trans_b,
               double alpha, double beta);

// One call of a deterministic product: c (m, n) = alpha * op(a) @ op(b) +
// beta * c, f32, on the fixed backend (oneDNN when built) with one thread.
void fixed_gemm(const float* a, int64_t lda, bool trans_a, const float* b, int64_t ldb, bool trans_b, float* c,
                int64_t ldc, int64_t m, int64_t n, int64_t k, float beta, float alpha = 1.0f) {
  if (internal::onednn_built()) {
    const internal::GemmCall g{.in = DType::f32, .out = DType::f32, .m = m, .n = n, .k = k, .a = a, .lda = lda,
                               .trans_a = trans_a, .b = b, .ldb = ldb, .trans_b = trans_b, .c = c, .ldc = ldc,
                               .alpha = alpha, .beta = beta};
    if (internal::onednn_gemm(g, 1)) return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}


// The workspace of widened_gemm: per thread, reused, outside every
// MemoryTracker (like oneDNN's scratchpad and OpenBLAS's packing buffers),
// so a CPU without half-precision kernels charges what one with them does.
struct WidenWorkspace {
  std::vector<float> a, b, c;
};
thread_local WidenWorkspace t_widen;

// Widens rows [r0, r0 + rows) x columns [c0, c0 + cols) of a row-major half
// matrix (leading dim ld) into dst (rows, cols) f32, row-major (exact).
void widen_block(DType t, const void* src, int64_t ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                 float* dst) {
  const auto* p = static_cast<const uint16_t*>(src);
  parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* row = p + (r0 + r) * ld + c0;
      if (t == DType::bf16) internal::bf16_to_f32(row, dst + r * cols, static_cast<size_t>(cols));
      else internal::f16_to_f32(row, dst + r * cols, static_cast<size_t>(cols));
    }
  });
}

// Half-precision operands where no library has a half kernel for this CPU
// (bf16 below AVX-512 in oneDNN 2.x, f16 below AVX512-FP16): the operands
// widened to f32 (exact) in blocks and the f32 GEMM run on each block, so the
// products and the f32 accumulation are a half kernel's and the extra memory
// is bounded: kWidenBlockBytes of widened op(a) rows (at least 64 rows),
// kWidenBlockCols columns of op(b) (each with all of k) and, for a half
// out, one f32 block of out. Every output element is still one GEMM's full
// sum over k.
constexpr int64_t kWidenBlockCols = 512;
constexpr int64_t kWidenBlockBytes = int64_t{4} << 20;  // of widened op(a) rows

void widened_gemm(const GemmOperand& pa, const GemmOperand& pb, const Tensor& c, int64_t m, int64_t n, int64_t k,
                  double alpha, double beta) {
  const DType t = pa.t.dtype();
  const int64_t mb = std::min(m, std::max<int64_t>(64, kWidenBlockBytes / (4 * k)));
  const int64_t nb = std::min(kWidenBlockCols, n);
  WidenWorkspace& w = t_widen;
  w.a.resize(static_cast<size_t>(mb * k));
  w.b.resize(static_cast<size_t>(k * nb));
  const bool half_out = c.dtype() != DType::f32;
  if (half_out) w.c.resize(static_cast<size_t>(mb * nb));
  for (int64_t j0 = 0; j0 < n; j0 += nb) {
    const int64_t cols = std::min(nb, n - j0);
    // op(b)[:, j0:j0+cols]: stored (k, n) rows, or (n, k) when transposed.
    if (pb.trans) widen_block(t, pb.t.data_ptr(), pb.ld, j0, 0, cols, k, w.b.data());
    else widen_block(t, pb.t.data_ptr(), pb.ld, 0, j0, k, cols, w.b.data());
    const Tensor b32 = pb.trans ? Tensor::from_blob(w.b.data(), {cols, k}, DType::f32)
                                : Tensor::from_blob(w.b.data(), {k, cols}, DType::f32);
    for (int64_t i0 = 0; i0 < m; i0 += mb) {
      const int64_t rows = std::min(mb, m - i0);
      // op(a)[i0:i0+rows, :]: stored (m, k) rows, or (k, m) when transposed.
      if (pa.trans) widen_block(t, pa.t.data_ptr(), pa.ld, 0, i0, k, rows, w.a.data());
      else widen_block(t, pa.t.data_ptr(), pa.ld, i0, 0, rows, k, w.a.data());
      const Tensor a32 = pa.trans ? Tensor::from_blob(w.a.data(), {k, rows}, DType::f32)
                                  : Tensor::from_blob(w.a.data(), {rows, k}, DType::f32);
      const Tensor out = c.narrow(0, i0, rows).narrow(1, j0, cols);
      if (!half_out) {
        matmul_2d(a32, b32, out, pa.trans, pb.trans, alpha, beta);
        continue;
      }
      // A half out: accumulate in f32, round once.
      const Tensor c32 = Tensor::from_blob(w.c.data(), {rows, cols}, DType::f32);
      if (beta != 0.0) c32.copy_from(out);
      matmul_2d(a32, b32, c32, pa.trans, pb.trans, alpha, beta);
      out.copy_from(c32);
    }
  }
}

// One product's operands as the backends take them.
struct GemmRun {
  const GemmOperand& pa;
  const GemmOperand& pb;
  int64_t m, n, k;
  double alpha, beta;
};

MatmulBackend backend_for(const GemmRun& r, DType out);

// Runs r into c (leading dim ldc) on `b`. Half-precision operands that b has
// no kernel for (OpenBLAS never; oneDNN without AVX512-BF16/FP16) are
// widened (widened_gemm) and their f32 blocks run on b too, so a shape runs
// as it was measured (the fixed policy's blocks excepted).
void run_on(MatmulBackend b, const GemmRun& r, const Tensor& c, int64_t ldc) {
  const DType in = r.pa.t.dtype();
  if (b == MatmulBackend::onednn && in != DType::f64) {
    const internal::GemmCall g{.in = in, .out = c.dtype(), .m = r.m, .n = r.n, .k = r.k,
                               .a = r.pa.t.data_ptr(), .lda = r.pa.ld, .trans_a = r.pa.trans,
                               .b = r.pb.t.data_ptr(), .ldb = r.pb.ld, .trans_b = r.pb.trans,
                               .c = c.data_ptr(), .ldc = ldc,
                               .alpha = static_cast<float>(r.alpha), .beta = static_cast<float>(r.beta)};
    if (internal::onednn_gemm(g, g_threads.load(std::memory_order_relaxed))) return;
  }
  if (!is_half(in)) return blas_gemm(r.pa, r.pb, c, r.m, r.n, r.k, ldc, r.alpha, r.beta);
  // The fixed policy routes each f32 block by its own layout, as before
  // there was a choice (so its results are those of that rule).
  const int previous = t_backend;
  if (previous >= 0 || gemm_policy() != GemmPolicy::fixed) t_backend = static_cast<int>(b);
  try {
    widened_gemm(r.pa, r.pb, c, r.m, r.n, r.k, r.alpha, r.beta);
  } catch (...) {
    t_backend = previous;
    throw;
  }
  t_backend = previous;
}

void matmul_2d(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a, bool trans_b,
               double alpha, double beta) {
  const int64_t m = out.size(0), n = out.size(1);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // the product is empty: out = beta * out
    if (beta == 0.0) out.fill(0.0);
    else scale(out, beta);
    return;
  }
  const GemmOperand pa = as_gemm(a, trans_a);
  const GemmOperand pb = as_gemm(b, trans_b);
  const bool out_direct = out.stride(1) == 1 && (m <= 1 || out.stride(0) >= n);
  Tensor c = out_direct ? out : (beta == 0.0 ? Tensor::empty(out.shape(), out.dtype()) : out.contiguous());
  const int64_t ldc = m <= 1 ? n : c.stride(0);
  if (t_deterministic && a.dtype() == DType::f32 && c.dtype() == DType::f32) {
    fixed_gemm(pa.t.data<float>(), pa.ld, pa.trans, pb.t.data<float>(), pb.ld, pb.trans, c.data<float>(), ldc, m, n,
               k, static_cast<float>(beta), static_cast<float>(alpha));
  } else {
    const GemmRun run{.pa = pa, .pb = pb, .m = m, .n = n, .k = k, .alpha = alpha, .beta = beta};
    run_on(backend_for(run, c.dtype()), run, c, ldc);
  }
  if (!out_direct) out.copy_from(c);
}

// The backend of a product: the calling thread's MatmulBackendScope, else
// the policy's choice (internal/gemm_choice.h), measured on scratch output
// the first time the process meets the shape.
MatmulBackend backend_for(const GemmRun& r, DType out) {
  if (t_backend >= 0) return static_cast<MatmulBackend>(t_backend);
  const DType in = r.pa.t.dtype();
  if (in == DType::f64) return MatmulBackend::openblas;
  const internal::GemmKey key{.in = in, .out = out, .m = r.m, .n = r.n, .k = r.k, .trans_a = r.pa.trans,
                              .trans_b = r.pb.trans, .threads = blas_threads()};
  // Scratch output outside every MemoryTracker, zeroed (first touch and
  // finite values for beta != 0) before the first clock starts.
  std::vector<double> scratch;
  return internal::gemm_backend_for(key, internal::onednn_built(), [&](MatmulBackend b) {
    if (scratch.empty()) scratch.assign((static_cast<size_t>(r.m * r.n) * dtype_size(out) + 7) / 8, 0.0);
    const Tensor c = Tensor::from_blob(scratch.data(), {r.m, r.n}, out);
    const auto t0 = std::chrono::steady_clock::now();
    run_on(b, r, c, r.n);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
}

}  // namespace

void set_blas_threads(int n) {
  if (n < 1)
    throw InvalidArgument("set_blas_threads", fmt::format("thread count {}", n), "use n >= 1");
  openblas_set_num_threads(n);
  g_threads.store(n, std::memory_order_relaxed);
}

int blas_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : openblas_get_num_threads();
}

MatmulBackend matmul_backend() {
  if (t_backend >= 0) return static_cast<MatmulBackend>(t_backend);
  if (gemm_policy() == GemmPolicy::openblas || !internal::onednn_built()) return MatmulBackend::openblas;
  return MatmulBackend::onednn;
}

std::string_view matmul_backend_name(MatmulBackend b) { return b == MatmulBackend::onednn ? "onednn" : "openblas"; }

bool matmul_backend_available(MatmulBackend b) { return b == MatmulBackend::openblas || internal::onednn_built(); }

std::string matmul_backend_description(MatmulBackend b) {
  if (b == MatmulBackend::onednn) return internal::onednn_built() ? internal::onednn_description() : "oneDNN (not built)";
  return fmt::format("OpenBLAS ({})", openblas_get_config());
}

bool native_gemm_dtype(DType t) {
  if (t == DType::f32 || t == DType::f64) return true;
  return t == DType::bf16 && cpu_isa() >= CpuIsa::avx512_bf16 && internal::onednn_built();
}

std::string gemm_dtype_note(DType t) {
  if (native_gemm_dtype(t)) return "";
  if (t == DType::bf16) {
    const bool onednn = internal::onednn_built();
    const std::string why = cpu_isa() < CpuIsa::avx512_bf16
                                ? fmt::format("this CPU ({}) has no bf16 instructions (AVX512-BF16 or AMX)",
                                              cpu_isa_name(cpu_isa()))
                                : std::string("this build has no oneDNN");
    return fmt::format("bf16 products: {}, so their operands are {} and multiplied in f32, and a bf16 step is "
                       "slower than fp32 here; parameters, gradients and their communication still take half the "
                       "bytes",
                       why, onednn && cpu_isa() >= CpuIsa::avx512 ? "converted by oneDNN's emulation"
                                                                   : "widened to f32 block by block");
  }
  if (t != DType::f16) return "";  // integer dtypes have no products here
  return fmt::format("fp16 products: this CPU ({}) has no fp16 instructions (AVX512-FP16), so their operands are "
                     "widened to f32 block by block and multiplied in f32, and an fp16 step is no faster than fp32 "
                     "here; parameters, gradients and their communication still take half the bytes",
                     cpu_isa_name(cpu_isa()));
}

MatmulBackendScope::MatmulBackendScope(MatmulBackend b) : previous_(t_backend) {
  if (!matmul_backend_available(b))
    throw Unsupported("MatmulBackendScope", "this build has no oneDNN",
                      "install libdnnl-dev (scripts/install-deps.sh) and reconfigure");
  t_backend = static_cast<int>(b);
}

MatmulBackendScope::~MatmulBackendScope() { t_backend = previous_; }

void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a, bool trans_b, double alpha,
            double beta) {
  check_matmul(a, b, out, trans_a, trans_b, 0, "matmul");
  matmul_2d(a, b, out, trans_a, trans_b, alpha, beta);
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  check_operand(a, "matmul", "a");
  check_operand(b, "matmul", "b");
  if (a.dim() != 2 || b.dim() != 2)
    throw InvalidArgument("matmul", fmt::format("a {} and b {} must be 2-d", shape_to_string(a.shape()),
                                                shape_to_string(b.shape())),
                          "use batched_matmul for 3-d operands");
  Tensor out = Tensor::empty({a.size(0), b.size(1)}, is_half(a.dtype()) ? DType::f32 : a.dtype());
  matmul(a, b, out);
  return out;
}

void batched_matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a, bool trans_b,
                    double alpha, double beta) {
  check_matmul(a, b, out, trans_a, trans_b, 1, "batched_matmul");
  for (int64_t i = 0; i < out.size(0); ++i)
    matmul_2d(a.select(0, i), b.select(0, i), out.select(0, i), trans_a, trans_b, alpha, beta);
}

// ---- Deterministic products ----

namespace {

// Runs fn(i) for i in [0, count) over the rank's threads (one after another
// without oneDNN: OpenBLAS's own threads serve each call), rethrowing the
// first error.
template <typename Fn>
void for_each_block(int64_t count, Fn&& fn) {
  std::exception_ptr error;
  std::mutex mu;
  auto run = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
      }
    }
  };
  if (internal::onednn_built())
    parallel_for(count, 1, run);
  else
    run(0, count);
  if (error) std::rethrow_exception(error);
}

void check_fixed(const Tensor& t, const char* op, const char* what) {
  check_operand(t, op, what);
  if (t.dtype() != DType::f32 || t.dim() != 2 || !t.is_contiguous())
    throw InvalidArgument(op, fmt::format("{} is {} {}", what, dtype_name(t.dtype()), shape_to_string(t.shape())),
                          "deterministic products take contiguous 2-d f32 tensors");
}

}  // namespace

void set_deterministic_products(bool on) { t_deterministic = on; }

bool deterministic_products() { return t_deterministic; }

void matmul_fixed_blocks(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_b, double beta,
                         int64_t row_block) {
  const char* op = "matmul_fixed_blocks";
  check_fixed(a, op, "a");
  check_fixed(b, op, "b");
  check_fixed(out, op, "out");
  check_matmul(a, b, out, false, trans_b, 0, op);
  if (row_block < 1) throw InvalidArgument(op, fmt::format("row_block {}", row_block), "use row_block >= 1");
  const int64_t m = out.size(0), n = out.size(1), k = a.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0) out.fill(0.0);
    else scale(out, beta);
    return;
  }
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  const int64_t col_blocks = (n + kFixedColumns - 1) / kFixedColumns;
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* pc = out.data<float>();
  const int64_t ldb = b.size(1);
  for_each_block(row_blocks * col_blocks, [&](int64_t i) {
    const int64_t r0 = (i / col_blocks) * row_block, c0 = (i % col_blocks) * kFixedColumns;
    const int64_t rows = std::min(row_block, m - r0), cols = std::min(kFixedColumns, n - c0);
    fixed_gemm(pa + r0 * k, k, false, trans_b ? pb + c0 * ldb : pb + c0, ldb, trans_b, pc + r0 * n + c0, n, rows,
               cols, k, static_cast<float>(beta));
  });
}

void matmul_tn_tree(const Tensor& a, const Tensor& b, const Tensor& out, int64_t row_block) {
  const char* op = "matmul_tn_tree";
  check_fixed(a, op, "a");
  check_fixed(b, op, "b");
  check_fixed(out, op, "out");
  check_matmul(a, b, out, true, false, 0, op);
  const int64_t r = a.size(0), m = out.size(0), n = out.size(1);
  if (row_block < 1 || r % row_block != 0)
    throw InvalidArgument(op, fmt::format("{} rows in blocks of {}", r, row_block),
                          "the rows must be a whole number of blocks");
  if (r == 0 || m == 0 || n == 0) return;
  constexpr int64_t kTileRows = 128;
  const int64_t blocks = r / row_block;
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (n + kFixedColumns - 1) / kFixedColumns;
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* pc = out.data<float>();
  for_each_block(row_tiles * col_tiles, [&](int64_t t) {
    const int64_t i0 = (t / col_tiles) * kTileRows, j0 = (t % col_tiles) * kFixedColumns;
    const int64_t rows = std::min(kTileRows, m - i0), cols = std::min(kFixedColumns, n - j0);
    TreeStack sum(blocks, rows * cols);
    for (int64_t l = 0; l < blocks; ++l) {
      const int64_t first = l * row_block;
      fixed_gemm(pa + first * m + i0, m, true, pb + first * n + j0, n, false, sum.next(), cols, rows, cols,
                 row_block, 0.0f);
      sum.push();
    }
    const float* s = sum.result();
    for (int64_t i = 0; i < rows; ++i) {
      float* dst = pc + (i0 + i) * n + j0;
      const float* src = s + i * cols;
      for (int64_t j = 0; j < cols; ++j) dst[j] += src[j];
    }
  });
}

}  // namespace meshtrain
