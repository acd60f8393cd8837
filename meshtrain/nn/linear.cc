#include "meshtrain/nn/linear.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

namespace {

// A Linear parameter ~ U(-bound, bound), keyed by its name.
Parameter make_param(const std::string& name, std::vector<int64_t> shape, sharding::ParamKind kind,
                     sharding::LinearRole role, bool weight_decay, uint64_t seed, double bound, bool defer) {
  Parameter p;
  p.name = name;
  p.weight_decay = weight_decay;
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
    db_.resize(static_cast<size_t>(out));
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

Tensor Linear::forward(const Tensor& x) {
  const char* op = "Linear::forward";
  Tensor xc = internal::f32_contiguous(x, op, "input");
  if (xc.dim() < 1 || xc.size(-1) != in_)
    throw InvalidArgument(op,
                          fmt::format("'{}': input shape {} does not end in in_features {}", name_,
                                      shape_to_string(xc.shape()), in_),
                          "pass (..., in_features); the weight is (in, out)");
  begin_use(Pass::forward);
  internal::check_param_tensor(weight_.value, op, weight_.name);
  const int64_t rows = xc.numel() / in_;
  in_shape_ = xc.shape();
  x_ = xc.view({rows, in_});                          // (R, in)
  if (compute_dtype_ != DType::f32) {  // the GEMM's input, as a half-precision GEMM would see it
    Tensor& xr = internal::reuse_or_allocate(xr_, {rows, in_}, tracker_);
    xr.copy_from(x_);
    round_to(xr, compute_dtype_);
    x_ = xr;
  }
  Tensor& y = internal::reuse_or_allocate(y_, {rows, out_}, tracker_);  // (R, out)
  double beta = 0.0;
  if (has_bias_) {
    internal::check_param_tensor(bias_.value, op, bias_.name);
    // Every row starts as b; the GEMM then adds x W on top (beta = 1).
    const float* b = bias_.value.data<float>();
    float* py = y.data<float>();
    for (int64_t r = 0; r < rows; ++r) std::memcpy(py + r * out_, b, static_cast<size_t>(out_) * sizeof(float));
    beta = 1.0;
  }
  matmul(x_, weight_.value, y, false, false, 1.0, beta);  // (R, in) x (in, out) -> (R, out)
  round_to(y, compute_dtype_);                            // f32 accumulation, half-precision result
  end_use(Pass::forward);
  std::vector<int64_t> out_shape = in_shape_;
  out_shape.back() = out_;
  return y.view(out_shape);
}

Tensor Linear::backward(const Tensor& grad_out) {
  const char* op = "Linear::backward";
  if (!x_.defined())
    throw InvalidArgument(op, fmt::format("'{}': no forward to go back through", name_),
                          "call forward before backward (backward releases forward's input, so one backward per forward)");
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  const int64_t rows = x_.size(0);
  std::vector<int64_t> out_shape = in_shape_;
  out_shape.back() = out_;
  internal::check_shape(dy, out_shape, op, "grad_out");
  dy = dy.view({rows, out_});  // (R, out)
  if (compute_dtype_ != DType::f32) {
    Tensor& dyr = internal::reuse_or_allocate(dyr_, {rows, out_}, tracker_);
    dyr.copy_from(dy);
    round_to(dyr, compute_dtype_);
    dy = dyr;
  }
  begin_use(Pass::backward);
  internal::check_param_tensor(weight_.grad, op, weight_.name);

  if (has_bias_) {
    internal::check_param_tensor(bias_.grad, op, bias_.name);
    // db += sum over rows of dy: (R, out) -> (out)
    std::fill(db_.begin(), db_.end(), 0.0f);
    const float* pdy = dy.data<float>();
    float* db = db_.data();
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = pdy + r * out_;
      for (int64_t j = 0; j < out_; ++j) db[j] += row[j];
    }
    float* gb = bias_.grad.data<float>();
    for (int64_t j = 0; j < out_; ++j) gb[j] += db[j];
    notify_grad_ready(bias_);
  }
  matmul(x_, dy, weight_.grad, true, false, 1.0, 1.0);  // dW += (R, in)^T x (R, out) -> (in, out)
  notify_grad_ready(weight_);

  Tensor result;
  if (needs_input_grad_) {
    Tensor& dx = internal::reuse_or_allocate(dx_, {rows, in_}, tracker_);
    matmul(dy, weight_.value, dx, false, true);  // (R, out) x (in, out)^T -> (R, in)
    round_to(dx, compute_dtype_);
    result = dx.view(in_shape_);
  }
  end_use(Pass::backward);
  x_ = Tensor();  // backward is done with forward's input
  return result;
}

}  // namespace meshtrain::nn
