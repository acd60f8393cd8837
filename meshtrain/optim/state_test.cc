// Optimizer state export/import: a round trip continues training bit for
// bit, and state that does not fit is refused with errors naming the
// parameter and the field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/sgd.h"
#include "meshtrain/testing/optim.h"

namespace meshtrain::optim {
namespace {

using ::testing::HasSubstr;
using testing::f32_bits;
using testing::make_param;
using testing::set_grad;

using Factory = std::function<std::unique_ptr<Optimizer>(std::vector<nn::Parameter*>)>;

// Three parameters of different sizes (one not decayed).
std::vector<nn::Parameter> make_params() {
  std::vector<nn::Parameter> ps;
  ps.push_back(make_param("layers.0.weight", {0.5f, -1.25f, 2.0f, 0.75f, -0.1f, 0.3f}));
  ps.push_back(make_param("layers.0.bias", {0.1f, -0.2f}, /*decay=*/false));
  ps.push_back(make_param("layers.1.weight", {1.5f, -0.5f, 0.25f}));
  return ps;
}

std::vector<nn::Parameter*> pointers(std::vector<nn::Parameter>& ps) {
  std::vector<nn::Parameter*> out;
  for (auto& p : ps) out.push_back(&p);
  return out;
}

// A deterministic gradient for step t (not all-zero, sign-changing).
void set_grads(std::vector<nn::Parameter>& ps, int t) {
  for (size_t k = 0; k < ps.size(); ++k) {
    std::vector<float> g(static_cast<size_t>(ps[k].value.numel()));
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(std::sin(0.7 * t + 1.3 * i + k) * (1.0 + 0.2 * i));
    set_grad(ps[k], g);
  }
}

// Copies of the parameters' current values (fresh grads).
std::vector<nn::Parameter> copy_params(const std::vector<nn::Parameter>& ps) {
  std::vector<nn::Parameter> out;
  for (const auto& p : ps) {
    const float* v = p.value.data<float>();
    out.push_back(make_param(p.name, std::vector<float>(v, v + p.value.numel()), p.weight_decay));
  }
  return out;
}

void expect_round_trip_continues_bit_for_bit(const Factory& make, const std::vector<std::string>& fields) {
  std::vector<nn::Parameter> a = make_params();
  std::unique_ptr<Optimizer> opt_a = make(pointers(a));
  for (int t = 0; t < 3; ++t) {
    set_grads(a, t);
    opt_a->step();
  }
  const OptimizerState saved = opt_a->export_state();
  ASSERT_EQ(saved.size(), 3u);
  for (size_t k = 0; k < saved.size(); ++k) {
    EXPECT_EQ(saved[k].param, a[k].name);
    EXPECT_EQ(saved[k].step, 3);
    ASSERT_EQ(saved[k].tensors.size(), fields.size());
    for (size_t f = 0; f < fields.size(); ++f) {
      EXPECT_EQ(saved[k].tensors[f].first, fields[f]);
      EXPECT_EQ(saved[k].tensors[f].second.shape(), a[k].value.shape());
    }
  }
  // A fresh optimizer over copies; the state is imported in reverse order
  // (it is matched by name, not position).
  std::vector<nn::Parameter> b = copy_params(a);
  std::unique_ptr<Optimizer> opt_b = make(pointers(b));
  opt_b->import_state(OptimizerState(saved.rbegin(), saved.rend()));
  // The export is a copy: stepping A does not change what B imported.
  for (int t = 3; t < 6; ++t) {
    set_grads(a, t);
    set_grads(b, t);
    opt_a->set_lr(opt_a->lr() * 0.9);
    opt_b->set_lr(opt_b->lr() * 0.9);
    opt_a->step();
    opt_b->step();
  }
  for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(f32_bits(a[k].value), f32_bits(b[k].value)) << a[k].name;
  const OptimizerState sa = opt_a->export_state(), sb = opt_b->export_state();
  for (size_t k = 0; k < sa.size(); ++k) {
    EXPECT_EQ(sa[k].step, 6);
    EXPECT_EQ(sb[k].step, 6);
    for (size_t f = 0; f < fields.size(); ++f)
      EXPECT_EQ(f32_bits(sa[k].tensors[f].second), f32_bits(sb[k].tensors[f].second)) << sa[k].param;
  }
  // Without the import, the fresh optimizer would have diverged: the test can fail.
  std::vector<nn::Parameter> c = copy_params(a);
  std::unique_ptr<Optimizer> opt_c = make(pointers(c));
  std::vector<nn::Parameter> d = copy_params(a);
  std::unique_ptr<Optimizer> opt_d = make(pointers(d));
  opt_d->import_state(opt_a->export_state());
  set_grads(c, 9);
  set_grads(d, 9);
  opt_c->step();
  opt_d->step();
  EXPECT_NE(f32_bits(c[0].value), f32_bits(d[0].value));
}

TEST(OptimizerState, AdamWRoundTripContinuesBitForBit) {
  expect_round_trip_continues_bit_for_bit(
      [](std::vector<nn::Parameter*> ps) { return std::make_unique<AdamW>(ps, 0.01, std::pair{0.9, 0.99}, 1e-8, 0.1); },
      {"exp_avg", "exp_avg_sq"});
}

TEST(OptimizerState, SgdWithMomentumRoundTripContinuesBitForBit) {
  expect_round_trip_continues_bit_for_bit(
      [](std::vector<nn::Parameter*> ps) { return std::make_unique<SGD>(ps, 0.05, 0.9, true, 0.01); },
      {"momentum_buffer"});
}

TEST(OptimizerState, SgdWithoutMomentumKeepsOnlyTheStep) {
  std::vector<nn::Parameter> a = make_params();
  SGD opt(pointers(a), 0.1);
  set_grads(a, 0);
  opt.step();
  const OptimizerState s = opt.export_state();
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[1].step, 1);
  EXPECT_TRUE(s[1].tensors.empty());
}

std::string import_error(Optimizer& opt, const OptimizerState& s) {
  try {
    opt.import_state(s);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(OptimizerState, StateThatDoesNotFitIsRefusedNamingParameterAndField) {
  std::vector<nn::Parameter> a = make_params();
  AdamW opt(pointers(a), 0.01);
  set_grads(a, 0);
  opt.step();
  const OptimizerState good = opt.export_state();
  const auto before = f32_bits(opt.state(0).exp_avg);

  OptimizerState missing = good;
  missing.erase(missing.begin() + 1);
  EXPECT_THAT(import_error(opt, missing), HasSubstr("no entry for parameter 'layers.0.bias'"));

  OptimizerState unknown = good;
  unknown.push_back(good[0]);
  unknown.back().param = "head.weight";
  EXPECT_THAT(import_error(opt, unknown), HasSubstr("parameter 'head.weight', which this AdamW does not update"));

  OptimizerState twice = good;
  twice.push_back(good[2]);
  EXPECT_THAT(import_error(opt, twice), HasSubstr("holds parameter 'layers.1.weight' twice"));

  OptimizerState shape = good;
  shape[2].tensors[1].second = Tensor::zeros({4}, DType::f32);
  EXPECT_THAT(import_error(opt, shape),
              HasSubstr("parameter 'layers.1.weight', field 'exp_avg_sq': f32 [4] but the parameter needs f32 [3]"));

  OptimizerState dtype = good;
  dtype[0].tensors[0].second = Tensor::zeros({6}, DType::bf16);
  EXPECT_THAT(import_error(opt, dtype), HasSubstr("parameter 'layers.0.weight', field 'exp_avg': bf16 [6]"));

  OptimizerState field = good;
  field[1].tensors.emplace_back("momentum_buffer", Tensor::zeros({2}, DType::f32));
  EXPECT_THAT(import_error(opt, field),
              HasSubstr("parameter 'layers.0.bias': unknown field 'momentum_buffer' (AdamW keeps exp_avg, exp_avg_sq)"));

  OptimizerState lacking = good;
  lacking[0].tensors.pop_back();
  EXPECT_THAT(import_error(opt, lacking), HasSubstr("parameter 'layers.0.weight': field 'exp_avg_sq' is missing"));

  OptimizerState negative = good;
  negative[2].step = -1;
  EXPECT_THAT(import_error(opt, negative), HasSubstr("parameter 'layers.1.weight': step -1 is negative"));

  // Nothing was written by the refused imports (the last entry was checked last).
  EXPECT_EQ(f32_bits(opt.state(0).exp_avg), before);
  EXPECT_EQ(opt.state(0).step, 1);

  // SGD state into AdamW: the field names say which optimizer it came from.
  std::vector<nn::Parameter> b = make_params();
  SGD sgd(pointers(b), 0.1, 0.9);
  EXPECT_THAT(import_error(opt, sgd.export_state()), HasSubstr("unknown field 'momentum_buffer'"));
}

TEST(OptimizerState, DuplicateParameterNamesAreRefused) {
  nn::Parameter p = make_param("w", {1.0f}), q = make_param("w", {2.0f});
  SGD opt({&p, &q}, 0.1, 0.9);
  EXPECT_THROW((void)opt.export_state(), InvalidArgument);
  try {
    (void)opt.export_state();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("parameters 0 and 1 are both named 'w'"));
  }
}

}  // namespace
}  // namespace meshtrain::optim
