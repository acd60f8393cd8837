// SGD with momentum, Nesterov momentum and L2 weight decay, computing what
// torch.optim.SGD computes.
//
//   optim::SGD opt(model.parameters(), /*lr=*/0.1, /*momentum=*/0.9, /*nesterov=*/true);
//   opt.step();
//
// Update for one parameter p with gradient g at its t-th step (t = 1, 2, ...),
// exactly PyTorch's _single_tensor_sgd (maximize=False):
//   d = g + weight_decay * p                    (only when p.weight_decay)
//   if momentum != 0:
//     buf = d                                   if t == 1 (PyTorch clones the first d)
//     buf = momentum * buf + (1 - dampening) * d  otherwise
//     d = d + momentum * buf                    if nesterov
//     d = buf                                   otherwise
//   p = p - lr * d
// Each line is evaluated in f32 in this order, with the hyperparameters
// rounded to f32 once, as PyTorch's CPU kernels do. Weight decay applies only
// to parameters with Parameter::weight_decay == true (PyTorch: put the others
// in a param group with weight_decay=0).
//
// The update is a free function on raw slices (sgd_update), so a sharded
// (ZeRO) optimizer applies it to the shard it owns; it and the SGD class run
// nn::functional::sgd_step (the kernel, dispatched on the tensors' device).
// The update is element-wise and `first` is per parameter, so a slice update
// equals that slice of the whole update, bit for bit.
//
// Thread-safety: an SGD object belongs to one thread; sgd_update may run
// concurrently on disjoint slices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "meshtrain/optim/optimizer.h"

namespace meshtrain::optim {

struct SGDHParams {
  double lr = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // 0 for parameters that are not decayed
  bool nesterov = false;
};

// One SGD update of n elements in place. p: values, g: gradients, buf: the
// momentum buffer (n floats; may be null only when momentum == 0). first:
// this is the parameter's first step (buf is set to the decayed gradient, not
// blended). Slices may be any part of a parameter: the update is element-wise.
// Hyperparameters are not checked here (the SGD constructor checks them).
void sgd_update(float* p, const float* g, float* buf, size_t n, bool first, const SGDHParams& h);

struct SGDState {
  Tensor momentum_buffer;  // shaped like the value; undefined when momentum == 0
  int64_t step = 0;        // updates applied to this parameter
};

class SGD : public Optimizer {
 public:
  // Needs finite lr >= 0, momentum >= 0, weight_decay >= 0, dampening in
  // [0, 1]; nesterov needs momentum > 0 and dampening == 0 (as PyTorch).
  // Throws InvalidArgument otherwise, or for a bad parameter list (see
  // Optimizer). Momentum buffers are charged to `tracker` (may be null).
  SGD(std::vector<nn::Parameter*> params, double lr, double momentum = 0.0, bool nesterov = false,
      double weight_decay = 0.0, double dampening = 0.0, MemoryTracker* tracker = nullptr);

  void step() override;
  size_t state_bytes() const override;

  double momentum() const { return momentum_; }
  bool nesterov() const { return nesterov_; }
  double weight_decay() const { return weight_decay_; }
  double dampening() const { return dampening_; }

  // State of params()[i] (i < params().size()); the mutable form is for
  // restoring a checkpoint (keep the buffer's shape and dtype).
  const SGDState& state(size_t i) const { return state_.at(i); }
  SGDState& state(size_t i) { return state_.at(i); }

 protected:
  StateView state_view(size_t i) override {
    StateView v{&state_.at(i).step, {}};
    if (state_[i].momentum_buffer.defined()) v.tensors.emplace_back("momentum_buffer", &state_[i].momentum_buffer);
    return v;
  }

 private:
  double momentum_;
  bool nesterov_;
  double weight_decay_;
  double dampening_;
  std::vector<SGDState> state_;  // one per parameter, same order
};

}  // namespace meshtrain::optim
