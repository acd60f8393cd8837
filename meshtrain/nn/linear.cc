#include "meshtrain/nn/linear.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

namespace {

// A Linear parameter ~ U(-bound, bound), keyed by its name.
Parameter make_param(const std::string& name, std::vector<int64_t> shape, sharding::ParamKind kind,
                     sharding::LinearRole role, bool weight_decay, uint64_t seed, double bound, bool defer) {
  Parameter p;
  p.name = name;
  p.weight_decay = weight_decay;
  p.placement = Placement::whole(shape);
  p.info = sharding::ParamInfo{.name = name, .shape = std::move(shape), .kind = kind, .role = role};
  const uint64_t key = key_from_name(name);
  p.init = [seed, key, bound](int64_t start, int64_t count, float* out) {
    fill_uniform(Tensor::from_blob(out, {count}, DType::f32), seed, key, -bound, bound, static_cast<uint64_t>(start));
  };
  if (!defer) materialize(p);
  return p;
}

}  // namespace

Linear::Linear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed, bool bias)
    : Linear(in, out, prefix, seed, LinearOptions{.bias = bias}) {}

Linear::Linear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed, const LinearOptions& options)
    : name_(prefix), in_(in), out_(out), has_bias_(options.bias), needs_input_grad_(options.needs_input_grad) {
  if (in < 1 || out < 1)
    throw InvalidArgument("Linear", fmt::format("'{}': in_features {}, out_features {}", prefix, in, out),
                          "both must be >= 1");
  // PyTorch's default: kaiming_uniform_(a=sqrt(5)) gives bound sqrt(6 / (6 in)) = 1/sqrt(in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  const std::string wname = internal::join_name(prefix, "weight");
  weight_ = make_param(wname, {in, out}, sharding::ParamKind::linear_weight, options.role, true, seed, bound,
                       options.defer_init);
  if (has_bias_) {
    const std::string bname = internal::join_name(prefix, "bias");
    bias_ = make_param(bname, {out}, sharding::ParamKind::linear_bias, options.role, false, seed, bound,
                       options.defer_init);
  }
  if (options.init_std > 0.0) {  // GPT-2: N(0, std) weights, zero biases
    const uint64_t key = key_from_name(wname);
    const double std = options.init_std;
    weight_.init = [seed, key, std](int64_t start, int64_t count, float* o) {
      fill_normal(o, static_cast<size_t>(count), seed, key, static_cast<uint64_t>(start), 0.0f, static_cast<float>(std));
    };
    if (has_bias_) bias_.init = [](int64_t, int64_t count, float* o) { std::fill(o, o + count, 0.0f); };
    if (!options.defer_init) {
      materialize(weight_);
      if (has_bias_) materialize(bias_);
    }
  }
}

Parameter& Linear::bias() {
  if (!has_bias_)
    throw InvalidArgument("Linear::bias", fmt::format("'{}' was built without a bias", name_),
                          "check has_bias() first");
  return bias_;
}

std::vector<Parameter*> Linear::parameters() {
  if (has_bias_) return {&weight_, &bias_};
  return {&weight_};
}

// What one call keeps: its input (as the GEMM saw it), dy between a split
// backward's passes, and the call's reusable buffers.
struct Linear::State {
  Tensor x;                        // (R, in) input: f32, or its compute-dtype copy
  std::vector<int64_t> in_shape;   // x's shape as given, for dX
  Tensor dy;                       // (R, out) split backward: kept for the weight pass
  Tensor y, dx, xr, dyr;           // buffers: output, input gradient, compute-dtype copies
};

std::string Linear::describe() const { return fmt::format("Linear '{}'", name_); }

Tensor Linear::do_forward(const Tensor& x, Saved& saved) {
  const char* op = "Linear::forward";
  Tensor xc = internal::f32_contiguous(x, op, "input");
  if (xc.dim() < 1 || xc.size(-1) != in_)
    throw InvalidArgument(op,
                          fmt::format("'{}': input shape {} does not end in in_features {}", name_,
                                      shape_to_string(xc.shape()), in_),
                          "pass (..., in_features); the weight is (in, out)");
  State& st = saved.state<State>();
  const int64_t rows = xc.numel() / in_;
  st.in_shape = xc.shape();
  st.x = xc.view({rows, in_});  // (R, in)
  const bool half = compute_dtype_ != DType::f32;
  if (half) {  // the GEMM's input in the compute dtype (kept for the weight gradient)
    Tensor& xr = internal::reuse_or_allocate(st.xr, {rows, in_}, tracker_, compute_dtype_);
    xr.copy_from(st.x);
    st.x = xr;
  }
  Tensor& y = internal::reuse_or_allocate(st.y, {rows, out_}, tracker_);  // (R, out)
  // The weight in the compute dtype (converted here unless fully sharded
  // mixed precision holds it so), the bias in f32: added to the f32 result.
  functional::linear_forward(st.x, internal::param_value(weight_.value, compute_dtype_, op, weight_.name),
                             has_bias_ ? internal::param_value(bias_.value, DType::f32, op, bias_.name) : Tensor(), y);
  round_to(y, compute_dtype_);  // f32 accumulation, half-precision result
  std::vector<int64_t> out_shape = st.in_shape;
  out_shape.back() = out_;
  return y.view(out_shape);
}

Tensor Linear::prepare_grad(const Tensor& grad_out, State& st, const char* op) {
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  const int64_t rows = st.x.size(0);
  std::vector<int64_t> out_shape = st.in_shape;
  out_shape.back() = out_;
  internal::check_shape(dy, out_shape, op, "grad_out");
  dy = dy.view({rows, out_});  // (R, out)
  if (compute_dtype_ != DType::f32) {
    Tensor& dyr = internal::reuse_or_allocate(st.dyr, {rows, out_}, tracker_, compute_dtype_);
    dyr.copy_from(dy);
    dy = dyr;
  }
  return dy;
}

Tensor Linear::input_grad(const Tensor& dy, State& st) {
  if (!needs_input_grad_) return Tensor();
  Tensor& dx = internal::reuse_or_allocate(st.dx, {dy.size(0), in_}, tracker_);
  functional::linear_backward_input(dy, internal::param_value(weight_.value, dy.dtype(), "Linear::backward", weight_.name),
                                    dx);
  round_to(dx, compute_dtype_);
  return dx.view(st.in_shape);
}

void Linear::weight_grads(const Tensor& dy, const Tensor& x) {
  const char* op = "Linear::backward";
  internal::check_param_grad(weight_.grad, op, weight_.name);
  if (has_bias_) internal::check_param_grad(bias_.grad, op, bias_.name);
  // The bias first, reported before the weight GEMM runs: data parallelism
  // can start the bucket holding it that much earlier.
  if (has_bias_) {
    functional::bias_backward(dy, bias_.grad);
    notify_grad_ready(bias_);
  }
  functional::linear_backward_weight(x, dy, weight_.grad, Tensor());
  notify_grad_ready(weight_);
}

Tensor Linear::do_backward(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  Tensor dy = prepare_grad(grad_out, st, "Linear::backward");
  weight_grads(dy, st.x);
  Tensor dx = input_grad(dy, st);
  st.x = Tensor();  // backward is done with forward's input
  return dx;
}

Tensor Linear::do_backward_input(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  st.dy = prepare_grad(grad_out, st, "Linear::backward_input");
  return input_grad(st.dy, st);
}

void Linear::do_backward_weight(Saved& saved) {
  State& st = saved.state<State>();
  weight_grads(st.dy, st.x);
  st.x = Tensor();
  st.dy = Tensor();
}

}  // namespace meshtrain::nn
