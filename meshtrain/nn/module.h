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
// - Parameter hook (ParamHook), installed with set_param_hook:
//   * grad_ready(p): during backward, as soon as a parameter's gradient for
//     this backward is complete, the module calls it (once per parameter per
//     backward). Data parallelism starts a bucket's all-reduce there.
//   * before_use(m, pass) / after_use(m, pass): a module that OWNS parameters
//     (a leaf such as Linear or LayerNorm; containers own none) calls
//     before_use before it touches its parameters' value or grad in forward
//     or backward, and after_use when it is done with them (in backward:
//     after every grad is complete and the last read of a value). Between
//     the two, the hook may have replaced p.value and p.grad (same shapes):
//     fully sharded data parallelism materializes a unit's parameters there
//     and frees them after. Outside these windows a sharded parameter's
//     value and grad may be undefined tensors.
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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::nn {

// Where the current local batch sits in the run: see "Batch context" above.
struct BatchContext {
  uint64_t step = 0;                // advanced by the trainer once per optimizer step
  int64_t first_global_sample = 0;  // global index of local sample 0 (>= 0)
};

// Fills elements [start, start + count) of a parameter's initial value
// (row-major over info.shape) into out: a pure function of (seed, name,
// index), so any rank can build exactly its shard (layout-invariant init).
using ParamInit = std::function<void(int64_t start, int64_t count, float* out)>;

struct Parameter {
  std::string name;           // path in the module tree, e.g. "encoder.0.weight"
  Tensor value;               // f32; undefined while deferred (see materialize)
  Tensor grad;                // f32, same shape
  bool weight_decay = true;   // AdamW decays it (false for biases and norms)
  sharding::ParamInfo info;   // global shape, kind and linear role, for the strategies
  ParamInit init;             // the initial value, sliceable
};

// Allocates p.value (info.shape, f32) filled by p.init and a zeroed grad.
// Modules built with deferred initialization (LinearOptions::defer_init,
// MLPConfig::defer_init, ...) leave values undefined so that fully sharded
// data parallelism can build each rank's shard alone; this builds the whole.
inline void materialize(Parameter& p) {
  p.value = Tensor::empty(p.info.shape, DType::f32);
  p.init(0, p.value.numel(), p.value.data<float>());
  p.grad = Tensor::zeros(p.info.shape, DType::f32);
}

// Which pass a module is in when it calls before_use / after_use.
enum class Pass : uint8_t { forward, backward };

class Module;

// Called by modules during forward and backward (see "Parameter hook" above).
// Every method has a do-nothing default.
class ParamHook {
 public:
  virtual ~ParamHook() = default;
  virtual void grad_ready(Parameter& /*p*/) {}
  virtual void before_use(Module& /*owner*/, Pass /*pass*/) {}
  virtual void after_use(Module& /*owner*/, Pass /*pass*/) {}
};

class Module {
 public:
  virtual ~Module() = default;

  virtual Tensor forward(const Tensor& x) = 0;
  virtual Tensor backward(const Tensor& grad_out) = 0;

  // Every parameter of this module and its children, in definition order.
  virtual std::vector<Parameter*> parameters() = 0;

  // The modules this one contains (containers override it); the settings
  // below propagate through it to every descendant.
  virtual std::vector<Module*> children() { return {}; }

  // Training mode (dropout active) or evaluation mode.
  void set_training(bool training) {
    training_ = training;
    for (Module* c : children()) c->set_training(training);
  }
  bool training() const { return training_; }

  // Installs the parameter hook (nullptr removes it). Borrowed: it must
  // outlive its use.
  void set_param_hook(ParamHook* hook) {
    hook_ = hook;
    for (Module* c : children()) c->set_param_hook(hook);
  }

  // Charges the buffers modules keep between forward and backward (outputs,
  // saved inputs' copies, masks, gradient buffers) to `tracker` as
  // MemoryCategory::activations (nullptr: not charged). Borrowed: it must
  // outlive the module's buffers. Applies to buffers allocated from now on.
  void set_memory_tracker(MemoryTracker* tracker) {
    tracker_ = tracker;
    for (Module* c : children()) c->set_memory_tracker(tracker);
  }
  MemoryTracker* memory_tracker() const { return tracker_; }

  // Half-precision compute emulation: f32, bf16 or f16 (InvalidArgument
  // otherwise). Layers with GEMMs (Linear) round their GEMM inputs and
  // outputs to it, as autocast would; norms, activations and losses stay
  // f32 (autocast's fp32 list). Parameters are not rounded here.
  void set_compute_dtype(DType dtype) {
    if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
      throw InvalidArgument("Module::set_compute_dtype", std::string("dtype ") + std::string(dtype_name(dtype)),
                            "use f32, bf16 or f16");
    compute_dtype_ = dtype;
    for (Module* c : children()) c->set_compute_dtype(dtype);
  }
  DType compute_dtype() const { return compute_dtype_; }

  // Sets the batch context (see above); first_global_sample must be >= 0.
  void set_batch_context(uint64_t step, int64_t first_global_sample) {
    batch_context_ = BatchContext{step, first_global_sample};
    for (Module* c : children()) c->set_batch_context(step, first_global_sample);
  }
  const BatchContext& batch_context() const { return batch_context_; }

  // Zeroes every defined grad (a sharded parameter's may be undefined).
  void zero_grad() {
    for (Parameter* p : parameters())
      if (p->grad.defined()) p->grad.fill(0.0);
  }
  // Elements of every parameter (by its global shape: a deferred or fully
  // sharded parameter counts whole).
  int64_t num_parameters() {
    int64_t n = 0;
    for (Parameter* p : parameters()) n += p->info.numel();
    return n;
  }

 protected:
  void notify_grad_ready(Parameter& p) {
    if (hook_) hook_->grad_ready(p);
  }
  // For modules that own parameters: bracket every use of them.
  void begin_use(Pass pass) {
    if (hook_) hook_->before_use(*this, pass);
  }
  void end_use(Pass pass) {
    if (hook_) hook_->after_use(*this, pass);
  }

  bool training_ = true;
  ParamHook* hook_ = nullptr;
  MemoryTracker* tracker_ = nullptr;
  DType compute_dtype_ = DType::f32;
  BatchContext batch_context_;
};

}  // namespace meshtrain::nn
