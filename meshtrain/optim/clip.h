// Global-norm gradient clipping, as torch.nn.utils.clip_grad_norm_ (L2 norm),
// in one call or split so that a distributed run can sum the squared norms
// across ranks before scaling.
//
//   double norm = optim::clip_grad_norm(model.parameters(), /*max_norm=*/1.0);
//
//   // Sharded: each element counted by exactly one rank.
//   double sq = optim::local_sq_norm(my_shard_params);
//   comm.all_reduce(&sq, 1, DType::f64, ReduceOp::sum);
//   double norm = std::sqrt(sq);
//   optim::scale_grads(my_shard_params, optim::clip_factor(norm, 1.0));
//
//   // Before a mixed-precision step: skip it on every rank if any grad overflowed.
//   bool finite = optim::grads_finite(my_params);
//
// Formulas (PyTorch's): total_norm = sqrt(sum over parameters and elements of
// g^2); factor = min(1, max_norm / (total_norm + 1e-6)); every grad *= factor.
// PyTorch always multiplies, by 1.0 when not clipping; we skip the multiply
// then (same values). Sums are accumulated in double in parameter order and
// element order (PyTorch accumulates per-tensor norms in the grads' dtype), so
// the result is deterministic for a given parameter list.
//
// Non-finite norm (a grad holds inf or NaN): PyTorch returns it and scales
// every grad by max_norm / (inf or NaN), which turns all grads into 0 or NaN.
// We return the non-finite norm and leave the grads untouched, so the caller
// (a loss scaler) can skip the step; with error_if_nonfinite = true we throw
// InvalidArgument naming the first parameter whose grad is not finite
// (PyTorch raises a RuntimeError there).
//
// Grad dtypes: f32, bf16 or f16 (mixed in one list is fine). Half grads are
// widened exactly to f32 and squared and summed in double like f32 ones, so
// the norm of a bf16 grad equals the norm of an f32 grad holding its
// widened values. scale_grads multiplies in f32 and rounds a bf16/f16 result
// back to the grad's dtype (to nearest even; f16 may overflow to inf or
// lose bits in subnormals); a trainer that wants no second rounding scales
// inside the optimizer instead (Optimizer::set_grad_scale, same multiply).
//
// Parameters whose grad is undefined are skipped (PyTorch skips grad None).
// Grads must be contiguous cpu tensors of dtype f32, bf16 or f16
// (InvalidArgument otherwise).
// Thread-safety: pure functions over the given grads; concurrent calls on
// disjoint parameters are safe.
#pragma once

#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::optim {

// PyTorch's epsilon in max_norm / (total_norm + eps).
inline constexpr double kClipEps = 1e-6;

// Sum of g^2 over every element of every defined grad (widened to f32), in
// double.
double local_sq_norm(const std::vector<nn::Parameter*>& params);

// min(1, max_norm / (total_norm + kClipEps)); 1 when total_norm is not finite
// (no scaling, see above). Needs a finite max_norm > 0.
double clip_factor(double total_norm, double max_norm);

// Multiplies every defined grad by factor (rounded to f32, as PyTorch's
// f32 clip coefficient), in f32: g = float(g) * float(factor), rounded back
// to nearest even for bf16/f16 grads. factor == 1 leaves the grads untouched.
void scale_grads(const std::vector<nn::Parameter*>& params, double factor);

// True when every element of every defined grad is finite (no inf, no NaN);
// true for an empty list. What a loss scaler's found_nonfinite is made of
// (negate it, then all-reduce across ranks: see loss_scaler.h). One pass
// over each grad's bits, no per-element branch (vectorizes); grads after the
// first non-finite one are validated but not scanned.
bool grads_finite(const std::vector<nn::Parameter*>& params);

// True when every element of every defined parameter value is finite; true
// for an empty list. The same vectorized scan as grads_finite, over the
// values (what a trainer checks before it trusts or saves a model).
bool values_finite(const std::vector<nn::Parameter*>& params);

// Clips the grads to a global L2 norm of max_norm (finite, > 0) and returns
// the norm they had before clipping.
double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm,
                      bool error_if_nonfinite = false);

}  // namespace meshtrain::optim
