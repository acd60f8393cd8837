// Module: a layer or model with explicit forward and backward (no autograd),
// whose per-call state lives in a Saved object, not in the module.
//
//   nn::Sequential mlp = ...;
//   nn::Saved s;                                // what this call keeps for backward
//   Tensor logits = mlp.forward(x, s);          // (B, 10)
//   Tensor dx = mlp.backward(dlogits, s);       // accumulates into every parameter's grad
//   // or split: dx = mlp.backward_input(dlogits, s); ... mlp.backward_weight(s);
//   Tensor y = mlp.forward(x);                  // one call in flight: the module's own Saved
//   for (Parameter* p : mlp.parameters()) ...   // stable order: definition order
//
// Contracts:
// - forward(x, saved) keeps in `saved` what backward needs (references to x
//   and intermediate results); backward(dy, saved) must follow a forward into
//   the same Saved, takes the gradient of the loss with respect to forward's
//   output, ACCUMULATES (+=) into each parameter's grad, and returns the
//   gradient with respect to x. Forwards into different Saved objects may be
//   in flight together (micro-batches of a pipeline) and their backwards may
//   run in any order. forward(x) / backward(dy) use the module's own Saved
//   (one call in flight).
// - Split backward: backward_input(dy, saved) returns dX and keeps what the
//   weight gradients need; backward_weight(saved) then accumulates them and
//   reports grad_ready. Together they compute exactly (bit for bit) what
//   backward computes; backward is their fusion. Zero-bubble pipeline
//   schedules delay backward_weight.
// - Recompute (set_recompute(true), per module): forward keeps only its input
//   (and the batch context); the backward passes first re-run forward to
//   rebuild the activations, then drop them. Results are bit for bit those of
//   a normal run, with less activation memory between forward and backward.
// - Parameters are f32 tensors (master weights); grad has the same shape and
//   is zeroed by zero_grad(). A parameter's name is its path in the module
//   tree ("layers.0.weight"); its initial value depends only on (seed, name)
//   through the core's counter-based generator (layout-invariant init).
// - Weight decay is chosen by parameter metadata (Parameter::weight_decay),
//   never by position.
// - Hooks (ParamHook), installed with add_hook (several, kept in order):
//   * grad_ready(p): during backward (the weight pass when split), as soon as
//     a parameter's gradient for this backward is complete, once per
//     parameter per backward, to every hook in installation order. Data
//     parallelism starts a bucket's all-reduce there.
//   * before_use(m, pass) / after_use(m, pass): a use-scope around each pass
//     (forward, backward, backward_input, backward_weight) of every module m
//     for which the hook's scopes(m) is true: by default the modules that own
//     parameters directly (Linear, LayerNorm); a hook may claim any module
//     (fully sharded data parallelism claims a whole block to make it one
//     unit). before_use runs in installation order, after_use in reverse,
//     so hooks nest. Between the two, the hook may have replaced p.value and
//     p.grad (same shapes): fully sharded data parallelism materializes a
//     unit's parameters there and frees them after. Outside these windows a
//     sharded parameter's value and grad may be undefined tensors. In
//     backward_input only values are used; in backward_weight only grads.
// - Tied parameters: a parameter that k modules use (a GPT's token
//   embedding and output head) is listed once by parameters() (at its first
//   user in definition order) and has Parameter::users = k. Every user
//   accumulates into the same grad and reports it; hooks see grad_ready once,
//   after the k-th report of a backward.
// - Weights follow the strategies' convention: Linear weights are (in, out),
//   y = x W + b (see sharding/strategy.h).
// - Batch context: random draws made during forward (dropout masks, a VAE's
//   reparameterization noise) are pure functions of (seed, module name,
//   step, GLOBAL sample index, feature). Before each forward the trainer calls
//   set_batch_context(step, first_global_sample), where first_global_sample
//   is the global index of this rank's first local sample, so a rank holding
//   samples [a, b) of the global batch draws exactly the same numbers for
//   them as a single device holding all samples. It propagates to children;
//   each forward records it in its Saved (recompute replays it).
// Thread-safety: a module belongs to one rank's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/saved.h"
#include "meshtrain/sharding/layout.h"
#include "meshtrain/sharding/placement.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::comm {
class Communicator;
}

namespace meshtrain::nn {

// Fills elements [start, start + count) of a parameter's initial value
// (row-major over info.shape) into out: a pure function of (seed, name,
// index), so any rank can build exactly its shard (layout-invariant init).
// fill_box (below) builds any rectangular block from it.
using ParamInit = std::function<void(int64_t start, int64_t count, float* out)>;

// What a parameter's value holds of its global tensor on this rank (whole,
// a tensor-parallel block, or a fully sharded range of it): the one
// description the runtime, checkpoints, the planner and the pictures share
// (sharding/placement.h). placement.shape is the global tensor's shape.
using sharding::Placement;

struct Parameter {
  std::string name;           // path in the module tree, e.g. "encoder.0.weight"
  Tensor value;               // f32; undefined while deferred (see materialize)
  Tensor grad;                // f32, same shape
  bool weight_decay = true;   // AdamW decays it (false for biases and norms)
  // Global shape, kind and linear role, for the strategies; a routed
  // expert's (info.routed_expert()) is held by one rank of the expert axis,
  // so its gradient is summed over the ranks that hold the same experts only
  // (parallel::ExpertParallel sums every other gradient over the axis too).
  sharding::ParamInfo info;
  ParamInit init;             // the initial value, sliceable
  Placement placement;        // what value holds of the global tensor (its modules set it)
  int users = 1;              // modules that accumulate into grad per backward (tied: > 1)
  // Sequence parallelism (tensor_parallel.h): replicated over the tensor
  // axis but fed this rank's tokens only, so grad holds a partial sum that
  // the trainer adds over the tensor axis once per step
  // (reduce_sequence_parallel_grads). Megatron's `sequence_parallel` attribute.
  bool sequence_parallel = false;
  // A block several tensor-parallel ranks hold alike but feed different
  // heads (Llama's key/value heads replicated over a tensor axis larger
  // than kv_heads): grad holds this rank's part, summed over these ranks
  // once per step (parallel::TensorParallel). Borrowed from the module.
  comm::Communicator* partial_over = nullptr;
  int reports = 0;            // grad reports so far in this backward (see Module::notify_grad_ready)
  // Mixed precision's working copy (parallel/fully_sharded.h): when defined,
  // a contiguous bf16/f16 tensor of value's numel that optimizer steps
  // write with the updated value rounded to its dtype, in the same pass
  // (no second sweep over the weights), setting rounded_fresh. Its owner
  // clears the flag after each step and rounds value itself when the flag
  // is unset (an optimizer that does not write the copy).
  Tensor rounded;
  bool rounded_fresh = false;
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

// Which pass a module is in when a hook's before_use / after_use runs.
enum class Pass : uint8_t { forward, backward, backward_input, backward_weight };

class Module;

// Called by modules during forward and backward (see "Hooks" above). Every
// method has a default: grad_ready and the use-scopes do nothing, scopes()
// claims the modules that own parameters directly.
class ParamHook {
 public:
  virtual ~ParamHook() = default;
  virtual void grad_ready(Parameter& /*p*/) {}
  virtual bool scopes(Module& m);
  virtual void before_use(Module& /*m*/, Pass /*pass*/) {}
  virtual void after_use(Module& /*m*/, Pass /*pass*/) {}
};

class Module {
 public:
  virtual ~Module() = default;

  // x -> y, keeping in `saved` what backward needs (see the contracts).
  Tensor forward(const Tensor& x, Saved& saved);
  // Fused backward: backward_input then backward_weight, in one pass.
  Tensor backward(const Tensor& grad_out, Saved& saved);
  // The input gradient only; backward_weight(saved) must follow.
  Tensor backward_input(const Tensor& grad_out, Saved& saved);
  // The parameter gradients of a backward_input into `saved`; grad_ready
  // fires here. Ends the call: `saved` may take the next forward.
  void backward_weight(Saved& saved);
  // One call in flight, in the module's own Saved.
  Tensor forward(const Tensor& x) { return forward(x, own_); }
  Tensor backward(const Tensor& grad_out) { return backward(grad_out, own_); }
  Saved& own_saved() { return own_; }

  // Every parameter of this module and its children, in definition order,
  // each once (a tied parameter at its first user).
  virtual std::vector<Parameter*> parameters() = 0;

  // The modules this one contains (containers override it); the settings
  // below propagate through it to every descendant.
  virtual std::vector<Module*> children() { return {}; }

  // A use of this module's parameters outside its own forward and backward
  // (a tied output head uses the embedding's table): the hooks' use-scope
  // for `pass` around fn, as forward and backward open it, so that fully
  // sharded data parallelism gathers the values and provides the gradient
  // there too.
  template <typename Fn>
  void use_parameters(Pass pass, Fn&& fn) {
    begin_scope(pass);
    fn();
    end_scope(pass);
  }

  // True for a module that owns parameters itself: one that none of its
  // children lists (a Linear; a row-parallel layer's replicated bias beside
  // its child's weight block). The default use-scope of a hook, and fully
  // sharded data parallelism's default unit (with its children's parameters).
  bool owns_parameters();

  // Recompute mode of this module (not its children): see the contracts.
  void set_recompute(bool recompute) { recompute_ = recompute; }
  bool recompute() const { return recompute_; }

  // Training mode (dropout active) or evaluation mode.
  void set_training(bool training) {
    training_ = training;
    for (Module* c : children()) c->set_training(training);
  }
  bool training() const { return training_; }

  // Appends a hook (non-null, not already installed) to this module and every
  // descendant. Borrowed: it must outlive its use or be removed.
  void add_hook(ParamHook* hook);
  // Removes `hook` from this module and every descendant (no-op if absent).
  void remove_hook(ParamHook* hook);
  // Replaces every hook by `hook` (nullptr: removes all).
  void set_param_hook(ParamHook* hook);
  const std::vector<ParamHook*>& hooks() const { return hooks_; }

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
  // The two-argument form leaves sequence_length 0.
  void set_batch_context(uint64_t step, int64_t first_global_sample) {
    set_batch_context(BatchContext{step, first_global_sample});
  }
  void set_batch_context(const BatchContext& context) {
    batch_context_ = context;
    for (Module* c : children()) c->set_batch_context(context);
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
  // What a module implements. `saved` is this call's (the recomputed one in
  // recompute mode); the batch context of the call is saved.batch.
  virtual Tensor do_forward(const Tensor& x, Saved& saved) = 0;
  virtual Tensor do_backward_input(const Tensor& grad_out, Saved& saved) = 0;
  // Modules with parameters accumulate their gradients here.
  virtual void do_backward_weight(Saved& /*saved*/) {}
  // Override to fuse the two passes (same numbers, e.g. fewer sweeps).
  virtual Tensor do_backward(const Tensor& grad_out, Saved& saved) {
    Tensor dx = do_backward_input(grad_out, saved);
    do_backward_weight(saved);
    return dx;
  }
  // "Linear 'encoder.0'", for errors.
  virtual std::string describe() const { return "module"; }

  // A module's gradient for p is complete in this backward: hooks see it
  // once p.users reports have come in.
  void notify_grad_ready(Parameter& p) {
    if (++p.reports < p.users) return;
    p.reports = 0;
    for (ParamHook* h : hooks_) h->grad_ready(p);
  }

  bool training_ = true;
  MemoryTracker* tracker_ = nullptr;
  DType compute_dtype_ = DType::f32;
  BatchContext batch_context_;

 private:
  // The Saved the do_* calls of a backward use: `saved` itself, or in
  // recompute mode the activations rebuilt from saved.input.
  Saved& backward_target(Saved& saved, const char* op);
  void require_phase(const Saved& saved, Saved::Phase phase, const char* op) const;
  void begin_scope(Pass pass);
  void end_scope(Pass pass);
  void end_call(Saved& saved);

  std::vector<ParamHook*> hooks_;
  bool recompute_ = false;
  int8_t owns_parameters_ = -1;  // cached owns_parameters(): -1 unknown
  Saved own_;
};

inline bool ParamHook::scopes(Module& m) { return m.owns_parameters(); }

// Summary rows (parameter name, description), folded: two or more
// parameters whose names differ only in layer indices
// ("h.3.attn.c_attn.weight") and whose descriptions all agree share one
// row named by the pattern ("h.*.attn.c_attn.weight"), at its first
// appearance; others (a layer alone, say a pipeline stage's one block)
// keep their own rows. For start-up dumps and `meshtrain shard --model`.
std::vector<std::pair<std::string, std::string>> fold_layer_rows(
    const std::vector<std::pair<std::string, std::string>>& rows);

// Fills the rectangular block `box` of p's initial value (offset and size
// per dimension of p.info.shape) into out (the block's elements, row-major),
// from p.init: any shard of any layout, e.g. a column block of a weight.
void fill_box(const Parameter& p, const std::vector<int64_t>& offset, const std::vector<int64_t>& size, float* out);

// The initial value of the block `box` of a tensor of `shape` whose whole
// initial value is `whole`, as a ParamInit over the block's own row-major
// elements: what a tensor-parallel rank's parameter (of the block's shape)
// is initialized from, bit-identical to that block of the unsharded value.
// InvalidArgument when the box does not lie inside the shape.
ParamInit box_init(ParamInit whole, std::vector<int64_t> shape, sharding::Box box);

}  // namespace meshtrain::nn
