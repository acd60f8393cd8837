// A rank's element-wise work over its compute threads: parallel_for splits
// [0, n) into contiguous ranges, one per thread of the count
// set_blas_threads chose for the GEMMs (matmul.h), and runs fn(begin, end)
// on each (OpenMP threads; serially when that count is 1, n < grain, or the
// build has no OpenMP or is a ThreadSanitizer build, which cannot see
// OpenMP's barriers). For element-wise kernels whose result per element
// does not depend on the split (an optimizer's update), so the numbers are
// the same on any thread count.
//
//   parallel_for(p.numel(), 1 << 16, [&](int64_t b, int64_t e) { update(p + b, g + b, e - b); });
//
// Thread-safety: fn runs concurrently on disjoint ranges; it must not throw.
#pragma once

#include <cstdint>
#include <functional>

namespace meshtrain {

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
// Under set_deterministic_products (core/matmul.h), parallel_for's ranges
// start at multiples of this many elements (more than any vector width).
inline constexpr int64_t kSplitAlign = 64;

// The cores this process may run on: its affinity mask (hardware
// concurrency when that cannot be read), at least 1.
int available_cores();

}  // namespace meshtrain
