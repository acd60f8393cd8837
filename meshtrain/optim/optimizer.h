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
//   // Mixed precision: bf16/f16 grads, unscaled (1 / loss scale) and clipped
//   // inside step() by one f32 multiply, the grads left as they are.
//   opt.set_grad_scale(clip / loss_scale);
//   opt.step();
//
//   // State for a checkpoint, per parameter name (what issue 16 saves):
//   OptimizerState saved = opt.export_state();
//   fresh.import_state(saved);  // same parameter names, shapes and optimizer kind
//
// Contracts:
// - Parameters are borrowed: each nn::Parameter must outlive the optimizer
//   and keep its value tensor (state is sized from it at construction).
//   Values are f32 master weights; a defined grad is f32, bf16 or f16. Both
//   are contiguous cpu tensors of the same shape.
// - Gradient input: step() feeds the update float(g) * float(grad_scale())
//   for every grad element g (bf16/f16 widened exactly to f32, the scale
//   rounded to f32 once, one f32 multiply): the multiply optim::scale_grads
//   does, so for f32 grads `scale_grads(params, f); step()` and
//   `set_grad_scale(f); step()` give bit-identical parameters (for bf16/f16
//   grads they agree when g * f is exact in the grad's dtype, e.g. for a
//   power-of-two f on bf16 grads; otherwise set_grad_scale is the more
//   precise, since scale_grads rounds the product back to the grad's dtype). Grads are never modified.
//   Half grads give bit-identical parameters to f32 grads holding their
//   widened values. Non-finite grads are not detected here (grads_finite, a
//   loss scaler); they propagate into the parameters as in PyTorch.
// - Kernels: the element-wise updates are nn::functional's (adamw_step,
//   sgd_step), dispatched on the tensors' device. On the CPU, f32 grads at
//   grad scale 1 are read in place; otherwise the kernel widens and scales
//   2048 elements at a time into a stack buffer (no allocation) and updates
//   that slice (updates are element-wise, so the result equals the
//   whole-parameter update bit for bit).
// - A parameter whose grad is undefined (Tensor()) is skipped by step(), like
//   a parameter whose .grad is None in PyTorch: its state and step count do
//   not advance.
// - State tensors are allocated at construction (PyTorch allocates lazily at
//   the first step; the values it computes are the same) and charged to the
//   MemoryTracker, if one is given, under MemoryCategory::optimizer.
// - State export/import is per parameter NAME (names must be unique in the
//   list), so it does not depend on the order of params(). A parameter's
//   state is its step count and the optimizer's named f32 tensors, each
//   shaped like the parameter's value (AdamW: "exp_avg", "exp_avg_sq"; SGD
//   with momentum: "momentum_buffer"; SGD without: none). Hyperparameters
//   (lr, betas, ...) are not state: the constructor and the schedule set
//   them. Optimizers keep no f32 master of their own (the masters are the
//   parameters, e.g. FullyShardedDataParallel::optimizer_parameters()), so
//   no master field appears. Importing and continuing gives the parameters
//   bit for bit what continuing the exporting optimizer gives.
// Thread-safety: an optimizer belongs to one rank's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::optim {

// One parameter's optimizer state (see the contracts above).
struct ParamState {
  std::string param;  // the parameter's name
  int64_t step = 0;   // updates applied to it
  std::vector<std::pair<std::string, Tensor>> tensors;  // named f32 tensors shaped like the parameter
  // The tensor named `field`, or null.
  const Tensor* find(std::string_view field) const;
};
// Every parameter's state, in params() order when exported.
using OptimizerState = std::vector<ParamState>;

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Applies one update to every parameter that has a defined grad, with the
  // gradient input described above. Throws InvalidArgument (naming the
  // parameter) when a grad is not a contiguous cpu tensor of dtype f32, bf16
  // or f16 and of the value's shape; parameters before it in params() have
  // then already been updated.
  virtual void step() = 0;

  // Sets every defined grad to zero (modules accumulate into grads, so they
  // are zeroed rather than released as PyTorch's set_to_none does).
  void zero_grad();

  double lr() const { return lr_; }
  // New learning rate for the following steps; needs a finite lr >= 0.
  void set_lr(double lr);

  // Factor every grad element is multiplied by (in f32) on its way into the
  // following steps, until changed; default 1. Needs a finite s > 0 whose f32
  // rounding is neither 0 nor inf (InvalidArgument otherwise). Typical use:
  // s = clip_factor / loss_scale, computed once per step by the trainer.
  void set_grad_scale(double s);
  double grad_scale() const { return grad_scale_; }

  // Bytes of optimizer state (momentum buffers, moments) held for all
  // parameters; what the tracker was charged.
  virtual size_t state_bytes() const = 0;

  const std::vector<nn::Parameter*>& params() const { return params_; }

  // Untracked copies of every parameter's state, in params() order. Throws
  // InvalidArgument when two parameters share a name (their states could
  // not be told apart).
  OptimizerState export_state() const;
  // Replaces every parameter's state with the entry of the same name (any
  // order). Checks everything before changing anything; throws
  // InvalidArgument naming the parameter (and the field) for: a parameter
  // without an entry, an entry for a parameter this optimizer does not hold,
  // two entries for one parameter, a field this optimizer does not keep or
  // one it keeps that is missing, a tensor that is undefined, not f32 or
  // not shaped like the parameter, or a negative step. The values are
  // copied into the optimizer's own (tracked) state tensors.
  void import_state(const OptimizerState& state);

 protected:
  // Checks the parameter list (no null, no duplicate, f32 contiguous cpu
  // values) and lr; `op` names the optimizer in errors ("SGD", "AdamW").
  Optimizer(std::string op, std::vector<nn::Parameter*> params, double lr);

  // True when params_[i] has a grad to apply; throws InvalidArgument when the
  // grad is defined but unusable (dtype other than f32/bf16/f16, shape,
  // layout, device).
  bool has_usable_grad(size_t i) const;
  // A zero-filled f32 tensor shaped like params_[i]'s value, charged to
  // `tracker` (may be null) under MemoryCategory::optimizer.
  Tensor zeros_like_param(size_t i, MemoryTracker* tracker) const;

  // The state of params_[i] that export_state copies and import_state
  // fills: its step count and its named state tensors (in a fixed order).
  struct StateView {
    int64_t* step = nullptr;
    std::vector<std::pair<std::string_view, Tensor*>> tensors;
  };
  virtual StateView state_view(size_t i) = 0;

  std::string op_;
  std::vector<nn::Parameter*> params_;
  double lr_;
  double grad_scale_ = 1.0;
};

// Throws InvalidArgument naming `op` and `what` unless lo <= value (and
// value < hi when hi_open, value <= hi otherwise) and value is finite.
void check_hparam(const std::string& op, const char* what, double value, double lo, double hi,
                  bool hi_open);

}  // namespace meshtrain::optim
