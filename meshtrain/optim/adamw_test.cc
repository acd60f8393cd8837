#include "meshtrain/testing/optim.h"
#include "meshtrain/optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"

namespace meshtrain::optim {
namespace {

using testing::make_param;
using testing::set_grad;

float grad_at(int t, size_t i) { return static_cast<float>(std::cos(0.9 * t + 1.1 * i) * (0.5 + 0.3 * i)); }

// torch.optim.AdamW's update (amsgrad=False), written out in double.
struct ReferenceAdamW {
  double lr, beta1, beta2, eps, weight_decay;
  std::vector<double> p, m, v;
  int t = 0;

  void step(const std::vector<double>& g) {
    ++t;
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    const double bc1 = 1.0 - std::pow(beta1, t), bc2 = 1.0 - std::pow(beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1.0 - lr * weight_decay;
      m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
      v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
      p[i] -= (lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
    }
  }
};

TEST(AdamWTest, HandComputedFirstStep) {
  // Step 1: m = 0.1 g, v = 0.001 g^2, so m / bc1 = g and sqrt(v / bc2) = |g|:
  // p = 1 * (1 - 0.1 * 0.01) - 0.1 * 0.5 / (0.5 + 1e-8) = 0.999 - 0.1 = 0.899.
  // The undecayed bias moves by lr * sign(g) only: -2 + 0.1 = -1.9.
  nn::Parameter w = make_param("w", {1.0f});
  nn::Parameter b = make_param("b", {-2.0f}, /*decay=*/false);
  AdamW opt({&w, &b}, 0.1);
  set_grad(w, {0.5f});
  set_grad(b, {-3.0f});
  opt.step();
  EXPECT_FLOAT_EQ(w.value.item({0}), 0.899f);
  EXPECT_FLOAT_EQ(b.value.item({0}), -1.9f);
  EXPECT_FLOAT_EQ(opt.state(0).exp_avg.item({0}), 0.05f);
  EXPECT_FLOAT_EQ(opt.state(0).exp_avg_sq.item({0}), 0.00025f);
  EXPECT_EQ(opt.state(0).step, 1);

  // Step 2 with g = -0.25: m = 0.045 - 0.025 = 0.02, v = 0.00024975 + 0.0000625
  // = 0.00031225, bc1 = 0.19, bc2 = 0.001999;
  // p = 0.899 * 0.999 - 0.1 * (0.02 / 0.19) / sqrt(0.00031225 / 0.001999) = 0.8714673...
  set_grad(w, {-0.25f});
  opt.step();
  EXPECT_FLOAT_EQ(opt.state(0).exp_avg.item({0}), 0.02f);
  EXPECT_FLOAT_EQ(opt.state(0).exp_avg_sq.item({0}), 0.00031225f);
  const double expected = 0.899 * 0.999 - 0.1 * (0.02 / 0.19) / std::sqrt(0.00031225 / 0.001999);
  EXPECT_NEAR(w.value.item({0}), expected, 2e-7);
}

struct Variant {
  const char* name;
  double lr, beta1, beta2, eps, weight_decay;
};

TEST(AdamWTest, MatchesDoubleReferenceOverTwelveSteps) {
  const std::vector<Variant> variants{
      {"defaults", 1e-2, 0.9, 0.999, 1e-8, 0.01},
      {"gpt betas, wd 0.1", 3e-3, 0.9, 0.95, 1e-8, 0.1},
      {"no decay, eps 1e-6", 1e-2, 0.9, 0.999, 1e-6, 0.0},
      {"beta1 0.3 (lerp's large-weight branch)", 1e-2, 0.3, 0.9, 1e-8, 0.05},
      {"beta1 0", 1e-2, 0.0, 0.99, 1e-8, 0.01}};
  const std::vector<float> init{0.5f, -1.25f, 2.0f, 0.0f, -0.75f, 3.5f, 1e-3f, -0.01f};
  for (const Variant& c : variants) {
    nn::Parameter w = make_param("w", init);
    nn::Parameter b = make_param("b", {0.25f, -0.5f, 4.0f}, /*decay=*/false);
    AdamW opt({&w, &b}, c.lr, {c.beta1, c.beta2}, c.eps, c.weight_decay);
    ReferenceAdamW rw{c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, {}, {}, {}};
    ReferenceAdamW rb{c.lr, c.beta1, c.beta2, c.eps, 0.0, {0.25, -0.5, 4.0}, {}, {}};
    rw.p.assign(init.begin(), init.end());
    for (int t = 1; t <= 12; ++t) {
      std::vector<float> gw(init.size()), gb(3);
      for (size_t i = 0; i < gw.size(); ++i) gw[i] = grad_at(t, i);
      for (size_t i = 0; i < gb.size(); ++i) gb[i] = grad_at(t, i + 20);
      set_grad(w, gw);
      set_grad(b, gb);
      opt.step();
      rw.step(std::vector<double>(gw.begin(), gw.end()));
      rb.step(std::vector<double>(gb.begin(), gb.end()));
    }
    for (size_t i = 0; i < init.size(); ++i) {
      const auto k = static_cast<int64_t>(i);
      EXPECT_NEAR(w.value.item({k}), rw.p[i], 2e-6 * (1 + std::abs(rw.p[i]))) << c.name << " w[" << i << "]";
      EXPECT_NEAR(opt.state(0).exp_avg.item({k}), rw.m[i], 1e-6) << c.name << " m[" << i << "]";
      EXPECT_NEAR(opt.state(0).exp_avg_sq.item({k}), rw.v[i], 1e-6 * (1 + rw.v[i])) << c.name << " v[" << i << "]";
    }
    for (size_t i = 0; i < 3; ++i)
      EXPECT_NEAR(b.value.item({static_cast<int64_t>(i)}), rb.p[i], 2e-6 * (1 + std::abs(rb.p[i])))
          << c.name << " b[" << i << "]";
  }
}

// What ZeRO relies on: updating a shard of (p, g, m, v) gives exactly that
// shard of the whole-parameter update.
TEST(AdamWTest, ShardUpdateEqualsSliceOfWholeUpdateBitForBit) {
  constexpr size_t kN = 11;
  std::vector<float> p(kN), m(kN, 0.0f), v(kN, 0.0f);
  for (size_t i = 0; i < kN; ++i) p[i] = 0.37f * static_cast<float>(i) - 1.5f;
  std::vector<float> whole = p, wm = m, wv = v, shard = p, sm = m, sv = v;
  const AdamWHParams h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  for (int t = 1; t <= 3; ++t) {
    std::vector<float> g(kN);
    for (size_t i = 0; i < kN; ++i) g[i] = grad_at(t, i);
    adamw_update(whole.data(), g.data(), wm.data(), wv.data(), kN, t, h);
    for (auto [lo, hi] : {std::pair<size_t, size_t>{0, 3}, {3, 4}, {4, kN}})
      adamw_update(shard.data() + lo, g.data() + lo, sm.data() + lo, sv.data() + lo, hi - lo, t, h);
  }
  EXPECT_EQ(whole, shard);
  EXPECT_EQ(wm, sm);
  EXPECT_EQ(wv, sv);
  EXPECT_THROW(adamw_update(whole.data(), whole.data(), wm.data(), wv.data(), kN, 0, h), InvalidArgument);
}

TEST(AdamWTest, HparamsForDropsDecayOfUndecayedParameters) {
  nn::Parameter w = make_param("w", {1.0f});
  nn::Parameter b = make_param("b", {1.0f}, false);
  AdamW opt({&w, &b}, 0.5, {0.8, 0.9}, 1e-7, 0.2);
  EXPECT_EQ(opt.hparams_for(0).weight_decay, 0.2);
  EXPECT_EQ(opt.hparams_for(1).weight_decay, 0.0);
  EXPECT_EQ(opt.hparams_for(1).lr, 0.5);
  EXPECT_EQ(opt.hparams_for(1).beta1, 0.8);
  EXPECT_EQ(opt.hparams_for(1).beta2, 0.9);
  EXPECT_EQ(opt.hparams_for(1).eps, 1e-7);
}

TEST(AdamWTest, MomentsAreChargedToTheTracker) {
  MemoryTracker tracker;
  nn::Parameter w = make_param("w", std::vector<float>(1000, 1.0f));
  nn::Parameter b = make_param("b", std::vector<float>(24, 1.0f), false);
  {
    AdamW opt({&w, &b}, 1e-3, {0.9, 0.999}, 1e-8, 0.01, &tracker);
    EXPECT_EQ(opt.state_bytes(), 2u * 4u * 1024u);
    EXPECT_EQ(tracker.in_use(MemoryCategory::optimizer), 2u * 4u * 1024u);
    EXPECT_EQ(tracker.in_use(MemoryCategory::parameters), 0u);
  }
  EXPECT_EQ(tracker.in_use(MemoryCategory::optimizer), 0u);
}

TEST(AdamWTest, UndefinedGradKeepsItsStepCount) {
  nn::Parameter w = make_param("w", {1.0f});
  nn::Parameter late = make_param("late", {1.0f});
  late.grad = Tensor();
  AdamW opt({&w, &late}, 0.1, {0.9, 0.999}, 1e-8, 0.0);
  set_grad(w, {1.0f});
  opt.step();
  opt.step();
  EXPECT_EQ(opt.state(0).step, 2);
  EXPECT_EQ(opt.state(1).step, 0);
  EXPECT_EQ(late.value.item({0}), 1.0);
  // Its first real step is bias-corrected as step 1: a move of lr * sign(g).
  late.grad = Tensor::full({1}, -4.0, DType::f32);
  opt.step();
  EXPECT_EQ(opt.state(1).step, 1);
  EXPECT_FLOAT_EQ(late.value.item({0}), 1.1f);
}

TEST(AdamWTest, RejectsBadHyperparameters) {
  nn::Parameter w = make_param("w", {1.0f});
  EXPECT_THROW(AdamW({&w}, -1e-3), InvalidArgument);
  EXPECT_THROW(AdamW({&w}, 1e-3, {1.0, 0.999}), InvalidArgument);
  EXPECT_THROW(AdamW({&w}, 1e-3, {0.9, -0.1}), InvalidArgument);
  EXPECT_THROW(AdamW({&w}, 1e-3, {0.9, 0.999}, -1e-8), InvalidArgument);
  EXPECT_THROW(AdamW({&w}, 1e-3, {0.9, 0.999}, 1e-8, -0.01), InvalidArgument);
  try {
    AdamW({&w}, 1e-3, {0.9, 1.5});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "AdamW: beta2 = 1.5 is out of range (hint: use a finite beta2 in [0, 1))");
  }
}

}  // namespace
}  // namespace meshtrain::optim
