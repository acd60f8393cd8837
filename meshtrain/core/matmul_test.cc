// matmul on each backend this build has (oneDNN, OpenBLAS) against a
// double-precision reference: every transpose, alpha/beta, strided views,
// f32/f64, half-precision operands against the reference on the rounded
// operands; concurrent calls from several threads; the thread policy; the
// primitive cache. (ops_test.cc checks the exact small-integer cases.)
#include "meshtrain/core/matmul.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/onednn_gemm.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/random.h"

namespace meshtrain {
namespace {

std::vector<MatmulBackend> backends() {
  std::vector<MatmulBackend> out{MatmulBackend::openblas};
  if (matmul_backend_available(MatmulBackend::onednn)) out.push_back(MatmulBackend::onednn);
  return out;
}

const char* name(MatmulBackend b) { return b == MatmulBackend::onednn ? "onednn" : "openblas"; }

// U(-1, 1) values of `dtype` (rounded from f32 for bf16/f16).
Tensor random_matrix(int64_t r, int64_t c, DType dtype, uint64_t key) {
  Tensor t = Tensor::empty({r, c}, DType::f32);
  fill_uniform(t, 7, key, -1.0, 1.0);
  return t.to(dtype);
}

// (r, c) with the values of `src`, laid out as asked.
enum class Layout { contiguous, narrowed, transposed, strided };
Tensor in_layout(const Tensor& src, Layout layout) {
  const int64_t r = src.size(0), c = src.size(1);
  switch (layout) {
    case Layout::contiguous: return src;
    case Layout::narrowed: {  // leading dim c + 3
      Tensor v = Tensor::full({r, c + 3}, 77.0, src.dtype()).narrow(1, 2, c);
      v.copy_from(src);
      return v;
    }
    case Layout::transposed: {  // column-major storage
      Tensor t = Tensor::empty({c, r}, src.dtype());
      t.copy_from(src.transpose(0, 1));
      return t.transpose(0, 1);
    }
    case Layout::strided: {  // no unit stride: copied to contiguous first
      Tensor v = Tensor::full({r, c, 2}, 77.0, src.dtype()).select(2, 0);
      v.copy_from(src);
      return v;
    }
  }
  return src;
}

// ref = alpha op(a) op(b) + beta c0 in double, and the sum of |terms| per
// element (the scale of the rounding error).
struct Reference {
  std::vector<double> value, magnitude;
};
Reference reference(const Tensor& a, const Tensor& b, const Tensor& c0, bool ta, bool tb, double alpha,
                    double beta) {
  const std::vector<double> va = a.contiguous().to_vector(), vb = b.contiguous().to_vector();
  const std::vector<double> vc = c0.to_vector();
  const int64_t m = c0.size(0), n = c0.size(1), k = ta ? a.size(0) : a.size(1);
  const int64_t acols = a.size(1), bcols = b.size(1);
  Reference r;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = ta ? va[static_cast<size_t>(p * acols + i)] : va[static_cast<size_t>(i * acols + p)];
        const double y = tb ? vb[static_cast<size_t>(j * bcols + p)] : vb[static_cast<size_t>(p * bcols + j)];
        acc += x * y;
        mag += std::fabs(x * y);
      }
      const double c = beta != 0.0 ? vc[static_cast<size_t>(i * n + j)] : 0.0;
      r.value.push_back(alpha * acc + beta * c);
      r.magnitude.push_back(std::fabs(alpha) * mag + std::fabs(beta * c));
    }
  return r;
}

// |got - ref| <= k * accumulate_eps * magnitude (the classical GEMM bound,
// products exact) plus out_eps * |ref| (rounding to out's dtype).
void expect_close(const Tensor& got, const Reference& ref, int64_t k, double accumulate_eps, double out_eps,
                  const std::string& what) {
  const std::vector<double> g = got.to_vector();
  ASSERT_EQ(g.size(), ref.value.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    const double tol = static_cast<double>(k + 2) * accumulate_eps * ref.magnitude[i] +
                       out_eps * std::fabs(ref.value[i]) + 1e-300;
    ASSERT_NEAR(g[i], ref.value[i], tol) << what << " element " << i;
  }
}

struct Case {
  MatmulBackend backend;
  DType in, out;
};

class MatmulBackendTest : public ::testing::TestWithParam<Case> {};

TEST_P(MatmulBackendTest, EveryTransposeAlphaBetaAndLayoutMatchesDoubleReference) {
  const auto [backend, in, out] = GetParam();
  MatmulBackendScope scope(backend);
  const double f32_eps = 0x1p-24, f64_eps = 0x1p-53;
  const double acc_eps = in == DType::f64 ? f64_eps : f32_eps;  // half operands accumulate in f32
  const double out_eps = out == DType::bf16 ? 0x1p-8 : out == DType::f16 ? 0x1p-11 : 0.0;
  struct Shape {
    int64_t m, k, n;
  };
  for (const Shape s : {Shape{1, 1, 1}, Shape{7, 13, 5}, Shape{1, 40, 33}, Shape{65, 3, 1}, Shape{48, 96, 40}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (Layout layout : {Layout::contiguous, Layout::narrowed, Layout::transposed, Layout::strided})
          for (const auto& [alpha, beta] : {std::pair{1.0, 0.0}, {1.0, 1.0}, {0.5, 0.0}, {-2.0, 0.25}}) {
            const Tensor a0 = ta ? random_matrix(s.k, s.m, in, 1) : random_matrix(s.m, s.k, in, 1);
            const Tensor b0 = tb ? random_matrix(s.n, s.k, in, 2) : random_matrix(s.k, s.n, in, 2);
            const Tensor a = in_layout(a0, layout), b = in_layout(b0, layout);
            const Tensor c0 = random_matrix(s.m, s.n, out, 3);
            const Reference ref = reference(a0, b0, c0, ta, tb, alpha, beta);
            const std::string what =
                fmt::format("{} {} -> {} ({}, {}, {}) {}{} layout {} alpha {} beta {}", name(backend),
                            dtype_name(in), dtype_name(out), s.m, s.k, s.n, ta ? "T" : "N", tb ? "T" : "N",
                            static_cast<int>(layout), alpha, beta);
            // Into a contiguous out (NaN when beta = 0: must not leak in).
            Tensor c = c0.clone();
            if (beta == 0.0) c.fill(std::numeric_limits<double>::quiet_NaN());
            matmul(a, b, c, ta, tb, alpha, beta);
            expect_close(c, ref, s.k, acc_eps, out_eps, what);
            // Into a narrowed out; the columns around it stay.
            Tensor wide = Tensor::full({s.m, s.n + 2}, 5.0, out);
            Tensor cv = wide.narrow(1, 1, s.n);
            cv.copy_from(c0);
            matmul(a, b, cv, ta, tb, alpha, beta);
            expect_close(cv, ref, s.k, acc_eps, out_eps, what + " narrowed out");
            EXPECT_EQ(wide.select(1, 0).to_vector(), std::vector<double>(static_cast<size_t>(s.m), 5.0)) << what;
            EXPECT_EQ(wide.select(1, s.n + 1).to_vector(), std::vector<double>(static_cast<size_t>(s.m), 5.0))
                << what;
          }
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (MatmulBackend b : backends()) {
    out.push_back({b, DType::f32, DType::f32});
    out.push_back({b, DType::f64, DType::f64});
    for (DType h : {DType::bf16, DType::f16}) {
      out.push_back({b, h, DType::f32});
      out.push_back({b, h, h});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(BackendsAndDTypes, MatmulBackendTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return fmt::format("{}_{}_to_{}", name(i.param.backend), dtype_name(i.param.in),
                                              dtype_name(i.param.out));
                         });

// A bf16 GEMM equals the f32 GEMM of the rounded operands up to f32
// accumulation order: the rounded-operand reference the old emulation computed.
TEST(MatmulHalfTest, Bf16MatchesF32GemmOfRoundedOperands) {
  const Tensor a = random_matrix(256, 784, DType::f32, 11), b = random_matrix(784, 512, DType::f32, 12);
  const Tensor ab = a.to(DType::bf16), bb = b.to(DType::bf16);
  Tensor want = Tensor::empty({256, 512}, DType::f32), got = Tensor::empty({256, 512}, DType::f32);
  {
    MatmulBackendScope scope(MatmulBackend::openblas);
    matmul(ab.to(DType::f32), bb.to(DType::f32), want);
  }
  matmul(ab, bb, got);
  const std::vector<double> w = want.to_vector(), g = got.to_vector();
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, std::fabs(w[i] - g[i]));
  EXPECT_LT(worst, 1e-4);  // |terms| sum to ~200: f32 accumulation differences only
  EXPECT_EQ(matmul(ab, bb).dtype(), DType::f32);
}

// Half operands no library has a kernel for here (f16 below AVX512-FP16,
// bf16 below AVX-512: MESHTRAIN_CPU_ISA=avx2) are widened block by block:
// two row blocks of op(a) (k = 9000: 116 rows each) and two column blocks of
// op(b) (512), every transpose, an f32 out with beta and a half out. The
// operands are small integers, so every partial sum is exact in f32 and the
// result must equal the exact product: an element taken from a wrong row,
// column or block cannot hide in a rounding tolerance. And no byte is
// charged beyond the operands and the outs.
TEST(MatmulHalfTest, WidenedBlocksCoverEveryTransposeAndChargeNothing) {
  const int64_t m = 150, k = 9000, n = 600;
  auto integers = [](int64_t r, int64_t c, uint64_t key) {  // in [-4, 4]
    std::vector<double> v = random_matrix(r, c, DType::f32, key).to_vector();
    for (double& e : v) e = std::round(4 * e);
    return Tensor::from_vector(v, {r, c}, DType::f32);
  };
  const Tensor a32 = integers(m, k, 21), b32 = integers(k, n, 22);
  // One GEMM thread: OpenBLAS's own pool synchronizes where ThreadSanitizer
  // cannot see it (the tsan preset).
  const int threads = blas_threads();
  set_blas_threads(1);
  std::vector<double> want = matmul(a32.to(DType::f64), b32.to(DType::f64)).to_vector();
  for (double& w : want) w += 0.5 * 0.25;  // beta 0.5 onto 0.25
  for (DType half : {DType::f16, DType::bf16}) {
    const std::vector<double> want_half = Tensor::from_vector(want, {m, n}, DType::f32).to(half).to_vector();
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const std::string what = fmt::format("{} trans_a {} trans_b {}", dtype_name(half), ta, tb);
      MemoryTracker tracker;
      auto tracked = [&](const Tensor& v, bool trans) {
        const Tensor stored = trans ? v.transpose(0, 1) : v;
        Tensor out = Tensor::empty(stored.shape(), half, Device{}, &tracker, MemoryCategory::activations);
        out.copy_from(stored);
        return out;
      };
      const Tensor a = tracked(a32, ta), b = tracked(b32, tb);
      Tensor out = Tensor::full({m, n}, 0.25, DType::f32, Device{}, &tracker, MemoryCategory::activations);
      Tensor out_half = Tensor::full({m, n}, 0.25, half, Device{}, &tracker, MemoryCategory::activations);
      const uint64_t charged = tracker.total_in_use();
      matmul(ta ? a.transpose(0, 1) : a, tb ? b.transpose(0, 1) : b, out, false, false, 1.0, 0.5);  // views
      matmul(a, b, out_half, ta, tb, 1.0, 0.5);                                                   // flags
      EXPECT_EQ(tracker.total_peak(), charged) << what;
      EXPECT_EQ(out.to_vector(), want) << what;
      EXPECT_EQ(out_half.to_vector(), want_half) << what << ", half out";
    }
  }
  set_blas_threads(threads);
}

TEST(MatmulHalfTest, TheNoteSaysWhenHalfPrecisionIsSlowerHere) {
  // Native: f32 and f64 always, bf16 with AVX512-BF16 (or AMX) and oneDNN,
  // fp16 never; MESHTRAIN_CPU_ISA=avx2 (make test-avx2) takes the other branch.
  EXPECT_EQ(gemm_dtype_note(DType::f32), "");
  EXPECT_EQ(gemm_dtype_note(DType::f64), "");
  EXPECT_EQ(gemm_dtype_note(DType::i32), "");
  const bool bf16 = cpu_isa() >= CpuIsa::avx512_bf16 && internal::onednn_built();
  EXPECT_EQ(native_gemm_dtype(DType::bf16), bf16);
  if (bf16) {
    EXPECT_EQ(gemm_dtype_note(DType::bf16), "");
  } else {
    EXPECT_NE(gemm_dtype_note(DType::bf16).find("a bf16 step is slower than fp32 here"), std::string::npos);
    EXPECT_NE(gemm_dtype_note(DType::bf16).find(std::string(cpu_isa_name(cpu_isa()))), std::string::npos);
  }
  EXPECT_FALSE(native_gemm_dtype(DType::f16));
  EXPECT_NE(gemm_dtype_note(DType::f16).find("no faster than fp32"), std::string::npos);
}

TEST(MatmulHalfTest, RejectsMixedOperandsAndWrongOut) {
  const Tensor a = random_matrix(4, 3, DType::bf16, 1), b = random_matrix(3, 5, DType::bf16, 2);
  EXPECT_THROW(matmul(a, b, Tensor::zeros({4, 5}, DType::f64)), InvalidArgument);
  EXPECT_THROW(matmul(a, b, Tensor::zeros({4, 5}, DType::f16)), InvalidArgument);
  EXPECT_THROW(matmul(a, b.to(DType::f16), Tensor::zeros({4, 5}, DType::f32)), InvalidArgument);
  try {
    matmul(a, b.to(DType::f32), Tensor::zeros({4, 5}, DType::f32));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "matmul");
    EXPECT_NE(e.detail().find("bf16"), std::string::npos) << e.what();
  }
}

// Ranks as threads: several threads multiply different shapes and dtypes at
// once, each against its own single-threaded reference result.
TEST(MatmulConcurrencyTest, ThreadsCallingOnDifferentShapesAgree) {
  const int before = blas_threads();
  set_blas_threads(1);
  struct Job {
    int64_t m, k, n;
    DType in;
    bool ta, tb;
  };
  const std::vector<Job> jobs = {{64, 96, 80, DType::f32, false, false}, {33, 17, 129, DType::bf16, false, true},
                                 {128, 64, 48, DType::f32, true, false}, {5, 300, 7, DType::bf16, true, true},
                                 {96, 96, 96, DType::f64, false, true},   {40, 70, 20, DType::f16, false, false}};
  std::vector<Tensor> as, bs, wants;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    as.push_back(j.ta ? random_matrix(j.k, j.m, j.in, 20 + i) : random_matrix(j.m, j.k, j.in, 20 + i));
    bs.push_back(j.tb ? random_matrix(j.n, j.k, j.in, 40 + i) : random_matrix(j.k, j.n, j.in, 40 + i));
    const DType out = j.in == DType::f64 ? DType::f64 : DType::f32;
    wants.push_back(Tensor::empty({j.m, j.n}, out));
    matmul(as[i], bs[i], wants[i], j.ta, j.tb, 0.5, 0.0);
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < 4 * jobs.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 20; ++rep) {
        const size_t i = (t + static_cast<size_t>(rep)) % jobs.size();
        const Job& j = jobs[i];
        Tensor c = Tensor::full(wants[i].shape(), 3.0, wants[i].dtype());
        matmul(as[i], bs[i], c, j.ta, j.tb, 0.5, 0.0);
        if (c.to_vector() != wants[i].to_vector()) ++mismatches;  // same shape, same kernel: bit for bit
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  set_blas_threads(before);
}

// set_blas_threads governs oneDNN on every thread, including threads started
// before the call (a rank thread applies it at its next matmul).
TEST(MatmulThreadsTest, EveryThreadUsesTheLatestCount) {
  if (!matmul_backend_available(MatmulBackend::onednn)) GTEST_SKIP() << "no oneDNN in this build";
  const int before = blas_threads();
  const Tensor a = random_matrix(8, 8, DType::f32, 1);
  for (int n : {1, 2, 1}) {
    set_blas_threads(n);
    int seen = -1;
    std::thread([&] {
      Tensor c = matmul(a, a);
      seen = internal::onednn_threads_here(0);
    }).join();
    EXPECT_EQ(seen, n);
    matmul(a, a);
    EXPECT_EQ(internal::onednn_threads_here(0), n);
  }
  EXPECT_THROW(set_blas_threads(0), InvalidArgument);
  set_blas_threads(before);
}

TEST(MatmulCacheTest, OnePrimitivePerShapeAndAlphaIsRuntime) {
  if (!matmul_backend_available(MatmulBackend::onednn)) GTEST_SKIP() << "no oneDNN in this build";
  MatmulBackendScope scope(MatmulBackend::onednn);
  const Tensor a = random_matrix(31, 29, DType::f32, 1), b = random_matrix(29, 27, DType::f32, 2);
  Tensor c = Tensor::zeros({31, 27}, DType::f32);
  matmul(a, b, c, false, false, 0.5, 0.0);
  const size_t n = internal::onednn_cached_primitives();
  for (double alpha : {0.25, 2.0, -1.0}) matmul(a, b, c, false, false, alpha, 0.0);
  EXPECT_EQ(internal::onednn_cached_primitives(), n);  // any alpha != 1: the same primitive
  matmul(a, b, c, false, false, 1.0, 1.0);
  EXPECT_EQ(internal::onednn_cached_primitives(), n + 1);
  EXPECT_NE(matmul_backend_description(MatmulBackend::onednn).find("oneDNN"), std::string::npos);
  EXPECT_NE(matmul_backend_description(MatmulBackend::openblas).find("OpenBLAS"), std::string::npos);
}

TEST(MatmulBackendScopeTest, OverridesThisThreadOnlyAndNests) {
  const MatmulBackend def = matmul_backend();
  {
    MatmulBackendScope s(MatmulBackend::openblas);
    EXPECT_EQ(matmul_backend(), MatmulBackend::openblas);
    MatmulBackend other = def;
    std::thread([&] { other = matmul_backend(); }).join();
    EXPECT_EQ(other, def);
  }
  EXPECT_EQ(matmul_backend(), def);
  if (!matmul_backend_available(MatmulBackend::onednn)) {
    EXPECT_THROW(MatmulBackendScope(MatmulBackend::onednn), Unsupported);
  }
}

}  // namespace
}  // namespace meshtrain
