#include "meshtrain/nn/dropout.h"

#include <fmt/format.h>

#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

Dropout::Dropout(double p, const std::string& name, uint64_t seed) : p_(p), name_(name), seed_(seed) {
  if (!(p >= 0.0 && p <= 1.0))
    throw InvalidArgument("Dropout", fmt::format("'{}': p = {}", name, p), "use a probability 0 <= p <= 1");
}

Tensor Dropout::do_forward(const Tensor& x, Saved& saved) {
  const char* op = "Dropout::forward";
  Tensor xc = internal::f32_contiguous(x, op, "input");
  if (xc.dim() < 1)
    throw InvalidArgument(op, fmt::format("'{}': input is a scalar", name_), "dim 0 must be the batch");
  State& st = saved.state<State>();
  st.shape = xc.shape();
  st.identity = !training_ || p_ == 0.0;
  if (st.identity) return x;

  const BatchContext& ctx = saved.batch;
  if (ctx.first_global_sample < 0)
    throw InvalidArgument(op, fmt::format("'{}': first_global_sample {}", name_, ctx.first_global_sample),
                          "set_batch_context needs the global index of the first local sample, >= 0");
  const int64_t n = xc.numel();
  const int64_t batch = xc.size(0);
  const int64_t features = batch == 0 ? 0 : n / batch;  // F: elements per sample
  Tensor& scale = internal::reuse_or_allocate(st.scale, {n}, tracker_);
  // u at global index (first_global_sample + i) * F + f: local elements are
  // one contiguous run of the global stream.
  const uint64_t start = static_cast<uint64_t>(ctx.first_global_sample) * static_cast<uint64_t>(features);
  functional::dropout_mask(seed_, internal::step_key(name_, ctx.step), start, p_, scale);
  Tensor& y = internal::reuse_or_allocate(st.y, st.shape, tracker_);
  mul(xc, scale.view(st.shape), y);
  return y;
}

Tensor Dropout::do_backward_input(const Tensor& grad_out, Saved& saved) {
  const char* op = "Dropout::backward";
  State& st = saved.state<State>();
  if (st.identity) {
    internal::check_shape(grad_out, st.shape, op, "grad_out");
    return grad_out;
  }
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(dy, st.shape, op, "grad_out");
  Tensor& dx = internal::reuse_or_allocate(st.dx, st.shape, tracker_);
  mul(dy, st.scale.view(st.shape), dx);
  return dx;
}

}  // namespace meshtrain::nn
