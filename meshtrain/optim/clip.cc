#include "meshtrain/optim/clip.h"

#include <fmt/format.h>

#include <cmath>
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

// The grad data of p and its size in *n (null and 0 when the grad is
// undefined); throws unless a defined grad is a contiguous f32 cpu tensor.
const float* grad_data(const char* op, const nn::Parameter* p, size_t* n) {
  if (p == nullptr) throw InvalidArgument(op, "null parameter in the list", "pass Module::parameters()");
  const Tensor& g = p->grad;
  *n = 0;
  if (!g.defined()) return nullptr;
  if (g.dtype() != DType::f32 || !g.is_contiguous() || g.device() != Device::cpu())
    throw InvalidArgument(op,
                          fmt::format("grad of parameter '{}' must be a contiguous f32 cpu tensor (got {}, "
                                      "contiguous={})",
                                      p->name, dtype_name(g.dtype()), g.is_contiguous()),
                          "clip the f32 master gradients");
  *n = static_cast<size_t>(g.numel());
  return g.data<float>();
}

double sq_norm_of(const float* g, size_t n) {
  double acc = 0.0;
  for (size_t i = 0; i < n; ++i) acc += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  return acc;
}

}  // namespace

double local_sq_norm(const std::vector<nn::Parameter*>& params) {
  double total = 0.0;
  for (const nn::Parameter* p : params) {
    size_t n;
    const float* g = grad_data("local_sq_norm", p, &n);
    total += sq_norm_of(g, n);
  }
  return total;
}

double clip_factor(double total_norm, double max_norm) {
  check_max_norm("clip_factor", max_norm);
  if (!std::isfinite(total_norm)) return 1.0;
  const double factor = max_norm / (total_norm + kClipEps);
  return factor < 1.0 ? factor : 1.0;
}

void scale_grads(const std::vector<nn::Parameter*>& params, double factor) {
  for (const nn::Parameter* p : params) {
    size_t n;
    grad_data("scale_grads", p, &n);  // validates
    if (factor != 1.0 && p->grad.defined()) scale(p->grad, factor);
  }
}

double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm, bool error_if_nonfinite) {
  check_max_norm("clip_grad_norm", max_norm);
  double total = 0.0;
  const nn::Parameter* first_bad = nullptr;
  for (const nn::Parameter* p : params) {
    size_t n;
    const float* g = grad_data("clip_grad_norm", p, &n);
    const double sq = sq_norm_of(g, n);
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
