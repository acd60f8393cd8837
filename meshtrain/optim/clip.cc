#include "meshtrain/optim/clip.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"

namespace meshtrain::optim {
namespace {

void check_max_norm(const char* op, double max_norm) {
  if (!(std::isfinite(max_norm) && max_norm > 0.0))
    throw InvalidArgument(op, fmt::format("max_norm = {} must be finite and > 0", max_norm),
                          "a typical value is 1.0");
}

// The grad of p, or null when it is undefined; throws unless a defined grad
// is a contiguous cpu tensor of dtype f32, bf16 or f16.
const Tensor* checked_grad(const char* op, const nn::Parameter* p) {
  if (p == nullptr) throw InvalidArgument(op, "null parameter in the list", "pass Module::parameters()");
  const Tensor& g = p->grad;
  if (!g.defined()) return nullptr;
  const DType t = g.dtype();
  if ((t != DType::f32 && t != DType::bf16 && t != DType::f16) || !g.is_contiguous() ||
      g.device() != Device::cpu())
    throw InvalidArgument(op,
                          fmt::format("grad of parameter '{}' must be a contiguous cpu tensor of dtype f32, "
                                      "bf16 or f16 (got {}, contiguous={}, device {})",
                                      p->name, dtype_name(t), g.is_contiguous(), g.device().to_string()),
                          "keep gradients in f32, bf16 or f16, contiguous, on the cpu");
  return &g;
}

}  // namespace

double local_sq_norm(const std::vector<nn::Parameter*>& params) {
  double total = 0.0;
  for (const nn::Parameter* p : params)
    if (const Tensor* g = checked_grad("local_sq_norm", p)) total += sum_of_squares(*g);
  return total;
}

bool grads_finite(const std::vector<nn::Parameter*>& params) {
  bool finite = true;
  for (const nn::Parameter* p : params) {
    const Tensor* g = checked_grad("grads_finite", p);  // checks every parameter, even after a bad one
    if (finite && g != nullptr) finite = all_finite(*g);
  }
  return finite;
}

bool values_finite(const std::vector<nn::Parameter*>& params) {
  for (const nn::Parameter* p : params) {
    if (p == nullptr) throw InvalidArgument("values_finite", "a null parameter", "pass the model's parameters");
    if (p->value.defined() && !all_finite(p->value.contiguous())) return false;
  }
  return true;
}

double clip_factor(double total_norm, double max_norm) {
  check_max_norm("clip_factor", max_norm);
  if (!std::isfinite(total_norm)) return 1.0;
  const double factor = max_norm / (total_norm + kClipEps);
  return factor < 1.0 ? factor : 1.0;
}

void scale_grads(const std::vector<nn::Parameter*>& params, double factor) {
  for (const nn::Parameter* p : params) {
    const Tensor* g = checked_grad("scale_grads", p);
    // ops::scale: f32 factor, f32 multiply, bf16/f16 rounded back to nearest even.
    if (factor != 1.0 && g != nullptr) scale(*g, factor);
  }
}

double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm, bool error_if_nonfinite) {
  check_max_norm("clip_grad_norm", max_norm);
  double total = 0.0;
  const nn::Parameter* first_bad = nullptr;
  for (const nn::Parameter* p : params) {
    const Tensor* g = checked_grad("clip_grad_norm", p);
    const double sq = g != nullptr ? sum_of_squares(*g) : 0.0;
    if (!std::isfinite(sq) && first_bad == nullptr) first_bad = p;
    total += sq;
  }
  const double norm = std::sqrt(total);
  if (!std::isfinite(norm)) {
    if (error_if_nonfinite)
      throw InvalidArgument(
          "clip_grad_norm",
          fmt::format("the total gradient norm is {}; the grad of parameter '{}' holds inf or NaN", norm,
                      first_bad != nullptr ? first_bad->name : std::string("?")),
          "lower the learning rate, use a loss scaler, or pass error_if_nonfinite=false and skip the step");
    return norm;
  }
  scale_grads(params, clip_factor(norm, max_norm));
  return norm;
}

}  // namespace meshtrain::optim
