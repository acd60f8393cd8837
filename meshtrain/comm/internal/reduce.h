// Element-wise reduction kernels shared by the CPU engines.
//
//   const void* in[] = {a, b, c};
//   void* out[] = {x, y};
//   reduce(out, 2, in, 3, count, DType::f32, ReduceOp::sum, /*avg_divisor=*/3);
//
// Each output element is in[0] op in[1] op ... op in[n-1] in that fixed order
// (deterministic), written to every output. bf16/f16 accumulate in f32 and
// round once; f32 in f32; f64 in f64; integer sums and products wrap modulo
// 2^bits. avg divides the sum by avg_divisor (integers truncate toward zero).
// Outputs may alias inputs element for element (out[j] == in[k]), never
// partially. With `streaming`, outputs are written with non-temporal stores
// (no read-for-ownership of the destination, no cache pollution): use it when
// the data far exceeds the last-level cache. Streaming stores are weakly
// ordered; both functions end with a store fence, so a release that follows
// publishes them. Pure; thread-safe.
#pragma once

#include <cstddef>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::comm::internal {

void reduce(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
            DType dtype, ReduceOp op, int avg_divisor, bool streaming = false);

// memcpy, optionally with non-temporal stores (see above).
void copy(void* dst, const void* src, size_t bytes, bool streaming);

// Bytes per rank from which the CPU engines use streaming stores: beyond
// this, the working set of two ranks exceeds a typical last-level cache.
inline constexpr size_t kStreamingBytes = size_t{8} << 20;

}  // namespace meshtrain::comm::internal
