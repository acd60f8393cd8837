// The per-shape choice of GEMM backend behind matmul (core/matmul.h,
// "Which backend runs a product"). Private to core: matmul.cc asks it which
// backend runs each f32 or half-precision product; gemm_choice.cc keeps the
// process's table, reads MESHTRAIN_GEMM_BACKEND and MESHTRAIN_GEMM_CACHE,
// and reads and writes the cache file.
//
//   const internal::GemmKey key{.in = DType::f32, .out = DType::f32, .m = 256, .n = 3072, .k = 768,
//                               .trans_a = false, .trans_b = false, .threads = 2};
//   MatmulBackend b = internal::gemm_backend_for(key, /*onednn_candidate=*/true,
//                                                [&](MatmulBackend c) { return seconds_of_one_run_on(c); });
#pragma once

#include <cstdint>
#include <functional>

#include "meshtrain/core/dtype.h"
#include "meshtrain/core/matmul.h"

namespace meshtrain::internal {

// A product as the choice sees it: dtypes, sizes, transposes as the memory
// lies (a transpose() view counts as what it is) and the GEMM thread count.
struct GemmKey {
  DType in = DType::f32, out = DType::f32;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int threads = 1;
  bool operator==(const GemmKey&) const = default;
};

// The size class of one dimension for the choice: the size itself up to 16,
// else the size rounded up to a quarter octave (17-32 by 4, 33-64 by 8,
// ..., 513-1024 by 128, ...). Products whose sizes change from call to call
// (a mixture of experts' rows per expert) then share a few classes, so the
// table measures a handful of shapes instead of every one (each new shape
// costs about 50 ms of measurement); sizes a model uses throughout (768,
// 3072, 1024) are their own class.
int64_t gemm_size_class(int64_t d);
// key with m, n and k replaced by their size classes: what the table and
// the threads' caches are keyed by (the entry keeps the first shape it
// measured).
GemmKey gemm_class_key(const GemmKey& key);

// Runs the product once on the given backend into scratch output and returns
// the seconds it took.
using GemmTimer = std::function<double(MatmulBackend)>;

// The fixed policy's backend for `key`: OpenBLAS for f32 weight gradients
// (op(a) = a^T, op(b) = b, as the memory lies) and wherever oneDNN may not
// run, oneDNN for the rest (`bench gemm` prices this rule too).
MatmulBackend fixed_rule_backend(const GemmKey& key, bool onednn_candidate);

// The backend that runs `key` under gemm_policy(): the forced one, the fixed
// rule, or (auto) the process's table entry, measured with `time_on` the
// first time the key's class (gemm_class_key) is seen (or read from the
// cache file). Other threads
// asking for a key being measured wait for the result, so every thread of a
// process runs a shape on the same backend. `onednn_candidate`: whether
// oneDNN may run this product at all (built, and not f64).
MatmulBackend gemm_backend_for(const GemmKey& key, bool onednn_candidate, const GemmTimer& time_on);

}  // namespace meshtrain::internal
