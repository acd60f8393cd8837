// Bulk f32 <-> f16 conversion with the rounding of core/half.h, using the
// CPU's F16C instructions when it has them (checked once at run time) and
// the portable scalar code otherwise; bulk f32 -> bf16 rounding with
// AVX-512F integer arithmetic when present (half.h's rule 16 lanes at a time:
// not VCVTNEPS2BF16, which flushes subnormals). Results are bit-identical either way
// (x86's VCVTPS2PH with round-to-nearest-even, quiet NaNs keeping the top
// payload bits, overflow to inf and exact subnormals is the rule half.h
// implements; half_test checks every f16 pattern and edge-case floats).
//
//   internal::f32_to_f16(src, dst, n);
//
// Thread-safety: pure functions over caller-owned memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace meshtrain::internal {

void f32_to_f16(const float* in, uint16_t* out, size_t n);
void f16_to_f32(const uint16_t* in, float* out, size_t n);
// The scalar code alone (for tests comparing the two paths).
void f32_to_f16_portable(const float* in, uint16_t* out, size_t n);
void f16_to_f32_portable(const uint16_t* in, float* out, size_t n);
// True when the F16C path is in use.
bool have_f16c();

// out[i] = float_to_bf16(in[i]).
void f32_to_bf16(const float* in, uint16_t* out, size_t n);
// p[i] = bf16_to_float(float_to_bf16(p[i])), in place.
void round_f32_to_bf16(float* p, size_t n);
void f32_to_bf16_portable(const float* in, uint16_t* out, size_t n);
// out[i] = bf16_to_float(in[i]) (exact: the bits shifted up).
void bf16_to_f32(const uint16_t* in, float* out, size_t n);
// True when the AVX-512 bf16 path is in use.
bool have_avx512_bf16_rounding();

}  // namespace meshtrain::internal
