// One row's numerically stable softmax, shared by the CPU kernels (the
// cross-entropy loss and the reference attention). Not for use outside nn.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace meshtrain::nn::internal {

struct SoftmaxRow {
  float max;   // the row's largest input
  double sum;  // sum of exp(in - max), accumulated in double
};

// out[j] = softmax(in)[j] for j in [0, n) (n >= 1; out may be in). The row
// max is subtracted first, so no exp overflows.
inline SoftmaxRow softmax_row(const float* in, float* out, int64_t n) {
  const float m = *std::max_element(in, in + n);
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    out[j] = std::exp(in[j] - m);
    s += out[j];
  }
  const float inv = static_cast<float>(1.0 / s);
  for (int64_t j = 0; j < n; ++j) out[j] *= inv;
  return {m, s};
}

}  // namespace meshtrain::nn::internal
