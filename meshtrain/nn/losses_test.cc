// Losses: closed-form values on tiny inputs, stability at extreme logits,
// gradients against finite differences, and the normalizer's data-parallel
// identity (two halves with the global normalizer sum to the whole mean).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/testing/grad_check.h"
#include "meshtrain/nn/losses.h"

namespace meshtrain::nn {
namespace {

using testing::expect_grad_matches;
using testing::random_tensor;

Tensor labels_of(std::vector<int64_t> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return Tensor::from_vector(v, {n});
}

TEST(GradCheck, DetectsAOnePercentError) {
  Tensor x = random_tensor({4}, 1);
  auto f = [&] { return 0.5 * std::pow(l2_norm(x), 2); };  // gradient: x
  Tensor wrong = x.clone();
  scale(wrong, 1.01);
  const double bad = testing::compare_grads(f, x, wrong).relative_error;
  EXPECT_GT(bad, 0.009);
  EXPECT_LT(bad, 0.011);
  EXPECT_LT(testing::compare_grads(f, x, x.clone()).relative_error, 1e-5);
}

TEST(CrossEntropyLoss, MatchesClosedFormAndIsStable) {
  CrossEntropyLoss ce;
  // log(e + e^2 + e^3) - 3
  Tensor z = Tensor::from_vector(std::vector<float>{1, 2, 3}, {1, 3});
  EXPECT_NEAR(ce.forward(z, labels_of({2})), 0.4076059644443803, 1e-6);
  const std::vector<double> g = ce.backward().to_vector();
  EXPECT_NEAR(g[0], 0.09003057317038046, 1e-6);
  EXPECT_NEAR(g[1], 0.24472847105479764, 1e-6);
  EXPECT_NEAR(g[2], 0.6652409557748219 - 1, 1e-6);
  // Huge logits: no overflow. Row 0 is certain and right, row 1 certain and wrong by 1000.
  Tensor big = Tensor::from_vector(std::vector<float>{1000, 0, 0, 1000}, {2, 2});
  EXPECT_NEAR(ce.forward(big, labels_of({0, 0})), 500.0, 1e-9);
  EXPECT_EQ(ce.backward(2.0).to_vector(), (std::vector<double>{0, 0, -1, 1}));  // (p - onehot) * 2 / 2
  // i32 labels work; counts of correct rows.
  Tensor l32 = Tensor::from_vector(std::vector<int64_t>{0, 1}, {2}).to(DType::i32);
  EXPECT_NEAR(ce.forward(big, l32), std::log1p(std::exp(-1000.0)), 1e-12);
  EXPECT_EQ(count_correct(big, labels_of({0, 0})), 1);
}

TEST(CrossEntropyLoss, BackwardMatchesFiniteDifferences) {
  CrossEntropyLoss ce;
  Tensor z = random_tensor({4, 5}, 1, -3, 3);
  Tensor y = labels_of({0, 4, 2, 2});
  auto f = [&] { return ce.forward(z, y, 3.0); };
  ce.forward(z, y, 3.0);
  expect_grad_matches(f, z, ce.backward().clone());
}

TEST(CrossEntropyLoss, GlobalNormalizerMakesHalvesSumToTheWholeMean) {
  CrossEntropyLoss whole, part;
  Tensor z = random_tensor({6, 4}, 3, -2, 2);
  Tensor y = labels_of({1, 0, 3, 3, 2, 1});
  const double mean = whole.forward(z, y);  // normalizer 6 by default
  const std::vector<double> g = whole.backward().to_vector();
  double sum = 0.0;
  std::vector<double> gs;
  for (int64_t first : {0, 3}) {
    sum += part.forward(z.narrow(0, first, 3), y.narrow(0, first, 3), /*normalizer=*/6.0);
    const std::vector<double> gp = part.backward().to_vector();
    gs.insert(gs.end(), gp.begin(), gp.end());
  }
  EXPECT_NEAR(sum, mean, 1e-12);
  ASSERT_EQ(gs.size(), g.size());
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(gs[i], g[i]);
}

TEST(CrossEntropyLoss, BadInputsAreErrors) {
  CrossEntropyLoss ce;
  Tensor z = random_tensor({2, 3}, 1);
  EXPECT_THROW(ce.backward(), InvalidArgument);  // no forward
  EXPECT_THROW(ce.forward(z, labels_of({0, 3})), InvalidArgument);
  EXPECT_THROW(ce.forward(z, labels_of({0})), InvalidArgument);
  EXPECT_THROW(ce.forward(z, labels_of({0, 1}), 0.0), InvalidArgument);
  EXPECT_THROW(ce.forward(z, labels_of({0, 1}), NAN), InvalidArgument);
  EXPECT_THROW(ce.forward(random_tensor({6}, 1), labels_of({0})), InvalidArgument);
}

TEST(MSELoss, MatchesClosedFormAndFiniteDifferences) {
  MSELoss mse;
  Tensor x = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  Tensor t = Tensor::from_vector(std::vector<float>{0, 2, 5, 4}, {2, 2});
  EXPECT_DOUBLE_EQ(mse.forward(x, t), 5.0 / 4);  // (1 + 0 + 4 + 0) / 4
  EXPECT_EQ(mse.backward().to_vector(), (std::vector<double>{0.5, 0, -1, 0}));
  EXPECT_DOUBLE_EQ(mse.forward(x, t, 2.0), 2.5);  // per-sample sum, mean over 2 samples
  Tensor xr = random_tensor({3, 4}, 1);
  Tensor tr = random_tensor({3, 4}, 2);
  auto f = [&] { return mse.forward(xr, tr); };
  mse.forward(xr, tr);
  expect_grad_matches(f, xr, mse.backward().clone());
  EXPECT_THROW(mse.forward(xr, t), InvalidArgument);
}

TEST(BCEWithLogitsLoss, MatchesClosedFormAndIsStable) {
  BCEWithLogitsLoss bce;
  Tensor x = Tensor::from_vector(std::vector<float>{0, 100, -100, 2}, {4});
  Tensor t = Tensor::from_vector(std::vector<float>{1, 0, 0, 0.25f}, {4});
  // log 2; 100; log1p(e^-100); max(2,0) - 0.5 + log1p(e^-2)
  const double want = std::log(2.0) + 100 + std::log1p(std::exp(-100.0)) + 1.5 + std::log1p(std::exp(-2.0));
  EXPECT_NEAR(bce.forward(x, t, 1.0), want, 1e-5);
  const std::vector<double> g = bce.backward().to_vector();
  EXPECT_NEAR(g[0], -0.5, 1e-7);
  EXPECT_NEAR(g[1], 1.0, 1e-7);
  EXPECT_NEAR(g[2], 0.0, 1e-7);
  EXPECT_NEAR(g[3], 1 / (1 + std::exp(-2.0)) - 0.25, 1e-7);
  EXPECT_NEAR(bce.forward(x, t), want / 4, 1e-5);  // default: mean over elements
  Tensor xr = random_tensor({3, 4}, 1, -4, 4);
  Tensor tr = random_tensor({3, 4}, 2, 0, 1);
  auto f = [&] { return bce.forward(xr, tr, 3.0); };
  bce.forward(xr, tr, 3.0);
  expect_grad_matches(f, xr, bce.backward().clone());
}

TEST(GaussianKLLoss, MatchesClosedFormAndFiniteDifferences) {
  GaussianKLLoss kl;
  // KL(N(0,1)||N(0,1)) = 0; mu = 1: 0.5; var = 2: 0.5 (1 - ln 2)
  Tensor mu = Tensor::from_vector(std::vector<float>{0, 1, 0}, {1, 3});
  Tensor lv = Tensor::from_vector(std::vector<float>{0, 0, static_cast<float>(std::log(2.0))}, {1, 3});
  EXPECT_NEAR(kl.forward(mu, lv), 0.5 + 0.5 * (1 - std::log(2.0)), 1e-7);
  GaussianKLLoss::Grads g = kl.backward();
  EXPECT_EQ(g.mu.to_vector(), (std::vector<double>{0, 1, 0}));
  EXPECT_NEAR(g.logvar.to_vector()[2], 0.5, 1e-7);  // 0.5 (2 - 1)
  Tensor m = random_tensor({4, 3}, 1);
  Tensor l = random_tensor({4, 3}, 2);
  auto f = [&] { return kl.forward(m, l, 2.0); };
  kl.forward(m, l, 2.0);
  g = kl.backward();
  expect_grad_matches(f, m, g.mu.clone());
  expect_grad_matches(f, l, g.logvar.clone());
}

}  // namespace
}  // namespace meshtrain::nn
