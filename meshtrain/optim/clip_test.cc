#include "meshtrain/optim/clip.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"

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
  nn::Parameter h = make_param("h", {1.0f});
  h.grad = h.grad.to(DType::bf16);
  EXPECT_THROW(local_sq_norm({&h}), InvalidArgument);
  EXPECT_THROW(clip_grad_norm({nullptr}, 1.0), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::optim
