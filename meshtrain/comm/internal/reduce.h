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
// partially. Pure; thread-safe.
#pragma once

#include <cstddef>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::comm::internal {

void reduce(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
            DType dtype, ReduceOp op, int avg_divisor);

}  // namespace meshtrain::comm::internal
