#include "meshtrain/optim/optimizer.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <unordered_set>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/core/half.h"

namespace meshtrain::optim {

void check_hparam(const std::string& op, const char* what, double value, double lo, double hi,
                  bool hi_open) {
  const bool ok = std::isfinite(value) && value >= lo && (hi_open ? value < hi : value <= hi);
  if (!ok)
    throw InvalidArgument(op, fmt::format("{} = {} is out of range", what, value),
                          fmt::format("use a finite {} in [{}, {}{}", what, lo, hi, hi_open ? ")" : "]"));
}

Optimizer::Optimizer(std::string op, std::vector<nn::Parameter*> params, double lr)
    : op_(std::move(op)), params_(std::move(params)), lr_(lr) {
  check_hparam(op_, "lr", lr, 0.0, HUGE_VAL, true);
  std::unordered_set<const nn::Parameter*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const nn::Parameter* p = params_[i];
    if (p == nullptr)
      throw InvalidArgument(op_, fmt::format("parameter {} of {} is null", i, params_.size()),
                            "pass the pointers from Module::parameters()");
    if (!seen.insert(p).second)
      throw InvalidArgument(op_, fmt::format("parameter '{}' appears twice in the list", p->name),
                            "list each parameter once; it would be updated twice per step");
    const Tensor& v = p->value;
    if (!v.defined() || v.dtype() != DType::f32 || !v.is_contiguous() || v.device() != Device::cpu())
      throw InvalidArgument(
          op_,
          fmt::format("parameter '{}' value must be a defined, contiguous f32 cpu tensor{}", p->name,
                      v.defined() ? fmt::format(" (got dtype {}, shape {}, contiguous={})",
                                                dtype_name(v.dtype()), shape_to_string(v.shape()),
                                                v.is_contiguous())
                                  : std::string(" (got an undefined tensor)")),
          "keep master weights in f32 (mixed precision casts copies, not the master)");
  }
}

void Optimizer::set_lr(double lr) {
  check_hparam(op_ + "::set_lr", "lr", lr, 0.0, HUGE_VAL, true);
  lr_ = lr;
}

void Optimizer::set_grad_scale(double s) {
  const float f = static_cast<float>(s);  // what step() multiplies by
  if (!(std::isfinite(s) && s > 0.0 && std::isfinite(f) && f > 0.0f))
    throw InvalidArgument(op_ + "::set_grad_scale",
                          fmt::format("grad scale {} must be finite and > 0, also once rounded to f32 (is {} "
                                      "in f32)",
                                      s, f),
                          "pass clip_factor / loss_scale (1 / loss_scale without clipping)");
  grad_scale_ = s;
}

void Optimizer::zero_grad() {
  for (nn::Parameter* p : params_)
    if (p->grad.defined()) p->grad.fill(0.0);
}

bool Optimizer::has_usable_grad(size_t i) const {
  const nn::Parameter& p = *params_[i];
  const Tensor& g = p.grad;
  if (!g.defined()) return false;
  const DType t = g.dtype();
  if ((t != DType::f32 && t != DType::bf16 && t != DType::f16) || !g.is_contiguous() ||
      g.device() != Device::cpu() || g.shape() != p.value.shape())
    throw InvalidArgument(
        op_ + "::step",
        fmt::format("grad of parameter '{}' must be a contiguous cpu tensor of dtype f32, bf16 or f16 and "
                    "shape {} (got dtype {}, shape {}, contiguous={}, device {})",
                    p.name, shape_to_string(p.value.shape()), dtype_name(t), shape_to_string(g.shape()),
                    g.is_contiguous(), g.device().to_string()),
        "keep gradients shaped like the value, in f32, bf16 or f16, on the cpu");
  return true;
}

size_t Optimizer::grad_chunk(size_t i) const {
  const Tensor& g = params_[i]->grad;
  return g.dtype() == DType::f32 && grad_scale_ == 1.0 ? static_cast<size_t>(g.numel()) : kGradChunk;
}

const float* Optimizer::grad_slice(size_t i, size_t offset, size_t n, float* scratch) const {
  const Tensor& g = params_[i]->grad;
  // The same f32 factor and f32 multiply as scale_grads (ops::scale), so
  // scale_grads(f) + step() and set_grad_scale(f) + step() agree bit for bit.
  const float s = static_cast<float>(grad_scale_);
  switch (g.dtype()) {
    case DType::f32: {
      const float* src = g.data<float>() + offset;
      if (grad_scale_ == 1.0) return src;
      for (size_t k = 0; k < n; ++k) scratch[k] = src[k] * s;
      return scratch;
    }
    case DType::bf16: {
      const uint16_t* src = g.data<uint16_t>() + offset;
      for (size_t k = 0; k < n; ++k) scratch[k] = bf16_to_float(src[k]) * s;
      return scratch;
    }
    case DType::f16: {
      const uint16_t* src = g.data<uint16_t>() + offset;
      for (size_t k = 0; k < n; ++k) scratch[k] = f16_to_float(src[k]) * s;
      return scratch;
    }
    default:
      throw InvalidArgument(op_ + "::step",
                            fmt::format("grad of parameter '{}' has dtype {}", params_[i]->name,
                                        dtype_name(g.dtype())),
                            "check has_usable_grad(i) before grad_slice");
  }
}

Tensor Optimizer::zeros_like_param(size_t i, MemoryTracker* tracker) const {
  return Tensor::zeros(params_[i]->value.shape(), DType::f32, Device::cpu(), tracker,
                       MemoryCategory::optimizer);
}

}  // namespace meshtrain::optim
