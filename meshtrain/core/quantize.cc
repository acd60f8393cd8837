#include "meshtrain/core/quantize.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "meshtrain/core/error.h"
#include "meshtrain/core/parallel_for.h"

namespace meshtrain {

namespace {

// max |x[i]| over [0, n): NaN if any element is NaN, else inf if any is
// infinite. Compared as the bits of |x| (sign cleared, so signed 32-bit
// order is the order of the values, and every NaN is above inf): an
// integer max GCC vectorizes, where a float max with a NaN check does not.
[[gnu::always_inline]] inline float abs_max(const float* x, int64_t n) {
  int32_t m[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      int32_t b;
      std::memcpy(&b, x + i + k, sizeof b);
      b &= 0x7fffffff;
      m[k] = b > m[k] ? b : m[k];
    }
  for (; i < n; ++i) {
    int32_t b;
    std::memcpy(&b, x + i, sizeof b);
    b &= 0x7fffffff;
    m[0] = b > m[0] ? b : m[0];
  }
  const int32_t top = *std::max_element(m, m + 8);
  float out;
  std::memcpy(&out, &top, sizeof out);
  return out;
}

constexpr float kRound = 12582912.0f;  // 1.5 * 2^23

// Blocks per parallel_for piece: about 64 Ki values.
int64_t block_grain(const BlockQuant& q) { return std::max<int64_t>(1, (int64_t{1} << 16) / q.block); }

}  // namespace

void BlockQuant::check(const char* what) const {
  if ((bits != 8 && bits != 4) || block < 1 || (bits == 4 && block % 2 != 0))
    throw InvalidArgument(what, fmt::format("bits {}, block {}", bits, block),
                          "use 8 bits with a block of at least 1 value, or 4 bits with an even block (blocks own "
                          "whole bytes); 64 to 256 is usual");
}

namespace {

// Round to nearest even by the 1.5 * 2^23 trick (|v| <= qmax after the
// scale): no libm call, so the loops below vectorize. Finite inputs only.
[[gnu::always_inline]] inline int code_of(float x, float inv, float qmax) {
  float c = (x * inv + kRound) - kRound;
  c = std::min(std::max(c, -qmax), qmax);
  return static_cast<int>(c);
}

// One block's codes, with its scale's inverse (finite values).
[[gnu::always_inline]] inline void quantize_block8(const float* x, int64_t len, float inv, int8_t* out) {
  for (int64_t i = 0; i < len; ++i) out[i] = static_cast<int8_t>(code_of(x[i], inv, 127.0f));
}

[[gnu::always_inline]] inline void quantize_block4(const float* x, int64_t len, float inv, uint8_t* out) {
  const int64_t pairs = len / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const int a = code_of(x[2 * j], inv, 7.0f), b = code_of(x[2 * j + 1], inv, 7.0f);
    out[j] = static_cast<uint8_t>((a & 0xf) | ((b & 0xf) << 4));
  }
  if (len % 2 != 0) out[pairs] = static_cast<uint8_t>(code_of(x[len - 1], inv, 7.0f) & 0xf);
}

template <bool kAccumulate>
[[gnu::always_inline]] inline void dequantize_block8(const int8_t* codes, int64_t len, float s, float* out) {
  for (int64_t i = 0; i < len; ++i) {
    const float v = static_cast<float>(codes[i]) * s;
    out[i] = kAccumulate ? out[i] + v : v;
  }
}

template <bool kAccumulate>
[[gnu::always_inline]] inline void dequantize_block4(const uint8_t* codes, int64_t len, float s, float* out) {
  const int64_t pairs = len / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    // Sign-extend each nibble: shift it to the top of an int8, then back.
    const auto lo = static_cast<int8_t>(static_cast<uint8_t>(codes[j] << 4)) >> 4;
    const auto hi = static_cast<int8_t>(codes[j]) >> 4;
    const float a = static_cast<float>(lo) * s, b = static_cast<float>(hi) * s;
    out[2 * j] = kAccumulate ? out[2 * j] + a : a;
    out[2 * j + 1] = kAccumulate ? out[2 * j + 1] + b : b;
  }
  if (len % 2 != 0) {
    const float a = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(codes[pairs] << 4)) >> 4) * s;
    out[len - 1] = kAccumulate ? out[len - 1] + a : a;
  }
}

// Blocks [b0, b1), the helpers above inlined. Built for AVX2 too (chosen
// at load time by the CPU, GCC's target_clones): baseline x86-64 lacks the
// packing and conversion instructions these loops want; the results are
// the same either way. Not under ThreadSanitizer, whose run-time is not yet
// set up when the loader calls the clones' resolver (the program crashes).
#if defined(__SANITIZE_THREAD__)
#define MESHTRAIN_CLONES
#else
#define MESHTRAIN_CLONES __attribute__((target_clones("avx2", "default")))
#endif
MESHTRAIN_CLONES void quantize_range(const float* x, int64_t n, const BlockQuant& q, uint8_t* codes, float* scales,
                                     int64_t b0, int64_t b1) {
  const int qmax = q.qmax();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * q.block, len = std::min(n, lo + q.block) - lo;
    const float amax = abs_max(x + lo, len);
    uint8_t* out = codes + (q.bits == 8 ? lo : lo / 2);  // an int4 block is even: it starts on a byte
    if (!std::isfinite(amax)) {  // inf or NaN: the scale carries the NaN, codes 0
      scales[b] = std::numeric_limits<float>::quiet_NaN();
      std::fill(out, out + q.code_bytes(len), uint8_t{0});
      continue;
    }
    const float s = amax / static_cast<float>(qmax);
    scales[b] = s;
    const float inv = s > 0 ? 1.0f / s : 0.0f;
    if (q.bits == 8)
      quantize_block8(x + lo, len, inv, reinterpret_cast<int8_t*>(out));
    else
      quantize_block4(x + lo, len, inv, out);
  }
}

MESHTRAIN_CLONES void dequantize_range(const uint8_t* codes, const float* scales, int64_t n, const BlockQuant& q,
                                       float* out, bool accumulate, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * q.block, len = std::min(n, lo + q.block) - lo;
    const float s = scales[b];
    if (q.bits == 8) {
      const auto* c = reinterpret_cast<const int8_t*>(codes + lo);
      accumulate ? dequantize_block8<true>(c, len, s, out + lo) : dequantize_block8<false>(c, len, s, out + lo);
    } else {
      accumulate ? dequantize_block4<true>(codes + lo / 2, len, s, out + lo)
                 : dequantize_block4<false>(codes + lo / 2, len, s, out + lo);
    }
  }
}

}  // namespace

void quantize_blocks(const float* x, int64_t n, const BlockQuant& q, uint8_t* codes, float* scales) {
  q.check("quantize_blocks");
  parallel_for(q.blocks(n), block_grain(q),
               [&](int64_t b0, int64_t b1) { quantize_range(x, n, q, codes, scales, b0, b1); });
}

void dequantize_blocks(const uint8_t* codes, const float* scales, int64_t n, const BlockQuant& q, float* out,
                       bool accumulate) {
  q.check("dequantize_blocks");
  parallel_for(q.blocks(n), block_grain(q),
               [&](int64_t b0, int64_t b1) { dequantize_range(codes, scales, n, q, out, accumulate, b0, b1); });
}

}  // namespace meshtrain
