#include "meshtrain/optim/sgd.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/functional.h"

namespace meshtrain::optim {

namespace {

nn::functional::SgdStep to_step(const SGDHParams& h, bool first, double grad_scale) {
  return {.lr = h.lr, .momentum = h.momentum, .dampening = h.dampening, .weight_decay = h.weight_decay,
          .nesterov = h.nesterov, .first = first, .grad_scale = grad_scale};
}

}  // namespace

void sgd_update(float* p, const float* g, float* buf, size_t n, bool first, const SGDHParams& h) {
  const int64_t len = static_cast<int64_t>(n);
  auto wrap = [len](const float* x) {
    return x == nullptr ? Tensor() : Tensor::from_blob(const_cast<float*>(x), {len}, DType::f32);
  };
  nn::functional::sgd_step(wrap(p), wrap(g), wrap(buf), to_step(h, first, 1.0));
}

SGD::SGD(std::vector<nn::Parameter*> params, double lr, double momentum, bool nesterov,
         double weight_decay, double dampening, MemoryTracker* tracker)
    : Optimizer("SGD", std::move(params), lr),
      momentum_(momentum),
      nesterov_(nesterov),
      weight_decay_(weight_decay),
      dampening_(dampening) {
  check_hparam(op_, "momentum", momentum, 0.0, HUGE_VAL, true);
  check_hparam(op_, "weight_decay", weight_decay, 0.0, HUGE_VAL, true);
  check_hparam(op_, "dampening", dampening, 0.0, 1.0, false);
  if (nesterov && (momentum <= 0.0 || dampening != 0.0))
    throw InvalidArgument(op_, fmt::format("nesterov needs momentum > 0 and dampening == 0 (got momentum {}, "
                                           "dampening {})",
                                           momentum, dampening),
                          "set momentum (e.g. 0.9) and dampening=0, or nesterov=false");
  state_.resize(params_.size());
  if (momentum_ != 0.0)
    for (size_t i = 0; i < params_.size(); ++i) state_[i].momentum_buffer = zeros_like_param(i, tracker);
}

void SGD::step() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!has_usable_grad(i)) continue;
    nn::Parameter& p = *params_[i];
    SGDState& s = state_[i];
    const SGDHParams h{.lr = lr_,
                       .momentum = momentum_,
                       .dampening = dampening_,
                       .weight_decay = p.weight_decay ? weight_decay_ : 0.0,
                       .nesterov = nesterov_};
    nn::functional::sgd_step(p.value, p.grad, s.momentum_buffer, to_step(h, s.step == 0, grad_scale_), p.rounded);
    p.rounded_fresh = p.rounded.defined();
    ++s.step;
  }
}

size_t SGD::state_bytes() const {
  size_t bytes = 0;
  for (const SGDState& s : state_) bytes += s.momentum_buffer.nbytes();
  return bytes;
}

}  // namespace meshtrain::optim
