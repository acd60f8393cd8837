#include "meshtrain/nn/layer_norm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

namespace {

Parameter norm_param(const std::string& name, int64_t dim, float value, bool defer) {
  Parameter p;
  p.name = name;
  p.weight_decay = false;
  p.info = sharding::ParamInfo{.name = name, .shape = {dim}, .kind = sharding::ParamKind::norm};
  p.init = [value](int64_t, int64_t count, float* out) { std::fill(out, out + count, value); };
  if (!defer) materialize(p);
  return p;
}

}  // namespace

LayerNorm::LayerNorm(int64_t dim, const std::string& prefix, double eps, bool affine, bool defer_init)
    : name_(prefix), dim_(dim), eps_(eps), affine_(affine) {
  if (dim < 1 || !(eps > 0.0) || !std::isfinite(eps))
    throw InvalidArgument("LayerNorm", fmt::format("'{}': dim {}, eps {}", prefix, dim, eps),
                          "need dim >= 1 and a finite eps > 0");
  if (affine_) {
    weight_ = norm_param(internal::join_name(prefix, "weight"), dim, 1.0f, defer_init);
    bias_ = norm_param(internal::join_name(prefix, "bias"), dim, 0.0f, defer_init);
    dgamma_.resize(static_cast<size_t>(dim));
    dbeta_.resize(static_cast<size_t>(dim));
  }
}

std::vector<Parameter*> LayerNorm::parameters() {
  if (affine_) return {&weight_, &bias_};
  return {};
}

Tensor LayerNorm::forward(const Tensor& x) {
  const char* op = "LayerNorm::forward";
  Tensor xc = internal::f32_contiguous(x, op, "input");
  if (xc.dim() < 1 || xc.size(-1) != dim_)
    throw InvalidArgument(op,
                          fmt::format("'{}': input shape {} does not end in dim {}", name_,
                                      shape_to_string(xc.shape()), dim_),
                          "LayerNorm normalizes the last dim");
  const int64_t rows = xc.numel() / dim_;
  begin_use(Pass::forward);
  shape_ = xc.shape();
  Tensor& xhat = internal::reuse_or_allocate(xhat_, {rows, dim_}, tracker_);  // (R, dim)
  Tensor& y = internal::reuse_or_allocate(y_, {rows, dim_}, tracker_);        // (R, dim)
  rstd_.resize(static_cast<size_t>(rows));
  const float* px = xc.data<float>();
  float* ph = xhat.data<float>();
  float* py = y.data<float>();
  const float* g = nullptr;
  const float* b = nullptr;
  if (affine_) {
    internal::check_param_tensor(weight_.value, op, weight_.name);
    internal::check_param_tensor(bias_.value, op, bias_.name);
    g = weight_.value.data<float>();
    b = bias_.value.data<float>();
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px + r * dim_;
    double mean = 0.0;
    for (int64_t j = 0; j < dim_; ++j) mean += xr[j];
    mean /= static_cast<double>(dim_);
    double var = 0.0;  // two passes: no cancellation for large means
    for (int64_t j = 0; j < dim_; ++j) {
      const double d = xr[j] - mean;
      var += d * d;
    }
    var /= static_cast<double>(dim_);
    const float rstd = static_cast<float>(1.0 / std::sqrt(var + eps_));
    const float m = static_cast<float>(mean);
    rstd_[static_cast<size_t>(r)] = rstd;
    float* hr = ph + r * dim_;
    float* yr = py + r * dim_;
    for (int64_t j = 0; j < dim_; ++j) hr[j] = (xr[j] - m) * rstd;
    if (affine_) {
      for (int64_t j = 0; j < dim_; ++j) yr[j] = hr[j] * g[j] + b[j];
    } else {
      std::copy(hr, hr + dim_, yr);
    }
  }
  end_use(Pass::forward);
  return y.view(shape_);
}

Tensor LayerNorm::backward(const Tensor& grad_out) {
  const char* op = "LayerNorm::backward";
  if (shape_.empty())
    throw InvalidArgument(op, fmt::format("'{}': no forward to go back through", name_),
                          "call forward before backward (one backward per forward)");
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(dy, shape_, op, "grad_out");
  begin_use(Pass::backward);
  const int64_t rows = xhat_.size(0);
  Tensor& dx = internal::reuse_or_allocate(dx_, {rows, dim_}, tracker_);
  const float* pdy = dy.data<float>();
  const float* ph = xhat_.data<float>();
  float* pdx = dx.data<float>();
  const float* g = affine_ ? weight_.value.data<float>() : nullptr;
  if (affine_) {
    std::fill(dgamma_.begin(), dgamma_.end(), 0.0f);
    std::fill(dbeta_.begin(), dbeta_.end(), 0.0f);
  }
  const float inv_dim = 1.0f / static_cast<float>(dim_);
  for (int64_t r = 0; r < rows; ++r) {
    const float* dyr = pdy + r * dim_;
    const float* hr = ph + r * dim_;
    float* dxr = pdx + r * dim_;
    // dxhat = dy * gamma (written into dx first);
    // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    float sum_dh = 0.0f, sum_dh_h = 0.0f;
    for (int64_t j = 0; j < dim_; ++j) {
      const float dh = affine_ ? dyr[j] * g[j] : dyr[j];
      dxr[j] = dh;
      sum_dh += dh;
      sum_dh_h += dh * hr[j];
    }
    const float mean_dh = sum_dh * inv_dim, mean_dh_h = sum_dh_h * inv_dim;
    const float rstd = rstd_[static_cast<size_t>(r)];
    for (int64_t j = 0; j < dim_; ++j) dxr[j] = rstd * (dxr[j] - mean_dh - hr[j] * mean_dh_h);
    if (affine_) {
      for (int64_t j = 0; j < dim_; ++j) {
        dgamma_[static_cast<size_t>(j)] += dyr[j] * hr[j];
        dbeta_[static_cast<size_t>(j)] += dyr[j];
      }
    }
  }
  if (affine_) {
    internal::check_param_tensor(weight_.grad, op, weight_.name);
    internal::check_param_tensor(bias_.grad, op, bias_.name);
    float* gb = bias_.grad.data<float>();
    float* gg = weight_.grad.data<float>();
    for (int64_t j = 0; j < dim_; ++j) gb[j] += dbeta_[static_cast<size_t>(j)];
    notify_grad_ready(bias_);
    for (int64_t j = 0; j < dim_; ++j) gg[j] += dgamma_[static_cast<size_t>(j)];
    notify_grad_ready(weight_);
  }
  end_use(Pass::backward);
  std::vector<int64_t> shape = std::move(shape_);
  shape_.clear();  // one backward per forward
  return dx.view(shape);
}

}  // namespace meshtrain::nn
