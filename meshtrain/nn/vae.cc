#include "meshtrain/nn/vae.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::nn {

namespace {

const VAEConfig& checked(const VAEConfig& c) {
  bool ok = c.input >= 1 && c.latent >= 1 && !c.hidden.empty();
  for (int64_t h : c.hidden) ok = ok && h >= 1;
  if (!ok)
    throw InvalidArgument("VAE",
                          fmt::format("input {}, hidden of {} layers, latent {}", c.input, c.hidden.size(), c.latent),
                          "need input >= 1, latent >= 1 and at least one hidden width, each >= 1");
  return c;
}

}  // namespace

VAE::VAE(VAEConfig config)
    : config_(checked(config)),
      encoder_(internal::join_name(config_.prefix, "encoder")),
      fc_mu_(config_.hidden.back(), config_.latent, internal::join_name(config_.prefix, "fc_mu"), config_.seed,
             LinearOptions{.defer_init = config_.defer_init}),
      fc_logvar_(config_.hidden.back(), config_.latent, internal::join_name(config_.prefix, "fc_logvar"),
                 config_.seed, LinearOptions{.defer_init = config_.defer_init}),
      decoder_(internal::join_name(config_.prefix, "decoder")) {
  // Each of encoder and decoder is a chain of Linears (tensor_parallel.h's
  // pairing under tensor parallelism), every one but the decoder's last
  // followed by a ReLU.
  const std::vector<int64_t>& h = config_.hidden;
  const TensorParallelGroup& tp = config_.tensor;
  std::vector<int64_t> sizes = {config_.input};
  sizes.insert(sizes.end(), h.begin(), h.end());
  const std::vector<ChainRole> encoder_roles = chain_roles(sizes);
  int64_t prev = config_.input;
  for (size_t i = 0; i < h.size(); ++i) {  // input -> h[0] -> ... -> h[n-1]
    LinearOptions options;
    options.needs_input_grad = i > 0 || config_.needs_input_grad;
    options.defer_init = config_.defer_init;
    encoder_.add(make_chain_linear(prev, h[i], encoder_.next_name(), config_.seed, options, tp, encoder_roles[i]));
    encoder_.add(std::make_unique<ReLU>());
    prev = h[i];
  }
  sizes.assign({config_.latent});
  sizes.insert(sizes.end(), h.rbegin(), h.rend());
  sizes.push_back(config_.input);
  const std::vector<ChainRole> decoder_roles = chain_roles(sizes);
  prev = config_.latent;
  const size_t layers = h.size() + 1;
  for (size_t j = 0; j < layers; ++j) {  // latent -> h[n-1] -> ... -> h[0] -> input
    const int64_t out = sizes[j + 1];
    decoder_.add(make_chain_linear(prev, out, decoder_.next_name(), config_.seed,
                                   LinearOptions{.defer_init = config_.defer_init}, tp, decoder_roles[j]));
    if (j + 1 < layers) decoder_.add(std::make_unique<ReLU>());
    prev = out;
  }
}

std::vector<Parameter*> VAE::parameters() {
  std::vector<Parameter*> all = encoder_.parameters();
  for (Module* m : {static_cast<Module*>(&fc_mu_), static_cast<Module*>(&fc_logvar_),
                    static_cast<Module*>(&decoder_)}) {
    std::vector<Parameter*> ps = m->parameters();
    all.insert(all.end(), ps.begin(), ps.end());
  }
  return all;
}

Tensor VAE::do_forward(const Tensor& x, Saved& saved) {
  const char* op = "VAE::forward";
  State& st = saved.state<State>();
  st.mu = Tensor();  // let the heads reuse their output buffers
  st.logvar = Tensor();
  Tensor h = encoder_.forward(x, saved.child(kEncoder));  // (B, input) -> (B, H)
  st.mu = fc_mu_.forward(h, saved.child(kMu));             // (B, H) -> (B, L)
  st.logvar = fc_logvar_.forward(h, saved.child(kLogvar));  // (B, H) -> (B, L)
  h = Tensor();
  const bool eval_sample = !eval_stream_.empty();
  st.sampled = training_ || eval_sample;
  if (!st.sampled) return decoder_.forward(st.mu, saved.child(kDecoder));  // z = mu

  const BatchContext& ctx = saved.batch;
  if (ctx.first_global_sample < 0)
    throw InvalidArgument(op, fmt::format("first_global_sample {}", ctx.first_global_sample),
                          "set_batch_context needs the global index of the first local sample, >= 0");
  const int64_t batch = st.mu.size(0), latent = config_.latent;
  const int64_t n = batch * latent;
  Tensor& eps = internal::reuse_or_allocate(st.eps, {batch, latent}, tracker_);
  Tensor& sd = internal::reuse_or_allocate(st.std, {batch, latent}, tracker_);
  Tensor& z = internal::reuse_or_allocate(st.z, {batch, latent}, tracker_);
  // eps at global index (first_global_sample + i) * latent + k: one contiguous run.
  if (noise_override_.defined()) {
    if (noise_override_.shape() != eps.shape())
      throw InvalidArgument(op, fmt::format("noise override of shape {} for a batch needing {}",
                                            shape_to_string(noise_override_.shape()), shape_to_string(eps.shape())),
                            "pass (batch, latent) noise");
    eps.copy_from(noise_override_);
  } else {
    const std::string stream = eval_sample ? eval_stream_ : std::string("eps");
    fill_normal(eps.data<float>(), static_cast<size_t>(n), config_.seed,
                internal::step_key(internal::join_name(config_.prefix, stream), ctx.step),
                static_cast<uint64_t>(ctx.first_global_sample) * static_cast<uint64_t>(latent), 0.0f, 1.0f);
  }
  functional::reparameterize(st.mu, st.logvar, eps, sd, z);  // z = mu + exp(0.5 logvar) * eps
  return decoder_.forward(z, saved.child(kDecoder));         // (B, L) -> (B, input) logits
}

Tensor VAE::backward(const Tensor& grad_logits, const Tensor& grad_mu, const Tensor& grad_logvar, Saved& saved) {
  const char* op = "VAE::backward";
  const std::vector<int64_t> shape = saved.state<State>().mu.shape();
  pending_grad_mu_ = Tensor();
  pending_grad_logvar_ = Tensor();
  if (grad_mu.defined()) {
    pending_grad_mu_ = internal::f32_contiguous(grad_mu, op, "grad_mu");
    internal::check_shape(pending_grad_mu_, shape, op, "grad_mu");
  }
  if (grad_logvar.defined()) {
    pending_grad_logvar_ = internal::f32_contiguous(grad_logvar, op, "grad_logvar");
    internal::check_shape(pending_grad_logvar_, shape, op, "grad_logvar");
  }
  try {
    return Module::backward(grad_logits, saved);
  } catch (...) {
    pending_grad_mu_ = pending_grad_logvar_ = Tensor();
    throw;
  }
}

void VAE::latent_grads(const Tensor& dz, State& st) {
  const std::vector<int64_t>& shape = st.mu.shape();
  Tensor& dmu = internal::reuse_or_allocate(st.dmu, shape, tracker_);
  Tensor& dlv = internal::reuse_or_allocate(st.dlogvar, shape, tracker_);
  // dz/dmu = 1; dz/dlogvar = 0.5 exp(0.5 logvar) eps (0 when z = mu).
  dmu.copy_from(dz);
  if (st.sampled)
    functional::reparameterize_backward_logvar(dz, st.eps, st.std, dlv);
  else
    dlv.fill(0.0);
  if (pending_grad_mu_.defined()) axpy(1.0, pending_grad_mu_, dmu);
  if (pending_grad_logvar_.defined()) axpy(1.0, pending_grad_logvar_, dlv);
  pending_grad_mu_ = pending_grad_logvar_ = Tensor();
}

Tensor VAE::sum_heads(const Tensor& dh_mu, const Tensor& dh_logvar, State& st) {
  Tensor& dh = internal::reuse_or_allocate(st.dh, dh_mu.shape(), tracker_);
  add(dh_mu, dh_logvar, dh);
  return dh;
}

Tensor VAE::do_backward(const Tensor& grad_logits, Saved& saved) {
  State& st = saved.state<State>();
  Tensor dz = decoder_.backward(grad_logits, saved.child(kDecoder));  // (B, input) -> (B, L)
  latent_grads(dz, st);
  dz = Tensor();
  // Heads in reverse definition order, so the hook sees reverse parameter order.
  Tensor dh_logvar = fc_logvar_.backward(st.dlogvar, saved.child(kLogvar));  // (B, L) -> (B, H)
  Tensor dh_mu = fc_mu_.backward(st.dmu, saved.child(kMu));                   // (B, L) -> (B, H)
  Tensor dh = sum_heads(dh_mu, dh_logvar, st);
  return encoder_.backward(dh, saved.child(kEncoder));  // (B, H) -> (B, input) or undefined
}

Tensor VAE::do_backward_input(const Tensor& grad_logits, Saved& saved) {
  State& st = saved.state<State>();
  Tensor dz = decoder_.backward_input(grad_logits, saved.child(kDecoder));
  latent_grads(dz, st);
  dz = Tensor();
  Tensor dh_logvar = fc_logvar_.backward_input(st.dlogvar, saved.child(kLogvar));
  Tensor dh_mu = fc_mu_.backward_input(st.dmu, saved.child(kMu));
  Tensor dh = sum_heads(dh_mu, dh_logvar, st);
  return encoder_.backward_input(dh, saved.child(kEncoder));
}

void VAE::do_backward_weight(Saved& saved) {
  // The fused order: decoder, logvar head, mu head, encoder.
  decoder_.backward_weight(saved.child(kDecoder));
  fc_logvar_.backward_weight(saved.child(kLogvar));
  fc_mu_.backward_weight(saved.child(kMu));
  encoder_.backward_weight(saved.child(kEncoder));
}

VAELoss VAE::losses(const Tensor& x, const Tensor& logits, Saved& saved, std::optional<double> normalizer) {
  const double norm = normalizer.value_or(static_cast<double>(std::max<int64_t>(logits.size(0), 1)));
  State& st = saved.state<State>();
  VAELoss l;
  l.recon = bce_.forward(logits, x, saved.child(kBce), norm);
  l.kl = kl_.forward(st.mu, st.logvar, saved.child(kKl), norm);
  l.total = l.recon + l.kl;
  return l;
}

VAELoss VAE::forward_backward(const Tensor& x, Saved& saved, std::optional<double> normalizer) {
  Tensor logits = forward(x, saved);
  const VAELoss l = losses(x, logits, saved, normalizer);
  logits = Tensor();
  GaussianKLLoss::Grads g = kl_.backward(saved.child(kKl));
  backward(bce_.backward(saved.child(kBce)), g.mu, g.logvar, saved);
  return l;
}

VAELoss VAE::evaluate(const Tensor& x, std::optional<double> normalizer) {
  Saved& saved = own_saved();
  Tensor logits = forward(x, saved);
  return losses(x, logits, saved, normalizer);
}

VAELoss VAE::evaluate_sampled(const Tensor& x, std::optional<double> normalizer) {
  Saved& saved = own_saved();
  eval_stream_ = "eval_eps";
  Tensor logits;
  try {
    logits = forward(x, saved);
  } catch (...) {
    eval_stream_.clear();
    throw;
  }
  eval_stream_.clear();
  return losses(x, logits, saved, normalizer);
}

Tensor VAE::decode(const Tensor& z) {
  Saved scratch;
  Tensor logits = decoder_.forward(z, scratch);  // (N, L) -> (N, input)
  Tensor out = Tensor::empty(logits.shape(), DType::f32);
  functional::activation_forward(functional::ActivationKind::sigmoid, logits, out);
  return out;
}

Tensor VAE::reconstruct(const Tensor& x) {
  Saved scratch;
  Tensor h = encoder_.forward(x, scratch.child(kEncoder));  // (N, input) -> (N, H)
  return decode(fc_mu_.forward(h, scratch.child(kMu)));
}

}  // namespace meshtrain::nn
