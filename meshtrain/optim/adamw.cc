#include "meshtrain/optim/adamw.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/functional.h"

namespace meshtrain::optim {

namespace {

nn::functional::AdamWStep to_step(const AdamWHParams& h, int64_t step, double grad_scale) {
  return {.lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .eps = h.eps, .weight_decay = h.weight_decay,
          .step = step, .grad_scale = grad_scale};
}

}  // namespace

void adamw_update(float* p, const float* g, float* m, float* v, size_t n, int64_t step, const AdamWHParams& h) {
  const int64_t len = static_cast<int64_t>(n);
  auto wrap = [len](const float* x) { return Tensor::from_blob(const_cast<float*>(x), {len}, DType::f32); };
  nn::functional::adamw_step(wrap(p), wrap(g), wrap(m), wrap(v), to_step(h, step, 1.0));
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
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!has_usable_grad(i)) continue;
    nn::Parameter& p = *params_[i];
    AdamWState& s = state_[i];
    nn::functional::adamw_step(p.value, p.grad, s.exp_avg, s.exp_avg_sq, to_step(hparams_for(i), s.step + 1, grad_scale_),
                               p.rounded);
    p.rounded_fresh = p.rounded.defined();
    ++s.step;
  }
}

size_t AdamW::state_bytes() const {
  size_t bytes = 0;
  for (const AdamWState& s : state_) bytes += s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
  return bytes;
}

}  // namespace meshtrain::optim
