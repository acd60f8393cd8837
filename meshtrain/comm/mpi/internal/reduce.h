// Element-wise reduction kernels of the MPI engine: the ring reduce-scatter's
// combine step and the user-defined MPI ops for bf16/f16. Internal: include
// only from meshtrain/comm/mpi/.
//
// A buffer of `dtype` elements is either in its own encoding or "wide": f32
// for bf16/f16 (so partial sums are rounded once), the dtype itself for every
// other type. Integer sums and products wrap modulo 2^bits; avg combines as
// sum and divides once, at the end (integers truncate toward zero). max/min of
// floats propagate NaN. Pure functions; thread-safe; deterministic.
#pragma once

#include <cstddef>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/dtype.h"

namespace meshtrain::comm::mpi::internal {

// Bytes per element of the wide encoding: 4 for bf16/f16, dtype_size otherwise.
size_t wide_size(DType dtype);

// out[i] = a[i] (op) b[i], divided by `divisor` when op is avg and divisor > 0.
// a is wide when a_wide, out is wide when out_wide, b is always in dtype's
// encoding. out may alias a or b exactly (same encoding), not partially.
void combine(DType dtype, ReduceOp op, const void* a, bool a_wide, const void* b, void* out,
             bool out_wide, size_t n, int divisor);

// buf[i] /= divisor in dtype's encoding (avg after a sum). bf16/f16 divide in
// f32 and round.
void divide(DType dtype, void* buf, size_t n, int divisor);

// inout[i] = in[i] (op) inout[i] for bf16/f16 words, computed in f32 and
// rounded: the body of the engine's user-defined MPI ops. op is not avg.
void reduce_16bit(DType dtype, ReduceOp op, const void* in, void* inout, size_t n);

}  // namespace meshtrain::comm::mpi::internal
