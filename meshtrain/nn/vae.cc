#include "meshtrain/nn/vae.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/internal/buffers.h"

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
  const std::vector<int64_t>& h = config_.hidden;
  int64_t prev = config_.input;
  for (size_t i = 0; i < h.size(); ++i) {  // input -> h[0] -> ... -> h[n-1]
    LinearOptions options;
    options.needs_input_grad = i > 0 || config_.needs_input_grad;
    options.defer_init = config_.defer_init;
    encoder_.add(std::make_unique<Linear>(prev, h[i], encoder_.next_name(), config_.seed, options));
    encoder_.add(std::make_unique<ReLU>());
    prev = h[i];
  }
  prev = config_.latent;
  for (size_t i = h.size(); i-- > 0;) {  // latent -> h[n-1] -> ... -> h[0] -> input
    decoder_.add(std::make_unique<Linear>(prev, h[i], decoder_.next_name(), config_.seed,
                                          LinearOptions{.defer_init = config_.defer_init}));
    decoder_.add(std::make_unique<ReLU>());
    prev = h[i];
  }
  decoder_.add(std::make_unique<Linear>(prev, config_.input, decoder_.next_name(), config_.seed,
                                        LinearOptions{.defer_init = config_.defer_init}));
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

Tensor VAE::forward(const Tensor& x) { return forward_impl(x, training_, "eps"); }

Tensor VAE::forward_impl(const Tensor& x, bool sample, std::string_view stream) {
  const char* op = "VAE::forward";
  mu_ = Tensor();  // let the heads reuse their output buffers
  logvar_ = Tensor();
  Tensor h = encoder_.forward(x);  // (B, input) -> (B, H)
  mu_ = fc_mu_.forward(h);         // (B, H) -> (B, L)
  logvar_ = fc_logvar_.forward(h);  // (B, H) -> (B, L)
  h = Tensor();
  sampled_ = sample;
  if (!sampled_) return decoder_.forward(mu_);  // z = mu

  const BatchContext& ctx = batch_context_;
  if (ctx.first_global_sample < 0)
    throw InvalidArgument(op, fmt::format("first_global_sample {}", ctx.first_global_sample),
                          "set_batch_context needs the global index of the first local sample, >= 0");
  const int64_t batch = mu_.size(0), latent = config_.latent;
  const int64_t n = batch * latent;
  Tensor& eps = internal::reuse_or_allocate(eps_, {batch, latent}, tracker_);
  Tensor& sd = internal::reuse_or_allocate(std_, {batch, latent}, tracker_);
  Tensor& z = internal::reuse_or_allocate(z_, {batch, latent}, tracker_);
  // eps at global index (first_global_sample + i) * latent + k: one contiguous run.
  if (noise_override_.defined()) {
    if (noise_override_.shape() != eps.shape())
      throw InvalidArgument(op, fmt::format("noise override of shape {} for a batch needing {}",
                                            shape_to_string(noise_override_.shape()), shape_to_string(eps.shape())),
                            "pass (batch, latent) noise");
    eps.copy_from(noise_override_);
  } else {
    fill_normal(eps.data<float>(), static_cast<size_t>(n), config_.seed,
                internal::step_key(internal::join_name(config_.prefix, stream), ctx.step),
                static_cast<uint64_t>(ctx.first_global_sample) * static_cast<uint64_t>(latent), 0.0f, 1.0f);
  }
  const float* pm = mu_.data<float>();
  const float* pl = logvar_.data<float>();
  const float* pe = eps.data<float>();
  float* ps = sd.data<float>();
  float* pz = z.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    ps[i] = std::exp(0.5f * pl[i]);
    pz[i] = pm[i] + ps[i] * pe[i];  // z = mu + exp(0.5 logvar) * eps
  }
  return decoder_.forward(z);  // (B, L) -> (B, input) logits
}

Tensor VAE::backward(const Tensor& grad_logits) { return backward(grad_logits, Tensor(), Tensor()); }

Tensor VAE::backward(const Tensor& grad_logits, const Tensor& grad_mu, const Tensor& grad_logvar) {
  const char* op = "VAE::backward";
  Tensor dz = decoder_.backward(grad_logits);  // (B, input) -> (B, L)
  const std::vector<int64_t>& shape = mu_.shape();
  Tensor gm, gl;
  if (grad_mu.defined()) {
    gm = internal::f32_contiguous(grad_mu, op, "grad_mu");
    internal::check_shape(gm, shape, op, "grad_mu");
  }
  if (grad_logvar.defined()) {
    gl = internal::f32_contiguous(grad_logvar, op, "grad_logvar");
    internal::check_shape(gl, shape, op, "grad_logvar");
  }
  Tensor& dmu = internal::reuse_or_allocate(dmu_, shape, tracker_);
  Tensor& dlv = internal::reuse_or_allocate(dlogvar_, shape, tracker_);
  const int64_t n = mu_.numel();
  const float* pdz = dz.data<float>();
  float* pdm = dmu.data<float>();
  float* pdl = dlv.data<float>();
  // dz/dmu = 1; dz/dlogvar = 0.5 exp(0.5 logvar) eps (0 when z = mu).
  std::copy(pdz, pdz + n, pdm);
  if (sampled_) {
    const float* pe = eps_.data<float>();
    const float* ps = std_.data<float>();
    for (int64_t i = 0; i < n; ++i) pdl[i] = pdz[i] * pe[i] * 0.5f * ps[i];
  } else {
    std::fill(pdl, pdl + n, 0.0f);
  }
  if (gm.defined()) {
    const float* p = gm.data<float>();
    for (int64_t i = 0; i < n; ++i) pdm[i] += p[i];
  }
  if (gl.defined()) {
    const float* p = gl.data<float>();
    for (int64_t i = 0; i < n; ++i) pdl[i] += p[i];
  }
  dz = Tensor();
  // Heads in reverse definition order, so the hook sees reverse parameter order.
  Tensor dh_logvar = fc_logvar_.backward(dlv);  // (B, L) -> (B, H)
  Tensor dh_mu = fc_mu_.backward(dmu);          // (B, L) -> (B, H)
  Tensor& dh = internal::reuse_or_allocate(dh_, dh_mu.shape(), tracker_);
  const float* a = dh_mu.data<float>();
  const float* b = dh_logvar.data<float>();
  float* pdh = dh.data<float>();
  const int64_t m = dh.numel();
  for (int64_t i = 0; i < m; ++i) pdh[i] = a[i] + b[i];
  return encoder_.backward(dh);  // (B, H) -> (B, input) or undefined
}

VAELoss VAE::losses(const Tensor& x, const Tensor& logits, std::optional<double> normalizer) {
  const double norm = normalizer.value_or(static_cast<double>(std::max<int64_t>(logits.size(0), 1)));
  VAELoss l;
  l.recon = bce_.forward(logits, x, norm);
  l.kl = kl_.forward(mu_, logvar_, norm);
  l.total = l.recon + l.kl;
  return l;
}

VAELoss VAE::forward_backward(const Tensor& x, std::optional<double> normalizer) {
  Tensor logits = forward(x);
  const VAELoss l = losses(x, logits, normalizer);
  logits = Tensor();
  GaussianKLLoss::Grads g = kl_.backward();
  backward(bce_.backward(), g.mu, g.logvar);
  return l;
}

VAELoss VAE::evaluate(const Tensor& x, std::optional<double> normalizer) {
  Tensor logits = forward(x);
  return losses(x, logits, normalizer);
}

VAELoss VAE::evaluate_sampled(const Tensor& x, std::optional<double> normalizer) {
  Tensor logits = forward_impl(x, true, "eval_eps");
  return losses(x, logits, normalizer);
}

Tensor VAE::decode(const Tensor& z) {
  Tensor logits = decoder_.forward(z);  // (N, L) -> (N, input)
  Tensor out = Tensor::empty(logits.shape(), DType::f32);
  const float* pl = logits.data<float>();
  float* po = out.data<float>();
  const int64_t n = logits.numel();
  for (int64_t i = 0; i < n; ++i) po[i] = 1.0f / (1.0f + std::exp(-pl[i]));
  return out;
}

Tensor VAE::reconstruct(const Tensor& x) {
  Tensor h = encoder_.forward(x);  // (N, input) -> (N, H)
  return decode(fc_mu_.forward(h));
}

}  // namespace meshtrain::nn
