// Helpers for the optimizer tests (header-only; not part of the library API).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::optim::testing {

// A 1-D f32 parameter with the given values and a zero gradient.
inline nn::Parameter make_param(std::string name, std::vector<float> value, bool decay = true) {
  nn::Parameter p;
  p.name = std::move(name);
  const int64_t n = static_cast<int64_t>(value.size());
  p.value = Tensor::from_vector(value, {n});
  p.grad = Tensor::zeros({n}, DType::f32);
  p.weight_decay = decay;
  return p;
}

inline void set_grad(nn::Parameter& p, const std::vector<float>& g) {
  p.grad.copy_from(Tensor::from_vector(g, {static_cast<int64_t>(g.size())}));
}

}  // namespace meshtrain::optim::testing
