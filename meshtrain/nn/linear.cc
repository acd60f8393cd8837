#include "meshtrain/nn/linear.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/deterministic.h"
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

// Runs body(first row, rows) for each block of `rows` rows in blocks.order,
// between blocks.ready(j) and blocks.done(j, body's result).
void run_blocks(const RowBlocks& blocks, int64_t rows, const char* op, const std::string& name,
                const std::function<Tensor(int64_t, int64_t)>& body) {
  const auto n = static_cast<int64_t>(blocks.order.size());
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (const int64_t j : blocks.order) {
    if (j < 0 || j >= n || seen[static_cast<size_t>(j)])
      throw InvalidArgument(op, fmt::format("'{}': row block order {} is not a permutation of 0..{}", name,
                                            fmt::join(blocks.order, ","), n - 1),
                            "name each block once");
    seen[static_cast<size_t>(j)] = true;
  }
  if (rows % n != 0)
    throw InvalidArgument(op, fmt::format("'{}': {} rows in {} row blocks", name, rows, n),
                          "use a block count that divides the rows");
  const int64_t per = rows / n;
  for (const int64_t j : blocks.order) {
    if (blocks.ready) blocks.ready(j);
    const Tensor out = body(j * per, per);
    if (blocks.done) blocks.done(j, out);
  }
}

// A blocked call's input: f32 and contiguous as given (its rows are filled
// in ready(), so a copy would miss them).
void check_blocked_input(const Tensor& t, const char* op, const std::string& name) {
  if (!t.defined() || t.dtype() != DType::f32 || !t.is_contiguous())
    throw InvalidArgument(op, fmt::format("'{}': a row-blocked call's input must be a contiguous f32 tensor", name),
                          "pass the buffer whose rows ready() fills");
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
  const RowBlocks blocks = std::exchange(next_forward_, RowBlocks{});
  if (!blocks.order.empty()) check_blocked_input(x, op, name_);
  State& st = saved.state<State>();
  const int64_t rows = xc.numel() / in_;
  st.in_shape = xc.shape();
  const Tensor x32 = xc.view({rows, in_});  // (R, in)
  st.x = x32;
  const bool half = compute_dtype_ != DType::f32;
  // The GEMM's input in the compute dtype (kept for the weight gradient),
  // converted block by block when blocked.
  if (half) st.x = internal::reuse_or_allocate(st.xr, {rows, in_}, tracker_, compute_dtype_);
  Tensor& y = internal::reuse_or_allocate(st.y, {rows, out_}, tracker_);  // (R, out)
  // The weight in the compute dtype (converted here unless fully sharded
  // mixed precision holds it so), the bias in f32: added to the f32 result.
  const Tensor w = internal::param_value(weight_.value, compute_dtype_, op, weight_.name);
  const Tensor b = has_bias_ ? internal::param_value(bias_.value, DType::f32, op, bias_.name) : Tensor();
  auto multiply = [&](int64_t first, int64_t n) {
    const Tensor xb = st.x.narrow(0, first, n), yb = y.narrow(0, first, n);
    if (half) xb.copy_from(x32.narrow(0, first, n));
    functional::linear_forward(xb, w, b, yb);
    round_to(yb, compute_dtype_);  // f32 accumulation, half-precision result
    return yb;
  };
  if (blocks.order.empty())
    multiply(0, rows);
  else
    run_blocks(blocks, rows, op, name_, multiply);
  std::vector<int64_t> out_shape = st.in_shape;
  out_shape.back() = out_;
  return y.view(out_shape);
}

Tensor Linear::prepare_grad(const Tensor& grad_out, State& st, const char* op, bool convert) {
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  const int64_t rows = st.x.size(0);
  std::vector<int64_t> out_shape = st.in_shape;
  out_shape.back() = out_;
  internal::check_shape(dy, out_shape, op, "grad_out");
  dy = dy.view({rows, out_});  // (R, out)
  if (convert && compute_dtype_ != DType::f32) {
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

std::pair<Tensor, Tensor> Linear::blocked_input_grad(const RowBlocks& blocks, const Tensor& dy, State& st) {
  const char* op = "Linear::backward";
  const int64_t rows = dy.size(0);
  const bool half = compute_dtype_ != DType::f32;
  const Tensor dyc = half ? internal::reuse_or_allocate(st.dyr, {rows, out_}, tracker_, compute_dtype_) : dy;
  Tensor dx, w;
  if (needs_input_grad_) {
    dx = internal::reuse_or_allocate(st.dx, {rows, in_}, tracker_);
    w = internal::param_value(weight_.value, dyc.dtype(), op, weight_.name);
  }
  run_blocks(blocks, rows, op, name_, [&](int64_t first, int64_t n) {
    if (half) dyc.narrow(0, first, n).copy_from(dy.narrow(0, first, n));
    if (!needs_input_grad_) return Tensor();
    const Tensor dxb = dx.narrow(0, first, n);
    functional::linear_backward_input(dyc.narrow(0, first, n), w, dxb);
    round_to(dxb, compute_dtype_);
    return dxb;
  });
  return {dyc, needs_input_grad_ ? dx.view(st.in_shape) : Tensor()};
}

void Linear::weight_grads(const Tensor& dy, const Tensor& x, Saved& saved) {
  const char* op = "Linear::backward";
  internal::check_param_grad(weight_.grad, op, weight_.name);
  if (has_bias_) internal::check_param_grad(bias_.grad, op, bias_.name);
  State& st = saved.state<State>();
  const TreeNode node = call_node(saved.batch, st.in_shape.size() > 1 ? st.in_shape[0] : 1);
  // The bias first, reported before the weight GEMM runs: data parallelism
  // can start the bucket holding it that much earlier.
  if (has_bias_) {
    add_gradient(bias_, 0, node, [&](const Tensor& g) { functional::bias_backward(dy, g); });
    notify_grad_ready(bias_);
  }
  add_gradient(weight_, 0, node,
               [&](const Tensor& g) { functional::linear_backward_weight(x, dy, g, Tensor()); });
  notify_grad_ready(weight_);
}

Tensor Linear::do_backward(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  const RowBlocks blocks = std::exchange(next_backward_, RowBlocks{});
  if (!blocks.order.empty()) {  // dX first, block by block, then the weight gradients
    check_blocked_input(grad_out, "Linear::backward", name_);
    auto [dy, dx] = blocked_input_grad(blocks, prepare_grad(grad_out, st, "Linear::backward", false), st);
    weight_grads(dy, st.x, saved);
    st.x = Tensor();
    return dx;
  }
  Tensor dy = prepare_grad(grad_out, st, "Linear::backward");
  weight_grads(dy, st.x, saved);
  Tensor dx = input_grad(dy, st);
  st.x = Tensor();  // backward is done with forward's input
  return dx;
}

Tensor Linear::do_backward_input(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  const RowBlocks blocks = std::exchange(next_backward_, RowBlocks{});
  if (!blocks.order.empty()) {
    check_blocked_input(grad_out, "Linear::backward_input", name_);
    auto [dy, dx] = blocked_input_grad(blocks, prepare_grad(grad_out, st, "Linear::backward_input", false), st);
    st.dy = dy;
    return dx;
  }
  st.dy = prepare_grad(grad_out, st, "Linear::backward_input");
  return input_grad(st.dy, st);
}

void Linear::do_backward_weight(Saved& saved) {
  State& st = saved.state<State>();
  weight_grads(st.dy, st.x, saved);
  st.x = Tensor();
  st.dy = Tensor();
}

}  // namespace meshtrain::nn
