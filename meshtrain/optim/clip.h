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
// Parameters whose grad is undefined are skipped (PyTorch skips grad None).
// Grads must be contiguous f32 cpu tensors (InvalidArgument otherwise).
// Thread-safety: pure functions over the given grads; concurrent calls on
// disjoint parameters are safe.
#pragma once

#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::optim {

// PyTorch's epsilon in max_norm / (total_norm + eps).
inline constexpr double kClipEps = 1e-6;

// Sum of g^2 over every element of every defined grad, in double.
double local_sq_norm(const std::vector<nn::Parameter*>& params);

// min(1, max_norm / (total_norm + kClipEps)); 1 when total_norm is not finite
// (no scaling, see above). Needs a finite max_norm > 0.
double clip_factor(double total_norm, double max_norm);

// Multiplies every defined grad by factor (rounded to f32, as PyTorch's
// f32 clip coefficient). factor == 1 leaves the grads untouched.
void scale_grads(const std::vector<nn::Parameter*>& params, double factor);

// Clips the grads to a global L2 norm of max_norm (finite, > 0) and returns
// the norm they had before clipping.
double clip_grad_norm(const std::vector<nn::Parameter*>& params, double max_norm,
                      bool error_if_nonfinite = false);

}  // namespace meshtrain::optim
