// Layers: values against closed forms and naive loops, gradients against
// central finite differences, dropout masks across batch splits, buffers.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/dropout.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/testing/grad_check.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/nn/layer_norm.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/llama.h"
#include "meshtrain/nn/sequential.h"
#include "meshtrain/nn/swiglu.h"

namespace meshtrain::nn {
namespace {

using testing::expect_grad_matches;
using testing::random_tensor;
using testing::RecordingHook;
using testing::weighted_sum;


// ---- Linear ----

TEST(Linear, HalfComputeMultipliesRoundedOperandsAndRoundsOutputs) {
  for (DType dt : {DType::bf16, DType::f16}) {
    Linear fc(5, 3, "fc", 4);
    fc.set_compute_dtype(dt);
    const Tensor x = random_tensor({4, 5}, 1), dy = random_tensor({4, 3}, 2);
    auto r = [&](const Tensor& t) { return t.to(dt).to(DType::f32); };
    // Reference: f32 GEMMs on rounded operands (x, dy and the weight: the
    // products a bf16/f16 GEMM with f32 accumulation forms), rounded results.
    const Tensor w = r(fc.weight().value);
    Tensor want_y = Tensor::zeros({4, 3}, DType::f32);
    for (int64_t i = 0; i < 4; ++i)
      want_y.narrow(0, i, 1).copy_from(fc.bias().value.view({1, 3}));
    matmul(r(x), w, want_y, false, false, 1.0, 1.0);
    want_y = r(want_y);
    Tensor want_dx = r(matmul(r(dy), w.transpose(0, 1)));
    Tensor want_dw = matmul(r(x).transpose(0, 1), r(dy));
    EXPECT_EQ(fc.forward(x).to_vector(), want_y.to_vector()) << dtype_name(dt);
    fc.zero_grad();
    EXPECT_EQ(fc.backward(dy).to_vector(), want_dx.to_vector());
    EXPECT_EQ(fc.weight().grad.to_vector(), want_dw.to_vector());
    EXPECT_NE(want_y.to_vector(), matmul(x, fc.weight().value).to_vector());  // rounding happened
  }
  Sequential net;
  net.add(std::make_unique<Linear>(2, 2, net.next_name(), 1));
  net.set_compute_dtype(DType::bf16);
  Linear& late = net.add(std::make_unique<Linear>(2, 2, net.next_name(), 1));
  EXPECT_EQ(late.compute_dtype(), DType::bf16);  // children added later inherit it
  EXPECT_THROW(net.set_compute_dtype(DType::i8), InvalidArgument);
}

// Row blocks: the GEMMs run block by block in the given order, ready(j)
// before block j's rows are read (a caller fills them there), done(j, rows)
// with block j's finished output rows; the results equal one GEMM's within
// rounding, in f32 and bf16, fused and split backward; a bad order or a
// block count that does not divide the rows is refused.
TEST(Linear, RowBlocksRunInOrderAndEqualOneGemm) {
  for (const DType dt : {DType::f32, DType::bf16})
    for (const bool split : {false, true}) {
      Linear whole(6, 5, "fc", 3), blocked(6, 5, "fc", 3);
      whole.set_compute_dtype(dt);
      blocked.set_compute_dtype(dt);
      const Tensor x = random_tensor({3, 4, 6}, 1), dy = random_tensor({3, 4, 5}, 2);
      const Tensor want_y = whole.forward(x);
      const Tensor want_dx = whole.backward(dy);
      // Block j's input rows appear only in ready(j).
      const Tensor xs = Tensor::zeros({3, 4, 6}, DType::f32), dys = Tensor::zeros({3, 4, 5}, DType::f32);
      std::vector<std::string> calls;
      const auto blocks = [&](const Tensor& from, const Tensor& to) {
        return RowBlocks{.order = {2, 0, 1},
                         .ready = [&calls, from, to](int64_t j) {
                           calls.push_back(fmt::format("ready {}", j));
                           to.narrow(0, j, 1).copy_from(from.narrow(0, j, 1));
                         },
                         .done = [&calls](int64_t j, const Tensor& rows) {
                           calls.push_back(fmt::format("done {} {}", j, rows.size(0)));
                         }};
      };
      blocked.set_next_forward_blocks(blocks(x, xs));
      const Tensor y = blocked.forward(xs);
      blocked.set_next_backward_blocks(blocks(dy, dys));
      Tensor dx;
      if (split) {
        dx = blocked.backward_input(dys, blocked.own_saved());
        blocked.backward_weight(blocked.own_saved());
      } else {
        dx = blocked.backward(dys);
      }
      const std::vector<std::string> once = {"ready 2", "done 2 4", "ready 0", "done 0 4", "ready 1", "done 1 4"};
      std::vector<std::string> twice = once;
      twice.insert(twice.end(), once.begin(), once.end());
      EXPECT_EQ(calls, twice);
      const double tol = dt == DType::f32 ? 1e-6 : 1e-2;
      const auto near = [&](const Tensor& got, const Tensor& want, const char* what) {
        const std::vector<double> g = got.to_vector(), w = want.to_vector();
        ASSERT_EQ(g.size(), w.size()) << what;
        for (size_t i = 0; i < g.size(); ++i)
          EXPECT_NEAR(g[i], w[i], tol * (1 + std::abs(w[i]))) << what << " " << i << " " << dtype_name(dt);
      };
      near(y, want_y, "y");
      near(dx, want_dx, "dx");
      near(blocked.weight().grad, whole.weight().grad, "dW");
      near(blocked.bias().grad, whole.bias().grad, "db");
      // The next call is a plain one again.
      calls.clear();
      (void)blocked.forward(x);
      EXPECT_TRUE(calls.empty());
    }
  Linear fc(6, 5, "fc", 3);
  const Tensor x = random_tensor({3, 4, 6}, 1);
  fc.set_next_forward_blocks(RowBlocks{.order = {0, 0, 1}});
  EXPECT_THAT(testing::error_of([&] { fc.forward(x); }), ::testing::HasSubstr("not a permutation of 0..2"));
  fc.set_next_forward_blocks(RowBlocks{.order = {0, 1, 2, 3, 4}});
  EXPECT_THAT(testing::error_of([&] { fc.forward(x); }), ::testing::HasSubstr("12 rows in 5 row blocks"));
}

TEST(Linear, ForwardMatchesNaiveLoopWithWeightConvention) {
  Linear fc(3, 2, "fc", 7);
  fc.weight().value.copy_from(Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2}));  // (in, out)
  fc.bias().value.copy_from(Tensor::from_vector(std::vector<float>{0.5f, -1}, {2}));
  Tensor x = Tensor::from_vector(std::vector<float>{1, 0, -1, 2, 1, 0}, {2, 3});
  // y = x W + b: row 0 = [1-5, 2-6] + b, row 1 = [2+3, 4+4] + b
  EXPECT_EQ(fc.forward(x).to_vector(), (std::vector<double>{-3.5, -5, 5.5, 7}));
}

TEST(Linear, InitIsKaimingUniformKeyedByName) {
  Linear fc(16, 8, "encoder.0", 42);
  EXPECT_EQ(fc.weight().name, "encoder.0.weight");
  EXPECT_EQ(fc.bias().name, "encoder.0.bias");
  const double bound = 0.25;  // 1 / sqrt(16)
  const std::vector<double> w = fc.weight().value.to_vector();
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ(w[i], static_cast<double>(static_cast<float>(
                        uniform_at(42, key_from_name("encoder.0.weight"), i, -bound, bound))));
  }
  const std::vector<double> b = fc.bias().value.to_vector();
  for (size_t i = 0; i < b.size(); ++i) {
    ASSERT_EQ(b[i], static_cast<double>(static_cast<float>(
                        uniform_at(42, key_from_name("encoder.0.bias"), i, -bound, bound))));
  }
  EXPECT_EQ(fc.weight().info.kind, sharding::ParamKind::linear_weight);
  EXPECT_EQ(fc.weight().info.shape, (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(fc.weight().info.role, sharding::LinearRole::none);
  EXPECT_TRUE(fc.weight().weight_decay);
  EXPECT_EQ(fc.bias().info.kind, sharding::ParamKind::linear_bias);
  EXPECT_FALSE(fc.bias().weight_decay);
  EXPECT_EQ(l2_norm(fc.weight().grad), 0.0);
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  Linear fc(5, 4, "fc", 3);
  Tensor x = random_tensor({2, 3, 5}, 1);  // leading dims are rows
  Tensor w = random_tensor({2, 3, 4}, 2);
  auto f = [&] { return weighted_sum(fc.forward(x), w); };
  fc.zero_grad();
  fc.forward(x);
  Tensor dx = fc.backward(w);
  ASSERT_EQ(dx.shape(), x.shape());
  expect_grad_matches(f, x, dx.clone());
  expect_grad_matches(f, fc.weight().value, fc.weight().grad.clone());
  expect_grad_matches(f, fc.bias().value, fc.bias().grad.clone());
}

TEST(Linear, GradientsAccumulateAndInputGradCanBeSkipped) {
  Linear fc(4, 3, "fc", 3, LinearOptions{.bias = true, .needs_input_grad = false});
  Tensor x = random_tensor({5, 4}, 1);
  Tensor dy = random_tensor({5, 3}, 2);
  fc.forward(x);
  EXPECT_FALSE(fc.backward(dy).defined());
  const std::vector<double> once = fc.weight().grad.to_vector();
  fc.forward(x);
  fc.backward(dy);
  const std::vector<double> twice = fc.weight().grad.to_vector();
  for (size_t i = 0; i < once.size(); ++i) EXPECT_FLOAT_EQ(twice[i], 2 * once[i]);
  fc.zero_grad();
  EXPECT_EQ(l2_norm(fc.weight().grad), 0.0);
}

TEST(Linear, WithoutBiasHasOnlyAWeight) {
  Linear fc(4, 3, "", 3, /*bias=*/false);
  ASSERT_EQ(fc.parameters().size(), 1u);
  EXPECT_EQ(fc.parameters()[0]->name, "weight");
  EXPECT_THROW(fc.bias(), InvalidArgument);
}

TEST(Linear, BadShapesAndOrderAreErrors) {
  Linear fc(4, 3, "fc", 3);
  EXPECT_THROW(fc.forward(random_tensor({2, 5}, 1)), InvalidArgument);
  EXPECT_THROW(fc.forward(Tensor::zeros({2, 4}, DType::f64)), InvalidArgument);
  EXPECT_THROW(fc.backward(random_tensor({2, 3}, 1)), InvalidArgument);  // no forward
  fc.forward(random_tensor({2, 4}, 1));
  EXPECT_THROW(fc.backward(random_tensor({3, 3}, 1)), InvalidArgument);
  EXPECT_THROW(Linear(0, 3, "fc", 1), InvalidArgument);
  try {
    fc.forward(random_tensor({2, 5}, 1));
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "Linear::forward");
    EXPECT_NE(std::string(e.what()).find("'fc'"), std::string::npos) << e.what();
  }
}

TEST(Linear, ReusesBuffersWhenTheCallerDropsResults) {
  Linear fc(4, 3, "fc", 3);
  Tensor x = random_tensor({5, 4}, 1);
  Tensor dy = random_tensor({5, 3}, 2);
  const void* y0 = fc.forward(x).data_ptr();
  const void* dx0 = fc.backward(dy).data_ptr();
  EXPECT_EQ(fc.forward(x).data_ptr(), y0);
  EXPECT_EQ(fc.backward(dy).data_ptr(), dx0);
  Tensor kept = fc.forward(x);  // held: the next forward must not overwrite it
  const std::vector<double> before = kept.to_vector();
  fc.backward(dy);
  Tensor next = fc.forward(random_tensor({5, 4}, 9));
  EXPECT_NE(next.data_ptr(), kept.data_ptr());
  EXPECT_EQ(kept.to_vector(), before);
}

// ---- activations ----

struct ActivationCase {
  std::string label;
  std::function<std::unique_ptr<Activation>()> make;
  // (x, f(x)) pairs from closed forms.
  std::vector<std::pair<float, double>> values;
};

std::vector<ActivationCase> activation_cases() {
  return {
      {"ReLU", [] { return std::make_unique<ReLU>(); }, {{-2, 0}, {0, 0}, {1.5f, 1.5}}},
      {"GELU-erf",
       [] { return std::make_unique<GELU>(); },
       {{1, 0.8413447460685429}, {-1, -0.15865525393145707}, {0, 0}}},
      {"GELU-tanh",
       [] { return std::make_unique<GELU>(GeluApproximation::tanh); },
       {{1, 0.8411919906082768}, {-1, -0.15880800939172324}}},
      {"SiLU", [] { return std::make_unique<SiLU>(); }, {{1, 0.7310585786300049}, {-2, -0.2384058440442351}}},
      {"Tanh", [] { return std::make_unique<Tanh>(); }, {{1, 0.7615941559557649}, {-0.5f, -0.46211715726000974}}},
      {"Sigmoid", [] { return std::make_unique<Sigmoid>(); }, {{0, 0.5}, {2, 0.8807970779778823}}},
  };
}

TEST(Activations, ValuesMatchClosedForms) {
  for (const ActivationCase& c : activation_cases()) {
    std::unique_ptr<Activation> act = c.make();
    for (auto [x, want] : c.values) {
      Tensor y = act->forward(Tensor::from_vector(std::vector<float>{x}, {1}));
      EXPECT_NEAR(y.to_vector()[0], want, 1e-6) << c.label << " at " << x;
    }
  }
}

TEST(Activations, BackwardMatchesFiniteDifferences) {
  for (const ActivationCase& c : activation_cases()) {
    SCOPED_TRACE(c.label);
    std::unique_ptr<Activation> act = c.make();
    Tensor x = random_tensor({3, 7}, 11, -3.0, 3.0);
    // Keep ReLU's kink out of reach of the finite-difference step.
    float* px = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      if (std::fabs(px[i]) < 0.05f) px[i] = 0.3f;
    }
    Tensor w = random_tensor({3, 7}, 12);
    auto f = [&] { return weighted_sum(act->forward(x), w); };
    act->forward(x);
    Tensor dx = act->backward(w).clone();
    expect_grad_matches(f, x, dx, 1e-3);
  }
}

// ---- LayerNorm ----

TEST(LayerNorm, MatchesClosedFormOnATinyRow) {
  LayerNorm ln(4, "ln");
  ln.parameters()[0]->value.copy_from(Tensor::from_vector(std::vector<float>{1, 2, 1, 1}, {4}));    // gamma
  ln.parameters()[1]->value.copy_from(Tensor::from_vector(std::vector<float>{0, 0, 0, 0.5f}, {4}));  // beta
  // x = [1, 2, 3, 4]: mean 2.5, biased variance 1.25.
  const std::vector<double> y = ln.forward(Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {1, 4})).to_vector();
  const double r = 1.0 / std::sqrt(1.25 + 1e-5);
  EXPECT_NEAR(y[0], -1.5 * r, 1e-6);
  EXPECT_NEAR(y[1], 2 * -0.5 * r, 1e-6);
  EXPECT_NEAR(y[2], 0.5 * r, 1e-6);
  EXPECT_NEAR(y[3], 1.5 * r + 0.5, 1e-6);
  EXPECT_EQ(ln.parameters()[0]->info.kind, sharding::ParamKind::norm);
  EXPECT_FALSE(ln.parameters()[0]->weight_decay);
  EXPECT_FALSE(ln.parameters()[1]->weight_decay);
  EXPECT_EQ(ln.parameters()[0]->name, "ln.weight");
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  LayerNorm ln(6, "ln");
  ln.parameters()[0]->value.copy_from(random_tensor({6}, 3, 0.5, 1.5));
  ln.parameters()[1]->value.copy_from(random_tensor({6}, 4));
  Tensor x = random_tensor({2, 2, 6}, 5, -2.0, 2.0);
  Tensor w = random_tensor({2, 2, 6}, 6);
  auto f = [&] { return weighted_sum(ln.forward(x), w); };
  ln.zero_grad();
  ln.forward(x);
  Tensor dx = ln.backward(w).clone();
  expect_grad_matches(f, x, dx, 1e-2);
  for (Parameter* p : ln.parameters()) expect_grad_matches(f, p->value, p->grad.clone());
}

// RMSNorm: x / sqrt(mean(x^2) + eps) * gamma on a tiny row; gradients of
// the input and gamma against finite differences; bad dims refused.
TEST(RMSNorm, MatchesClosedFormAndFiniteDifferences) {
  RMSNorm norm(4, "norm");
  EXPECT_EQ(norm.parameters().size(), 1u);
  EXPECT_EQ(norm.weight().name, "norm.weight");
  EXPECT_EQ(norm.weight().info.kind, sharding::ParamKind::norm);
  EXPECT_FALSE(norm.weight().weight_decay);
  EXPECT_EQ(norm.weight().value.to_vector(), (std::vector<double>{1, 1, 1, 1}));
  norm.weight().value.copy_from(Tensor::from_vector(std::vector<float>{1, 2, 1, 0.5f}, {4}));
  // x = [1, 2, 3, 4]: mean of squares 7.5.
  const std::vector<double> y = norm.forward(Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {1, 4})).to_vector();
  const double r = 1.0 / std::sqrt(7.5 + 1e-6);
  const std::vector<double> want = {1 * r, 2 * 2 * r, 3 * r, 0.5 * 4 * r};
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(y[i], want[i], 1e-6) << i;

  RMSNorm n6(6, "n6", 1e-5);
  n6.weight().value.copy_from(random_tensor({6}, 3, 0.5, 1.5));
  const Tensor x = random_tensor({2, 2, 6}, 5, -2.0, 2.0), w = random_tensor({2, 2, 6}, 6);
  auto f = [&] { return weighted_sum(n6.forward(x), w); };
  n6.zero_grad();
  n6.forward(x);
  const Tensor dx = n6.backward(w).clone();
  expect_grad_matches(f, x, dx, 1e-2);
  expect_grad_matches(f, n6.weight().value, n6.weight().grad.clone());
  EXPECT_THROW(RMSNorm(0, "bad"), InvalidArgument);
  EXPECT_THROW(RMSNorm(4, "bad", 0.0), InvalidArgument);
  EXPECT_THAT(testing::error_of([&] { n6.forward(random_tensor({2, 5}, 1)); }),
              ::testing::HasSubstr("does not end in dim 6"));
}

// SwiGLU MLP: down(silu(gate x) * up x) against the formula built from
// plain Linears, Hugging Face Llama's names, gradients of the input and
// every weight against finite differences, and the split backward equal to
// the fused one.
TEST(SwiGLUMLP, MatchesTheFormulaAndFiniteDifferences) {
  SwiGLUMLP mlp({.width = 5, .hidden = 7, .prefix = "mlp", .seed = 3});
  const std::vector<Parameter*> ps = mlp.parameters();
  ASSERT_EQ(ps.size(), 3u);
  EXPECT_EQ(ps[0]->name, "mlp.gate_proj.weight");
  EXPECT_EQ(ps[1]->name, "mlp.up_proj.weight");
  EXPECT_EQ(ps[2]->name, "mlp.down_proj.weight");
  EXPECT_EQ(ps[2]->value.shape(), (std::vector<int64_t>{7, 5}));
  const Tensor x = random_tensor({2, 3, 5}, 1), w = random_tensor({2, 3, 5}, 2);
  const Tensor g = matmul(x.view({6, 5}), ps[0]->value), u = matmul(x.view({6, 5}), ps[1]->value);
  std::vector<double> h = g.to_vector();
  const std::vector<double> uv = u.to_vector();
  for (size_t i = 0; i < h.size(); ++i) h[i] = h[i] / (1.0 + std::exp(-h[i])) * uv[i];
  const std::vector<double> want = matmul(Tensor::from_vector(h, {6, 7}).to(DType::f32), ps[2]->value).to_vector();
  const std::vector<double> got = mlp.forward(x).to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * (1 + std::abs(want[i]))) << i;
  auto f = [&] { return weighted_sum(mlp.forward(x), w); };
  mlp.zero_grad();
  mlp.forward(x);
  const Tensor dx = mlp.backward(w).clone();
  expect_grad_matches(f, x, dx, 1e-2);
  std::vector<std::vector<double>> fused;
  for (Parameter* p : ps) {
    expect_grad_matches(f, p->value, p->grad.clone());
    fused.push_back(p->grad.to_vector());
  }
  mlp.zero_grad();
  mlp.forward(x);
  EXPECT_EQ(mlp.backward_input(w, mlp.own_saved()).to_vector(), dx.to_vector());
  mlp.backward_weight(mlp.own_saved());
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(ps[i]->grad.to_vector(), fused[i]) << ps[i]->name;
  EXPECT_THROW(SwiGLUMLP({.width = 5, .hidden = 0, .prefix = "bad"}), InvalidArgument);
}

// Llama attention (4 query heads reading 2 key/value heads, head dim 4):
// forward against a double-precision reference built from the module's
// weights (projections, rotate_half RoPE at positions 0..T-1, causal
// softmax, o_proj); gradients of the input and every weight against finite
// differences; bad head counts refused.
TEST(LlamaAttention, MatchesTheReferenceAndFiniteDifferences) {
  const int64_t b = 2, t = 5, c = 16, hq = 4, hk = 2, d = c / hq;
  LlamaAttention attn({.width = c, .heads = hq, .kv_heads = hk, .rope_base = 100.0, .prefix = "attn", .seed = 9,
                       .init_std = 0.3});
  const std::vector<Parameter*> ps = attn.parameters();
  ASSERT_EQ(ps.size(), 4u);
  EXPECT_EQ(ps[0]->name, "attn.q_proj.weight");
  EXPECT_EQ(ps[1]->value.shape(), (std::vector<int64_t>{c, hk * d}));
  EXPECT_EQ(ps[3]->name, "attn.o_proj.weight");
  const Tensor x = random_tensor({b, t, c}, 1), w = random_tensor({b, t, c}, 2);
  // The reference, in double.
  const auto proj = [&](const Tensor& wt) { return matmul(x.view({b * t, c}), wt).to_vector(); };
  const std::vector<double> q = proj(ps[0]->value), k = proj(ps[1]->value), v = proj(ps[2]->value);
  const auto rope = [&](std::vector<double> row, int64_t pos) {  // one head's d values
    std::vector<double> out(row.size());
    for (int64_t i = 0; i < d / 2; ++i) {
      const double th = static_cast<double>(pos) * std::pow(100.0, -2.0 * i / d);
      out[i] = row[i] * std::cos(th) - row[i + d / 2] * std::sin(th);
      out[i + d / 2] = row[i + d / 2] * std::cos(th) + row[i] * std::sin(th);
    }
    return out;
  };
  std::vector<double> merged(static_cast<size_t>(b * t * c));
  for (int64_t s = 0; s < b; ++s)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kvh = h / (hq / hk);
      const auto head = [&](const std::vector<double>& m, int64_t width, int64_t hh, int64_t i) {
        const auto* p = m.data() + (s * t + i) * width + hh * d;
        return std::vector<double>(p, p + d);
      };
      for (int64_t i = 0; i < t; ++i) {
        const std::vector<double> qi = rope(head(q, hq * d, h, i), i);
        std::vector<double> sc(static_cast<size_t>(i + 1));
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          const std::vector<double> kj = rope(head(k, hk * d, kvh, j), j);
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += qi[e] * kj[e];
          sc[j] = dot / std::sqrt(static_cast<double>(d));
          mx = std::max(mx, sc[j]);
        }
        double z = 0;
        for (double& e : sc) z += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= i; ++j) {
          const std::vector<double> vj = head(v, hk * d, kvh, j);
          for (int64_t e = 0; e < d; ++e) merged[static_cast<size_t>((s * t + i) * c + h * d + e)] += sc[j] / z * vj[e];
        }
      }
    }
  const std::vector<double> want =
      matmul(Tensor::from_vector(merged, {b * t, c}).to(DType::f32), ps[3]->value).to_vector();
  const std::vector<double> got = attn.forward(x).to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * (1 + std::abs(want[i]))) << i;
  auto f = [&] { return weighted_sum(attn.forward(x), w); };
  attn.zero_grad();
  attn.forward(x);
  const Tensor dx = attn.backward(w).clone();
  expect_grad_matches(f, x, dx, 1e-2);
  for (Parameter* p : ps) expect_grad_matches(f, p->value, p->grad.clone());
  EXPECT_THAT(testing::error_of([] { LlamaAttention({.width = 16, .heads = 4, .kv_heads = 3, .prefix = "a"}); }),
              ::testing::HasSubstr("3 key/value heads for 4 query heads"));
  EXPECT_THAT(testing::error_of([] { LlamaAttention({.width = 12, .heads = 4, .prefix = "a"}); }),
              ::testing::HasSubstr("even head dims"));
}

// A Llama block: Hugging Face Llama's names in definition order, the
// residual projections at out_std, x + attn(norm(x)) then h + mlp(norm(h))
// (checked through the modules' own outputs), and every gradient against
// finite differences, fused and split backward alike.
TEST(LlamaBlock, PreNormResidualsAndFiniteDifferences) {
  LlamaBlock block({.width = 8, .heads = 2, .kv_heads = 1, .ffn_hidden = 12, .prefix = "layers.0", .seed = 4,
                    .init_std = 0.3, .out_std = 0.1});
  std::vector<std::string> names;
  for (const Parameter* p : block.parameters()) names.push_back(p->name);
  EXPECT_EQ(names, (std::vector<std::string>{"layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight",
                                              "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                                              "layers.0.self_attn.o_proj.weight",
                                              "layers.0.post_attention_layernorm.weight",
                                              "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                                              "layers.0.mlp.down_proj.weight"}));
  const std::vector<Parameter*> ps = block.parameters();
  const auto stddev = [](const Tensor& t) {
    double s = 0;
    for (double v : t.to_vector()) s += v * v;
    return std::sqrt(s / static_cast<double>(t.numel()));
  };
  EXPECT_GT(stddev(ps[1]->value), 0.2);  // q_proj at 0.3
  EXPECT_LT(stddev(ps[4]->value), 0.15);  // o_proj at 0.1
  EXPECT_LT(stddev(ps[8]->value), 0.15);  // down_proj at 0.1
  for (Parameter* p : ps)  // norms off 1 so their gradients matter
    if (p->value.dim() == 1) p->value.copy_from(random_tensor({8}, 7, 0.5, 1.5));
  const Tensor x = random_tensor({2, 3, 8}, 1), w = random_tensor({2, 3, 8}, 2);
  auto f = [&] { return weighted_sum(block.forward(x), w); };
  block.zero_grad();
  block.forward(x);
  const Tensor dx = block.backward(w).clone();
  expect_grad_matches(f, x, dx, 1e-2);
  std::vector<std::vector<double>> fused;
  for (Parameter* p : ps) {
    expect_grad_matches(f, p->value, p->grad.clone(), 1e-2);
    fused.push_back(p->grad.to_vector());
  }
  block.zero_grad();
  block.forward(x);
  EXPECT_EQ(block.backward_input(w, block.own_saved()).to_vector(), dx.to_vector());
  block.backward_weight(block.own_saved());
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(ps[i]->grad.to_vector(), fused[i]) << ps[i]->name;
}

TEST(LayerNorm, WithoutAffineHasNoParameters) {
  LayerNorm ln(5, "ln", 1e-5, /*affine=*/false);
  EXPECT_TRUE(ln.parameters().empty());
  Tensor x = random_tensor({3, 5}, 5);
  Tensor w = random_tensor({3, 5}, 6);
  auto f = [&] { return weighted_sum(ln.forward(x), w); };
  ln.forward(x);
  expect_grad_matches(f, x, ln.backward(w).clone());
}

// ---- Dropout ----

TEST(Dropout, TwoHalvesDrawTheMaskOfTheWholeBatch) {
  Dropout whole(0.5, "drop", 99), half(0.5, "drop", 99);
  Tensor x = random_tensor({8, 6}, 1);
  whole.set_batch_context(3, 0);
  const std::vector<double> y = whole.forward(x).to_vector();
  std::vector<double> parts;
  for (int64_t first : {0, 4}) {
    half.set_batch_context(3, first);
    const std::vector<double> p = half.forward(x.narrow(0, first, 4)).to_vector();
    parts.insert(parts.end(), p.begin(), p.end());
  }
  EXPECT_EQ(parts, y);  // bit-identical
  // And the mask follows the documented stream.
  const std::vector<double> xv = x.to_vector();
  for (size_t i = 0; i < xv.size(); ++i) {
    const float u = static_cast<float>(uniform_at(99, internal::step_key("drop", 3), i, 0.0, 1.0));
    ASSERT_EQ(y[i], u >= 0.5f ? static_cast<double>(static_cast<float>(xv[i]) * 2.0f) : 0.0) << i;
  }
}

// A rank holding a slice of each sample's features (a column split of 7
// hidden features over 3 ranks: 3, 3, 1; or equal slices of a sequence
// split) draws exactly those columns of the whole mask.
TEST(Dropout, FeatureSlicesDrawTheirColumnsOfTheWholeMask) {
  Dropout whole(0.5, "drop", 99);
  const Tensor x = random_tensor({4, 7}, 2);
  whole.set_batch_context(5, 8);
  const Tensor y = whole.forward(x);
  for (int64_t features : {int64_t{7}, int64_t{0}}) {
    const int ranks = features == 7 ? 3 : 7;  // equal slices: one feature each
    for (int r = 0; r < ranks; ++r) {
      const int64_t begin = features == 7 ? r * 3 : r, size = features == 7 ? std::min<int64_t>(3, 7 - begin) : 1;
      Dropout part(0.5, "drop", 99, DropoutShard{.rank = r, .ranks = ranks, .features = features});
      part.set_batch_context(5, 8);
      EXPECT_EQ(part.forward(x.narrow(1, begin, size).contiguous()).to_vector(),
                y.narrow(1, begin, size).contiguous().to_vector())
          << "rank " << r << " of " << ranks << ", features " << features;
    }
  }
  Dropout wrong(0.5, "drop", 99, DropoutShard{.rank = 2, .ranks = 3, .features = 7});
  wrong.set_batch_context(5, 8);
  EXPECT_THAT(testing::error_of([&] { wrong.forward(x.narrow(1, 0, 3).contiguous()); }),
              ::testing::HasSubstr("rank 2 of 3 holds 1 of 7"));
}

TEST(Dropout, KeepsAboutOneMinusPAndScales) {
  Dropout drop(0.3, "d", 5);
  drop.set_batch_context(1, 0);
  Tensor x = Tensor::full({100, 100}, 1.0, DType::f32);
  const std::vector<double> y = drop.forward(x).to_vector();
  int64_t kept = 0;
  for (double v : y) {
    if (v != 0.0) {
      ++kept;
      EXPECT_FLOAT_EQ(v, 1.0 / 0.7);
    }
  }
  EXPECT_NEAR(kept / 10000.0, 0.7, 0.02);
  // Backward applies the same mask.
  const std::vector<double> dx = drop.backward(x).to_vector();
  EXPECT_EQ(dx, y);
  // Another step gives another mask; the same step the same one.
  drop.set_batch_context(2, 0);
  EXPECT_NE(drop.forward(x).to_vector(), y);
  drop.set_batch_context(1, 0);
  EXPECT_EQ(drop.forward(x).to_vector(), y);
}

TEST(Dropout, EvalAndZeroPAreIdentityAndPOneDropsAll) {
  Dropout drop(0.5, "d", 5);
  Tensor x = random_tensor({4, 3}, 1);
  drop.set_training(false);
  Tensor y = drop.forward(x);
  EXPECT_EQ(y.data_ptr(), x.data_ptr());
  EXPECT_EQ(drop.backward(x).data_ptr(), x.data_ptr());
  Dropout all(1.0, "d", 5);
  EXPECT_EQ(l2_norm(all.forward(x)), 0.0);
  EXPECT_THROW(Dropout(1.5, "d", 5), InvalidArgument);
  Dropout neg(0.5, "d", 5);
  neg.set_batch_context(0, -1);
  EXPECT_THROW(neg.forward(x), InvalidArgument);
}

// ---- Sequential ----

TEST(Sequential, NamesChildrenAndChainsForwardAndBackward) {
  Sequential net("body");
  net.add(std::make_unique<Linear>(4, 5, net.next_name(), 1));
  net.add(std::make_unique<Tanh>());
  net.add(std::make_unique<Linear>(5, 3, net.next_name(), 1));
  std::vector<std::string> names;
  for (Parameter* p : net.parameters()) names.push_back(p->name);
  EXPECT_EQ(names, (std::vector<std::string>{"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}));
  EXPECT_THROW(net.add(std::make_unique<Linear>(3, 3, "body.0", 1)), InvalidArgument);

  Tensor x = random_tensor({3, 4}, 1);
  Tensor w = random_tensor({3, 3}, 2);
  auto f = [&] { return weighted_sum(net.forward(x), w); };
  RecordingHook hook;
  net.set_param_hook(&hook);
  net.zero_grad();
  net.forward(x);
  Tensor dx = net.backward(w).clone();
  EXPECT_EQ(hook.names, (std::vector<std::string>{"body.2.bias", "body.2.weight", "body.0.bias", "body.0.weight"}));
  net.set_param_hook(nullptr);
  expect_grad_matches(f, x, dx);
  for (Parameter* p : net.parameters()) expect_grad_matches(f, p->value, p->grad.clone());
}

// Keeps every parameter's value and grad off the module except between
// before_use and after_use, as fully sharded data parallelism does, and logs
// the calls. The results must equal an unhooked run.
class MaterializingHook : public ParamHook {
 public:
  explicit MaterializingHook(Module& m) {
    for (Parameter* p : m.parameters()) {
      store[p] = {p->value.clone(), p->grad.clone()};
      p->value = Tensor();
      p->grad = Tensor();
    }
  }
  void before_use(Module& owner, Pass pass) override {
    for (Parameter* p : owner.parameters()) {
      EXPECT_FALSE(p->value.defined()) << p->name << " used outside a window";
      p->value = store[p].first.clone();
      if (pass == Pass::backward) p->grad = store[p].second;
    }
    log.push_back((pass == Pass::forward ? "F+" : "B+") + owner.parameters()[0]->name);
  }
  void after_use(Module& owner, Pass pass) override {
    for (Parameter* p : owner.parameters()) {
      p->value = Tensor();
      p->grad = Tensor();
    }
    log.push_back((pass == Pass::forward ? "F-" : "B-") + owner.parameters()[0]->name);
  }
  std::map<Parameter*, std::pair<Tensor, Tensor>> store;
  std::vector<std::string> log;
};

TEST(Sequential, UseHooksBracketEveryParameterUse) {
  auto build = [](Sequential& net) {
    net.add(std::make_unique<Linear>(4, 5, net.next_name(), 3));
    net.add(std::make_unique<LayerNorm>(5, net.next_name()));
    net.add(std::make_unique<Tanh>());
    net.add(std::make_unique<Linear>(5, 2, net.next_name(), 3));
  };
  Sequential plain("m"), hooked("m");
  build(plain);
  build(hooked);
  const Tensor x = random_tensor({3, 4}, 1), dy = random_tensor({3, 2}, 2);
  plain.zero_grad();
  const Tensor y_plain = plain.forward(x).clone();
  const Tensor dx_plain = plain.backward(dy).clone();
  hooked.zero_grad();
  MaterializingHook hook(hooked);
  hooked.set_param_hook(&hook);
  const Tensor y = hooked.forward(x).clone();
  const Tensor dx = hooked.backward(dy).clone();
  EXPECT_EQ(y.to_vector(), y_plain.to_vector());
  EXPECT_EQ(dx.to_vector(), dx_plain.to_vector());
  const std::vector<Parameter*> ps = plain.parameters(), hs = hooked.parameters();
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_EQ(hook.store[hs[i]].second.to_vector(), ps[i]->grad.to_vector()) << ps[i]->name;
  EXPECT_EQ(hook.log, (std::vector<std::string>{"F+m.0.weight", "F-m.0.weight", "F+m.1.weight", "F-m.1.weight",
                                                "F+m.3.weight", "F-m.3.weight", "B+m.3.weight", "B-m.3.weight",
                                                "B+m.1.weight", "B-m.1.weight", "B+m.0.weight", "B-m.0.weight"}));
}

TEST(Sequential, PropagatesTrainingAndContextToLaterChildren) {
  Sequential net;
  net.set_training(false);
  net.set_batch_context(7, 12);
  Dropout& d = net.add(std::make_unique<Dropout>(0.5, net.next_name(), 1));
  EXPECT_FALSE(d.training());
  EXPECT_EQ(d.batch_context().step, 7u);
  EXPECT_EQ(d.batch_context().first_global_sample, 12);
  EXPECT_EQ(d.name(), "0");
  net.set_training(true);
  EXPECT_TRUE(d.training());
}

}  // namespace
}  // namespace meshtrain::nn
