#include "meshtrain/optim/adamw.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"

namespace meshtrain::optim {

void adamw_update(float* p, const float* g, float* m, float* v, size_t n, int64_t step,
                  const AdamWHParams& h) {
  if (step < 1)
    throw InvalidArgument("adamw_update", fmt::format("step {} < 1", step),
                          "pass the 1-based number of this update (the state's step count after it)");
  // Python-side scalars (double), each rounded to f32 where the tensor op uses it.
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(h.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, t);
  const float decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w1 = static_cast<float>(1.0 - h.beta1);  // lerp weight
  const bool small_weight = std::abs(w1) < 0.5f;
  const float beta2 = static_cast<float>(h.beta2);
  const float c2 = static_cast<float>(1.0 - h.beta2);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float eps = static_cast<float>(h.eps);
  const float neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  const bool decay_on = h.weight_decay != 0.0;
  for (size_t i = 0; i < n; ++i) {
    float pi = p[i];
    if (decay_on) pi = pi * decay;  // param.mul_(1 - lr * weight_decay)
    const float gi = g[i];
    // exp_avg.lerp_(grad, 1 - beta1), with torch.lerp's two branches.
    const float mi = small_weight ? m[i] + w1 * (gi - m[i]) : gi - (gi - m[i]) * (1.0f - w1);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    float vi = v[i] * beta2;
    vi = vi + c2 * gi * gi;
    // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    p[i] = pi + neg_step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

AdamW::AdamW(std::vector<nn::Parameter*> params, double lr, std::pair<double, double> betas, double eps,
             double weight_decay, MemoryTracker* tracker)
    : Optimizer("AdamW", std::move(params), lr),
      beta1_(betas.first),
      beta2_(betas.second),
      eps_(eps),
      weight_decay_(weight_decay) {
  check_hparam(op_, "beta1", beta1_, 0.0, 1.0, true);
  check_hparam(op_, "beta2", beta2_, 0.0, 1.0, true);
  check_hparam(op_, "eps", eps_, 0.0, HUGE_VAL, true);
  check_hparam(op_, "weight_decay", weight_decay_, 0.0, HUGE_VAL, true);
  state_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    state_[i].exp_avg = zeros_like_param(i, tracker);
    state_[i].exp_avg_sq = zeros_like_param(i, tracker);
  }
}

AdamWHParams AdamW::hparams_for(size_t i) const {
  return AdamWHParams{.lr = lr_,
                      .beta1 = beta1_,
                      .beta2 = beta2_,
                      .eps = eps_,
                      .weight_decay = params_.at(i)->weight_decay ? weight_decay_ : 0.0};
}

void AdamW::step() {
  float scratch[kGradChunk];  // widened/scaled grads; unused on the in-place path
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!has_usable_grad(i)) continue;
    nn::Parameter& p = *params_[i];
    AdamWState& s = state_[i];
    const AdamWHParams h = hparams_for(i);
    float* value = p.value.data<float>();
    float* m = s.exp_avg.data<float>();
    float* v = s.exp_avg_sq.data<float>();
    // A slice update equals that slice of the whole update (see the header).
    const size_t n = static_cast<size_t>(p.value.numel()), chunk = grad_chunk(i);
    for (size_t off = 0; off < n; off += chunk) {
      const size_t len = std::min(chunk, n - off);
      adamw_update(value + off, grad_slice(i, off, len, scratch), m + off, v + off, len, s.step + 1, h);
    }
    ++s.step;
  }
}

size_t AdamW::state_bytes() const {
  size_t bytes = 0;
  for (const AdamWState& s : state_) bytes += s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
  return bytes;
}

}  // namespace meshtrain::optim
