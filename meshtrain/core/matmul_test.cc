// matmul on each backend this build has (oneDNN, OpenBLAS) against a
// double-precision reference: every transpose, alpha/beta, strided views,
// f32/f64, half-precision operands against the reference on the rounded
// operands; concurrent calls from several threads; the thread policy; the
// primitive cache. (ops_test.cc checks the exact small-integer cases.)
#include "meshtrain/core/matmul.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/gemm_choice.h"
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
      MatmulBackendScope on(MatmulBackend::onednn);
      Tensor c = matmul(a, a);
      seen = internal::onednn_threads_here(0);
    }).join();
    EXPECT_EQ(seen, n);
    {
      MatmulBackendScope on(MatmulBackend::onednn);
      matmul(a, a);
    }
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

// ---- the backend chosen per shape (MESHTRAIN_GEMM_BACKEND, MESHTRAIN_GEMM_CACHE) ----

// Sets the process's policy for one test and restores auto after it.
struct PolicyScope {
  explicit PolicyScope(GemmPolicy p) { set_gemm_policy(p); }
  ~PolicyScope() { set_gemm_policy(GemmPolicy::automatic); }
};

// The entry of gemm_choices() for (m, n, k, transposes), or nullptr.
const GemmChoice* find_choice(const std::vector<GemmChoice>& all, int64_t m, int64_t n, int64_t k, bool ta,
                              bool tb, DType in = DType::f32) {
  for (const GemmChoice& c : all)
    if (c.m == m && c.n == n && c.k == k && c.trans_a == ta && c.trans_b == tb && c.in == in) return &c;
  return nullptr;
}

// The bits `backend` gives for a @ b (transposes as asked), forced.
std::vector<double> bits_on(MatmulBackend backend, const Tensor& a, const Tensor& b, bool ta, bool tb,
                            int64_t m, int64_t n) {
  MatmulBackendScope scope(backend);
  Tensor c = Tensor::empty({m, n}, DType::f32);
  matmul(a, b, c, ta, tb);
  return c.to_vector();
}

TEST(GemmPolicyTest, NamesParseAndBadOnesSayTheChoices) {
  for (GemmPolicy p : {GemmPolicy::automatic, GemmPolicy::openblas, GemmPolicy::fixed})
    EXPECT_EQ(parse_gemm_policy(gemm_policy_name(p), "X"), p);
  EXPECT_EQ(gemm_policy_name(GemmPolicy::automatic), "auto");
  try {
    parse_gemm_policy("blas", "MESHTRAIN_GEMM_BACKEND");
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("MESHTRAIN_GEMM_BACKEND"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("auto (measure per shape), onednn, openblas or fixed"), std::string::npos)
        << e.what();
  }
  if (!matmul_backend_available(MatmulBackend::onednn)) {
    EXPECT_THROW(parse_gemm_policy("onednn", "X"), InvalidArgument);
    EXPECT_THROW(set_gemm_policy(GemmPolicy::onednn), InvalidArgument);
  }
}

// auto: a new shape is measured once, by one thread, while the others wait;
// every thread then computes it on the same backend (the same bits), the
// faster of the two measured.
TEST(GemmPolicyTest, AutoMeasuresEachShapeOnceAndEveryThreadGetsItsChoice) {
  if (!matmul_backend_available(MatmulBackend::onednn)) GTEST_SKIP() << "no oneDNN in this build";
  PolicyScope auto_policy(GemmPolicy::automatic);
  const int before = blas_threads();
  set_blas_threads(1);
  const int64_t m = 131, k = 67, n = 89;  // a shape no other test uses
  const Tensor a = random_matrix(k, m, DType::f32, 501), b = random_matrix(k, n, DType::f32, 502);
  std::vector<std::vector<double>> got(6);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t)
    threads.emplace_back([&, t] {
      Tensor c = Tensor::empty({m, n}, DType::f32);
      matmul(a, b, c, /*trans_a=*/true, false);
      got[t] = c.to_vector();
    });
  for (auto& th : threads) th.join();
  const std::vector<GemmChoice> all = gemm_choices();
  int entries = 0;
  for (const GemmChoice& c : all) entries += c.m == m && c.n == n && c.k == k && c.trans_a && !c.trans_b;
  EXPECT_EQ(entries, 1);
  const GemmChoice* c = find_choice(all, m, n, k, true, false);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->threads, 1);
  EXPECT_FALSE(c->from_cache);
  ASSERT_GT(c->onednn_seconds, 0);
  ASSERT_GT(c->openblas_seconds, 0);
  EXPECT_EQ(c->backend, c->onednn_seconds <= c->openblas_seconds ? MatmulBackend::onednn : MatmulBackend::openblas);
  const std::vector<double> want = bits_on(c->backend, a, b, true, false, m, n);
  for (const auto& g : got) EXPECT_EQ(g, want);
  // The thread count is part of the shape: 2 threads are measured anew.
  set_blas_threads(2);
  Tensor c2 = Tensor::empty({m, n}, DType::f32);
  matmul(a, b, c2, true, false);
  int per_threads = 0;
  for (const GemmChoice& e : gemm_choices())
    per_threads += e.m == m && e.n == n && e.k == k && e.trans_a && !e.trans_b;
  EXPECT_EQ(per_threads, 2);
  set_blas_threads(before);
}

// Sizes that change from call to call (a mixture of experts' rows per
// expert) share a size class: one measurement serves them all. Classes:
// exact up to 16, then quarter octaves; a model's usual sizes are their own.
TEST(GemmPolicyTest, ShapesOfOneSizeClassShareOneMeasurement) {
  using internal::gemm_size_class;
  EXPECT_EQ(gemm_size_class(1), 1);
  EXPECT_EQ(gemm_size_class(16), 16);
  EXPECT_EQ(gemm_size_class(17), 20);
  EXPECT_EQ(gemm_size_class(33), 40);
  EXPECT_EQ(gemm_size_class(230), 256);
  EXPECT_EQ(gemm_size_class(257), 320);
  for (int64_t d : {64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096}) EXPECT_EQ(gemm_size_class(d), d) << d;
  for (int64_t d = 1; d < 5000; ++d) {
    ASSERT_GE(gemm_size_class(d), d);
    ASSERT_LE(gemm_size_class(d), d + d / 4 + 1) << d;  // at most a quarter octave up
  }
  if (!matmul_backend_available(MatmulBackend::onednn)) GTEST_SKIP() << "no oneDNN in this build";
  PolicyScope auto_policy(GemmPolicy::automatic);
  const int64_t k = 45, n = 53;  // sizes no other test uses
  auto entries = [&] {
    int count = 0;
    for (const GemmChoice& c : gemm_choices()) count += c.n == n && c.k == k && !c.trans_a && !c.trans_b;
    return count;
  };
  const Tensor b = random_matrix(k, n, DType::f32, 531);
  MatmulBackend first = MatmulBackend::openblas;
  for (int64_t m : {230, 241, 256, 233}) {  // one class: 256
    const Tensor a = random_matrix(m, k, DType::f32, 530);
    Tensor c = Tensor::empty({m, n}, DType::f32);
    matmul(a, b, c, false, false);
    const std::vector<GemmChoice> all = gemm_choices();
    const GemmChoice* e = find_choice(all, 230, n, k, false, false);  // the first shape is the one measured
    ASSERT_NE(e, nullptr) << m;
    if (m == 230) first = e->backend;
    EXPECT_EQ(c.to_vector(), bits_on(first, a, b, false, false, m, n)) << m;
  }
  EXPECT_EQ(entries(), 1);
  const GemmChoice* e = find_choice(gemm_choices(), 230, n, k, false, false);
  ASSERT_NE(e, nullptr);
  EXPECT_TRUE(gemm_covers(*e, DType::f32, 249, n, k, false, false, e->threads));
  EXPECT_FALSE(gemm_covers(*e, DType::f32, 300, n, k, false, false, e->threads));
  EXPECT_FALSE(gemm_covers(*e, DType::f32, 249, n, k, true, false, e->threads));
  const Tensor a = random_matrix(300, k, DType::f32, 532);  // class 320: measured anew
  Tensor c = Tensor::empty({300, n}, DType::f32);
  matmul(a, b, c, false, false);
  EXPECT_EQ(entries(), 2);
}

// Forced policies run every shape on their backend; fixed runs f32 weight
// gradients (a^T b) on OpenBLAS and the rest on oneDNN, by the layout.
TEST(GemmPolicyTest, ForcedAndFixedPoliciesRunTheirBackend) {
  if (!matmul_backend_available(MatmulBackend::onednn)) GTEST_SKIP() << "no oneDNN in this build";
  const int64_t m = 37, k = 53, n = 41;
  const Tensor at = random_matrix(k, m, DType::f32, 511), a = random_matrix(m, k, DType::f32, 512);
  const Tensor b = random_matrix(k, n, DType::f32, 513);
  const auto run = [&](GemmPolicy p, const Tensor& x, bool ta) {
    PolicyScope scope(p);
    EXPECT_EQ(gemm_policy(), p);
    Tensor c = Tensor::empty({m, n}, DType::f32);
    matmul(x, b, c, ta, false);
    return c.to_vector();
  };
  for (MatmulBackend forced : {MatmulBackend::onednn, MatmulBackend::openblas}) {
    const GemmPolicy p = forced == MatmulBackend::onednn ? GemmPolicy::onednn : GemmPolicy::openblas;
    EXPECT_EQ(run(p, a, false), bits_on(forced, a, b, false, false, m, n));
    EXPECT_EQ(run(p, at, true), bits_on(forced, at, b, true, false, m, n));
  }
  EXPECT_EQ(run(GemmPolicy::fixed, a, false), bits_on(MatmulBackend::onednn, a, b, false, false, m, n));
  EXPECT_EQ(run(GemmPolicy::fixed, at, true), bits_on(MatmulBackend::openblas, at, b, true, false, m, n));
  // A transpose() view of a row-major matrix is the same memory as `at`.
  {
    PolicyScope scope(GemmPolicy::fixed);
    Tensor c = Tensor::empty({m, n}, DType::f32);
    matmul(at.transpose(0, 1), b, c);
    EXPECT_EQ(c.to_vector(), bits_on(MatmulBackend::openblas, at, b, true, false, m, n));
    EXPECT_NE(gemm_policy_summary().find("fixed"), std::string::npos) << gemm_policy_summary();
  }
  PolicyScope scope(GemmPolicy::openblas);
  EXPECT_EQ(matmul_backend(), MatmulBackend::openblas);
}

// The cache file, in child processes (the variables are read once per
// process; the children are the DISABLED_ tests below, which only this test
// runs): the first measures and writes, the second obeys what the file
// says (here edited to the other backend, so obeying is visible), a broken
// file is an error naming it.
std::string self_run(const std::string& env, const std::string& filter) {
  // Through a shell, whose /proc/self/exe is the shell: name this binary.
  const std::string cmd = fmt::format("{} {} --gtest_also_run_disabled_tests --gtest_filter={} 2>&1", env,
                                      std::filesystem::read_symlink("/proc/self/exe").string(), filter);
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  char buf[4096];
  while (size_t got = fread(buf, 1, sizeof buf, p)) out.append(buf, got);
  const int status = pclose(p);
  return fmt::format("{}exit {}", out, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

// The products the cache children run: (m, k, n), trans_a.
constexpr int64_t kCached[][4] = {{96, 40, 72, 0}, {40, 96, 72, 1}};

TEST(GemmCacheChild, DISABLED_WritesTheChoices) {
  for (const auto& s : kCached) {
    const Tensor a = s[3] ? random_matrix(s[1], s[0], DType::f32, 1) : random_matrix(s[0], s[1], DType::f32, 1);
    matmul(a, random_matrix(s[1], s[2], DType::f32, 2), Tensor::empty({s[0], s[2]}, DType::f32), s[3] != 0, false);
  }
  const std::vector<GemmChoice> all = gemm_choices();
  for (const auto& s : kCached) {
    const GemmChoice* c = find_choice(all, s[0], s[2], s[1], s[3] != 0, false);
    ASSERT_NE(c, nullptr);
    EXPECT_FALSE(c->from_cache);
  }
  EXPECT_NE(gemm_policy_summary().find("0 shapes read"), std::string::npos) << gemm_policy_summary();
}

TEST(GemmCacheChild, DISABLED_ObeysTheFile) {
  EXPECT_NE(gemm_policy_summary().find("2 shapes read"), std::string::npos) << gemm_policy_summary();
  const std::vector<GemmChoice> all = gemm_choices();
  for (const auto& s : kCached) {
    const GemmChoice* c = find_choice(all, s[0], s[2], s[1], s[3] != 0, false);
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(c->from_cache);
    const Tensor a = s[3] ? random_matrix(s[1], s[0], DType::f32, 1) : random_matrix(s[0], s[1], DType::f32, 1);
    const Tensor b = random_matrix(s[1], s[2], DType::f32, 2);
    Tensor out = Tensor::empty({s[0], s[2]}, DType::f32);
    matmul(a, b, out, s[3] != 0, false);
    EXPECT_EQ(out.to_vector(), bits_on(c->backend, a, b, s[3] != 0, false, s[0], s[2]));
    // What the parent wrote into the file.
    EXPECT_EQ(c->backend, s[3] ? MatmulBackend::openblas : MatmulBackend::onednn);
  }
}

TEST(GemmCacheChild, DISABLED_RefusesABrokenFile) {
  const Tensor a = random_matrix(8, 8, DType::f32, 1);
  matmul(a, a);
}

TEST(GemmCacheTest, WrittenReadAndRefusedWhenBroken) {
  if (!matmul_backend_available(MatmulBackend::onednn)) GTEST_SKIP() << "no oneDNN in this build";
  const std::string dir = ::testing::TempDir() + fmt::format("gemm_cache_{}", getpid());
  ASSERT_EQ(std::system(fmt::format("rm -rf {0} && mkdir -p {0}", dir).c_str()), 0);
  const std::string path = dir + "/gemm.json";
  const std::string env = fmt::format("MESHTRAIN_GEMM_BACKEND=auto MESHTRAIN_GEMM_CACHE={}",
                                      path);
  std::string out = self_run(env, "GemmCacheChild.DISABLED_WritesTheChoices");
  ASSERT_NE(out.find("exit 0"), std::string::npos) << out;
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string file = text.str();
  ASSERT_NE(file.find("\"format\": \"meshtrain GEMM choices 1\""), std::string::npos) << file;
  ASSERT_NE(file.find(std::string(cpu_isa_name(cpu_isa()))), std::string::npos) << file;
  // Set the choices by hand: onednn for NN, openblas for TN.
  for (const char* from : {"\"backend\": \"onednn\"", "\"backend\": \"openblas\""})
    for (size_t at = file.find(from); at != std::string::npos; at = file.find(from, at + 1))
      file.replace(at, std::strlen(from), "\"backend\": \"PLACE\"");
  for (const char* op : {"\"op\": \"NN\"", "\"op\": \"TN\""}) {
    const size_t at = file.find(op);
    ASSERT_NE(at, std::string::npos) << file;
    const size_t place = file.find("PLACE", at);
    ASSERT_NE(place, std::string::npos);
    file.replace(place, 5, std::string(op).find("NN") != std::string::npos ? "onednn" : "openblas");
  }
  ASSERT_EQ(file.find("PLACE"), std::string::npos) << file;
  std::ofstream(path) << file;
  out = self_run(env, "GemmCacheChild.DISABLED_ObeysTheFile");
  EXPECT_NE(out.find("exit 0"), std::string::npos) << out;
  std::ofstream(path) << "{\"format\": \"something else\"}";
  out = self_run(env, "GemmCacheChild.DISABLED_RefusesABrokenFile");
  EXPECT_EQ(out.find("exit 0"), std::string::npos) << out;
  EXPECT_NE(out.find(path + " is not a GEMM cache"), std::string::npos) << out;
  EXPECT_NE(out.find("delete the file"), std::string::npos) << out;
  out = self_run("MESHTRAIN_GEMM_BACKEND=fastest", "GemmCacheChild.DISABLED_RefusesABrokenFile");
  EXPECT_NE(out.find("MESHTRAIN_GEMM_BACKEND: 'fastest' is no GEMM backend policy"), std::string::npos) << out;
  std::system(fmt::format("rm -rf {}", dir).c_str());
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
