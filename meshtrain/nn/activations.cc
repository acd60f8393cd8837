#include "meshtrain/nn/activations.h"

#include <fmt/format.h>

#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

namespace {

constexpr float kSqrtHalf = 0.70710678118654752f;      // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;    // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;   // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

Tensor Activation::forward(const Tensor& x) {
  const std::string op = fmt::format("{}::forward", name());
  x_ = internal::f32_contiguous(x, op.c_str(), "input");
  Tensor& y = internal::reuse_or_allocate(y_, x_.shape(), tracker_);
  apply(x_.data<float>(), y.data<float>(), x_.numel());
  return y;
}

Tensor Activation::backward(const Tensor& grad_out) {
  const std::string op = fmt::format("{}::backward", name());
  if (!x_.defined())
    throw InvalidArgument(op, "no forward to go back through",
                          "call forward before backward (backward releases forward's input)");
  Tensor dy = internal::f32_contiguous(grad_out, op.c_str(), "grad_out");
  internal::check_shape(dy, x_.shape(), op.c_str(), "grad_out");
  Tensor& dx = internal::reuse_or_allocate(dx_, x_.shape(), tracker_);
  apply_backward(x_.data<float>(), y_.data<float>(), dy.data<float>(), dx.data<float>(), x_.numel());
  x_ = Tensor();
  return dx;
}

void ReLU::apply(const float* x, float* y, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
void ReLU::apply_backward(const float* x, const float*, const float* dy, float* dx, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) {
    const float g = dy[i];  // loaded unconditionally so the select vectorizes
    dx[i] = x[i] > 0.0f ? g : 0.0f;
  }
}

void GELU::apply(const float* x, float* y, int64_t n) const {
  if (approximation_ == GeluApproximation::none) {
    for (int64_t i = 0; i < n; ++i) y[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kSqrtHalf));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      y[i] = 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v)));
    }
  }
}
void GELU::apply_backward(const float* x, const float*, const float* dy, float* dx, int64_t n) const {
  if (approximation_ == GeluApproximation::none) {
    // d/dx x Phi(x) = Phi(x) + x phi(x)
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      const float cdf = 0.5f * (1.0f + std::erf(v * kSqrtHalf));
      const float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
      dx[i] = dy[i] * (cdf + v * pdf);
    }
  } else {
    // u = k (v + c v^3), t = tanh u: d/dv = 0.5 (1 + t) + 0.5 v (1 - t^2) k (1 + 3 c v^2)
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      const float t = std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
      const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v * v);
      dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
  }
}

void SiLU::apply(const float* x, float* y, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * sigmoid(x[i]);
}
void SiLU::apply_backward(const float* x, const float*, const float* dy, float* dx, int64_t n) const {
  // d/dx x s(x) = s + x s (1 - s)
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(x[i]);
    dx[i] = dy[i] * (s + x[i] * s * (1.0f - s));
  }
}

void Tanh::apply(const float* x, float* y, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
}
void Tanh::apply_backward(const float*, const float* y, const float* dy, float* dx, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
}

void Sigmoid::apply(const float* x, float* y, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) y[i] = sigmoid(x[i]);
}
void Sigmoid::apply_backward(const float*, const float* y, const float* dy, float* dx, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

}  // namespace meshtrain::nn
