// AdamW (Loshchilov and Hutter, decoupled weight decay), computing what
// torch.optim.AdamW computes (amsgrad=False, maximize=False).
//
//   optim::AdamW opt(model.parameters(), /*lr=*/3e-4, {0.9, 0.95}, 1e-8, /*weight_decay=*/0.1);
//   opt.step();
//
// Update for one parameter p with gradient g at its t-th step (t = 1, 2, ...),
// exactly PyTorch's _single_tensor_adam with decoupled decay:
//   p   = p * (1 - lr * weight_decay)          (only when p.weight_decay)
//   m   = lerp(m, g, 1 - beta1)                 = m + (1 - beta1) * (g - m)
//   v   = v * beta2 + (1 - beta2) * g * g
//   bc1 = 1 - beta1^t,  bc2 = 1 - beta2^t       (double)
//   p   = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// The scalars (1 - lr*wd, lr/bc1, sqrt(bc2), ...) are computed in double and
// rounded to f32 once; element arithmetic is f32 in PyTorch's order (lerp
// switches to g - (g - m) * beta1 when 1 - beta1 >= 0.5, as torch.lerp does).
// Weight decay applies only to parameters with Parameter::weight_decay ==
// true (PyTorch: a param group with weight_decay=0 for the others). Last-bit
// agreement with PyTorch's vectorized kernels is not promised (they may fuse
// multiply-adds); the formula and the order of operations are the same.
//
// The update is a free function on raw slices (adamw_update), so a sharded
// (ZeRO) optimizer applies it to the shard of (p, g, m, v) it owns; it and
// the AdamW class run nn::functional::adamw_step (the kernel, dispatched on
// the tensors' device). A slice update equals the same slice of the
// whole-parameter update, bit for bit.
//
// Thread-safety: an AdamW object belongs to one thread; adamw_update may run
// concurrently on disjoint slices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "meshtrain/optim/optimizer.h"

namespace meshtrain::optim {

struct AdamWHParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // 0 for parameters that are not decayed
};

// One AdamW update of n elements in place: p values, g gradients, m and v the
// first and second moments (n floats each). `step` is this update's 1-based
// step number t (the parameter's step count after this update), used for bias
// correction; needs step >= 1 (InvalidArgument otherwise). Hyperparameters are
// not checked here (the AdamW constructor checks them).
void adamw_update(float* p, const float* g, float* m, float* v, size_t n, int64_t step,
                  const AdamWHParams& h);

struct AdamWState {
  Tensor exp_avg;     // m, shaped like the value
  Tensor exp_avg_sq;  // v, shaped like the value
  int64_t step = 0;   // updates applied to this parameter
};

class AdamW : public Optimizer {
 public:
  // Needs finite lr >= 0, betas in [0, 1), eps >= 0, weight_decay >= 0
  // (PyTorch's checks); throws InvalidArgument otherwise, or for a bad
  // parameter list (see Optimizer). Moments are charged to `tracker` (may be
  // null): 8 bytes per parameter element.
  AdamW(std::vector<nn::Parameter*> params, double lr, std::pair<double, double> betas = {0.9, 0.999},
        double eps = 1e-8, double weight_decay = 0.01, MemoryTracker* tracker = nullptr);

  void step() override;
  size_t state_bytes() const override;

  std::pair<double, double> betas() const { return {beta1_, beta2_}; }
  double eps() const { return eps_; }
  double weight_decay() const { return weight_decay_; }
  // The hyperparameters step() uses for params()[i] (its lr is lr(), its
  // weight_decay is 0 when that parameter is not decayed): what a sharded
  // optimizer passes to adamw_update for its shard.
  AdamWHParams hparams_for(size_t i) const;

  // State of params()[i] (i < params().size()); the mutable form is for
  // restoring a checkpoint (keep the tensors' shapes and dtypes).
  const AdamWState& state(size_t i) const { return state_.at(i); }
  AdamWState& state(size_t i) { return state_.at(i); }

 protected:
  StateView state_view(size_t i) override {
    return {&state_.at(i).step, {{"exp_avg", &state_[i].exp_avg}, {"exp_avg_sq", &state_[i].exp_avg_sq}}};
  }

 private:
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  std::vector<AdamWState> state_;  // one per parameter, same order
};

}  // namespace meshtrain::optim
