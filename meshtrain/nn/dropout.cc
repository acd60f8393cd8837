#include "meshtrain/nn/dropout.h"

#include <fmt/format.h>

#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

Dropout::Dropout(double p, const std::string& name, uint64_t seed) : p_(p), name_(name), seed_(seed) {
  if (!(p >= 0.0 && p <= 1.0))
    throw InvalidArgument("Dropout", fmt::format("'{}': p = {}", name, p), "use a probability 0 <= p <= 1");
}

Tensor Dropout::forward(const Tensor& x) {
  const char* op = "Dropout::forward";
  Tensor xc = internal::f32_contiguous(x, op, "input");
  if (xc.dim() < 1)
    throw InvalidArgument(op, fmt::format("'{}': input is a scalar", name_), "dim 0 must be the batch");
  shape_ = xc.shape();
  pending_ = true;
  identity_ = !training_ || p_ == 0.0;
  if (identity_) return x;

  const BatchContext& ctx = batch_context_;
  if (ctx.first_global_sample < 0)
    throw InvalidArgument(op, fmt::format("'{}': first_global_sample {}", name_, ctx.first_global_sample),
                          "set_batch_context needs the global index of the first local sample, >= 0");
  const int64_t n = xc.numel();
  const int64_t batch = xc.size(0);
  const int64_t features = batch == 0 ? 0 : n / batch;  // F: elements per sample
  Tensor& scale = internal::reuse_or_allocate(scale_, {n}, tracker_);
  float* s = scale.data<float>();
  // u at global index (first_global_sample + i) * F + f: local elements are
  // one contiguous run of the global stream.
  const uint64_t start = static_cast<uint64_t>(ctx.first_global_sample) * static_cast<uint64_t>(features);
  fill_uniform(s, static_cast<size_t>(n), seed_, internal::step_key(name_, ctx.step), start, 0.0f, 1.0f);
  const float p = static_cast<float>(p_);
  const float keep_scale = p_ == 1.0 ? 0.0f : static_cast<float>(1.0 / (1.0 - p_));
  for (int64_t i = 0; i < n; ++i) s[i] = s[i] >= p ? keep_scale : 0.0f;

  Tensor& y = internal::reuse_or_allocate(y_, shape_, tracker_);
  const float* px = xc.data<float>();
  float* py = y.data<float>();
  for (int64_t i = 0; i < n; ++i) py[i] = px[i] * s[i];
  return y;
}

Tensor Dropout::backward(const Tensor& grad_out) {
  const char* op = "Dropout::backward";
  if (!pending_)
    throw InvalidArgument(op, fmt::format("'{}': no forward to go back through", name_),
                          "call forward before backward (one backward per forward)");
  pending_ = false;
  if (identity_) {
    internal::check_shape(grad_out, shape_, op, "grad_out");
    return grad_out;
  }
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(dy, shape_, op, "grad_out");
  Tensor& dx = internal::reuse_or_allocate(dx_, shape_, tracker_);
  const int64_t n = dy.numel();
  const float* s = scale_.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * s[i];
  return dx;
}

}  // namespace meshtrain::nn
