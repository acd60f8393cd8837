// Every kernel against a naive reference loop, on contiguous and strided
// operands and for every dtype it supports.
#include "meshtrain/core/half.h"
#include "meshtrain/core/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"

namespace meshtrain {
namespace {

// Deterministic, sign-mixed test values: small multiples of 1/8 (exact in
// every floating dtype, so sums and products are exact too).
Tensor pattern(std::vector<int64_t> shape, DType dtype, int salt) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = (i * 7 + salt * 13) % 23 - 11;  // -11..11
    v[static_cast<size_t>(i)] = is_floating(dtype) ? k / 8.0 : (dtype == DType::u8 ? k + 11 : k);
  }
  return Tensor::from_vector(v, std::move(shape), dtype);
}

// Reference op(a) @ op(b) in double, element by element.
std::vector<double> reference_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  const int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const int64_t n = tb ? b.size(0) : b.size(1);
  std::vector<double> c;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p)
        acc += (ta ? a.item({p, i}) : a.item({i, p})) * (tb ? b.item({j, p}) : b.item({p, j}));
      c.push_back(acc);
    }
  return c;
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, double tol,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::fabs(want[i]))) << what << " at " << i;
}

// An (r, c) operand in one of four memory layouts, all with the same values.
enum class Layout { contiguous, narrowed_cols, transposed_view, no_unit_stride };

Tensor make_operand(int64_t r, int64_t c, DType dtype, int salt, Layout layout) {
  Tensor base = pattern({r, c}, dtype, salt);
  switch (layout) {
    case Layout::contiguous: return base;
    case Layout::narrowed_cols: {  // leading dimension c + 5 > c
      Tensor wide = Tensor::full({r, c + 5}, 99.0, dtype);
      Tensor v = wide.narrow(1, 3, c);
      v.copy_from(base);
      return v;
    }
    case Layout::transposed_view: {  // column-major storage
      Tensor t = Tensor::empty({c, r}, dtype);
      t.copy_from(base.transpose(0, 1));
      return t.transpose(0, 1);
    }
    case Layout::no_unit_stride: {  // strides (2c, 2): BLAS cannot take it
      Tensor t = Tensor::full({r, c, 2}, 99.0, dtype);
      Tensor v = t.select(2, 1);
      v.copy_from(base);
      return v;
    }
  }
  return base;
}

struct MatmulCase {
  bool ta, tb;
  Layout layout;
  DType dtype;
};

class MatmulTest : public ::testing::TestWithParam<MatmulCase> {};

TEST_P(MatmulTest, MatchesNaiveReference) {
  const auto [ta, tb, layout, dtype] = GetParam();
  const int64_t m = 7, k = 13, n = 5;
  Tensor a = ta ? make_operand(k, m, dtype, 1, layout) : make_operand(m, k, dtype, 1, layout);
  Tensor b = tb ? make_operand(n, k, dtype, 2, layout) : make_operand(k, n, dtype, 2, layout);
  const std::vector<double> want = reference_matmul(a, b, ta, tb);
  const double tol = dtype == DType::f32 ? 1e-6 : 1e-14;
  const std::string what = std::string(ta ? "T" : "N") + (tb ? "T" : "N");

  // beta = 0: out's old values (NaN here) must not leak in.
  Tensor c = Tensor::full({m, n}, std::numeric_limits<double>::quiet_NaN(), dtype);
  matmul(a, b, c, ta, tb);
  expect_near_all(c.to_vector(), want, tol, what);

  // alpha and beta into a narrowed output (leading dimension n + 2).
  Tensor wide = Tensor::full({m, n + 2}, 1.0, dtype);
  Tensor cv = wide.narrow(1, 1, n);
  matmul(a, b, cv, ta, tb, 2.0, 0.5);
  std::vector<double> want2;
  for (double w : want) want2.push_back(2.0 * w + 0.5);
  expect_near_all(cv.to_vector(), want2, tol, what + " alpha/beta");
  EXPECT_EQ(wide.select(1, 0).to_vector(), std::vector<double>(m, 1.0));  // outside the view
  EXPECT_EQ(wide.select(1, n + 1).to_vector(), std::vector<double>(m, 1.0));

  // A transposed output goes through a contiguous copy.
  Tensor ct = Tensor::full({n, m}, 1.0, dtype);
  matmul(a, b, ct.transpose(0, 1), ta, tb, 1.0, 1.0);
  std::vector<double> want3;
  for (double w : want) want3.push_back(w + 1.0);
  expect_near_all(ct.transpose(0, 1).to_vector(), want3, tol, what + " transposed out");
}

std::vector<MatmulCase> all_matmul_cases() {
  std::vector<MatmulCase> cases;
  for (DType d : {DType::f32, DType::f64})
    for (Layout l : {Layout::contiguous, Layout::narrowed_cols, Layout::transposed_view, Layout::no_unit_stride})
      for (bool ta : {false, true})
        for (bool tb : {false, true}) cases.push_back({ta, tb, l, d});
  return cases;
}

std::string matmul_case_name(const ::testing::TestParamInfo<MatmulCase>& info) {
  const MatmulCase& c = info.param;
  static const char* kLayout[] = {"contig", "narrowed", "transposed", "strided"};
  return std::string(c.ta ? "T" : "N") + (c.tb ? "T" : "N") + "_" + kLayout[static_cast<int>(c.layout)] + "_" +
         std::string(dtype_name(c.dtype));
}

INSTANTIATE_TEST_SUITE_P(AllTransposesLayoutsAndDTypes, MatmulTest, ::testing::ValuesIn(all_matmul_cases()),
                         matmul_case_name);

TEST(MatmulTest, ConvenienceFormAndDocExample) {
  Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = Tensor::full({3, 2}, 0.5, DType::f32);
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.to_vector(), (std::vector<double>{3, 3, 7.5, 7.5}));
  matmul(a, b, c, false, false, 1.0, 1.0);
  EXPECT_EQ(c.to_vector(), (std::vector<double>{6, 6, 15, 15}));
}

TEST(MatmulTest, EmptyInnerDimensionScalesOut) {
  Tensor a = Tensor::empty({3, 0}, DType::f64);
  Tensor b = Tensor::empty({0, 2}, DType::f64);
  Tensor c = Tensor::full({3, 2}, 4.0, DType::f64);
  matmul(a, b, c, false, false, 1.0, 0.25);
  EXPECT_EQ(c.to_vector(), std::vector<double>(6, 1.0));
  matmul(a, b, c);
  EXPECT_EQ(c.to_vector(), std::vector<double>(6, 0.0));
  Tensor e = Tensor::empty({0, 2}, DType::f64);
  matmul(Tensor::empty({0, 4}, DType::f64), Tensor::empty({4, 2}, DType::f64), e);
  EXPECT_EQ(e.numel(), 0);
}

TEST(MatmulTest, RejectsBadShapesDTypesAndOverlap) {
  Tensor a = Tensor::zeros({4, 3}, DType::f32);
  Tensor b = Tensor::zeros({3, 5}, DType::f32);
  try {
    matmul(a, b, Tensor::zeros({4, 4}, DType::f32));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "matmul");
    EXPECT_NE(e.detail().find("[4, 3]"), std::string::npos) << e.what();
    EXPECT_NE(e.detail().find("[4, 4]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(matmul(a, b, Tensor::zeros({4, 5}, DType::f32), true, false), InvalidArgument);
  EXPECT_THROW(matmul(a.to(DType::bf16), b, Tensor::zeros({4, 5}, DType::f32)), InvalidArgument);  // mixed
  EXPECT_THROW(matmul(a.to(DType::bf16), b.to(DType::bf16), Tensor::zeros({4, 5}, DType::f16)), InvalidArgument);
  EXPECT_THROW(matmul(a, b.to(DType::f64)), InvalidArgument);
  EXPECT_THROW(matmul(Tensor::zeros({2, 3, 4}, DType::f32), b), InvalidArgument);
  Tensor sq = Tensor::zeros({3, 3}, DType::f32);
  EXPECT_THROW(matmul(sq, sq, sq), InvalidArgument);
}

TEST(BatchedMatmulTest, MatchesPerBatchReference) {
  const int64_t batch = 3, m = 7, k = 13, n = 5;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      Tensor a = ta ? pattern({batch, k, m}, DType::f64, 3) : pattern({batch, m, k}, DType::f64, 3);
      // b as a narrowed view of a wider batch.
      Tensor bw = pattern({batch + 1, tb ? n : k, tb ? k : n}, DType::f64, 4);
      Tensor b = bw.narrow(0, 1, batch);
      Tensor c = Tensor::zeros({batch, m, n}, DType::f64);
      batched_matmul(a, b, c, ta, tb);
      for (int64_t i = 0; i < batch; ++i)
        expect_near_all(c.select(0, i).to_vector(), reference_matmul(a.select(0, i), b.select(0, i), ta, tb), 1e-14,
                        "batch " + std::to_string(i));
    }
  }
  EXPECT_THROW(batched_matmul(Tensor::zeros({2, 3, 4}, DType::f32), Tensor::zeros({3, 4, 5}, DType::f32),
                              Tensor::zeros({2, 3, 5}, DType::f32)),
               InvalidArgument);
}

// ---- element-wise ----

class ElementwiseTest : public ::testing::TestWithParam<DType> {};

// Exact result in double, rounded (or wrapped) once to the dtype.
std::vector<double> rounded(const std::vector<double>& exact, DType dtype) {
  if (is_floating(dtype)) return Tensor::from_vector(exact, {static_cast<int64_t>(exact.size())}, dtype).to_vector();
  std::vector<int64_t> ints(exact.begin(), exact.end());
  return Tensor::from_vector(ints, {static_cast<int64_t>(ints.size())}, dtype).to_vector();
}

TEST_P(ElementwiseTest, AddMulAxpyScaleOnContiguousAndStridedViews) {
  const DType dt = GetParam();
  for (bool strided : {false, true}) {
    // (5, 7) operands; the strided variants are transposes of (7, 5) storage.
    Tensor a = strided ? pattern({7, 5}, dt, 1).transpose(0, 1) : pattern({5, 7}, dt, 1);
    Tensor b = strided ? pattern({7, 5}, dt, 2).transpose(0, 1) : pattern({5, 7}, dt, 2);
    Tensor out = strided ? Tensor::zeros({7, 9}, dt).narrow(1, 2, 5).transpose(0, 1) : Tensor::zeros({5, 7}, dt);
    const std::vector<double> va = a.to_vector(), vb = b.to_vector();
    std::vector<double> sum, prod, ax, sc;
    for (size_t i = 0; i < va.size(); ++i) {
      sum.push_back(va[i] + vb[i]);
      prod.push_back(va[i] * vb[i]);
      ax.push_back(vb[i] + (-2.0) * va[i]);
      sc.push_back(va[i] * 3.0);
    }
    const std::string what = std::string(dtype_name(dt)) + (strided ? " strided" : " contiguous");
    add(a, b, out);
    EXPECT_EQ(out.to_vector(), rounded(sum, dt)) << what;
    mul(a, b, out);
    EXPECT_EQ(out.to_vector(), rounded(prod, dt)) << what;
    Tensor y = b.clone();
    axpy(-2.0, a, y);
    EXPECT_EQ(y.to_vector(), rounded(ax, dt)) << what;
    Tensor x = a.clone();
    scale(x, 3.0);
    EXPECT_EQ(x.to_vector(), rounded(sc, dt)) << what;
    // In place, through the very same view.
    add(a, b, a);
    EXPECT_EQ(a.to_vector(), rounded(sum, dt)) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, ElementwiseTest, ::testing::ValuesIn(kAllDTypes),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// bf16/f16 compute in float and round once per op: the exact sum lies just
// above a bf16 tie and must round up, not to the tie's even neighbour.
TEST(ElementwiseTest, HalfTypesRoundOncePerOp) {
  Tensor a = Tensor::full({1}, 1.0, DType::bf16);
  Tensor b = Tensor::full({1}, 0x1p-8 + 0x1p-15, DType::bf16);  // exact in bf16
  Tensor out = Tensor::empty({1}, DType::bf16);
  add(a, b, out);  // exact 1 + 2^-8 + 2^-15, just above the tie: rounds up
  EXPECT_EQ(out.item({0}), 1.0 + 0x1p-7);
  Tensor h = Tensor::full({2}, 60000.0, DType::f16);
  Tensor ho = Tensor::empty({2}, DType::f16);
  add(h, h, ho);  // overflows f16's range: inf, as hardware f16 would give
  EXPECT_TRUE(std::isinf(ho.item({0})));
}

TEST(ElementwiseTest, IntegersWrapOnOverflow) {
  Tensor i8 = Tensor::full({2}, 100, DType::i8);
  Tensor o8 = Tensor::empty({2}, DType::i8);
  add(i8, i8, o8);
  EXPECT_EQ(o8.item({0}), -56.0);
  mul(i8, i8, o8);
  EXPECT_EQ(o8.item({1}), 16.0);  // 10000 mod 256
  Tensor u8 = Tensor::full({1}, 200, DType::u8);
  Tensor ou8 = Tensor::empty({1}, DType::u8);
  add(u8, u8, ou8);
  EXPECT_EQ(ou8.item({0}), 144.0);
  Tensor i32 = Tensor::full({1}, 2147483647.0, DType::i32);
  Tensor one = Tensor::full({1}, 1, DType::i32);
  Tensor o32 = Tensor::empty({1}, DType::i32);
  add(i32, one, o32);
  EXPECT_EQ(o32.item({0}), -2147483648.0);
  Tensor i64 = Tensor::from_vector(std::vector<int64_t>{int64_t{1} << 62}, {1});
  scale(i64, 4.0);
  EXPECT_EQ(i64.data<int64_t>()[0], 0);
  EXPECT_THROW(scale(i64, 0.5), InvalidArgument);
  EXPECT_THROW(axpy(1.5, i64, i64), InvalidArgument);
}

TEST(ElementwiseTest, RejectsMismatchesAndPartialOverlap) {
  Tensor a = Tensor::zeros({4, 4}, DType::f32);
  try {
    add(a, Tensor::zeros({4, 3}, DType::f32), a);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "add");
    EXPECT_NE(e.detail().find("[4, 3]"), std::string::npos) << e.what();
    EXPECT_NE(e.hint().find("broadcasting"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mul(a, a.to(DType::f64), a), InvalidArgument);
  EXPECT_THROW(add(a, a, a.transpose(0, 1)), InvalidArgument);  // same bytes, other layout
  EXPECT_THROW(axpy(1.0, a.narrow(0, 0, 2), a.narrow(0, 1, 2)), InvalidArgument);
  EXPECT_THROW(add(Tensor(), a, a), InvalidArgument);
}

// ---- reductions ----

class ReductionTest : public ::testing::TestWithParam<DType> {};

TEST_P(ReductionTest, SumMaxNormOnStridedViews) {
  const DType dt = GetParam();
  Tensor base = pattern({9, 6}, dt, 5);
  Tensor v = base.narrow(0, 1, 7).transpose(0, 1);  // (6, 7), strided
  double s = 0, m = -INFINITY, sq = 0;
  for (double x : v.to_vector()) {
    s += x;
    m = std::max(m, x);
    sq += x * x;
  }
  EXPECT_EQ(sum(v), s);
  EXPECT_EQ(max(v), m);
  EXPECT_DOUBLE_EQ(l2_norm(v), std::sqrt(sq));
  EXPECT_EQ(sum(base), sum(base.transpose(0, 1)));  // order-independent here: exact values
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, ReductionTest, ::testing::ValuesIn(kAllDTypes),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(ReductionTest, EdgeCases) {
  EXPECT_EQ(sum(Tensor::zeros({0}, DType::f32)), 0.0);
  EXPECT_EQ(l2_norm(Tensor::zeros({0}, DType::f32)), 0.0);
  EXPECT_THROW(max(Tensor::zeros({2, 0}, DType::f32)), InvalidArgument);
  Tensor n = Tensor::from_vector(std::vector<float>{1, NAN, 3}, {3});
  EXPECT_TRUE(std::isnan(max(n)));
  EXPECT_TRUE(std::isnan(sum(n)));
  EXPECT_TRUE(std::isnan(l2_norm(n.to(DType::f64))));
  EXPECT_EQ(max(Tensor::from_vector(std::vector<float>{-3, -1, -2}, {3})), -1.0);
  // Squares of 1e200 overflow double and of 1e-200 underflow; the scaled sum does not.
  EXPECT_DOUBLE_EQ(l2_norm(Tensor::from_vector(std::vector<double>{3e200, 4e200}, {2})), 5e200);
  EXPECT_DOUBLE_EQ(l2_norm(Tensor::from_vector(std::vector<double>{3e-200, 4e-200}, {2})), 5e-200);
  EXPECT_EQ(l2_norm(Tensor::from_vector(std::vector<double>{INFINITY, 1}, {2})), INFINITY);
  // f32's largest values square without overflow in the double accumulator.
  const float big = std::numeric_limits<float>::max();
  EXPECT_DOUBLE_EQ(l2_norm(Tensor::from_vector(std::vector<float>{big, big}, {2})),
                   std::sqrt(2.0) * static_cast<double>(big));
  // 2^20 copies of 0.1f: the double accumulator sums them exactly (44 bits).
  Tensor many = Tensor::full({1 << 20}, 0.1f, DType::f32);
  EXPECT_EQ(sum(many), (1 << 20) * static_cast<double>(0.1f));
}

TEST(BlasThreadsTest, SetAndGet) {
  const int before = blas_threads();
  EXPECT_GE(before, 1);
  set_blas_threads(1);
  EXPECT_EQ(blas_threads(), 1);
  EXPECT_THROW(set_blas_threads(0), InvalidArgument);
  set_blas_threads(before);
  EXPECT_EQ(blas_threads(), before);
}

TEST(RoundToTest, EqualsConvertingThereAndBack) {
  Tensor x = Tensor::from_vector(std::vector<float>{1.0f, 1.00390625f, 1.001f, -3.14159f, 70000.0f, 1e-8f,
                                                    std::numeric_limits<float>::infinity(), 0.1f},
                                 {8});
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor y = x.clone();
    round_to(y, dt);
    EXPECT_EQ(y.to_vector(), x.to(dt).to(DType::f32).to_vector()) << dtype_name(dt);
    Tensor strided = x.clone().view({2, 4}).transpose(0, 1);
    round_to(strided, dt);
    EXPECT_EQ(strided.transpose(0, 1).contiguous().view({8}).to_vector(), y.to_vector());
  }
  EXPECT_TRUE(std::isinf(x.to(DType::f16).to(DType::f32).item({4})));  // 70000 overflows f16
  Tensor same = x.clone();
  round_to(same, DType::f32);
  EXPECT_EQ(same.to_vector(), x.to_vector());
  EXPECT_THROW(round_to(x, DType::i32), InvalidArgument);
  EXPECT_THROW(round_to(x.to(DType::f64), DType::bf16), InvalidArgument);
}

TEST(AccumulateTest, MixedPrecisionSumsInF32AndRoundsOnce) {
  // bf16 dst 1.0 += f32 src: the sum is exact in f32, then rounded once to
  // bf16 (ulp 2^-7 at 1): + 2^-9 (a quarter ulp) stays 1.0, + 3 * 2^-9
  // (three quarters) rounds up to 1 + 2^-7.
  Tensor dst = Tensor::full({3}, 1.0, DType::bf16);
  Tensor src = Tensor::from_vector(std::vector<float>{0x1p-9f, 3 * 0x1p-9f, -0.5f}, {3});
  accumulate(src, dst);
  EXPECT_EQ(dst.to(DType::f32).to_vector(), (std::vector<double>{1.0, 1.0078125, 0.5}));
  // f32 dst += f16 src: the f16 values widen exactly.
  Tensor acc = Tensor::full({3}, 0.25, DType::f32);
  accumulate(Tensor::full({3}, 0.1, DType::f16), acc);
  EXPECT_EQ(acc.to_vector()[0], 0.25 + static_cast<double>(f16_to_float(float_to_f16(0.1f))));
  EXPECT_THROW(accumulate(Tensor::zeros({2}, DType::i32), acc), InvalidArgument);
  EXPECT_THROW(accumulate(Tensor::zeros({2}, DType::f32), acc), InvalidArgument);
}

TEST(FiniteScanTest, AllFiniteAndSumOfSquaresInEveryFloatDtype) {
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    Tensor x = Tensor::from_vector(std::vector<float>{1, -2, 3, 0.5f}, {4}).to(t);
    EXPECT_TRUE(all_finite(x)) << dtype_name(t);
    EXPECT_EQ(sum_of_squares(x), 1 + 4 + 9 + 0.25) << dtype_name(t);
    for (double bad : {INFINITY, -INFINITY, NAN}) {
      Tensor y = Tensor::from_vector(std::vector<float>(37, 1.0f), {37}).to(t);
      y.narrow(0, 36, 1).fill(bad);
      EXPECT_FALSE(all_finite(y)) << dtype_name(t) << " " << bad;
    }
  }
  EXPECT_THROW(all_finite(Tensor::zeros({2}, DType::i32)), InvalidArgument);
  EXPECT_THROW(sum_of_squares(Tensor::zeros({4, 4}, DType::f32).transpose(0, 1)), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain
