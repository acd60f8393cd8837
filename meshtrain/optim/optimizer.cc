#include "meshtrain/optim/optimizer.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <unordered_map>
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

Tensor Optimizer::zeros_like_param(size_t i, MemoryTracker* tracker) const {
  return Tensor::zeros(params_[i]->value.shape(), DType::f32, Device::cpu(), tracker,
                       MemoryCategory::optimizer);
}

const Tensor* ParamState::find(std::string_view field) const {
  for (const auto& [name, t] : tensors)
    if (name == field) return &t;
  return nullptr;
}

namespace {

// Throws unless every parameter name is unique: state is matched by name.
void check_unique_names(const std::string& op, const std::vector<nn::Parameter*>& params) {
  std::unordered_map<std::string_view, size_t> first;
  for (size_t i = 0; i < params.size(); ++i)
    if (auto [it, fresh] = first.emplace(params[i]->name, i); !fresh)
      throw InvalidArgument(op,
                            fmt::format("parameters {} and {} are both named '{}'; state is kept by parameter name",
                                        it->second, i, params[i]->name),
                            "give every parameter a unique name (Module::parameters() does)");
}

std::string field_list(const std::vector<std::pair<std::string_view, Tensor*>>& tensors) {
  if (tensors.empty()) return "no state tensors";
  std::string out;
  for (const auto& [name, t] : tensors) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

}  // namespace

OptimizerState Optimizer::export_state() const {
  check_unique_names(op_ + "::export_state", params_);
  // state_view hands out mutable pointers; nothing is written through them here.
  auto& self = const_cast<Optimizer&>(*this);
  OptimizerState out;
  out.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const StateView v = self.state_view(i);
    ParamState s{params_[i]->name, *v.step, {}};
    for (const auto& [name, t] : v.tensors) {
      Tensor copy = Tensor::empty(t->shape(), t->dtype());  // untracked: it outlives nothing of ours
      copy.copy_from(*t);
      s.tensors.emplace_back(std::string(name), std::move(copy));
    }
    out.push_back(std::move(s));
  }
  return out;
}

void Optimizer::import_state(const OptimizerState& state) {
  const std::string op = op_ + "::import_state";
  check_unique_names(op, params_);
  std::unordered_map<std::string_view, const ParamState*> by_name;
  for (const ParamState& s : state) {
    if (!by_name.emplace(s.param, &s).second)
      throw InvalidArgument(op, fmt::format("the state holds parameter '{}' twice", s.param),
                            "pass one entry per parameter, as export_state() gives");
  }
  std::unordered_set<std::string_view> held;
  for (const nn::Parameter* p : params_) held.insert(p->name);
  for (const ParamState& s : state)
    if (!held.contains(s.param))
      throw InvalidArgument(op,
                            fmt::format("the state holds parameter '{}', which this {} does not update ({} "
                                        "parameters)",
                                        s.param, op_, params_.size()),
                            "import state exported for the same model and parallel layout (parameter names "
                            "must match)");
  // Everything is checked before anything is written, so a refused import
  // leaves the optimizer as it was.
  std::vector<std::pair<StateView, const ParamState*>> plan;
  for (size_t i = 0; i < params_.size(); ++i) {
    const nn::Parameter& p = *params_[i];
    const auto it = by_name.find(p.name);
    if (it == by_name.end())
      throw InvalidArgument(op, fmt::format("the state has no entry for parameter '{}'", p.name),
                            "import state exported for the same model and parallel layout");
    const ParamState& s = *it->second;
    StateView v = state_view(i);
    if (s.step < 0)
      throw InvalidArgument(op, fmt::format("parameter '{}': step {} is negative", p.name, s.step),
                            "pass the step count export_state() gave");
    for (const auto& [name, t] : s.tensors) {
      Tensor* dst = nullptr;
      for (const auto& [want, mine] : v.tensors)
        if (want == name) dst = mine;
      if (dst == nullptr)
        throw InvalidArgument(op,
                              fmt::format("parameter '{}': unknown field '{}' ({} keeps {})", p.name, name, op_,
                                          field_list(v.tensors)),
                              "import state exported by the same kind of optimizer with the same settings");
      if (!t.defined() || t.dtype() != DType::f32 || t.shape() != p.value.shape())
        throw InvalidArgument(op,
                              fmt::format("parameter '{}', field '{}': {} but the parameter needs f32 {}", p.name,
                                          name,
                                          t.defined() ? fmt::format("{} {}", dtype_name(t.dtype()),
                                                                    shape_to_string(t.shape()))
                                                      : std::string("an undefined tensor"),
                                          shape_to_string(p.value.shape())),
                              "import state exported for parameters of the same shapes");
    }
    for (const auto& [want, mine] : v.tensors)
      if (s.find(want) == nullptr)
        throw InvalidArgument(op, fmt::format("parameter '{}': field '{}' is missing", p.name, want),
                              fmt::format("{} keeps {} per parameter; import what export_state() gave", op_,
                                          field_list(v.tensors)));
    plan.emplace_back(std::move(v), &s);
  }
  for (auto& [v, s] : plan) {
    *v.step = s->step;
    for (const auto& [name, t] : v.tensors) t->copy_from(*s->find(name));
  }
}

}  // namespace meshtrain::optim
