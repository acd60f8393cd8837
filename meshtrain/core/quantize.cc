#include "meshtrain/core/quantize.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "meshtrain/core/error.h"
#include "meshtrain/core/parallel_for.h"

namespace meshtrain {

namespace {

// max |x[i]| over [0, n) in 8 lanes (a pattern GCC vectorizes); NaN if any
// element is NaN, inf if any is infinite.
float abs_max(const float* x, int64_t n) {
  float m[8] = {};
  bool nan = false;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const float a = std::fabs(x[i + k]);
      m[k] = a > m[k] ? a : m[k];
      nan |= a != a;
    }
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    m[0] = a > m[0] ? a : m[0];
    nan |= a != a;
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  return *std::max_element(m, m + 8);
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

void quantize_blocks(const float* x, int64_t n, const BlockQuant& q, uint8_t* codes, float* scales) {
  q.check("quantize_blocks");
  const int qmax = q.qmax();
  parallel_for(q.blocks(n), block_grain(q), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * q.block, hi = std::min(n, lo + q.block);
      const float amax = abs_max(x + lo, hi - lo);
      const float s = std::isfinite(amax) ? amax / static_cast<float>(qmax) : std::numeric_limits<float>::quiet_NaN();
      scales[b] = s;
      const float inv = s > 0 ? 1.0f / s : 0.0f;  // NaN s: codes 0, the scale carries the NaN
      for (int64_t i = lo; i < hi; ++i) {
        // Round to nearest even by the 1.5 * 2^23 trick (|x / s| <= qmax):
        // no libm call, so the loop vectorizes.
        float c = (x[i] * inv + kRound) - kRound;
        c = std::min(std::max(c, static_cast<float>(-qmax)), static_cast<float>(qmax));
        const auto code = static_cast<int>(c == c ? c : 0.0f);
        if (q.bits == 8) {
          codes[i] = static_cast<uint8_t>(static_cast<int8_t>(code));
        } else {
          const auto nib = static_cast<uint8_t>(code & 0xf);
          uint8_t& byte = codes[i / 2];
          byte = (i % 2 == 0) ? static_cast<uint8_t>((byte & 0xf0) | nib) : static_cast<uint8_t>((byte & 0x0f) | (nib << 4));
        }
      }
    }
  });
}

void dequantize_blocks(const uint8_t* codes, const float* scales, int64_t n, const BlockQuant& q, float* out,
                       bool accumulate) {
  q.check("dequantize_blocks");
  parallel_for(q.blocks(n), block_grain(q), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * q.block, hi = std::min(n, lo + q.block);
      const float s = scales[b];
      for (int64_t i = lo; i < hi; ++i) {
        int code;
        if (q.bits == 8) {
          code = static_cast<int8_t>(codes[i]);
        } else {
          const int nib = (i % 2 == 0) ? (codes[i / 2] & 0xf) : (codes[i / 2] >> 4);
          code = nib >= 8 ? nib - 16 : nib;
        }
        const float v = static_cast<float>(code) * s;
        out[i] = accumulate ? out[i] + v : v;
      }
    }
  });
}

}  // namespace meshtrain
