#include "meshtrain/nn/activations.h"

#include <fmt/format.h>

#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

Tensor Activation::do_forward(const Tensor& x, Saved& saved) {
  const std::string op = fmt::format("{}::forward", name());
  State& st = saved.state<State>();
  st.x = internal::f32_contiguous(x, op.c_str(), "input");
  Tensor& y = internal::reuse_or_allocate(st.y, st.x.shape(), tracker_);
  functional::activation_forward(kind(), st.x, y);
  return y;
}

Tensor Activation::do_backward_input(const Tensor& grad_out, Saved& saved) {
  const std::string op = fmt::format("{}::backward", name());
  State& st = saved.state<State>();
  Tensor dy = internal::f32_contiguous(grad_out, op.c_str(), "grad_out");
  internal::check_shape(dy, st.x.shape(), op.c_str(), "grad_out");
  Tensor& dx = internal::reuse_or_allocate(st.dx, st.x.shape(), tracker_);
  functional::activation_backward(kind(), st.x, st.y, dy, dx);
  st.x = Tensor();
  return dx;
}

}  // namespace meshtrain::nn
