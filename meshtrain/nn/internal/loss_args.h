// Argument handling every loss shares (losses.cc, tensor_parallel.cc).
// Not for use outside nn.
#pragma once

#include <cstdint>
#include <optional>

#include "meshtrain/core/tensor.h"

namespace meshtrain::nn::internal {

// The normalizer to use: the given one (finite, > 0; else InvalidArgument
// naming op) or `fallback` (1 when fallback is 0: an empty input sums to 0).
double resolve_normalizer(std::optional<double> normalizer, double fallback, const char* op);

// InvalidArgument naming op when normalizer is 0 (no forward yet).
void check_forward_done(double normalizer, const char* op);

// Labels as an i64 tensor (N) into `out` (labels itself when already
// contiguous i64); InvalidArgument naming op for a wrong shape or dtype.
// The functional kernels check the range and name the row.
void read_labels(const Tensor& labels, int64_t n, int64_t classes, const char* op, Tensor& out);

}  // namespace meshtrain::nn::internal
