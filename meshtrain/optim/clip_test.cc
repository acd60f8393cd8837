#include "meshtrain/optim/clip.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/half.h"

namespace meshtrain::optim {
namespace {

nn::Parameter make_param(std::string name, std::vector<float> grad) {
  nn::Parameter p;
  p.name = std::move(name);
  const int64_t n = static_cast<int64_t>(grad.size());
  p.value = Tensor::zeros({n}, DType::f32);
  p.grad = Tensor::from_vector(grad, {n});
  return p;
}

TEST(ClipGradNormTest, ScalesToMaxNormLikeTorch) {
  // |(3, 4, 12)| = 13.
  nn::Parameter a = make_param("a", {3.0f, 4.0f});
  nn::Parameter b = make_param("b", {12.0f});
  const double norm = clip_grad_norm({&a, &b}, 1.0);
  EXPECT_EQ(norm, 13.0);
  const double f = 1.0 / (13.0 + 1e-6);
  EXPECT_FLOAT_EQ(a.grad.item({0}), static_cast<float>(3.0f * static_cast<float>(f)));
  EXPECT_FLOAT_EQ(a.grad.item({1}), static_cast<float>(4.0f * static_cast<float>(f)));
  EXPECT_FLOAT_EQ(b.grad.item({0}), static_cast<float>(12.0f * static_cast<float>(f)));
  const double after = std::sqrt(local_sq_norm({&a, &b}));
  EXPECT_NEAR(after, 1.0, 1e-6);
  EXPECT_LT(after, 1.0 + 1e-7);
}

TEST(ClipGradNormTest, BelowMaxNormLeavesGradsAlone) {
  nn::Parameter a = make_param("a", {3.0f, 4.0f});
  EXPECT_EQ(clip_grad_norm({&a}, 5.5), 5.0);
  EXPECT_EQ(a.grad.to_vector(), (std::vector<double>{3.0, 4.0}));
  // At exactly max_norm, torch's factor is max / (max + 1e-6) < 1: it scales.
  EXPECT_EQ(clip_factor(5.0, 5.0), 5.0 / (5.0 + 1e-6));
  EXPECT_LT(clip_factor(5.0, 5.0), 1.0);
  EXPECT_EQ(clip_factor(5.0, 6.0), 1.0);
  EXPECT_EQ(clip_factor(0.0, 1.0), 1.0);
}

TEST(ClipGradNormTest, SplitFormSumsShardsToTheSameNorm) {
  nn::Parameter a = make_param("a", {1.0f, -2.0f, 3.0f});
  nn::Parameter b = make_param("b", {-4.0f, 5.0f});
  nn::Parameter a2 = make_param("a", {1.0f, -2.0f, 3.0f});
  nn::Parameter b2 = make_param("b", {-4.0f, 5.0f});
  // Two "ranks", each with one parameter; the all-reduce is the sum.
  const double sq = local_sq_norm({&a}) + local_sq_norm({&b});
  EXPECT_EQ(sq, 55.0);
  const double norm = std::sqrt(sq);
  scale_grads({&a}, clip_factor(norm, 2.0));
  scale_grads({&b}, clip_factor(norm, 2.0));
  EXPECT_EQ(clip_grad_norm({&a2, &b2}, 2.0), norm);
  EXPECT_EQ(a.grad.to_vector(), a2.grad.to_vector());
  EXPECT_EQ(b.grad.to_vector(), b2.grad.to_vector());
}

TEST(ClipGradNormTest, NonFiniteNormIsReturnedAndGradsKept) {
  const float inf = std::numeric_limits<float>::infinity();
  nn::Parameter a = make_param("layers.0.weight", {1.0f, 2.0f});
  nn::Parameter b = make_param("layers.1.weight", {inf, 1.0f});
  EXPECT_EQ(clip_grad_norm({&a, &b}, 1.0), HUGE_VAL);
  EXPECT_EQ(a.grad.to_vector(), (std::vector<double>{1.0, 2.0}));
  EXPECT_EQ(b.grad.item({0}), HUGE_VAL);
  EXPECT_EQ(clip_factor(HUGE_VAL, 1.0), 1.0);
  EXPECT_EQ(clip_factor(NAN, 1.0), 1.0);

  nn::Parameter c = make_param("c", {NAN});
  EXPECT_TRUE(std::isnan(clip_grad_norm({&a, &c}, 1.0)));
  try {
    clip_grad_norm({&a, &b}, 1.0, /*error_if_nonfinite=*/true);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "clip_grad_norm");
    EXPECT_NE(std::string(e.what()).find("norm is inf"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'layers.1.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("loss scaler"), std::string::npos) << e.what();
  }
  EXPECT_EQ(a.grad.to_vector(), (std::vector<double>{1.0, 2.0}));
}

TEST(ClipGradNormTest, SkipsUndefinedGradsAndChecksArguments) {
  nn::Parameter a = make_param("a", {3.0f, 4.0f});
  nn::Parameter none = make_param("none", {});
  none.grad = Tensor();
  EXPECT_EQ(clip_grad_norm({&a, &none}, 10.0), 5.0);
  EXPECT_EQ(local_sq_norm({}), 0.0);
  EXPECT_EQ(clip_grad_norm({}, 1.0), 0.0);
  EXPECT_THROW(clip_grad_norm({&a}, 0.0), InvalidArgument);
  EXPECT_THROW(clip_grad_norm({&a}, -1.0), InvalidArgument);
  EXPECT_THROW(clip_factor(1.0, HUGE_VAL), InvalidArgument);
  nn::Parameter d = make_param("d", {1.0f});
  d.grad = d.grad.to(DType::f64);
  EXPECT_THROW(local_sq_norm({&d}), InvalidArgument);
  EXPECT_THROW(scale_grads({&d}, 0.5), InvalidArgument);
  EXPECT_THROW(grads_finite({&d}), InvalidArgument);
  d.grad = d.grad.to(DType::i32);
  try {
    local_sq_norm({&a, &d});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "local_sq_norm");
    EXPECT_NE(std::string(e.what()).find(
                  "'d' must be a contiguous cpu tensor of dtype f32, bf16 or f16 (got i32"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(clip_grad_norm({nullptr}, 1.0), InvalidArgument);
  EXPECT_THROW(grads_finite({nullptr}), InvalidArgument);
}

// Values with many significant bits and a wide range, rounded through `dtype`.
Tensor half_grad(DType dtype, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>(std::sin(0.9 * i + 0.2) * std::exp2(i % 23 - 11));
  return Tensor::from_vector(v, {n}, dtype);
}

TEST(ClipGradNormTest, HalfGradsNormEqualsF32NormOfTheWidenedValues) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    nn::Parameter h1 = make_param("h1", {}), h2 = make_param("h2", {});
    h1.grad = half_grad(dtype, 1000);
    h2.grad = half_grad(dtype, 7);
    nn::Parameter f1 = make_param("f1", {}), f2 = make_param("f2", {});
    f1.grad = h1.grad.to(DType::f32);
    f2.grad = h2.grad.to(DType::f32);
    const double sq = local_sq_norm({&h1, &h2});
    EXPECT_GT(sq, 1.0);
    EXPECT_EQ(sq, local_sq_norm({&f1, &f2}));
    // A mixed list: the f32 and the half parameters' squares add up.
    EXPECT_EQ(local_sq_norm({&f1, &h2}), sq);
    EXPECT_EQ(clip_grad_norm({&h1, &h2}, 1e6), std::sqrt(sq));
    EXPECT_EQ(h1.grad.dtype(), dtype);
  }
  // Exact values: (1.5, -2, 0.25) in bf16: 2.25 + 4 + 0.0625.
  nn::Parameter b = make_param("b", {});
  b.grad = Tensor::from_vector(std::vector<float>{1.5f, -2.0f, 0.25f}, {3}, DType::bf16);
  EXPECT_EQ(local_sq_norm({&b}), 6.3125);
}

TEST(ClipGradNormTest, ScaleGradsOnHalfGradsMultipliesInF32AndRoundsBack) {
  struct Format {
    DType dtype;
    float (*widen)(uint16_t);
    uint16_t (*narrow)(float);
  };
  for (const Format& format : {Format{DType::bf16, bf16_to_float, float_to_bf16},
                            Format{DType::f16, f16_to_float, float_to_f16}}) {
    SCOPED_TRACE(dtype_name(format.dtype));
    nn::Parameter h = make_param("h", {});
    h.grad = half_grad(format.dtype, 300);
    const Tensor before = h.grad.clone();
    const double factor = 0.3;
    scale_grads({&h}, factor);
    ASSERT_EQ(h.grad.dtype(), format.dtype);
    const uint16_t* in = before.data<uint16_t>();
    const uint16_t* out = h.grad.data<uint16_t>();
    int changed = 0;
    for (int64_t i = 0; i < 300; ++i) {
      const uint16_t want = format.narrow(format.widen(in[i]) * static_cast<float>(factor));
      EXPECT_EQ(out[i], want) << "element " << i;
      changed += out[i] != in[i];
    }
    EXPECT_GT(changed, 250);
  }
  // f16 overflows to inf past 65504; clip_grad_norm's factor <= 1 never does that.
  nn::Parameter f = make_param("f", {});
  f.grad = Tensor::from_vector(std::vector<float>{60000.0f, -1.0f}, {2}, DType::f16);
  scale_grads({&f}, 2.0);
  EXPECT_EQ(f.grad.to_vector(), (std::vector<double>{HUGE_VAL, -2.0}));
}

TEST(GradsFiniteTest, DetectsInfAndNanAtFirstMiddleAndLastElementOfEachDtype) {
  const double kBad[] = {HUGE_VAL, -HUGE_VAL, NAN};
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t n : {1, 2, 1000, 4099}) {
      for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
        for (double bad : kBad) {
          SCOPED_TRACE(::testing::Message()
                       << dtype_name(dtype) << ", n " << n << ", at " << pos << ": " << bad);
          nn::Parameter ok = make_param("ok", {});
          ok.grad = half_grad(dtype, 33);
          nn::Parameter p = make_param("p", {});
          p.grad = half_grad(dtype, n);
          EXPECT_TRUE(grads_finite({&ok, &p}));
          p.grad.narrow(0, pos, 1).fill(bad);
          EXPECT_FALSE(grads_finite({&ok, &p}));
          EXPECT_FALSE(grads_finite({&p, &ok}));
          EXPECT_TRUE(grads_finite({&ok}));
        }
      }
    }
  }
}

TEST(GradsFiniteTest, LargestFiniteValuesSubnormalsAndUndefinedGradsAreFinite) {
  nn::Parameter f = make_param("f", {});
  f.grad = Tensor::from_vector(std::vector<float>{std::numeric_limits<float>::max(),
                                                  -std::numeric_limits<float>::max(),
                                                  std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f},
                               {5});
  nn::Parameter b = make_param("b", {});
  b.grad = f.grad.to(DType::bf16);  // max f32 rounds to inf in bf16: use bf16's own max below
  b.grad.narrow(0, 0, 1).copy_from(Tensor::from_vector(std::vector<float>{bf16_to_float(0x7f7f)}, {1}));
  b.grad.narrow(0, 1, 1).copy_from(Tensor::from_vector(std::vector<float>{bf16_to_float(0xff7f)}, {1}));
  nn::Parameter h = make_param("h", {});
  h.grad = Tensor::from_vector(std::vector<float>{65504.0f, -65504.0f, 0x1p-24f, -0.0f}, {4}, DType::f16);
  nn::Parameter none = make_param("none", {});
  none.grad = Tensor();
  EXPECT_TRUE(grads_finite({&f, &b, &h, &none}));
  EXPECT_TRUE(grads_finite({}));
  EXPECT_EQ(b.grad.item({0}), static_cast<double>(bf16_to_float(0x7f7f)));
  EXPECT_EQ(h.grad.item({0}), 65504.0);
  // One more f16 ulp is inf.
  h.grad.narrow(0, 1, 1).fill(-65520.0);
  EXPECT_FALSE(grads_finite({&f, &b, &h, &none}));
}

TEST(ValuesFiniteTest, ChecksValuesNotGrads) {
  nn::Parameter a = make_param("a", {1.0f, -2.0f, std::numeric_limits<float>::max()});
  nn::Parameter b = make_param("b", {0.5f});
  b.grad = Tensor::from_vector(std::vector<float>{NAN}, {1});  // a bad grad is not a bad value
  EXPECT_TRUE(values_finite({&a, &b}));
  EXPECT_TRUE(values_finite({}));
  for (double bad : {HUGE_VAL, -HUGE_VAL, static_cast<double>(NAN)}) {
    a.value.narrow(0, 1, 1).fill(bad);
    EXPECT_FALSE(values_finite({&b, &a})) << bad;
    EXPECT_TRUE(values_finite({&b}));
  }
  EXPECT_THROW(values_finite({nullptr}), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::optim
