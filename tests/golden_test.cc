// PyTorch parity (llm.c style) for the MLP, the VAE, the GPT (tied
// embedding, causal attention), the GPT with Llama's blocks and the
// mixture-of-experts layer: golden
// files written by scripts/make_golden.py with Debian's python3-torch hold
// inputs, initial weights, the loss, every
// gradient and 10 AdamW steps of losses. meshtrain loads the same weights and
// must agree within 1e-5 (fp32). CI needs only the committed files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/moe.h"
#include "meshtrain/nn/vae.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/train/artifacts.h"

namespace meshtrain {
namespace {

using Golden = std::map<std::string, Tensor>;

Golden load(const std::string& file) {
  Golden g;
  for (auto& [name, t] : checkpoint::load_safetensors(std::string(MESHTRAIN_GOLDEN_DIR) + "/" + file)) g[name] = t;
  return g;
}

// Max |a - b| relative to max |b| (scale-aware: gradients span decades).
double rel_diff(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  EXPECT_EQ(va.size(), vb.size());
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    diff = std::max(diff, std::fabs(va[i] - vb[i]));
    scale = std::max(scale, std::fabs(vb[i]));
  }
  return diff / scale;
}

// Golden names in parameter order: <layer>.weight, <layer>.bias per Linear.
void load_weights(nn::Module& model, const Golden& g, const std::vector<std::string>& layers) {
  auto params = model.parameters();
  ASSERT_EQ(params.size(), 2 * layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    params[2 * i]->value.copy_from(g.at("init." + layers[i] + ".weight"));
    params[2 * i + 1]->value.copy_from(g.at("init." + layers[i] + ".bias"));
  }
}

void expect_grads(nn::Module& model, const Golden& g, const std::vector<std::string>& layers) {
  auto params = model.parameters();
  for (size_t i = 0; i < layers.size(); ++i) {
    EXPECT_LT(rel_diff(params[2 * i]->grad, g.at("grad." + layers[i] + ".weight")), 1e-5) << layers[i];
    EXPECT_LT(rel_diff(params[2 * i + 1]->grad, g.at("grad." + layers[i] + ".bias")), 1e-5) << layers[i];
  }
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(1e-30, std::fabs(b)); }

TEST(GoldenPyTorch, MlpLossGradientsAndTenAdamWSteps) {
  const Golden g = load("mlp_v1.safetensors");
  nn::MLPConfig cfg;
  cfg.sizes = {784, 32, 16, 10};
  nn::MLP model(cfg);
  const std::vector<std::string> layers = {"layers.0", "layers.1", "layers.2"};
  load_weights(model, g, layers);
  const Tensor& x = g.at("x");
  const Tensor& y = g.at("labels");
  nn::CrossEntropyLoss ce;
  model.zero_grad();
  const double loss = ce.forward(model.forward(x), y);
  model.backward(ce.backward());
  EXPECT_LT(rel(loss, g.at("loss").to_vector()[0]), 1e-5);
  expect_grads(model, g, layers);

  optim::AdamW opt(model.parameters(), 1e-3, {0.9, 0.999}, 1e-8, 0.01);
  const auto want = g.at("steps.loss").to_vector();
  for (size_t s = 0; s < want.size(); ++s) {
    opt.zero_grad();
    const double l = ce.forward(model.forward(x), y);
    model.backward(ce.backward());
    opt.step();
    EXPECT_LT(rel(l, want[s]), 1e-5) << "step " << s;
  }
}

TEST(GoldenPyTorch, VaeElboGradientsAndTenAdamWSteps) {
  const Golden g = load("vae_v1.safetensors");
  nn::VAEConfig cfg;
  cfg.hidden = {32, 16};
  cfg.latent = 4;
  nn::VAE model(cfg);
  const std::vector<std::string> layers = {"enc.0", "enc.1", "mu", "logvar", "dec.0", "dec.1", "dec.2"};
  load_weights(model, g, layers);
  model.set_noise_override(g.at("eps"));
  const Tensor& x = g.at("x");
  model.zero_grad();
  const nn::VAELoss l = model.forward_backward(x);
  EXPECT_LT(rel(l.recon, g.at("recon").to_vector()[0]), 1e-5);
  EXPECT_LT(rel(l.kl, g.at("kl").to_vector()[0]), 1e-5);
  EXPECT_LT(rel(l.total, g.at("loss").to_vector()[0]), 1e-5);
  expect_grads(model, g, layers);

  optim::AdamW opt(model.parameters(), 1e-3, {0.9, 0.999}, 1e-8, 0.01);
  const auto want = g.at("steps.loss").to_vector();
  for (size_t s = 0; s < want.size(); ++s) {
    opt.zero_grad();
    const double total = model.forward_backward(x).total;
    opt.step();
    EXPECT_LT(rel(total, want[s]), 1e-5) << "step " << s;
  }
}

// A decoder's golden file against the GPT built from `c`: the loss, every
// gradient and 10 AdamW steps within 1e-5.
void expect_decoder_golden(const std::string& file, const nn::GPTConfig& c) {
  const Golden g = load(file);
  nn::GPT model(c);
  for (nn::Parameter* p : model.parameters()) p->value.copy_from(g.at("init." + p->name));
  const Tensor& ids = g.at("ids");
  const Tensor targets = g.at("targets").view({ids.numel()});
  nn::CrossEntropyLoss ce;
  model.zero_grad();
  const double loss = ce.forward(model.forward(ids), targets);
  model.backward(ce.backward());
  EXPECT_LT(rel(loss, g.at("loss").to_vector()[0]), 1e-5);
  for (nn::Parameter* p : model.parameters())
    EXPECT_LT(rel_diff(p->grad, g.at("grad." + p->name)), 1e-5) << p->name;

  optim::AdamW opt(model.parameters(), 1e-3, {0.9, 0.999}, 1e-8, 0.01);  // decay: matrices, by metadata
  const auto want = g.at("steps.loss").to_vector();
  for (size_t s = 0; s < want.size(); ++s) {
    opt.zero_grad();
    const double l = ce.forward(model.forward(ids), targets);
    model.backward(ce.backward());
    opt.step();
    EXPECT_LT(rel(l, want[s]), 1e-5) << "step " << s;
  }
}

TEST(GoldenPyTorch, GptLossGradientsAndTenAdamWSteps) {
  expect_decoder_golden("gpt_v1.safetensors",
                        nn::GPTConfig{.vocab = 13, .block_size = 32, .layers = 2, .heads = 2, .width = 16});
}

// Llama's blocks (RMSNorm, rotate_half RoPE, 4 query heads over 2
// key/value heads, SwiGLU, no biases, tied head) against PyTorch's
// computation of the same model (scripts/make_golden.py's Llama).
TEST(GoldenPyTorch, LlamaLossGradientsAndTenAdamWSteps) {
  expect_decoder_golden("llama_v1.safetensors",
                        nn::GPTConfig{.arch = layout::DecoderArch::llama, .kv_heads = 2, .rope_base = 10000.0,
                                      .ffn_hidden = 24, .vocab = 13, .block_size = 32, .layers = 2, .heads = 4,
                                      .width = 16});
}

// The mixture-of-experts layer against scripts/make_golden.py's MoE: a
// softmax router with a capacity that drops tokens, and a sigmoid router
// with a shared expert and a selection bias. y, L_aux, the dropped count,
// dx and every gradient of sum(w * y) + L_aux within 1e-5.
TEST(GoldenPyTorch, MoEOutputAuxiliaryLossAndGradients) {
  const Golden g = load("moe_v1.safetensors");
  for (const std::string tag : {"soft", "sig"}) {
    SCOPED_TRACE(tag);
    const bool soft = tag == "soft";
    nn::MoE moe({.width = 8,
                 .moe = {.experts = 4, .top_k = 2, .expert_hidden = 6, .shared_experts = soft ? 0 : 1,
                         .score = soft ? layout::RouterScore::softmax : layout::RouterScore::sigmoid,
                         .aux_loss_coef = 0.05, .capacity_factor = soft ? 0.75 : 0.0},
                 .prefix = "mlp"});
    for (nn::Parameter* p : moe.parameters()) p->value.copy_from(g.at(tag + ".init." + p->name));
    std::vector<float> bias;
    for (double b : g.at(tag + ".bias").to_vector()) bias.push_back(static_cast<float>(b));
    moe.set_bias(bias);
    const Tensor& x = g.at(tag + ".x");
    moe.zero_grad();
    EXPECT_LT(rel_diff(moe.forward(x), g.at(tag + ".y")), 1e-5);
    const nn::MoELoad load = moe.take_load();
    EXPECT_LT(rel(load.aux_loss / static_cast<double>(load.sequences), g.at(tag + ".aux").to_vector()[0]), 1e-5);
    EXPECT_EQ(static_cast<double>(load.dropped), g.at(tag + ".dropped").to_vector()[0]);
    if (soft) {
      EXPECT_GT(load.dropped, 0);
    }
    EXPECT_LT(rel_diff(moe.backward(g.at(tag + ".w")), g.at(tag + ".grad.x")), 1e-5);
    for (nn::Parameter* p : moe.parameters())
      EXPECT_LT(rel_diff(p->grad, g.at(tag + ".grad." + p->name)), 1e-5) << p->name;
  }
}

}  // namespace
}  // namespace meshtrain
