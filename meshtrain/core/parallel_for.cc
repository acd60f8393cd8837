#include "meshtrain/core/parallel_for.h"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "meshtrain/core/matmul.h"

namespace meshtrain {

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(blas_threads(), std::max<int64_t>(1, n / std::max<int64_t>(grain, 1)));
// ThreadSanitizer cannot see libgomp's (uninstrumented) barriers and would
// report the team's work as racing with the caller: a TSan build runs the
// ranges serially (the numbers are the same on any thread count).
#if defined(_OPENMP) && !defined(__SANITIZE_THREAD__)
  if (threads > 1) {
    const bool deterministic = deterministic_products();  // the caller's, in every range
    // The deterministic mode: ranges start at multiples of kSplitAlign, so
    // a vectorized kernel takes each element down the same path (its
    // vector body or its tail) on any thread count.
    const int64_t align = deterministic ? kSplitAlign : 1;
    const auto at = [&](int64_t t) { return t == threads ? n : n * t / threads / align * align; };
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
    for (int64_t t = 0; t < threads; ++t) {
      const bool previous = deterministic_products();
      set_deterministic_products(deterministic);
      if (at(t) < at(t + 1)) fn(at(t), at(t + 1));
      set_deterministic_products(previous);
    }
    return;
  }
#endif
  (void)threads;
  fn(0, n);
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace meshtrain
