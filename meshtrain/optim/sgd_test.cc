#include "meshtrain/testing/optim.h"
#include "meshtrain/optim/sgd.h"

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

// The gradient fed at step t to element i: varied signs and magnitudes.
float grad_at(int t, size_t i) { return static_cast<float>(std::sin(1.3 * t + 0.7 * i) * (1.0 + 0.5 * i)); }

// torch.optim.SGD's update, written out in double.
struct ReferenceSGD {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  std::vector<double> p, buf;
  int t = 0;

  void step(const std::vector<double>& g) {
    ++t;
    if (buf.empty()) buf.assign(p.size(), 0.0);
    for (size_t i = 0; i < p.size(); ++i) {
      double d = g[i] + weight_decay * p[i];
      if (momentum != 0.0) {
        buf[i] = t == 1 ? d : momentum * buf[i] + (1.0 - dampening) * d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
};

TEST(SGDTest, HandComputedPlainMomentumNesterovAndDecay) {
  {  // plain: p = 1 - 0.1 * 0.5
    nn::Parameter w = make_param("w", {1.0f});
    SGD opt({&w}, 0.1);
    set_grad(w, {0.5f});
    opt.step();
    EXPECT_FLOAT_EQ(w.value.item({0}), 0.95f);
    EXPECT_EQ(opt.state_bytes(), 0u);
  }
  {  // momentum 0.9: buf = 0.5 -> p = 0.95; buf = 0.9 * 0.5 + 0.5 = 0.95 -> p = 0.855
    nn::Parameter w = make_param("w", {1.0f});
    SGD opt({&w}, 0.1, 0.9);
    set_grad(w, {0.5f});
    opt.step();
    EXPECT_FLOAT_EQ(w.value.item({0}), 0.95f);
    EXPECT_FLOAT_EQ(opt.state(0).momentum_buffer.item({0}), 0.5f);
    opt.step();
    EXPECT_FLOAT_EQ(opt.state(0).momentum_buffer.item({0}), 0.95f);
    EXPECT_FLOAT_EQ(w.value.item({0}), 0.855f);
    EXPECT_EQ(opt.state(0).step, 2);
  }
  {  // nesterov: buf = 0.5, d = 0.5 + 0.9 * 0.5 = 0.95 -> p = 0.905;
     // then buf = 0.95, d = 0.5 + 0.9 * 0.95 = 1.355 -> p = 0.7695
    nn::Parameter w = make_param("w", {1.0f});
    SGD opt({&w}, 0.1, 0.9, /*nesterov=*/true);
    set_grad(w, {0.5f});
    opt.step();
    EXPECT_FLOAT_EQ(w.value.item({0}), 0.905f);
    opt.step();
    EXPECT_FLOAT_EQ(w.value.item({0}), 0.7695f);
  }
  {  // weight decay 0.1: d = 0.5 + 0.1 * 1 = 0.6 -> p = 0.94; undecayed b: 0.95
    nn::Parameter w = make_param("w", {1.0f});
    nn::Parameter b = make_param("b", {1.0f}, /*decay=*/false);
    SGD opt({&w, &b}, 0.1, 0.0, false, /*weight_decay=*/0.1);
    set_grad(w, {0.5f});
    set_grad(b, {0.5f});
    opt.step();
    EXPECT_FLOAT_EQ(w.value.item({0}), 0.94f);
    EXPECT_FLOAT_EQ(b.value.item({0}), 0.95f);
  }
  {  // dampening 0.5: first buf = 0.5 (not damped); then 0.9 * 0.5 + 0.5 * 0.5 = 0.7
    nn::Parameter w = make_param("w", {1.0f});
    SGD opt({&w}, 0.1, 0.9, false, 0.0, /*dampening=*/0.5);
    set_grad(w, {0.5f});
    opt.step();
    opt.step();
    EXPECT_FLOAT_EQ(opt.state(0).momentum_buffer.item({0}), 0.7f);
    EXPECT_FLOAT_EQ(w.value.item({0}), 1.0f - 0.05f - 0.07f);
  }
}

struct Variant {
  const char* name;
  double momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(SGDTest, MatchesDoubleReferenceOverTenSteps) {
  const std::vector<Variant> variants{{"plain", 0, 0, 0, false},
                                      {"momentum", 0.9, 0, 0, false},
                                      {"nesterov", 0.9, 0, 0, true},
                                      {"decay", 0.9, 0, 0.05, false},
                                      {"nesterov+decay", 0.8, 0, 0.05, true},
                                      {"dampening", 0.9, 0.3, 0.01, false}};
  const std::vector<float> init{0.5f, -1.25f, 2.0f, 0.0f, -0.75f, 3.5f, 1e-3f};
  for (const Variant& v : variants) {
    nn::Parameter w = make_param("w", init);
    nn::Parameter b = make_param("b", {0.25f, -0.5f}, /*decay=*/false);
    SGD opt({&w, &b}, 0.05, v.momentum, v.nesterov, v.weight_decay, v.dampening);
    ReferenceSGD rw{0.05, v.momentum, v.dampening, v.weight_decay, v.nesterov, {}, {}};
    ReferenceSGD rb{0.05, v.momentum, v.dampening, 0.0, v.nesterov, {0.25, -0.5}, {}};
    rw.p.assign(init.begin(), init.end());
    for (int t = 1; t <= 10; ++t) {
      std::vector<float> gw(init.size()), gb(2);
      for (size_t i = 0; i < gw.size(); ++i) gw[i] = grad_at(t, i);
      for (size_t i = 0; i < gb.size(); ++i) gb[i] = grad_at(t, i + 10);
      set_grad(w, gw);
      set_grad(b, gb);
      opt.step();
      rw.step(std::vector<double>(gw.begin(), gw.end()));
      rb.step(std::vector<double>(gb.begin(), gb.end()));
    }
    for (size_t i = 0; i < init.size(); ++i)
      EXPECT_NEAR(w.value.item({static_cast<int64_t>(i)}), rw.p[i], 1e-5 * (1 + std::abs(rw.p[i])))
          << v.name << " w[" << i << "]";
    for (size_t i = 0; i < 2; ++i)
      EXPECT_NEAR(b.value.item({static_cast<int64_t>(i)}), rb.p[i], 1e-5 * (1 + std::abs(rb.p[i])))
          << v.name << " b[" << i << "]";
  }
}

TEST(SGDTest, SliceUpdateEqualsSliceOfWholeUpdate) {
  std::vector<float> p(9), g(9), buf(9, 0.0f);
  for (size_t i = 0; i < 9; ++i) {
    p[i] = 0.1f * static_cast<float>(i) - 0.3f;
    g[i] = grad_at(1, i);
  }
  std::vector<float> whole = p, whole_buf = buf, parts = p, parts_buf = buf;
  const SGDHParams h{.lr = 0.1, .momentum = 0.9, .dampening = 0.0, .weight_decay = 0.01, .nesterov = true};
  for (bool first : {true, false}) {
    sgd_update(whole.data(), g.data(), whole_buf.data(), 9, first, h);
    sgd_update(parts.data(), g.data(), parts_buf.data(), 4, first, h);
    sgd_update(parts.data() + 4, g.data() + 4, parts_buf.data() + 4, 5, first, h);
  }
  EXPECT_EQ(whole, parts);
  EXPECT_EQ(whole_buf, parts_buf);
}

TEST(SGDTest, UndefinedGradIsSkippedAndZeroGradZeroes) {
  nn::Parameter w = make_param("w", {1.0f, 2.0f});
  nn::Parameter frozen = make_param("frozen", {3.0f});
  frozen.grad = Tensor();
  SGD opt({&w, &frozen}, 0.5, 0.9);
  set_grad(w, {1.0f, -1.0f});
  opt.step();
  EXPECT_EQ(w.value.to_vector(), (std::vector<double>{0.5, 2.5}));
  EXPECT_EQ(frozen.value.to_vector(), (std::vector<double>{3.0}));
  EXPECT_EQ(opt.state(0).step, 1);
  EXPECT_EQ(opt.state(1).step, 0);
  opt.zero_grad();
  EXPECT_EQ(w.grad.to_vector(), (std::vector<double>{0.0, 0.0}));
  EXPECT_FALSE(frozen.grad.defined());
}

TEST(SGDTest, SetLrAppliesToLaterSteps) {
  nn::Parameter w = make_param("w", {1.0f});
  SGD opt({&w}, 0.1);
  set_grad(w, {1.0f});
  opt.set_lr(0.25);
  EXPECT_EQ(opt.lr(), 0.25);
  opt.step();
  EXPECT_FLOAT_EQ(w.value.item({0}), 0.75f);
  EXPECT_THROW(opt.set_lr(-1.0), InvalidArgument);
  EXPECT_THROW(opt.set_lr(NAN), InvalidArgument);
}

TEST(SGDTest, MomentumBuffersAreChargedToTheTracker) {
  MemoryTracker tracker;
  nn::Parameter w = make_param("w", std::vector<float>(100, 1.0f));
  nn::Parameter b = make_param("b", std::vector<float>(10, 1.0f));
  {
    SGD opt({&w, &b}, 0.1, 0.9, false, 0.0, 0.0, &tracker);
    EXPECT_EQ(opt.state_bytes(), 440u);
    EXPECT_EQ(tracker.in_use(MemoryCategory::optimizer), 440u);
  }
  EXPECT_EQ(tracker.in_use(MemoryCategory::optimizer), 0u);
  SGD no_momentum({&w, &b}, 0.1, 0.0, false, 0.0, 0.0, &tracker);
  EXPECT_EQ(no_momentum.state_bytes(), 0u);
  EXPECT_EQ(tracker.in_use(MemoryCategory::optimizer), 0u);
}

TEST(SGDTest, RejectsBadHyperparametersAndParameters) {
  nn::Parameter w = make_param("layers.0.weight", {1.0f, 2.0f});
  try {
    SGD({&w}, 0.1, 0.0, /*nesterov=*/true);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "SGD");
    EXPECT_NE(std::string(e.what()).find("nesterov needs momentum > 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SGD({&w}, 0.1, 0.9, true, 0.0, /*dampening=*/0.1), InvalidArgument);
  EXPECT_THROW(SGD({&w}, -0.1), InvalidArgument);
  EXPECT_THROW(SGD({&w}, 0.1, -0.9), InvalidArgument);
  EXPECT_THROW(SGD({&w}, 0.1, 0.0, false, -1.0), InvalidArgument);
  EXPECT_THROW(SGD({nullptr}, 0.1), InvalidArgument);
  try {
    SGD({&w, &w}, 0.1);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'layers.0.weight' appears twice"), std::string::npos) << e.what();
  }
  nn::Parameter half = make_param("h", {1.0f});
  half.value = half.value.to(DType::bf16);
  EXPECT_THROW(SGD({&half}, 0.1), InvalidArgument);

  SGD opt({&w}, 0.1);
  w.grad = Tensor::zeros({3}, DType::f32);
  try {
    opt.step();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "SGD::step");
    EXPECT_NE(std::string(e.what()).find("'layers.0.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[3]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::optim
