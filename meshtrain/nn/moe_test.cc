// The mixture-of-experts layer: routing, weights, capacity and the
// auxiliary loss against a double-precision reference built from the
// layer's own experts; gradients against finite differences; the split
// backward equal to the fused one; load counts and DeepSeek-V3's bias
// update; expert parallelism over 2 and 4 ranks of the threads engine
// (tokens routed everywhere, all to one expert, and to ranks that receive
// none; and three training steps with every token on one expert) equal to
// one device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/llama.h"
#include "meshtrain/nn/moe.h"
#include "meshtrain/nn/parallel/parity_test_util.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/testing/grad_check.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::nn {
namespace {

using ::testing::HasSubstr;
using meshtrain::testing::error_of;
using meshtrain::testing::expect_grad_matches;
using meshtrain::testing::random_tensor;
using meshtrain::testing::weighted_sum;
using parity_test::expect_near;

Parameter* find(Module& m, const std::string& name) {
  for (Parameter* p : m.parameters())
    if (p->name == name) return p;
  ADD_FAILURE() << "no parameter " << name;
  return nullptr;
}

// One token's reference output: scores, top-k by s + bias (lower index on
// ties), weights, the experts (run alone on the row), the shared experts.
// `kept(j)` says whether slot j survived capacity.
struct Reference {
  std::vector<double> y;
  std::vector<int> chosen;
};

Reference reference_token(MoE& moe, const MoEConfig& c, const Tensor& row, const std::function<bool(int)>& kept) {
  const Tensor logits = matmul(row, find(moe, c.prefix + ".gate.weight")->value);
  std::vector<double> s = logits.to_vector();
  if (c.moe.score == RouterScore::softmax) {
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double& v : s) z += (v = std::exp(v - m));
    for (double& v : s) v /= z;
  } else {
    for (double& v : s) v = 1.0 / (1.0 + std::exp(-v));
  }
  Reference r;
  r.y.assign(static_cast<size_t>(c.width), 0.0);
  std::vector<int> idx(static_cast<size_t>(c.moe.experts));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) {
    return s[a] + moe.bias().data<float>()[a] > s[b] + moe.bias().data<float>()[b];
  });
  double sum = 0;
  for (int j = 0; j < c.moe.top_k; ++j) sum += s[idx[j]];
  for (int j = 0; j < c.moe.top_k; ++j) {
    r.chosen.push_back(idx[j]);
    if (!kept(j)) continue;
    SwiGLUMLP expert({.width = c.width, .hidden = c.moe.expert_hidden,
                      .prefix = fmt::format("{}.experts.{}", c.prefix, idx[j]), .seed = c.seed,
                      .init_std = c.init_std});
    const std::vector<double> out = expert.forward(row.view({1, 1, c.width})).to_vector();
    const double w = c.moe.normalize_top_k ? s[idx[j]] / sum : s[idx[j]];
    for (int64_t i = 0; i < c.width; ++i) r.y[i] += w * out[i];
  }
  if (c.moe.shared_experts > 0) {
    SwiGLUMLP shared({.width = c.width, .hidden = c.moe.shared_experts * c.moe.expert_hidden,
                      .prefix = c.prefix + ".shared_experts", .seed = c.seed, .init_std = c.init_std});
    const std::vector<double> out = shared.forward(row.view({1, 1, c.width})).to_vector();
    for (int64_t i = 0; i < c.width; ++i) r.y[i] += out[i];
  }
  return r;
}

// Softmax and sigmoid routers, with and without normalization and shared
// experts: every token's output equals the reference within 1e-5.
TEST(MoE, RoutesEachTokenToItsTopKExperts) {
  for (RouterScore score : {RouterScore::softmax, RouterScore::sigmoid}) {
    for (bool normalize : {true, false}) {
      const MoEConfig c{.width = 6,
                        .moe = {.experts = 5, .top_k = 2, .expert_hidden = 5, .shared_experts = normalize ? 1 : 0,
                                .score = score, .normalize_top_k = normalize},
                        .prefix = "mlp", .seed = 4, .init_std = 0.5};
      MoE moe(c);
      const Tensor x = random_tensor({2, 4, 6}, 11);
      const std::vector<double> y = moe.forward(x).to_vector();
      for (int64_t t = 0; t < 8; ++t) {
        const Reference r = reference_token(moe, c, x.view({8, 6}).narrow(0, t, 1), [](int) { return true; });
        for (int64_t i = 0; i < 6; ++i)
          EXPECT_NEAR(y[t * 6 + i], r.y[i], 1e-5) << layout::router_score_name(score) << " token " << t;
      }
    }
  }
}

// Capacity ceil(cf T k / E) per sequence, slot 0 of every step before slot
// 1: with every token preferring expert 0 then 1 (a router that only looks
// at feature 0, which is positive everywhere), experts 0 and 1 take the
// first `cap` steps of each sequence's slot 0 and slot 1 and drop the rest.
TEST(MoE, CapacityKeepsTheFirstAssignmentsOfEachSequence) {
  const MoEConfig c{.width = 4, .moe = {.experts = 4, .top_k = 2, .expert_hidden = 3, .capacity_factor = 1.0},
                    .prefix = "mlp", .seed = 2, .init_std = 0.5};
  MoE moe(c);
  Parameter* router = find(moe, "mlp.gate.weight");
  std::vector<double> w(16, 0.0);
  w[0] = 3.0, w[1] = 2.0, w[2] = -1.0, w[3] = -2.0;  // row 0: expert 0 > 1 > 2 > 3
  router->value.copy_from(Tensor::from_vector(w, {4, 4}).to(DType::f32));
  Tensor x = random_tensor({2, 6, 4}, 3);
  for (int64_t t = 0; t < 12; ++t) x.data<float>()[t * 4] = 1.0f + 0.1f * static_cast<float>(t);
  const std::vector<double> y = moe.forward(x).to_vector();
  const int64_t cap = 3;  // ceil(1.0 * 6 * 2 / 4)
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t step = 0; step < 6; ++step) {
      const int64_t t = b * 6 + step;
      const Reference r = reference_token(moe, c, x.view({12, 4}).narrow(0, t, 1), [&](int) { return step < cap; });
      EXPECT_EQ(r.chosen, (std::vector<int>{0, 1})) << t;
      for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(y[t * 4 + i], r.y[i], 1e-5) << "token " << t;
    }
  const MoELoad load = moe.take_load();
  EXPECT_EQ(load.tokens, (std::vector<int64_t>{12, 12, 0, 0}));
  EXPECT_EQ(load.assignments, 24);
  EXPECT_EQ(load.dropped, 12);  // steps 3..5 of both slots of both sequences
  EXPECT_EQ(load.sequences, 2);
  EXPECT_EQ(moe.take_load().assignments, 0);  // reset
}

// Gradients of sum(w * y) + L_aux with respect to the input, the router and
// an expert's weights against central differences, softmax with capacity
// dropping and sigmoid with shared experts; the split backward gives the
// fused one's bits.
TEST(MoE, GradientsMatchFiniteDifferences) {
  for (RouterScore score : {RouterScore::softmax, RouterScore::sigmoid}) {
    const bool soft = score == RouterScore::softmax;
    const MoEConfig c{.width = 5,
                      .moe = {.experts = 4, .top_k = 2, .expert_hidden = 4, .shared_experts = soft ? 0 : 1,
                              .score = score, .aux_loss_coef = 0.3, .capacity_factor = soft ? 0.75 : 0.0},
                      .prefix = "mlp", .seed = 8, .init_std = 0.6};
    MoE moe(c);
    const Tensor x = random_tensor({2, 4, 5}, 21), w = random_tensor({2, 4, 5}, 22);
    auto f = [&] {
      const double main = weighted_sum(moe.forward(x), w);
      const MoELoad load = moe.take_load();
      return main + load.aux_loss / static_cast<double>(load.sequences);
    };
    moe.zero_grad();
    moe.forward(x);
    const MoELoad load = moe.take_load();
    EXPECT_GT(load.aux_loss, 0.0);
    if (soft) {
      EXPECT_GT(load.dropped, 0);
    }
    const Tensor dx = moe.backward(w).clone();
    const std::string what(layout::router_score_name(score));
    SCOPED_TRACE(what);
    expect_grad_matches(f, x, dx, 1e-3, 1e-2);
    std::vector<std::vector<double>> fused;
    for (Parameter* p : moe.parameters()) fused.push_back(p->grad.to_vector());
    for (const char* name : {"mlp.gate.weight", "mlp.experts.1.up_proj.weight", "mlp.experts.2.down_proj.weight"}) {
      Parameter* p = find(moe, name);
      expect_grad_matches(f, p->value, p->grad.clone(), 1e-3, 1e-2);
    }
    moe.zero_grad();
    moe.forward(x);
    EXPECT_EQ(moe.backward_input(w, moe.own_saved()).to_vector(), dx.to_vector());
    moe.backward_weight(moe.own_saved());
    const std::vector<Parameter*> ps = moe.parameters();
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(ps[i]->grad.to_vector(), fused[i]) << ps[i]->name;
  }
}

// DeepSeek-V3's balancing: below-mean experts gain `rate`, above-mean lose
// it; the bias shifts selection only (the weights stay the scores).
TEST(MoE, BiasUpdateShiftsSelection) {
  const MoEConfig c{.width = 4,
                    .moe = {.experts = 4, .top_k = 1, .expert_hidden = 3, .score = RouterScore::sigmoid,
                            .normalize_top_k = false},
                    .prefix = "mlp", .seed = 2, .init_std = 0.5};
  MoE moe(c);
  moe.update_bias(std::vector<int64_t>{10, 2, 4, 0}, 0.5);  // mean 4
  EXPECT_EQ(moe.bias().to_vector(), (std::vector<double>{-0.5, 0.5, 0.0, 0.5}));
  EXPECT_EQ(moe.bias_name(), "mlp.gate.e_score_correction_bias");
  moe.set_bias(std::vector<float>{0, 0, 0, 100});  // expert 3 wins every token
  const Tensor x = random_tensor({1, 5, 4}, 5);
  const std::vector<double> y = moe.forward(x).to_vector();
  for (int64_t t = 0; t < 5; ++t) {
    const Reference r = reference_token(moe, c, x.view({5, 4}).narrow(0, t, 1), [](int) { return true; });
    EXPECT_EQ(r.chosen, std::vector<int>{3});
    for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(y[t * 4 + i], r.y[i], 1e-5);
  }
  EXPECT_EQ(moe.take_load().tokens, (std::vector<int64_t>{0, 0, 0, 5}));
  EXPECT_THAT(error_of([&] { moe.update_bias(std::vector<int64_t>{1, 2}, 0.1); }), HasSubstr("2 loads for 4 experts"));
  EXPECT_THAT(error_of([] { MoE({.width = 4, .moe = {.experts = 3, .top_k = 4, .expert_hidden = 2}, .prefix = "m"}); }),
              HasSubstr("experts 3, top_k 4"));
}

// A Llama block with a MoE layer in recompute mode replays the forward in
// backward: the load is counted once, the gradients are the normal run's.
TEST(MoE, RecomputeCountsTheLoadOnce) {
  const LlamaBlockConfig c{.width = 8, .heads = 2, .kv_heads = 1, .ffn_hidden = 6, .prefix = "h.0", .seed = 3,
                           .init_std = 0.3, .moe = {.experts = 4, .top_k = 2, .capacity_factor = 1.0}};
  LlamaBlock plain(c), again(c);
  again.set_recompute(true);
  const Tensor x = random_tensor({2, 5, 8}, 41), dy = random_tensor({2, 5, 8}, 42);
  ASSERT_NE(plain.moe(), nullptr);
  (void)plain.forward(x);
  plain.backward(dy);
  (void)again.forward(x);
  again.backward(dy);
  const MoELoad a = plain.moe()->take_load(), b = again.moe()->take_load();
  EXPECT_EQ(b.tokens, a.tokens);
  EXPECT_EQ(b.assignments, 20);
  EXPECT_EQ(b.dropped, a.dropped);
  const std::vector<Parameter*> pa = plain.parameters(), pb = again.parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_EQ(pb[i]->grad.to_vector(), pa[i]->grad.to_vector()) << pa[i]->name;
}

// Expert parallelism over k ranks: rank r holds sequences [r B/k, (r+1) B/k)
// and experts [r E/k, (r+1) E/k); outputs, dX, the experts' gradients (on
// their owner) and the router's (summed over ranks) equal one device's.
// `force` (>= 0) routes every token to that expert first (a router that
// favours it), so the other ranks' experts receive nothing.
void expect_expert_parallel_equals(const MoEConfig& base, int k, int force) {
  MoE ref(base);
  const int64_t batch = 4, steps = 3, width = base.width;
  Tensor x = random_tensor({batch, steps, width}, 31);
  if (force >= 0) {
    Parameter* router = find(ref, base.prefix + ".gate.weight");
    Tensor w = Tensor::zeros({width, base.moe.experts}, DType::f32);
    for (int64_t i = 0; i < width; ++i) w.data<float>()[i * base.moe.experts + force] = 5.0f;
    router->value.copy_from(w);
    for (int64_t t = 0; t < batch * steps; ++t)
      for (int64_t i = 0; i < width; ++i) x.data<float>()[t * width + i] = std::abs(x.data<float>()[t * width + i]);
  }
  const Tensor dy = random_tensor({batch, steps, width}, 32);
  ref.set_batch_context(BatchContext{.global_samples = static_cast<double>(batch)});
  ref.zero_grad();
  const std::vector<double> y_ref = ref.forward(x).to_vector();
  const MoELoad load_ref = ref.take_load();
  const std::vector<double> dx_ref = ref.backward(dy).to_vector();
  comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 MoEConfig c = base;
                 c.expert.comm = &world;
                 MoE moe(c);
                 const std::string what = fmt::format("k {} force {} rank {}", k, force, world.rank());
                 EXPECT_EQ(moe.local_experts(), base.moe.experts / k);
                 for (Parameter* p : moe.parameters()) {
                   p->value.copy_from(find(ref, p->name)->value);
                   p->grad.fill(0.0);
                 }
                 const int64_t local = batch / k, first = world.rank() * local;
                 moe.set_batch_context(BatchContext{.first_global_sample = first,
                                                    .global_samples = static_cast<double>(batch)});
                 const Tensor mine_x = x.narrow(0, first, local).contiguous();
                 const auto rows = [&](const std::vector<double>& v) {
                   return std::vector<double>(v.begin() + first * steps * width,
                                              v.begin() + (first + local) * steps * width);
                 };
                 expect_near(moe.forward(mine_x).to_vector(), rows(y_ref), 1e-5, what + " y");
                 expect_near(moe.backward(dy.narrow(0, first, local).contiguous()).to_vector(), rows(dx_ref), 1e-5,
                             what + " dx");
                 const MoELoad load = moe.take_load();
                 std::vector<int64_t> tokens = load.tokens;
                 world.all_reduce(tokens.data(), tokens.data(), tokens.size(), DType::i64, comm::ReduceOp::sum);
                 EXPECT_EQ(tokens, load_ref.tokens) << what;
                 for (Parameter* p : moe.parameters()) {
                   const bool routed = p->name.find(".experts.") != std::string::npos;
                   if (!routed)
                     world.all_reduce(p->grad.data<float>(), p->grad.data<float>(),
                                      static_cast<size_t>(p->grad.numel()), DType::f32, comm::ReduceOp::sum);
                   expect_near(p->grad.to_vector(), find(ref, p->name)->grad.to_vector(), 1e-5, what + " " + p->name);
                 }
               });
}

// Training with every token routed to one expert (a selection bias of 100
// on expert 0, top-1): on 2 and 4 expert ranks every rank's tokens go to
// rank 0's expert and the other ranks' experts receive none, step after
// step. Three SGD steps (replicated gradients summed over the ranks, each
// expert's on its owner) end where one device's do, within 1e-5.
TEST(MoE, TrainingWithEveryTokenOnOneExpertEqualsOneDevice) {
  const MoEConfig base{.width = 6, .moe = {.experts = 4, .top_k = 1, .expert_hidden = 4, .shared_experts = 1,
                                           .aux_loss_coef = 0.1},
                       .prefix = "mlp", .seed = 12, .init_std = 0.5};
  const std::vector<float> bias = {100, 0, 0, 0};
  const int64_t batch = 4, steps_t = 3, width = base.width;
  constexpr int kSteps = 3;
  constexpr double kLr = 0.1;
  const auto sgd = [](const std::vector<Parameter*>& ps) {
    for (Parameter* p : ps) {
      axpy(-kLr, p->grad, p->value);
      p->grad.fill(0.0);
    }
  };
  MoE ref(base);
  ref.set_bias(bias);
  ref.set_batch_context(BatchContext{.global_samples = static_cast<double>(batch)});
  ref.zero_grad();
  for (int s = 0; s < kSteps; ++s) {
    const Tensor x = random_tensor({batch, steps_t, width}, 60 + s);
    const Tensor dy = random_tensor({batch, steps_t, width}, 70 + s);
    (void)ref.forward(x);
    (void)ref.backward(dy);
    EXPECT_EQ(ref.take_load().tokens, (std::vector<int64_t>{batch * steps_t, 0, 0, 0}));
    sgd(ref.parameters());
  }
  for (int k : {2, 4})
    comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                 [&](comm::Communicator& world) {
                   MoEConfig c = base;
                   c.expert.comm = &world;
                   MoE moe(c);
                   moe.set_bias(bias);
                   const int64_t local = batch / k, first = world.rank() * local;
                   moe.set_batch_context(BatchContext{.first_global_sample = first,
                                                      .global_samples = static_cast<double>(batch)});
                   for (Parameter* p : moe.parameters()) p->grad.fill(0.0);
                   for (int s = 0; s < kSteps; ++s) {
                     const Tensor x =
                         random_tensor({batch, steps_t, width}, 60 + s).narrow(0, first, local).contiguous();
                     const Tensor dy =
                         random_tensor({batch, steps_t, width}, 70 + s).narrow(0, first, local).contiguous();
                     (void)moe.forward(x);
                     (void)moe.backward(dy);
                     std::vector<Parameter*> replicated;
                     for (Parameter* p : moe.parameters())
                       if (!p->info.routed_expert()) replicated.push_back(p);
                     sum_grads(replicated, world, "test");
                     sgd(moe.parameters());
                   }
                   for (Parameter* p : moe.parameters())
                     expect_near(p->value.to_vector(), find(ref, p->name)->value.to_vector(), 1e-5,
                                 fmt::format("k {} rank {} {}", k, world.rank(), p->name));
                 });
}

TEST(MoE, ExpertParallelEqualsOneDevice) {
  const MoEConfig base{.width = 6,
                       .moe = {.experts = 4, .top_k = 2, .expert_hidden = 4, .shared_experts = 1, .aux_loss_coef = 0.1},
                       .prefix = "mlp", .seed = 6, .init_std = 0.5};
  for (int k : {2, 4}) expect_expert_parallel_equals(base, k, -1);
  MoEConfig dropping = base;
  dropping.moe.capacity_factor = 0.5;
  dropping.moe.score = RouterScore::sigmoid;
  expect_expert_parallel_equals(dropping, 2, -1);
  // Every token to expert 0 (and one other): rank 1 of 2 gets some tokens,
  // ranks 2 and 3 of 4 receive nothing for their experts but still run.
  MoEConfig one = base;
  one.moe.top_k = 1;
  expect_expert_parallel_equals(one, 2, 0);
  expect_expert_parallel_equals(one, 4, 0);
  expect_expert_parallel_equals(base, 4, 3);
}

}  // namespace
}  // namespace meshtrain::nn
