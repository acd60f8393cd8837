#include "meshtrain/nn/layer_norm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/deterministic.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

namespace {

// The checks every norm makes: dim and eps at construction, the input's
// last dim at forward.
void check_norm(const char* what, const std::string& prefix, int64_t dim, double eps) {
  if (dim < 1 || !(eps > 0.0) || !std::isfinite(eps))
    throw InvalidArgument(what, fmt::format("'{}': dim {}, eps {}", prefix, dim, eps),
                          "need dim >= 1 and a finite eps > 0");
}
Tensor norm_input(const Tensor& x, const char* op, const std::string& name, int64_t dim) {
  Tensor xc = internal::f32_contiguous(x, op, "input");
  if (xc.dim() < 1 || xc.size(-1) != dim)
    throw InvalidArgument(op,
                          fmt::format("'{}': input shape {} does not end in dim {}", name, shape_to_string(xc.shape()),
                                      dim),
                          "a norm normalizes the last dim");
  return xc;
}

Parameter norm_param(const std::string& name, int64_t dim, float value, bool defer) {
  Parameter p;
  p.name = name;
  p.weight_decay = false;
  p.info = sharding::ParamInfo{.name = name, .shape = {dim}, .kind = sharding::ParamKind::norm};
  p.placement = Placement::whole({dim});
  p.init = [value](int64_t, int64_t count, float* out) { std::fill(out, out + count, value); };
  if (!defer) materialize(p);
  return p;
}

}  // namespace

LayerNorm::LayerNorm(int64_t dim, const std::string& prefix, double eps, bool affine, bool defer_init)
    : name_(prefix), dim_(dim), eps_(eps), affine_(affine) {
  check_norm("LayerNorm", prefix, dim, eps);
  if (affine_) {
    weight_ = norm_param(internal::join_name(prefix, "weight"), dim, 1.0f, defer_init);
    bias_ = norm_param(internal::join_name(prefix, "bias"), dim, 0.0f, defer_init);
  }
}

std::vector<Parameter*> LayerNorm::parameters() {
  if (affine_) return {&weight_, &bias_};
  return {};
}

Tensor LayerNorm::do_forward(const Tensor& x, Saved& saved) {
  const char* op = "LayerNorm::forward";
  const Tensor xc = norm_input(x, op, name_, dim_);
  const int64_t rows = xc.numel() / dim_;
  State& st = saved.state<State>();
  st.shape = xc.shape();
  Tensor& xhat = internal::reuse_or_allocate(st.xhat, {rows, dim_}, tracker_);  // (R, dim)
  Tensor& y = internal::reuse_or_allocate(st.y, {rows, dim_}, tracker_);        // (R, dim)
  Tensor& rstd = internal::reuse_or_allocate(st.rstd, {rows}, tracker_);
  functional::layer_norm_forward(xc.view({rows, dim_}),
                                 affine_ ? internal::param_value(weight_.value, DType::f32, op, weight_.name) : Tensor(),
                                 affine_ ? internal::param_value(bias_.value, DType::f32, op, bias_.name) : Tensor(),
                                 eps_, y, xhat, rstd);
  return y.view(st.shape);
}

Tensor LayerNorm::do_backward_input(const Tensor& grad_out, Saved& saved) {
  const char* op = "LayerNorm::backward";
  State& st = saved.state<State>();
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(dy, st.shape, op, "grad_out");
  const int64_t rows = st.xhat.size(0);
  st.dy = dy.view({rows, dim_});
  Tensor& dx = internal::reuse_or_allocate(st.dx, {rows, dim_}, tracker_);
  functional::layer_norm_backward_input(
      st.dy, st.xhat, st.rstd, affine_ ? internal::param_value(weight_.value, DType::f32, op, weight_.name) : Tensor(),
      dx);
  if (!affine_) st.dy = Tensor();  // nothing for the weight pass
  return dx.view(st.shape);
}

void LayerNorm::do_backward_weight(Saved& saved) {
  if (!affine_) return;
  const char* op = "LayerNorm::backward";
  State& st = saved.state<State>();
  internal::check_param_grad(weight_.grad, op, weight_.name);
  internal::check_param_grad(bias_.grad, op, bias_.name);
  const TreeNode node = call_node(saved.batch, st.shape.size() > 1 ? st.shape[0] : 1);
  if (node.count > 0) {  // the deterministic mode: both sums in one pass, then each its own node
    const Tensor dgamma = Tensor::zeros({dim_}, DType::f32), dbeta = Tensor::zeros({dim_}, DType::f32);
    functional::layer_norm_backward_weight(st.dy, st.xhat, dgamma, dbeta);
    add_gradient(bias_, 0, node, [&](const Tensor& g) { accumulate(dbeta, g); });
    add_gradient(weight_, 0, node, [&](const Tensor& g) { accumulate(dgamma, g); });
  } else {
    functional::layer_norm_backward_weight(st.dy, st.xhat, weight_.grad, bias_.grad);
  }
  notify_grad_ready(bias_);
  notify_grad_ready(weight_);
  st.dy = Tensor();
}

// ---- RMSNorm ----

RMSNorm::RMSNorm(int64_t dim, const std::string& prefix, double eps, bool defer_init)
    : name_(prefix), dim_(dim), eps_(eps) {
  check_norm("RMSNorm", prefix, dim, eps);
  weight_ = norm_param(internal::join_name(prefix, "weight"), dim, 1.0f, defer_init);
}

Tensor RMSNorm::do_forward(const Tensor& x, Saved& saved) {
  const char* op = "RMSNorm::forward";
  const Tensor xc = norm_input(x, op, name_, dim_);
  const int64_t rows = xc.numel() / dim_;
  State& st = saved.state<State>();
  st.shape = xc.shape();
  Tensor& xhat = internal::reuse_or_allocate(st.xhat, {rows, dim_}, tracker_);
  Tensor& y = internal::reuse_or_allocate(st.y, {rows, dim_}, tracker_);
  Tensor& rstd = internal::reuse_or_allocate(st.rstd, {rows}, tracker_);
  functional::rms_norm_forward(xc.view({rows, dim_}), internal::param_value(weight_.value, DType::f32, op, weight_.name),
                               eps_, y, xhat, rstd);
  return y.view(st.shape);
}

Tensor RMSNorm::do_backward_input(const Tensor& grad_out, Saved& saved) {
  const char* op = "RMSNorm::backward";
  State& st = saved.state<State>();
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(dy, st.shape, op, "grad_out");
  const int64_t rows = st.xhat.size(0);
  st.dy = dy.view({rows, dim_});
  Tensor& dx = internal::reuse_or_allocate(st.dx, {rows, dim_}, tracker_);
  functional::rms_norm_backward_input(st.dy, st.xhat, st.rstd,
                                      internal::param_value(weight_.value, DType::f32, op, weight_.name), dx);
  return dx.view(st.shape);
}

void RMSNorm::do_backward_weight(Saved& saved) {
  const char* op = "RMSNorm::backward";
  State& st = saved.state<State>();
  internal::check_param_grad(weight_.grad, op, weight_.name);
  add_gradient(weight_, 0, call_node(saved.batch, st.shape.size() > 1 ? st.shape[0] : 1),
               [&](const Tensor& g) { functional::layer_norm_backward_weight(st.dy, st.xhat, g, Tensor()); });
  notify_grad_ready(weight_);
  st.dy = Tensor();
}

}  // namespace meshtrain::nn
