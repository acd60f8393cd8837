#include "meshtrain/core/quantize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"

namespace meshtrain {
namespace {

std::vector<float> values(int64_t n, uint64_t key) {
  std::vector<float> x(static_cast<size_t>(n));
  fill_normal(x.data(), x.size(), 3, key, 0, 0.0f, 1.0f);
  // Blocks of very different magnitudes, an exact zero and a ten-fold outlier.
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] *= std::exp2(static_cast<float>((i / 97) % 9) - 4);
  if (n > 5) x[5] = 0.0f;
  if (n > 200) x[200] *= 10.0f;
  return x;
}

// Every element within scale / 2 of its value (up to f32 rounding of 1 /
// s, x / s and code * s: 3 qmax 2^-24 of the scale), for int8 and int4,
// block sizes that do and do not divide n, and n from 1 up.
TEST(BlockQuant, EveryValueWithinHalfItsBlocksScale) {
  for (int bits : {8, 4})
    for (int64_t block : {64, 128, 256, 2})
      for (int64_t n : std::vector<int64_t>{1, 2, 3, 63, 64, 65, 255, 256, 257, 1000, 4099, (int64_t{1} << 17) + 3}) {
        SCOPED_TRACE(::testing::Message() << "int" << bits << " block " << block << " n " << n);
        const BlockQuant q{.bits = bits, .block = block};
        const std::vector<float> x = values(n, static_cast<uint64_t>(n * 31 + block));
        std::vector<uint8_t> codes(q.code_bytes(n), 0xAB);
        std::vector<float> scales(static_cast<size_t>(q.blocks(n)));
        quantize_blocks(x.data(), n, q, codes.data(), scales.data());
        std::vector<float> y(static_cast<size_t>(n));
        dequantize_blocks(codes.data(), scales.data(), n, q, y.data());
        for (int64_t b = 0; b < q.blocks(n); ++b) {
          float amax = 0;
          for (int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
            amax = std::max(amax, std::fabs(x[static_cast<size_t>(i)]));
          }
          ASSERT_EQ(scales[static_cast<size_t>(b)], amax / static_cast<float>(q.qmax())) << "block " << b;
        }
        for (int64_t i = 0; i < n; ++i) {
          const float s = scales[static_cast<size_t>(i / block)];
          ASSERT_LE(std::fabs(x[static_cast<size_t>(i)] - y[static_cast<size_t>(i)]),
                    s / 2 * (1 + 6 * q.qmax() * std::exp2(-24.0f)))
              << "element " << i << " of scale " << s;
        }
        if (n > 5) {
          EXPECT_EQ(y[5], 0.0f);  // zero stays zero
        }
        // dequantize(accumulate) adds.
        std::vector<float> acc(static_cast<size_t>(n), 1.0f);
        dequantize_blocks(codes.data(), scales.data(), n, q, acc.data(), /*accumulate=*/true);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(acc[static_cast<size_t>(i)], 1.0f + y[static_cast<size_t>(i)]);
      }
}

TEST(BlockQuant, CodesAndSizesAreTheDocumentedLayout) {
  const BlockQuant q8{.bits = 8, .block = 4}, q4{.bits = 4, .block = 4};
  EXPECT_EQ(q8.code_bytes(5), 5u);
  EXPECT_EQ(q4.code_bytes(5), 3u);
  EXPECT_EQ(q4.blocks(5), 2);
  EXPECT_EQ(q4.wire_bytes(5), 3u + 2 * sizeof(float));
  // Block 0: max 7 -> scale 1 (int4): codes 7, -3, 0 (0.25 rounds to 0), 1.
  const std::vector<float> x = {7.0f, -3.0f, 0.25f, 1.0f, -2.0f};
  std::vector<uint8_t> c4(q4.code_bytes(5));
  std::vector<float> s4(2);
  quantize_blocks(x.data(), 5, q4, c4.data(), s4.data());
  EXPECT_EQ(s4[0], 1.0f);
  EXPECT_EQ(s4[1], 2.0f / 7.0f);
  EXPECT_EQ(c4[0], 0xD7);  // element 0 (7) low nibble, element 1 (-3 = 0xD) high
  EXPECT_EQ(c4[1], 0x10);  // 0.25 rounds to 0; 1
  EXPECT_EQ(c4[2] & 0xf, 0x9);  // -2 / (2/7) = -7 = 0x9
  std::vector<uint8_t> c8(5);
  std::vector<float> s8(2);
  quantize_blocks(x.data(), 5, q8, c8.data(), s8.data());
  EXPECT_EQ(static_cast<int8_t>(c8[0]), 127);
  EXPECT_EQ(static_cast<int8_t>(c8[1]), -54);  // -3 * 127 / 7 = -54.4
  EXPECT_EQ(static_cast<int8_t>(c8[4]), -127);
}

TEST(BlockQuant, NonFiniteBlocksDequantizeToNaNAndBadShapesAreRefused) {
  const BlockQuant q{.bits = 8, .block = 4};
  const std::vector<float> x = {1, std::numeric_limits<float>::infinity(), 2, 3, 4, 5, 6, 7};
  std::vector<uint8_t> c(8);
  std::vector<float> s(2), y(8);
  quantize_blocks(x.data(), 8, q, c.data(), s.data());
  dequantize_blocks(c.data(), s.data(), 8, q, y.data());
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(std::isnan(y[static_cast<size_t>(i)])) << i;
  EXPECT_EQ(y[7], 7.0f);  // the other block is unaffected
  EXPECT_THAT([&] { quantize_blocks(x.data(), 8, BlockQuant{.bits = 3}, c.data(), s.data()); },
              ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr("bits 3")));
  EXPECT_THAT([&] { quantize_blocks(x.data(), 8, BlockQuant{.bits = 4, .block = 3}, c.data(), s.data()); },
              ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr("4 bits with an even block")));
}

}  // namespace
}  // namespace meshtrain
