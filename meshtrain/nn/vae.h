// Variational autoencoder for 28x28 images: encoder 784-512-512 (ReLU), two
// Linear heads for the mean and log-variance of a 20-d latent, the
// reparameterization z = mu + exp(0.5 logvar) * eps, and a symmetric decoder
// 20-512-512-784 whose output is logits (sigmoid gives pixel probabilities).
//
//   nn::VAE vae(nn::VAEConfig{.seed = 42});
//   vae.set_batch_context(step, first_global_sample);  // keys eps
//   nn::VAELoss l = vae.forward_backward(x);           // x (B, 784) in [0, 1]; grads += d ELBO
//   // l.recon (BCE summed over pixels, mean over samples), l.kl, l.total = recon + kl
//   Tensor pics = vae.decode(z);                       // (N, 20) -> (N, 784) probabilities
//
// Parameters, in this order: "encoder.0", "encoder.2" (Sequential numbering),
// "fc_mu", "fc_logvar", "decoder.0", "decoder.2", "decoder.4"; each a Linear
// with ".weight" (in, out) and ".bias". backward notifies the gradient hook
// in exactly the reverse order.
//
// Noise: eps[i][k] = normal_at(seed, step_key("<prefix>.eps", step),
// (first_global_sample + i) * latent + k, 0, 1) rounded to f32, so any
// data-parallel split of the batch draws the single-device noise. In
// evaluation mode forward() uses z = mu (no noise); evaluate_sampled() draws
// z as in training from its own stream "<prefix>.eval_eps" (same keying),
// so an evaluation never reuses a training draw.
//
// Loss (ELBO, to minimize): recon = sum over pixels of BCE-with-logits(logits,
// x), kl = sum over latent dims of KL(q(z|x) || N(0, 1)); both divided by the
// normalizer (default: the local batch; pass the global batch under data
// parallelism so the ranks' losses and gradients sum to the global mean).
//
// forward(x) / backward(dlogits) keep the Module contract with the loss seen
// as a function of the logits only; the three-argument backward adds the
// gradients reaching mu and logvar directly (the KL term). Every form takes
// an optional Saved (the call's state: children's activations, mu, logvar,
// noise, the losses'); without one the VAE's own is used.
// decode() and reconstruct() keep nothing: they may run between a forward
// and its backward.
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/sequential.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::nn {

struct VAEConfig {
  int64_t input = 784;                   // pixels per image
  std::vector<int64_t> hidden = {512, 512};  // encoder widths; the decoder mirrors them
  int64_t latent = 20;
  uint64_t seed = 0;                     // initialization and noise seed
  bool needs_input_grad = false;         // true: backward returns d loss / d x
  bool defer_init = false;               // leave parameter values to be built later (LinearOptions::defer_init)
  std::string prefix;                    // module path of the VAE ("" at the root)
  // Tensor parallelism: encoder and decoder split in Megatron's column/row
  // pairs (tensor_parallel.h's chain_roles: with two hidden layers the
  // encoder is one pair, the decoder's small first Linear stays whole and
  // the other two pair up); the latent heads stay whole. Every rank computes the same mu, logvar, loss.
  TensorParallelGroup tensor = {};
};

struct VAELoss {
  double recon = 0.0;  // BCE-with-logits summed over pixels / normalizer
  double kl = 0.0;     // KL(q || N(0, 1)) summed over latent dims / normalizer
  double total = 0.0;  // recon + kl
};

class VAE final : public Module {
 public:
  explicit VAE(VAEConfig config = {});
  VAE(const VAE&) = delete;
  VAE& operator=(const VAE&) = delete;

  // forward: x (B, input) f32 -> reconstruction logits (B, input); keeps mu,
  // logvar. backward: the gradient of a loss of the logits only (no KL term).
  using Module::backward;
  // grad_logits (B, input); grad_mu and grad_logvar (B, latent), each may be
  // undefined (zero). Returns d loss / d x, or undefined unless needs_input_grad.
  Tensor backward(const Tensor& grad_logits, const Tensor& grad_mu, const Tensor& grad_logvar, Saved& saved);
  Tensor backward(const Tensor& grad_logits, const Tensor& grad_mu, const Tensor& grad_logvar) {
    return backward(grad_logits, grad_mu, grad_logvar, own_saved());
  }
  std::vector<Parameter*> parameters() override;

  std::vector<Module*> children() override { return {&encoder_, &fc_mu_, &fc_logvar_, &decoder_}; }

  // forward, the ELBO parts, and backward through decoder, both heads and
  // encoder (gradients accumulate). x is also the BCE target, in [0, 1].
  VAELoss forward_backward(const Tensor& x, Saved& saved, std::optional<double> normalizer = std::nullopt);
  VAELoss forward_backward(const Tensor& x, std::optional<double> normalizer = std::nullopt) {
    return forward_backward(x, own_saved(), normalizer);
  }
  // forward and the ELBO parts only (honours training(): in evaluation mode
  // z = mu, so recon + kl is NOT a bound on -log p(x)).
  VAELoss evaluate(const Tensor& x, std::optional<double> normalizer = std::nullopt);
  // The negative ELBO estimated with one z per sample, drawn by the
  // reparameterization whatever training() says (noise keyed by the batch
  // context on the "eval_eps" stream, see Noise above): recon is
  // -E_q[log p(x|z)] at that z, kl the closed form; total = recon + kl is an
  // unbiased estimate of the negative ELBO, an upper bound on -log p(x) in
  // nats. What evaluation should report.
  VAELoss evaluate_sampled(const Tensor& x, std::optional<double> normalizer = std::nullopt);

  // Pixel probabilities sigmoid(decoder(z)): z (N, latent) -> (N, input), new tensor.
  Tensor decode(const Tensor& z);
  // decode(mu(x)): the deterministic reconstruction, (N, input) -> (N, input).
  Tensor reconstruct(const Tensor& x);

  // The posterior parameters of the last forward into `saved` (default: the
  // VAE's own), (B, latent).
  const Tensor& mu(Saved& saved) { return saved.state<State>().mu; }
  const Tensor& logvar(Saved& saved) { return saved.state<State>().logvar; }
  const Tensor& mu() { return mu(own_saved()); }
  const Tensor& logvar() { return logvar(own_saved()); }
  // The noise of the last training forward into the VAE's own Saved, (B, latent).
  const Tensor& eps() { return own_saved().state<State>().eps; }
  // Uses this (B, latent) noise instead of drawing it, until cleared with an
  // undefined Tensor: for parity tests against another framework's noise.
  void set_noise_override(Tensor eps) { noise_override_ = std::move(eps); }
  const VAEConfig& config() const { return config_; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_logits, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_logits, Saved& saved) override;
  std::string describe() const override { return "VAE '" + config_.prefix + "'"; }

 private:
  // Child slots of a VAE's Saved.
  enum Slot : size_t { kEncoder = 0, kMu, kLogvar, kDecoder, kBce, kKl };
  struct State {
    Tensor mu, logvar;        // (B, latent) heads' outputs
    Tensor eps, std, z;       // (B, latent) noise, exp(0.5 logvar), decoder input
    bool sampled = false;     // the forward drew noise
    Tensor dmu, dlogvar, dh;  // gradient buffers
  };
  VAELoss losses(const Tensor& x, const Tensor& logits, Saved& saved, std::optional<double> normalizer);
  // The gradients reaching mu and logvar from the decoder's dz.
  // (The three-argument backward's extra gradients are added here.)
  void latent_grads(const Tensor& dz, State& st);
  // dh = dh_mu + dh_logvar into st.dh.
  Tensor sum_heads(const Tensor& dh_mu, const Tensor& dh_logvar, State& st);

  VAEConfig config_;
  Sequential encoder_;  // (B, input) -> (B, hidden.back())
  Linear fc_mu_;        // (B, hidden.back()) -> (B, latent)
  Linear fc_logvar_;    // (B, hidden.back()) -> (B, latent)
  Sequential decoder_;  // (B, latent) -> (B, input) logits
  Tensor noise_override_;  // see set_noise_override
  // The three-argument backward's grad_mu, grad_logvar, for the call in progress.
  Tensor pending_grad_mu_, pending_grad_logvar_;
  // evaluate_sampled: the noise stream of the next forward (sampled whatever
  // training() says); empty: training() decides, stream "eps".
  std::string eval_stream_;
  BCEWithLogitsLoss bce_;
  GaussianKLLoss kl_;
};

}  // namespace meshtrain::nn
