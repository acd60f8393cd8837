// Block quantization: f32 values as symmetric int8 or int4 codes with one f32
// scale per block of `block` values, the scheme ZeRO++'s quantized
// communication sends (qwZ weights, qgZ gradients: parallel/zeropp.h).
//
//   const BlockQuant q{.bits = 8, .block = 128};
//   std::vector<uint8_t> codes(q.code_bytes(n));
//   std::vector<float> scales(q.blocks(n));
//   quantize_blocks(x, n, q, codes.data(), scales.data());
//   dequantize_blocks(codes.data(), scales.data(), n, q, y);   // |x - y| <= scale / 2 per element
//
// Per block b (elements [b block, min(n, (b + 1) block))): scale s =
// max |x| / qmax (qmax = 127 for int8, 7 for int4), code = round-to-nearest
// (ties to even) of x / s in [-qmax, qmax], dequantized value code * s. So
// |x - dequant| <= s / 2 up to f32 rounding of 1 / s, x / s and code * s:
// at most 3 qmax 2^-24 s more (core/quantize_test.cc checks it). A block
// of zeros has s = 0 and codes 0; a block holding inf or NaN has a NaN
// scale, so every value of it dequantizes to NaN (a gradient check still
// sees the overflow). Codes: int8 one byte per element (two's complement);
// int4 two per byte, element i in the low nibble of byte i / 2 when i is
// even, the high nibble when odd (two's complement nibbles). The last
// block may be short; nothing is padded.
//
// Thread-safety: pure functions of their arguments; long inputs use the
// calling thread's compute threads (parallel_for.h), which changes no value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace meshtrain {

struct BlockQuant {
  int bits = 8;         // 8 or 4
  int64_t block = 128;  // values per scale, >= 1 (even for int4: a block owns whole bytes)
  int qmax() const { return bits == 8 ? 127 : 7; }
  // ceil(n / block) scales.
  int64_t blocks(int64_t n) const { return (n + block - 1) / block; }
  // n bytes (int8) or ceil(n / 2) (int4).
  size_t code_bytes(int64_t n) const {
    return bits == 8 ? static_cast<size_t>(n) : static_cast<size_t>((n + 1) / 2);
  }
  // Codes and scales of n values, as one message carries them.
  size_t wire_bytes(int64_t n) const { return code_bytes(n) + static_cast<size_t>(blocks(n)) * sizeof(float); }
  // InvalidArgument naming `what` unless bits is 8 with block >= 1, or 4
  // with an even block.
  void check(const char* what) const;
};

// codes (q.code_bytes(n)), scales (q.blocks(n)) of x[0, n).
void quantize_blocks(const float* x, int64_t n, const BlockQuant& q, uint8_t* codes, float* scales);
// out[i] = code_i * scale (accumulate: out[i] += it).
void dequantize_blocks(const uint8_t* codes, const float* scales, int64_t n, const BlockQuant& q, float* out,
                       bool accumulate = false);

}  // namespace meshtrain
