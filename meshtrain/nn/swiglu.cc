#include "meshtrain/nn/swiglu.h"

#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

namespace {

std::unique_ptr<Module> projection(const SwiGLUConfig& c, int64_t in, int64_t out, const char* name, ChainRole role) {
  const double std = role == ChainRole::row && c.out_std > 0.0 ? c.out_std : c.init_std;
  LinearOptions o{.bias = false, .defer_init = c.defer_init, .init_std = std};
  return make_chain_linear(in, out, internal::join_name(c.prefix, name), c.seed, o, c.tensor, role);
}

const SwiGLUConfig& checked(const SwiGLUConfig& c) {
  if (c.width < 1 || c.hidden < 1)
    throw InvalidArgument("SwiGLUMLP", fmt::format("'{}': width {}, hidden {}", c.prefix, c.width, c.hidden),
                          "both must be >= 1");
  return c;
}

}  // namespace

SwiGLUMLP::SwiGLUMLP(const SwiGLUConfig& config)
    : config_(checked(config)),
      gate_(projection(config_, config_.width, config_.hidden, "gate_proj", ChainRole::column)),
      up_(projection(config_, config_.width, config_.hidden, "up_proj", ChainRole::column)),
      down_(projection(config_, config_.hidden, config_.width, "down_proj", ChainRole::row)) {}

std::vector<Parameter*> SwiGLUMLP::parameters() {
  std::vector<Parameter*> ps;
  for (Module* m : children())
    for (Parameter* p : m->parameters()) ps.push_back(p);
  return ps;
}

Tensor SwiGLUMLP::do_forward(const Tensor& x, Saved& saved) {
  State& st = saved.state<State>();
  st.g = gate_->forward(x, saved.child(0)).contiguous();
  st.u = up_->forward(x, saved.child(1)).contiguous();
  Tensor& s = internal::reuse_or_allocate(st.s, st.g.shape(), tracker_);
  functional::activation_forward(functional::ActivationKind::silu, st.g, s);
  Tensor& h = internal::reuse_or_allocate(st.h, st.g.shape(), tracker_);
  mul(s, st.u, h);
  round_to(h, compute_dtype_);
  return down_->forward(h, saved.child(2));
}

// dh = down^T dy; d gate = dh u silu'(g); d up = dh silu(g); dx = both projections' dX summed.
Tensor SwiGLUMLP::do_backward_input(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  const Tensor dh = down_->backward_input(grad_out, saved.child(2)).contiguous();
  Tensor dg = Tensor::empty(st.g.shape(), DType::f32, Device{}, tracker_, MemoryCategory::activations);
  mul(dh, st.u, dg);
  functional::activation_backward(functional::ActivationKind::silu, st.g, st.s, dg, dg);
  Tensor du = Tensor::empty(st.g.shape(), DType::f32, Device{}, tracker_, MemoryCategory::activations);
  mul(dh, st.s, du);
  round_to(dg, compute_dtype_);
  round_to(du, compute_dtype_);
  st.g = Tensor();  // the projections' outputs: their buffers may be reused (s and h are this module's)
  st.u = Tensor();
  Tensor dx = gate_->backward_input(dg, saved.child(0));
  const Tensor dx_up = up_->backward_input(du, saved.child(1));
  if (!dx.defined()) return dx_up;
  Tensor sum = Tensor::empty(dx.shape(), DType::f32, Device{}, tracker_, MemoryCategory::activations);
  add(dx, dx_up, sum);
  round_to(sum, compute_dtype_);
  return sum;
}

// Reverse definition order: down, up, gate.
void SwiGLUMLP::do_backward_weight(Saved& saved) {
  down_->backward_weight(saved.child(2));
  up_->backward_weight(saved.child(1));
  gate_->backward_weight(saved.child(0));
}

}  // namespace meshtrain::nn
