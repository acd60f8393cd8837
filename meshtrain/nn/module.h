// Module: a layer or model with explicit forward and backward (no autograd).
//
//   nn::Sequential mlp = ...;
//   Tensor logits = mlp.forward(x);            // (B, 10); keeps what backward needs
//   Tensor dx = mlp.backward(dlogits);         // accumulates into every parameter's grad
//   for (Parameter* p : mlp.parameters()) ...  // stable order: definition order
//
// Contracts:
// - forward(x) may keep references to x and to intermediate results until the
//   next forward or backward; backward(dy) must follow a forward, takes the
//   gradient of the loss with respect to forward's output, ACCUMULATES (+=)
//   into each parameter's grad, and returns the gradient with respect to x.
// - Parameters are f32 tensors (master weights); grad has the same shape and
//   is zeroed by zero_grad(). A parameter's name is its path in the module
//   tree ("layers.0.weight"); its initial value depends only on (seed, name)
//   through the core's counter-based generator (layout-invariant init).
// - Weight decay is chosen by parameter metadata (Parameter::weight_decay),
//   never by position.
// - Gradient-ready hook: during backward, as soon as a parameter's gradient
//   for this backward is complete, the module calls hook->grad_ready(param)
//   (once per parameter per backward). Data parallelism uses it to start a
//   bucket's all-reduce while backward continues.
// - Weights follow the strategies' convention: Linear weights are (in, out),
//   y = x W + b (see sharding/strategy.h).
// - Batch context: random draws made during forward (dropout masks, a VAE's
//   reparameterization noise) are pure functions of (seed, module name,
//   step, GLOBAL sample index, feature). Before each forward the trainer calls
//   set_batch_context(step, first_global_sample), where first_global_sample
//   is the global index of this rank's first local sample, so a rank holding
//   samples [a, b) of the global batch draws exactly the same numbers for
//   them as a single device holding all samples. It propagates to children.
// Thread-safety: a module belongs to one rank's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/core/tensor.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::nn {

// Where the current local batch sits in the run: see "Batch context" above.
struct BatchContext {
  uint64_t step = 0;                // advanced by the trainer once per optimizer step
  int64_t first_global_sample = 0;  // global index of local sample 0 (>= 0)
};

struct Parameter {
  std::string name;           // path in the module tree, e.g. "encoder.0.weight"
  Tensor value;               // f32
  Tensor grad;                // f32, same shape
  bool weight_decay = true;   // AdamW decays it (false for biases and norms)
  sharding::ParamInfo info;   // kind and linear role, for the strategies
};

class GradHook {
 public:
  virtual ~GradHook() = default;
  virtual void grad_ready(Parameter& p) = 0;
};

class Module {
 public:
  virtual ~Module() = default;

  virtual Tensor forward(const Tensor& x) = 0;
  virtual Tensor backward(const Tensor& grad_out) = 0;

  // Every parameter of this module and its children, in definition order.
  virtual std::vector<Parameter*> parameters() = 0;

  // Training mode (dropout active) or evaluation mode. Propagates to children.
  virtual void set_training(bool training) { training_ = training; }
  bool training() const { return training_; }

  // Installs the gradient-ready hook on this module and its children
  // (nullptr removes it). Borrowed: it must outlive its use.
  virtual void set_grad_hook(GradHook* hook) { hook_ = hook; }

  // Sets the batch context of this module and its children (see above).
  // first_global_sample must be >= 0. Containers override it to propagate.
  virtual void set_batch_context(uint64_t step, int64_t first_global_sample) {
    batch_context_ = BatchContext{step, first_global_sample};
  }
  const BatchContext& batch_context() const { return batch_context_; }

  void zero_grad() {
    for (Parameter* p : parameters()) p->grad.fill(0.0);
  }
  int64_t num_parameters() {
    int64_t n = 0;
    for (Parameter* p : parameters()) n += p->value.numel();
    return n;
  }

 protected:
  void notify_grad_ready(Parameter& p) {
    if (hook_) hook_->grad_ready(p);
  }

  bool training_ = true;
  GradHook* hook_ = nullptr;
  BatchContext batch_context_;
};

}  // namespace meshtrain::nn
