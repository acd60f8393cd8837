// Helpers for the optimizer tests (header-only; not part of the library API).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::testing {

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

// The bit patterns of an f32 tensor's elements, for bit-for-bit comparisons
// (== on values would equate 0 and -0 and fail on NaN).
inline std::vector<uint32_t> f32_bits(const Tensor& t) {
  std::vector<uint32_t> bits(static_cast<size_t>(t.numel()));
  if (!bits.empty()) std::memcpy(bits.data(), t.data<float>(), bits.size() * sizeof(float));
  return bits;
}

}  // namespace meshtrain::testing
