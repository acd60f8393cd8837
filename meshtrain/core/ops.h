// CPU kernels over Tensor: matrix products (core/matmul.h, included here),
// element-wise arithmetic and reductions. The building blocks of nn's
// forward/backward.
//
//   Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
//   Tensor b = Tensor::full({3, 2}, 0.5, DType::f32);
//   Tensor c = matmul(a, b);                    // (2, 2): [[3, 3], [7.5, 7.5]]
//   matmul(a, b, c, false, false, 1.0, 1.0);    // c += a @ b
//   axpy(-0.1, c, c);                           // c -= 0.1 * c
//   double norm = l2_norm(c);
//
// Outputs are `const Tensor&`: a Tensor is a handle, and const applies to the
// handle, not to the elements it points at. This lets a view be an output:
// add(a, b, c.narrow(0, 0, 2)) writes rows 0..1 of c.
//
// Shapes and dtypes are checked (InvalidArgument naming the op, the shapes and
// a hint); there is no broadcasting and no type promotion: operands and
// outputs have one shape and one dtype. Inputs and outputs may be any strided
// views. An output may be the very same view as an input (in place), but not
// a partly overlapping one (InvalidArgument). Tensors must be on the cpu
// (Unsupported otherwise).
//
// Numerics: f32 and f64 compute in their own precision; bf16 and f16 compute
// in float and round once to the output (RNE); integers wrap (two's complement)
// on overflow. Reductions accumulate in double in row-major order, so results
// are deterministic for a given shape, dtype and strides.
//
// Thread-safety: functions may run concurrently on disjoint outputs. matmul's
// backends and threads: core/matmul.h.
#pragma once

#include "meshtrain/core/matmul.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain {

// out = a + b, element-wise; any dtype.
void add(const Tensor& a, const Tensor& b, const Tensor& out);
// out = a * b, element-wise; any dtype.
void mul(const Tensor& a, const Tensor& b, const Tensor& out);
// y += alpha * x. For integer dtypes alpha must be a whole number.
void axpy(double alpha, const Tensor& x, const Tensor& y);
// dst += src element-wise, where each of dst and src may be f32, bf16 or f16
// (mixed is fine; contiguous, same numel): the sum is formed in f32 and
// rounded once to dst's dtype. Gradient accumulation across precisions.
void accumulate(const Tensor& src, const Tensor& dst);
// x *= alpha, in place. For integer dtypes alpha must be a whole number.
void scale(const Tensor& x, double alpha);
// Rounds every element of the f32 tensor x, in place, to the nearest value
// representable in `dtype` (bf16 or f16, ties to even, overflow to inf, as
// Tensor::to), keeping it f32: x.copy_from(x.to(dtype)) without the copy.
// Emulates a half-precision result while computing in f32. f32 is a no-op.
void round_to(const Tensor& x, DType dtype);

// True when no element is inf or NaN; x contiguous f32, bf16 or f16. A
// branch-free scan of the exponent bits (vectorizes on baseline x86-64).
bool all_finite(const Tensor& x);
// Sum of float(x)^2 accumulated in double in element order (no rescaling);
// x contiguous f32, bf16 or f16. inf/NaN propagate.
double sum_of_squares(const Tensor& x);
// Sum of all elements (0 for an empty tensor).
double sum(const Tensor& x);
// Largest element; NaN if any element is NaN. Throws InvalidArgument when empty.
double max(const Tensor& x);
// sqrt(sum of squares), without overflow or underflow in the accumulation
// (f64 inputs are rescaled by their largest magnitude when needed).
double l2_norm(const Tensor& x);

}  // namespace meshtrain
