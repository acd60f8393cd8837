// Exhaustive tests of half.h: every one of the 65536 bit patterns of bf16 and
// f16 against a reference built from the bit fields in double arithmetic.
#include "meshtrain/core/half.h"
#include "meshtrain/core/internal/convert.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <vector>

namespace meshtrain {
namespace {

// One 16-bit format: field widths and the functions under test.
struct Format {
  const char* name;
  int exp_bits;
  int man_bits;
  float (*to_float)(uint16_t);
  uint16_t (*from_float)(float);

  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  uint16_t exp_mask() const { return static_cast<uint16_t>(((1u << exp_bits) - 1) << man_bits); }
  uint16_t man_mask() const { return static_cast<uint16_t>((1u << man_bits) - 1); }
  uint16_t inf_bits() const { return exp_mask(); }
  uint16_t max_finite_bits() const { return static_cast<uint16_t>(exp_mask() - 1); }
  bool is_nan(uint16_t h) const { return (h & exp_mask()) == exp_mask() && (h & man_mask()) != 0; }
  bool is_inf(uint16_t h) const { return (h & 0x7fffu) == exp_mask(); }

  // The value of a finite pattern, from its fields: sign * man * 2^(e - bias - man_bits).
  double reference(uint16_t h) const {
    const int sign = (h >> 15) ? -1 : 1;
    const int e = (h >> man_bits) & ((1 << exp_bits) - 1);
    const int m = h & man_mask();
    const double mag = e == 0 ? std::ldexp(m, 1 - bias() - man_bits)                        // subnormal
                              : std::ldexp((1 << man_bits) + m, e - bias() - man_bits);  // normal
    return sign * mag;
  }
};

// gtest prints parameters in failure messages; show the format's name.
void PrintTo(const Format& f, std::ostream* os) { *os << f.name; }

const Format kBf16{"bf16", 8, 7, bf16_to_float, float_to_bf16};
const Format kF16{"f16", 5, 10, f16_to_float, float_to_f16};

class HalfTest : public ::testing::TestWithParam<Format> {};

TEST_P(HalfTest, ToFloatMatchesBitFieldReference) {
  const Format& f = GetParam();
  int nans = 0, infs = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float v = f.to_float(h);
    const bool negative = (h & 0x8000u) != 0;
    if (f.is_nan(h)) {
      ASSERT_TRUE(std::isnan(v)) << f.name << " 0x" << std::hex << i;
      ASSERT_EQ(std::signbit(v), negative) << f.name << " 0x" << std::hex << i;
      ++nans;
    } else if (f.is_inf(h)) {
      ASSERT_TRUE(std::isinf(v)) << f.name << " 0x" << std::hex << i;
      ASSERT_EQ(std::signbit(v), negative) << f.name << " 0x" << std::hex << i;
      ++infs;
    } else {
      ASSERT_EQ(static_cast<double>(v), f.reference(h)) << f.name << " 0x" << std::hex << i;
      ASSERT_EQ(std::signbit(v), negative) << f.name << " 0x" << std::hex << i;  // -0 stays -0
    }
  }
  EXPECT_EQ(infs, 2);
  EXPECT_EQ(nans, 2 * f.man_mask());
}

TEST_P(HalfTest, RoundTripIsIdentityAndNaNStaysNaN) {
  const Format& f = GetParam();
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const uint16_t back = f.from_float(f.to_float(h));
    if (f.is_nan(h)) {
      ASSERT_TRUE(f.is_nan(back)) << f.name << " 0x" << std::hex << i << " -> 0x" << back;
      ASSERT_EQ(back & 0x8000u, h & 0x8000u) << f.name << " 0x" << std::hex << i;
    } else {
      ASSERT_EQ(back, h) << f.name << " 0x" << std::hex << i;
    }
  }
}

// Float NaNs with payloads only in the bits that conversion drops must not
// become infinities.
TEST_P(HalfTest, FloatNaNsStayNaN) {
  const Format& f = GetParam();
  for (uint32_t payload : {1u, 2u, 0x1fffu, 0x400000u, 0x7fffffu}) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float nan = std::bit_cast<float>(sign | 0x7f800000u | payload);
      ASSERT_TRUE(std::isnan(nan));
      const uint16_t h = f.from_float(nan);
      EXPECT_TRUE(f.is_nan(h)) << f.name << " payload 0x" << std::hex << payload;
      EXPECT_EQ(h & 0x8000u, sign >> 16);
    }
  }
  EXPECT_EQ(f.from_float(std::numeric_limits<float>::infinity()), f.inf_bits());
  EXPECT_EQ(f.from_float(-std::numeric_limits<float>::infinity()), f.inf_bits() | 0x8000u);
}

// For every pair of adjacent values (including max finite and inf, whose
// "value" for rounding is max + one ulp): the midpoint goes to the pattern
// with the even mantissa, and one float ulp either side goes to the nearer.
TEST_P(HalfTest, RoundsToNearestTiesToEvenBetweenEveryAdjacentPair) {
  const Format& f = GetParam();
  const double ulp_at_max = f.reference(f.max_finite_bits()) - f.reference(f.max_finite_bits() - 1);
  for (uint16_t h = 0; h < f.inf_bits(); ++h) {
    const auto next = static_cast<uint16_t>(h + 1);
    const double lo = f.reference(h);
    const double hi = next == f.inf_bits() ? lo + ulp_at_max : f.reference(next);
    const double mid = (lo + hi) / 2;
    const auto mid_f = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(mid_f), mid) << "midpoint must be exact in float";
    const uint16_t even = (h % 2 == 0) ? h : next;
    for (uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
      const float s = sign ? -1.0f : 1.0f;
      ASSERT_EQ(f.from_float(s * mid_f), even | sign) << f.name << " mid after 0x" << std::hex << h;
      ASSERT_EQ(f.from_float(s * std::nextafter(mid_f, 0.0f)), h | sign)
          << f.name << " below mid after 0x" << std::hex << h;
      ASSERT_EQ(f.from_float(s * std::nextafter(mid_f, INFINITY)), next | sign)
          << f.name << " above mid after 0x" << std::hex << h;
    }
  }
}

// A reference rounding: binary search in the table of all non-negative
// values (inf counted as max + ulp), nearest wins, ties go to the even pattern.
uint16_t reference_round(const Format& f, const std::vector<double>& table, float x) {
  if (std::isnan(x)) return 0;  // callers skip NaN
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= table.back()) return f.inf_bits() | sign;
  const auto it = std::upper_bound(table.begin(), table.end(), a);  // first value > a
  const auto hi = static_cast<uint16_t>(it - table.begin());
  const auto lo = static_cast<uint16_t>(hi - 1);
  const double dlo = a - table[lo], dhi = table[hi] - a;
  uint16_t r;
  if (dlo < dhi) r = lo;
  else if (dhi < dlo) r = hi;
  else r = (lo % 2 == 0) ? lo : hi;
  return r | sign;
}

// Every 1021st float bit pattern (about 4.2M, all exponents and signs) against
// the reference rounding.
TEST_P(HalfTest, SampledFloatsMatchReferenceRounding) {
  const Format& f = GetParam();
  std::vector<double> table;
  for (uint16_t h = 0; h < f.inf_bits(); ++h) table.push_back(f.reference(h));
  table.push_back(table.back() + (table.back() - table[table.size() - 2]));  // inf as max + ulp
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 1021) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(bits));
    if (std::isnan(x)) continue;
    ASSERT_EQ(f.from_float(x), reference_round(f, table, x))
        << f.name << " float bits 0x" << std::hex << bits;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, HalfTest, ::testing::Values(kBf16, kF16),
                         [](const auto& info) { return std::string(info.param.name); });

// The bulk conversions (F16C when the CPU has it) equal the scalar code bit
// for bit: every f16 pattern, and every 97th f32 pattern including NaNs with
// payloads, at lengths that exercise the vector body and the scalar tail.
TEST(F16Test, BulkConversionEqualsScalarCode) {
  std::vector<uint16_t> h(65536);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i);
  std::vector<float> fast(h.size()), slow(h.size());
  internal::f16_to_f32(h.data(), fast.data(), h.size() - 3);  // odd length: a tail
  internal::f16_to_f32_portable(h.data(), slow.data(), h.size() - 3);
  for (size_t i = 0; i + 3 < h.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(fast[i]), std::bit_cast<uint32_t>(slow[i])) << "f16 0x" << std::hex << i;
  std::vector<float> x;
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 97) x.push_back(std::bit_cast<float>(static_cast<uint32_t>(bits)));
  for (float v : {65504.0f, 65519.99f, 65520.0f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x1p-14f, -0.0f})
    x.push_back(v);
  std::vector<uint16_t> hf(x.size()), hs(x.size());
  internal::f32_to_f16(x.data(), hf.data(), x.size());
  internal::f32_to_f16_portable(x.data(), hs.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(hf[i], hs[i]) << "float bits 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
  std::printf("F16C in use: %s\n", internal::have_f16c() ? "yes" : "no");
}

// The bulk bf16 rounding (AVX-512 when present) equals the scalar code bit
// for bit on every 97th f32 pattern (NaNs with payloads, subnormals, values
// rounding up to inf), in both its forms, with a scalar tail.
TEST(Bf16Test, BulkConversionEqualsScalarCode) {
  std::vector<float> x;
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 97) x.push_back(std::bit_cast<float>(static_cast<uint32_t>(bits)));
  for (uint32_t b : {0x7f7fffffu, 0x7f7f8000u, 0x00008000u, 0x00018000u, 0x7f800001u, 0xff800000u, 0x80000000u})
    x.push_back(std::bit_cast<float>(b));
  x.push_back(1.0f);  // 1 + 7 * 16 + ...: an odd count leaves a tail
  std::vector<uint16_t> fast(x.size()), slow(x.size());
  internal::f32_to_bf16(x.data(), fast.data(), x.size());
  internal::f32_to_bf16_portable(x.data(), slow.data(), x.size());
  std::vector<float> rounded = x;
  internal::round_f32_to_bf16(rounded.data(), rounded.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(fast[i], slow[i]) << "float bits 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
    ASSERT_EQ(std::bit_cast<uint32_t>(rounded[i]), uint32_t{slow[i]} << 16)
        << "float bits 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
  }
  std::printf("AVX-512 bf16 rounding in use: %s\n", internal::have_avx512_bf16_rounding() ? "yes" : "no");
}

TEST(F16Test, OverflowsToInfinityHalfwayPastMax) {
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // tie; 0x7bff is odd, so up to inf
  EXPECT_EQ(float_to_f16(-65520.0f), 0xfc00);
  EXPECT_EQ(float_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::max()), 0x7c00);
}

TEST(F16Test, SubnormalsRoundOnTheirOwnGrid) {
  const float tiny = 0x1p-24f;  // smallest f16 subnormal
  EXPECT_EQ(f16_to_float(0x0001), tiny);
  EXPECT_EQ(f16_to_float(0x03ff), 1023 * tiny);
  EXPECT_EQ(float_to_f16(tiny), 0x0001);
  EXPECT_EQ(float_to_f16(0.5f * tiny), 0x0000);                          // tie -> even (0)
  EXPECT_EQ(float_to_f16(std::nextafter(0.5f * tiny, 1.0f)), 0x0001);    // just above the tie
  EXPECT_EQ(float_to_f16(1.5f * tiny), 0x0002);                          // tie -> even (2)
  EXPECT_EQ(float_to_f16(2.5f * tiny), 0x0002);                          // tie -> even (2)
  EXPECT_EQ(float_to_f16(1023.5f * tiny), 0x0400);                       // up into the normals
  EXPECT_EQ(float_to_f16(-3 * tiny), 0x8003);
  EXPECT_EQ(float_to_f16(0x1p-14f), 0x0400);                             // smallest normal
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_f16(-std::numeric_limits<float>::denorm_min()), 0x8000);
}

TEST(Bf16Test, KnownValues) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);                 // tie -> even
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f + 0x1p-23f), 0x3f81);      // just above
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);             // tie -> even (up)
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(bf16_to_float(0x7f7f), 0x1.fep127f);                     // bf16 max
}

}  // namespace
}  // namespace meshtrain
