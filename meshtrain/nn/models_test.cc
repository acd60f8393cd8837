// Models: structure and metadata, layout-invariant init, full-model gradient
// checks, gradient-hook order, and data-parallel invariance of dropout masks
// and VAE noise (a batch processed whole equals the same batch in two halves).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "meshtrain/core/memory.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/testing/grad_check.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/vae.h"

namespace meshtrain::nn {
namespace {

using testing::expect_grad_matches;
using testing::random_tensor;
using testing::RecordingHook;
using testing::weighted_sum;


std::vector<std::string> names_of(Module& m) {
  std::vector<std::string> out;
  for (Parameter* p : m.parameters()) out.push_back(p->name);
  return out;
}

std::vector<std::string> reversed(std::vector<std::string> v) { return {v.rbegin(), v.rend()}; }

void expect_bit_identical(Module& a, Module& b) {
  std::vector<Parameter*> pa = a.parameters(), pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i]->name, pb[i]->name);
    EXPECT_EQ(pa[i]->value.to_vector(), pb[i]->value.to_vector()) << pa[i]->name;
  }
}

Tensor labels_of(std::vector<int64_t> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return Tensor::from_vector(v, {n});
}

// Rows [first, first + n) of every element of a list of per-half results, concatenated.
std::vector<double> concat(const std::vector<std::vector<double>>& parts) {
  std::vector<double> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

// ---- MLP ----

TEST(MLP, ActivationBuffersAreChargedToTheTracker) {
  MLPConfig c;
  c.sizes = {6, 5, 3};
  MLP mlp(c);
  MemoryTracker tracker;
  mlp.set_memory_tracker(&tracker);
  const Tensor x = testing::random_tensor({4, 6}, 1);
  const Tensor y = mlp.forward(x);
  // Linear 0 output (4, 5), ReLU output (4, 5), Linear 1 output (4, 3).
  EXPECT_EQ(tracker.in_use(MemoryCategory::activations), 4u * (20 + 20 + 12));
  mlp.backward(testing::random_tensor({4, 3}, 2));
  // + Linear 1 dX (4, 5) and ReLU dX (4, 5); Linear 0 needs no input gradient.
  EXPECT_EQ(tracker.in_use(MemoryCategory::activations), 4u * (20 + 20 + 12 + 20 + 20));
  EXPECT_EQ(tracker.in_use(MemoryCategory::parameters), 0u);
  // A second step of the same shape reuses every buffer the caller let go of.
  mlp.forward(x);
  EXPECT_EQ(tracker.peak(MemoryCategory::activations), 4u * (20 + 20 + 12 + 20 + 20) + 4u * 12);
}

// Pipeline parts of an MLP (Linears [0, 2) and [2, 4), dropout on) chained
// give the whole MLP's output and gradients bit for bit, under its names.
TEST(MLP, PipelinePartsChainedEqualTheWholeModel) {
  MLPConfig c;
  c.sizes = {12, 10, 8, 6, 3};
  c.dropout = 0.3;
  c.seed = 5;
  MLP whole(c);
  whole.set_batch_context(2, 6);
  Tensor x = Tensor::empty({4, 12}, DType::f32), dy = Tensor::empty({4, 3}, DType::f32);
  fill_normal(x, 1, key_from_name("parts.x"), 0.0, 1.0);
  fill_normal(dy, 1, key_from_name("parts.dy"), 0.0, 1.0);
  const std::vector<double> want = whole.forward(x).to_vector();
  whole.backward(dy);
  MLPConfig a = c, b = c;
  a.last_layer = 2;
  b.first_layer = 2;
  MLP first(a), second(b);
  first.set_batch_context(2, 6);
  second.set_batch_context(2, 6);
  EXPECT_EQ(second.parameters().front()->name, "6.weight");
  EXPECT_EQ(second.forward(first.forward(x)).to_vector(), want);
  EXPECT_FALSE(first.backward(second.backward(dy)).defined());
  std::vector<Parameter*> parts = first.parameters();
  for (Parameter* p : second.parameters()) parts.push_back(p);
  const std::vector<Parameter*> all = whole.parameters();
  ASSERT_EQ(parts.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(parts[i]->name, all[i]->name);
    EXPECT_EQ(parts[i]->grad.to_vector(), all[i]->grad.to_vector()) << all[i]->name;
  }
  MLPConfig bad = c;
  bad.first_layer = 3, bad.last_layer = 2;
  EXPECT_THROW(MLP{bad}, InvalidArgument);
}

TEST(MLP, DefaultStructureAndMetadata) {
  MLP mlp;
  EXPECT_EQ(names_of(mlp), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight",
                                                     "4.bias", "6.weight", "6.bias"}));
  EXPECT_EQ(mlp.num_parameters(), 784 * 512 + 512 + 512 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
  for (Parameter* p : mlp.parameters()) {
    const bool is_weight = p->name.ends_with("weight");
    EXPECT_EQ(p->info.name, p->name);
    EXPECT_EQ(p->info.shape, p->value.shape());
    EXPECT_EQ(p->info.kind, is_weight ? sharding::ParamKind::linear_weight : sharding::ParamKind::linear_bias);
    EXPECT_EQ(p->weight_decay, is_weight);
  }
  EXPECT_EQ(mlp.parameters()[0]->value.shape(), (std::vector<int64_t>{784, 512}));  // (in, out)
  MLP with_dropout(MLPConfig{.sizes = {8, 4, 2}, .dropout = 0.1, .prefix = "clf"});
  EXPECT_EQ(names_of(with_dropout), (std::vector<std::string>{"clf.0.weight", "clf.0.bias", "clf.3.weight",
                                                              "clf.3.bias"}));
}

TEST(MLP, InitDependsOnlyOnSeedAndName) {
  MLPConfig c{.sizes = {32, 16, 8}, .seed = 42, .prefix = ""};
  MLP a(c), b(c);
  expect_bit_identical(a, b);
  c.seed = 43;
  MLP other(c);
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_NE(a.parameters()[i]->value.to_vector(), other.parameters()[i]->value.to_vector());
  // Element 100 of "2.weight" (16, 8) is a pure function of (seed, name, 100).
  const double bound = 0.25;  // 1 / sqrt(16)
  EXPECT_EQ(a.parameters()[2]->value.to_vector()[100],
            static_cast<double>(static_cast<float>(uniform_at(42, key_from_name("2.weight"), 100, -bound, bound))));
}

// Full-model checks use h = 5e-3: the f32 forward's rounding noise in the
// loss is ~1e-6 absolute, i.e. ~1e-6 / 2h in the quotient, while a larger h
// starts to cross ReLU kinks. Observed relative errors are <= 4.1e-4.
TEST(MLP, FullModelGradientsMatchFiniteDifferences) {
  MLP mlp(MLPConfig{.sizes = {6, 5, 4, 3}, .dropout = 0.2, .seed = 7, .needs_input_grad = true, .prefix = ""});
  mlp.set_batch_context(5, 10);  // fixed: every forward draws the same masks
  CrossEntropyLoss ce;
  Tensor x = random_tensor({4, 6}, 1, -2, 2);
  Tensor y = labels_of({0, 2, 1, 2});
  auto f = [&] { return ce.forward(mlp.forward(x), y); };
  mlp.zero_grad();
  ce.forward(mlp.forward(x), y);
  Tensor dx = mlp.backward(ce.backward()).clone();
  expect_grad_matches(f, x, dx, 5e-3);
  for (Parameter* p : mlp.parameters()) {
    SCOPED_TRACE(p->name);
    expect_grad_matches(f, p->value, p->grad.clone(), 5e-3);
  }
}

TEST(MLP, ParamHookFiresOncePerParameterInReverseOrder) {
  MLP mlp(MLPConfig{.sizes = {6, 5, 4, 3}, .dropout = 0.5, .seed = 7, .prefix = ""});
  RecordingHook hook;
  mlp.set_param_hook(&hook);
  CrossEntropyLoss ce;
  ce.forward(mlp.forward(random_tensor({4, 6}, 1)), labels_of({0, 1, 2, 0}));
  EXPECT_FALSE(mlp.backward(ce.backward()).defined());  // the first layer skips dX
  EXPECT_EQ(hook.names, reversed(names_of(mlp)));
}

TEST(MLP, HalvesOfABatchMatchTheWholeBatch) {
  const MLPConfig c{.sizes = {12, 16, 16, 5}, .dropout = 0.5, .seed = 3, .prefix = ""};
  MLP whole(c), half(c);
  Tensor x = random_tensor({8, 12}, 1);
  Tensor y = labels_of({0, 1, 2, 3, 4, 0, 1, 2});
  CrossEntropyLoss ce;
  whole.set_batch_context(11, 0);
  const std::vector<double> out = whole.forward(x).to_vector();
  const double loss = ce.forward(whole.forward(x), y);  // the same forward again
  whole.backward(ce.backward());
  std::vector<std::vector<double>> outs;
  double loss_sum = 0.0;
  for (int64_t first : {0, 4}) {
    half.set_batch_context(11, first);
    outs.push_back(half.forward(x.narrow(0, first, 4)).to_vector());
    loss_sum += ce.forward(half.forward(x.narrow(0, first, 4)), y.narrow(0, first, 4), /*normalizer=*/8.0);
    half.backward(ce.backward());  // gradients of both halves accumulate
  }
  // Same masks, same rows: equal to f32 rounding. Not bit for bit: the GEMM
  // library may pick another kernel (another order of additions) for 4 rows
  // than for 8 (oneDNN does on AVX2: MESHTRAIN_CPU_ISA=avx2), and a row's
  // bits independent of its batch are the deterministic mode's promise
  // (batch-invariant kernels), not the default's. A dropout mask keyed by
  // anything but the global row would differ by far more.
  const std::vector<double> halves = concat(outs);
  ASSERT_EQ(halves.size(), out.size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(halves[i], out[i], 1e-6 * (1 + std::abs(out[i]))) << i;
  EXPECT_NEAR(loss_sum, loss, 1e-6);
  for (size_t i = 0; i < whole.parameters().size(); ++i) {
    Parameter* a = whole.parameters()[i];
    Parameter* b = half.parameters()[i];
    Tensor diff = a->grad.clone();
    axpy(-1.0, b->grad, diff);
    EXPECT_LE(l2_norm(diff), 1e-5 * l2_norm(a->grad)) << a->name;
  }
}

TEST(MLP, SteadyStateStepReusesBuffers) {
  MLP mlp(MLPConfig{.sizes = {12, 16, 5}, .dropout = 0.5, .seed = 0, .prefix = ""});
  CrossEntropyLoss ce;
  Tensor x = random_tensor({8, 12}, 1);
  Tensor y = labels_of({0, 1, 2, 3, 4, 0, 1, 2});
  std::vector<const void*> ptrs;
  for (int step = 0; step < 3; ++step) {
    mlp.set_batch_context(static_cast<uint64_t>(step), 0);
    Tensor logits = mlp.forward(x);
    ptrs.push_back(logits.data_ptr());
    ce.forward(logits, y);
    logits = Tensor();
    mlp.backward(ce.backward());
  }
  EXPECT_EQ(ptrs[1], ptrs[0]);
  EXPECT_EQ(ptrs[2], ptrs[0]);
}

// ---- VAE ----

VAEConfig small_vae(bool needs_input_grad = false) {
  return VAEConfig{.input = 6, .hidden = {5, 4}, .latent = 3, .seed = 9, .needs_input_grad = needs_input_grad, .prefix = ""};
}

TEST(VAE, DefaultStructureAndMetadata) {
  VAE vae;
  EXPECT_EQ(names_of(vae),
            (std::vector<std::string>{"encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias",
                                      "fc_mu.weight", "fc_mu.bias", "fc_logvar.weight", "fc_logvar.bias",
                                      "decoder.0.weight", "decoder.0.bias", "decoder.2.weight", "decoder.2.bias",
                                      "decoder.4.weight", "decoder.4.bias"}));
  const int64_t encoder = 784 * 512 + 512 + 512 * 512 + 512;
  const int64_t heads = 2 * (512 * 20 + 20);
  const int64_t decoder = 20 * 512 + 512 + 512 * 512 + 512 + 512 * 784 + 784;
  EXPECT_EQ(vae.num_parameters(), encoder + heads + decoder);
  EXPECT_EQ(vae.parameters()[8]->value.shape(), (std::vector<int64_t>{20, 512}));
  EXPECT_EQ(vae.parameters()[12]->value.shape(), (std::vector<int64_t>{512, 784}));
  for (Parameter* p : vae.parameters()) EXPECT_EQ(p->weight_decay, p->name.ends_with("weight")) << p->name;
}

TEST(VAE, InitDependsOnlyOnSeedAndName) {
  VAE a(small_vae()), b(small_vae());
  expect_bit_identical(a, b);
  VAEConfig c = small_vae();
  c.seed = 10;
  VAE other(c);
  EXPECT_NE(a.parameters()[0]->value.to_vector(), other.parameters()[0]->value.to_vector());
}

TEST(VAE, ElboGradientsMatchFiniteDifferences) {
  VAE vae(small_vae());
  vae.set_batch_context(2, 4);
  Tensor x = random_tensor({3, 6}, 1, 0, 1);  // pixels in [0, 1]: input and target
  auto f = [&] { return vae.evaluate(x).total; };
  vae.zero_grad();
  const VAELoss l = vae.forward_backward(x);
  EXPECT_NEAR(l.total, l.recon + l.kl, 1e-12);
  EXPECT_GT(l.kl, 0.0);
  for (Parameter* p : vae.parameters()) {
    SCOPED_TRACE(p->name);
    expect_grad_matches(f, p->value, p->grad.clone(), 5e-3);
  }
}

TEST(VAE, InputGradientThroughTheReparameterization) {
  VAE vae(small_vae(/*needs_input_grad=*/true));
  vae.set_batch_context(0, 0);
  Tensor x = random_tensor({3, 6}, 1, 0, 1);
  Tensor w = random_tensor({3, 6}, 2);
  auto f = [&] { return weighted_sum(vae.forward(x), w); };  // a loss of the logits only
  vae.forward(x);
  Tensor dx = vae.backward(w).clone();
  expect_grad_matches(f, x, dx, 5e-3);
}

TEST(VAE, ParamHookFiresOncePerParameterInReverseOrder) {
  VAE vae(small_vae());
  RecordingHook hook;
  vae.set_param_hook(&hook);
  vae.forward_backward(random_tensor({3, 6}, 1, 0, 1));
  EXPECT_EQ(hook.names, reversed(names_of(vae)));
}

TEST(VAE, NoiseFollowsGlobalSampleIndexAcrossHalves) {
  VAE whole(small_vae()), half(small_vae());
  Tensor x = random_tensor({8, 6}, 1, 0, 1);
  whole.set_batch_context(6, 0);
  const VAELoss lw = whole.forward_backward(x);
  const std::vector<double> eps = whole.eps().to_vector();
  for (size_t i = 0; i < eps.size(); ++i) {
    ASSERT_EQ(eps[i], static_cast<double>(static_cast<float>(normal_at(9, internal::step_key("eps", 6), i, 0, 1))));
  }
  std::vector<std::vector<double>> eps_parts, mu_parts;
  double recon = 0.0, kl = 0.0;
  for (int64_t first : {0, 4}) {
    half.set_batch_context(6, first);
    const VAELoss l = half.forward_backward(x.narrow(0, first, 4), /*normalizer=*/8.0);
    recon += l.recon;
    kl += l.kl;
    eps_parts.push_back(half.eps().to_vector());
  }
  EXPECT_EQ(concat(eps_parts), eps);
  EXPECT_NEAR(recon, lw.recon, 1e-5 * lw.recon);
  EXPECT_NEAR(kl, lw.kl, 1e-5 * lw.kl);
  for (size_t i = 0; i < whole.parameters().size(); ++i) {
    Parameter* a = whole.parameters()[i];
    Tensor diff = a->grad.clone();
    axpy(-1.0, half.parameters()[i]->grad, diff);
    EXPECT_LE(l2_norm(diff), 1e-5 * l2_norm(a->grad)) << a->name;
  }
}

TEST(VAE, EvalModeAndPicturesAreDeterministic) {
  VAE vae(small_vae());
  Tensor x = random_tensor({2, 6}, 1, 0, 1);
  vae.set_training(false);
  const std::vector<double> a = vae.forward(x).to_vector();
  vae.set_batch_context(99, 1000);  // no noise in eval: the context does not matter
  const std::vector<double> logits = vae.forward(x).to_vector();
  EXPECT_EQ(logits, a);
  const std::vector<double> pics = vae.reconstruct(x).to_vector();
  ASSERT_EQ(pics.size(), logits.size());
  for (size_t i = 0; i < pics.size(); ++i) EXPECT_NEAR(pics[i], 1 / (1 + std::exp(-logits[i])), 1e-6);
  Tensor z = random_tensor({4, 3}, 5, -2, 2);
  Tensor d = vae.decode(z);
  EXPECT_EQ(d.shape(), (std::vector<int64_t>{4, 6}));
  for (double v : d.to_vector()) {
    EXPECT_GT(v, 0.0);
    EXPECT_LT(v, 1.0);
  }
  // Training mode: the noise changes the reconstruction logits.
  vae.set_training(true);
  EXPECT_NE(vae.forward(x).to_vector(), logits);
}

// What evaluation reports: the negative ELBO with z drawn by the
// reparameterization (not z = mu), from the "eval_eps" stream keyed like
// training's noise, in any mode and for any split of the batch.
TEST(VAE, SampledElboDrawsZFromItsOwnStream) {
  VAE vae(small_vae());
  Tensor x = random_tensor({8, 6}, 1, 0, 1);
  vae.set_training(false);
  vae.set_batch_context(0, 0);
  const VAELoss at_mean = vae.evaluate(x);
  const VAELoss sampled = vae.evaluate_sampled(x);
  EXPECT_NE(sampled.recon, at_mean.recon);  // z is sampled, not mu
  EXPECT_EQ(sampled.kl, at_mean.kl);        // the KL is in closed form, independent of z
  EXPECT_EQ(sampled.total, sampled.recon + sampled.kl);
  // The same numbers as a training-mode forward given the eval stream's noise.
  Tensor eps = Tensor::empty({8, 3}, DType::f32);
  for (int64_t i = 0; i < 24; ++i)
    eps.data<float>()[i] = static_cast<float>(normal_at(9, internal::step_key("eval_eps", 0), i, 0, 1));
  VAE reference(small_vae());
  reference.set_noise_override(eps);
  reference.set_training(true);
  const VAELoss want = reference.evaluate(x);
  EXPECT_EQ(sampled.recon, want.recon);
  EXPECT_EQ(sampled.kl, want.kl);
  // Two halves with their global sample index give the whole batch's sum.
  double total = 0.0;
  for (int64_t first : {0, 4}) {
    vae.set_batch_context(0, first);
    total += vae.evaluate_sampled(x.narrow(0, first, 4), /*normalizer=*/8.0).total;
  }
  EXPECT_NEAR(total, sampled.total, 1e-6 * sampled.total);
  EXPECT_FALSE(vae.training());  // evaluation left the mode alone
  // Deterministic: the same context draws the same z.
  vae.set_batch_context(0, 0);
  EXPECT_EQ(vae.evaluate_sampled(x).total, sampled.total);
}

}  // namespace
}  // namespace meshtrain::nn
