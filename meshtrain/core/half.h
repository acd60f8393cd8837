// bf16 and f16 <-> f32 conversion. Round to nearest, ties to even; NaN stays
// NaN (quiet, sign and top payload bits kept), infinities stay infinities, f16
// subnormals are exact both ways and f32 values past the f16 range round to
// infinity. f32 <-> f16 equals x86's F16C instructions bit for bit (bulk
// conversions use them: internal/convert.h).
// Bit patterns travel as uint16_t. Pure functions; thread-safe.
#pragma once

#include <bit>
#include <cstdint>

namespace meshtrain {

inline float bf16_to_float(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);  // ties to even; carries into the exponent (up to inf)
  return static_cast<uint16_t>(x >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f)  // inf, or NaN made quiet with its payload kept (as x86's VCVTPH2PS)
    return std::bit_cast<float>(sign | 0x7f800000u | (man != 0 ? 0x00400000u : 0u) | (man << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24, exact in f32.
  const float v = static_cast<float>(man) * 0x1p-24f;
  return sign ? -v : v;
}

inline uint16_t float_to_f16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((ax >> 13) & 0x3ffu);  // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (halfway past max): inf
  if (ax < 0x38800000u) {
    // Below the smallest normal f16 (2^-14): the result is subnormal or zero.
    // Adding 0.5 (2^-1) aligns the f16 subnormal grid (2^-24) with the f32
    // ulp at that exponent, so the FPU's own RNE does the rounding.
    const float r = std::bit_cast<float>(ax) + 0.5f;
    return sign | static_cast<uint16_t>(std::bit_cast<uint32_t>(r) - 0x3f000000u);
  }
  // Normal: rebias the exponent (127 -> 15) and round 23 -> 10 mantissa bits.
  uint32_t m = ax - (112u << 23);
  m += 0xfffu + ((m >> 13) & 1u);
  return sign | static_cast<uint16_t>(m >> 13);
}

}  // namespace meshtrain
