// One row's numerically stable softmax, shared by the CPU kernels (the
// cross-entropy loss and the reference attention). Not for use outside nn.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "meshtrain/nn/internal/fast_math.h"

namespace meshtrain::nn::internal {

struct SoftmaxRow {
  float max;   // the row's largest input
  double sum;  // sum of exp(in - max), accumulated in double
};

// out[j] = softmax(in)[j] for j in [0, n) (n >= 1; out may be in). The row
// max is subtracted first, so no exp overflows; exp is exp_approx
// (fast_math.h), the sum sum_f64's (double, fixed order).
inline SoftmaxRow softmax_row(const float* in, float* out, int64_t n) {
  const float m = max_f32(in, n);
  map_f32(in, out, n, [m](auto v) { return exp_approx(v - m); });
  const double s = sum_f64(out, n);
  const float inv = static_cast<float>(1.0 / s);
  map_f32(out, out, n, [inv](auto v) { return v * inv; });
  return {m, s};
}

}  // namespace meshtrain::nn::internal
