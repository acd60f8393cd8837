#include "meshtrain/optim/optimizer.h"

#include <fmt/format.h>

#include <cmath>
#include <unordered_set>
#include <utility>

#include "meshtrain/core/error.h"

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

void Optimizer::zero_grad() {
  for (nn::Parameter* p : params_)
    if (p->grad.defined()) p->grad.fill(0.0);
}

bool Optimizer::has_usable_grad(size_t i) const {
  const nn::Parameter& p = *params_[i];
  const Tensor& g = p.grad;
  if (!g.defined()) return false;
  if (g.dtype() != DType::f32 || !g.is_contiguous() || g.device() != Device::cpu() ||
      g.shape() != p.value.shape())
    throw InvalidArgument(
        op_ + "::step",
        fmt::format("grad of parameter '{}' must be a contiguous f32 cpu tensor of shape {} (got dtype {}, "
                    "shape {}, contiguous={})",
                    p.name, shape_to_string(p.value.shape()), dtype_name(g.dtype()),
                    shape_to_string(g.shape()), g.is_contiguous()),
        "unscale/convert gradients to f32 master gradients before step()");
  return true;
}

Tensor Optimizer::zeros_like_param(size_t i, MemoryTracker* tracker) const {
  return Tensor::zeros(params_[i]->value.shape(), DType::f32, Device::cpu(), tracker,
                       MemoryCategory::optimizer);
}

}  // namespace meshtrain::optim
