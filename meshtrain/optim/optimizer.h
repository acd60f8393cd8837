// Optimizer: what a training loop drives (step, zero_grad, the learning rate)
// and the parameter checks every optimizer shares. SGD (sgd.h) and AdamW
// (adamw.h) derive from it.
//
//   std::vector<nn::Parameter*> params = model.parameters();
//   optim::AdamW opt(params, /*lr=*/1e-3);
//   for (...) {
//     opt.zero_grad();
//     model.backward(...);       // accumulates into every p->grad
//     opt.set_lr(schedule.lr(step));
//     opt.step();
//   }
//
// Contracts:
// - Parameters are borrowed: each nn::Parameter must outlive the optimizer
//   and keep its value tensor (state is sized from it at construction).
//   value and grad are f32, contiguous and on the cpu, with equal shapes.
// - A parameter whose grad is undefined (Tensor()) is skipped by step(), like
//   a parameter whose .grad is None in PyTorch: its state and step count do
//   not advance.
// - State tensors are allocated at construction (PyTorch allocates lazily at
//   the first step; the values it computes are the same) and charged to the
//   MemoryTracker, if one is given, under MemoryCategory::optimizer.
// Thread-safety: an optimizer belongs to one rank's thread.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::optim {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Applies one update to every parameter that has a defined grad. Throws
  // InvalidArgument (naming the parameter) when a grad is not an f32,
  // contiguous cpu tensor of the value's shape; parameters before it in
  // params() have then already been updated.
  virtual void step() = 0;

  // Sets every defined grad to zero (modules accumulate into grads, so they
  // are zeroed rather than released as PyTorch's set_to_none does).
  void zero_grad();

  double lr() const { return lr_; }
  // New learning rate for the following steps; needs a finite lr >= 0.
  void set_lr(double lr);

  // Bytes of optimizer state (momentum buffers, moments) held for all
  // parameters; what the tracker was charged.
  virtual size_t state_bytes() const = 0;

  const std::vector<nn::Parameter*>& params() const { return params_; }

 protected:
  // Checks the parameter list (no null, no duplicate, f32 contiguous cpu
  // values) and lr; `op` names the optimizer in errors ("SGD", "AdamW").
  Optimizer(std::string op, std::vector<nn::Parameter*> params, double lr);

  // True when params_[i] has a grad to apply; throws InvalidArgument when the
  // grad is defined but unusable (dtype, shape, layout, device).
  bool has_usable_grad(size_t i) const;
  // A zero-filled f32 tensor shaped like params_[i]'s value, charged to
  // `tracker` (may be null) under MemoryCategory::optimizer.
  Tensor zeros_like_param(size_t i, MemoryTracker* tracker) const;

  std::string op_;
  std::vector<nn::Parameter*> params_;
  double lr_;
};

// Throws InvalidArgument naming `op` and `what` unless lo <= value (and
// value < hi when hi_open, value <= hi otherwise) and value is finite.
void check_hparam(const std::string& op, const char* what, double value, double lo, double hi,
                  bool hi_open);

}  // namespace meshtrain::optim
