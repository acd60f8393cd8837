#include "meshtrain/optim/sgd.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::optim {

void sgd_update(float* p, const float* g, float* buf, size_t n, bool first, const SGDHParams& h) {
  // PyTorch casts each Python-float hyperparameter to the tensor's dtype.
  const float wd = static_cast<float>(h.weight_decay);
  const float momentum = static_cast<float>(h.momentum);
  const float blend = static_cast<float>(1.0 - h.dampening);
  const float neg_lr = static_cast<float>(-h.lr);
  const bool decay = h.weight_decay != 0.0, use_momentum = h.momentum != 0.0;
  for (size_t i = 0; i < n; ++i) {
    float d = g[i];
    if (decay) d = d + wd * p[i];  // grad.add(param, alpha=weight_decay)
    if (use_momentum) {
      float b;
      if (first) {
        b = d;  // torch.clone(grad)
      } else {
        b = buf[i] * momentum;  // buf.mul_(momentum)
        b = b + blend * d;      // .add_(grad, alpha=1 - dampening)
      }
      buf[i] = b;
      d = h.nesterov ? d + momentum * b : b;
    }
    p[i] = p[i] + neg_lr * d;  // param.add_(grad, alpha=-lr)
  }
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
  float scratch[kGradChunk];  // widened/scaled grads; unused on the in-place path
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!has_usable_grad(i)) continue;
    nn::Parameter& p = *params_[i];
    SGDState& s = state_[i];
    const SGDHParams h{.lr = lr_,
                       .momentum = momentum_,
                       .dampening = dampening_,
                       .weight_decay = p.weight_decay ? weight_decay_ : 0.0,
                       .nesterov = nesterov_};
    float* value = p.value.data<float>();
    float* buf = s.momentum_buffer.defined() ? s.momentum_buffer.data<float>() : nullptr;
    // sgd_update is element-wise and `first` is per parameter, so updating
    // slice by slice gives the whole-parameter result bit for bit.
    const size_t n = static_cast<size_t>(p.value.numel()), chunk = grad_chunk(i);
    for (size_t off = 0; off < n; off += chunk) {
      const size_t len = std::min(chunk, n - off);
      sgd_update(value + off, grad_slice(i, off, len, scratch), buf != nullptr ? buf + off : nullptr, len,
                 s.step == 0, h);
    }
    ++s.step;
  }
}

size_t SGD::state_bytes() const {
  size_t bytes = 0;
  for (const SGDState& s : state_) bytes += s.momentum_buffer.nbytes();
  return bytes;
}

}  // namespace meshtrain::optim
