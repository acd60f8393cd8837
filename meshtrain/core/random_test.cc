#include "meshtrain/core/random.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <set>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"

namespace meshtrain {
namespace {

// Bitwise equality of n values (memcmp needs non-null pointers even for n = 0).
template <typename T>
bool same_bits(const T* a, const T* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

// Known-answer vectors from Random123 (kat_vectors, philox4x32_10).
TEST(PhiloxTest, Random123KnownAnswers) {
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// FNV-1a 64 test vectors (Fowler/Noll/Vo reference suite).
TEST(KeyFromNameTest, IsFnv1a64) {
  EXPECT_EQ(key_from_name(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(key_from_name("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(key_from_name("foobar"), 0x85944171f73967e8ull);
  EXPECT_NE(key_from_name("layers.0.w"), key_from_name("layers.1.w"));
}

// Pins the documented stream layout: block i / 4, counter (block lo, block
// hi, key lo, key hi), Philox key (seed lo, seed hi), word i % 4.
TEST(StreamLayoutTest, UniformUsesDocumentedCounterLayout) {
  const uint64_t seed = 0x0123456789abcdefull, key = 0xfedcba9876543210ull;
  for (uint64_t index : {uint64_t{0}, uint64_t{3}, uint64_t{4}, uint64_t{1001}, (uint64_t{5} << 34) + 2}) {
    const uint64_t block = index / 4;
    const PhiloxCounter w = philox4x32_10(
        {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0x76543210u, 0xfedcba98u},
        {0x89abcdefu, 0x01234567u});
    EXPECT_EQ(uniform_at(seed, key, index, 0.0, 1.0), w[index % 4] * 0x1p-32) << index;
    EXPECT_EQ(uniform_at(seed, key, index, -2.0, 6.0), -2.0 + 8.0 * (w[index % 4] * 0x1p-32)) << index;
  }
}

TEST(StreamLayoutTest, NormalIsBoxMullerOnThePairOfItsBlock) {
  const uint64_t seed = 7, key = key_from_name("w");
  for (uint64_t index = 0; index < 8; ++index) {
    const uint64_t block = index / 4;
    const PhiloxCounter w = philox4x32_10(
        {static_cast<uint32_t>(block), 0, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)}, {7, 0});
    const size_t p = (index % 4) / 2;
    const double u1 = (w[2 * p] + 0.5) * 0x1p-32, u2 = w[2 * p + 1] * 0x1p-32;
    const double r = std::sqrt(-2.0 * std::log(u1)), theta = 2.0 * std::numbers::pi * u2;
    const double z = index % 2 == 0 ? r * std::cos(theta) : r * std::sin(theta);
    EXPECT_EQ(normal_at(seed, key, index, 1.0, 3.0), 1.0 + 3.0 * z) << index;
  }
}

// A fill of [a, b) equals that slice of the full fill, bit for bit.
TEST(LayoutInvarianceTest, SliceOfFullFillEqualsFillOfSlice) {
  constexpr size_t kN = 1000;
  const uint64_t seed = 42, key = key_from_name("layers.3.attn.qkv");
  std::vector<float> fu(kN), fn(kN);
  std::vector<double> du(kN), dn(kN);
  fill_uniform(fu.data(), kN, seed, key, 0, -0.1f, 0.1f);
  fill_normal(fn.data(), kN, seed, key, 0, 0.0f, 0.02f);
  fill_uniform(du.data(), kN, seed, key, 0, -0.1, 0.1);
  fill_normal(dn.data(), kN, seed, key, 0, 0.0, 0.02);
  std::vector<std::pair<size_t, size_t>> ranges{{0, 0}, {0, 1}, {1, 2}, {3, 4}, {3, 5}, {0, kN}, {999, 1000}};
  for (size_t a = 0; a < 40; ++a)
    for (size_t len : {1, 2, 3, 5, 7, 8, 13, 64, 333}) ranges.emplace_back(a * 23 % 600, a * 23 % 600 + len);
  for (auto [a, b] : ranges) {
    const size_t n = b - a;
    std::vector<float> su(n), sn(n);
    std::vector<double> sdu(n), sdn(n);
    fill_uniform(su.data(), n, seed, key, a, -0.1f, 0.1f);
    fill_normal(sn.data(), n, seed, key, a, 0.0f, 0.02f);
    fill_uniform(sdu.data(), n, seed, key, a, -0.1, 0.1);
    fill_normal(sdn.data(), n, seed, key, a, 0.0, 0.02);
    EXPECT_TRUE(same_bits(su.data(), fu.data() + a, n)) << a << ".." << b;
    EXPECT_TRUE(same_bits(sn.data(), fn.data() + a, n)) << a << ".." << b;
    EXPECT_TRUE(same_bits(sdu.data(), du.data() + a, n)) << a << ".." << b;
    EXPECT_TRUE(same_bits(sdn.data(), dn.data() + a, n)) << a << ".." << b;
  }
}

// The f32 fill is the canonical double value rounded once.
TEST(LayoutInvarianceTest, FloatFillIsRoundedDoubleFill) {
  constexpr size_t kN = 4096;
  std::vector<float> f(kN);
  std::vector<double> d(kN);
  fill_normal(f.data(), kN, 1, 2, 1ull << 40, 0.5f, 2.0f);
  fill_normal(d.data(), kN, 1, 2, 1ull << 40, 0.5, 2.0);
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(f[i], static_cast<float>(d[i])) << i;
    ASSERT_EQ(d[i], normal_at(1, 2, (1ull << 40) + i, 0.5, 2.0)) << i;
  }
}

TEST(StatisticsTest, UniformMeanAndVariance) {
  constexpr size_t kN = 1000000;
  const double lo = -1.0, hi = 3.0;
  std::vector<float> v(kN);
  fill_uniform(v.data(), kN, 123, key_from_name("u"), 0, static_cast<float>(lo), static_cast<float>(hi));
  double s = 0, s2 = 0;
  for (float x : v) {
    ASSERT_GE(x, lo);
    ASSERT_LT(x, hi);
    s += x;
    s2 += static_cast<double>(x) * x;
  }
  const double mean = s / kN, var = s2 / kN - mean * mean;
  // Standard errors: mean 4/sqrt(12 n) = 1.2e-3; variance about 1.2e-3. Allow 5.
  EXPECT_NEAR(mean, 1.0, 6e-3);
  EXPECT_NEAR(var, 16.0 / 12.0, 6e-3);
}

TEST(StatisticsTest, NormalMeanStdAndShape) {
  constexpr size_t kN = 1000000;
  std::vector<double> v(kN);
  fill_normal(v.data(), kN, 321, key_from_name("n"), 17, 0.5, 2.0);
  double s = 0, s2 = 0;
  size_t within1 = 0;
  for (double x : v) {
    s += x;
    s2 += x * x;
    within1 += std::fabs(x - 0.5) < 2.0;
  }
  const double mean = s / kN, sd = std::sqrt(s2 / kN - mean * mean);
  // Standard errors: mean 2e-3, std 1.4e-3, P(|z| < 1) 4.7e-4. Allow 5.
  EXPECT_NEAR(mean, 0.5, 1e-2);
  EXPECT_NEAR(sd, 2.0, 7e-3);
  EXPECT_NEAR(static_cast<double>(within1) / kN, 0.682689, 2.5e-3);
}

TEST(UniformBoundsTest, ValuesStayBelowHiEvenWhenRoundingWouldReachIt) {
  // Only 16 floats lie in [1, 1 + 2^-19): rounding pushes many draws to hi.
  constexpr size_t kN = 100000;
  std::vector<float> v(kN);
  const float lo = 1.0f, hi = 1.0f + 0x1p-19f;
  fill_uniform(v.data(), kN, 9, 9, 0, lo, hi);
  std::set<float> distinct;
  for (float x : v) {
    ASSERT_GE(x, lo);
    ASSERT_LT(x, hi);
    distinct.insert(x);
  }
  EXPECT_EQ(distinct.size(), 16u);
  std::vector<float> unit(kN);
  fill_uniform(unit.data(), kN, 1, 1, 0, 0.0f, 1.0f);
  for (float x : unit) ASSERT_TRUE(x >= 0.0f && x < 1.0f) << x;
}

TEST(StreamsTest, DifferentKeysAndSeedsGiveDifferentStreams) {
  constexpr size_t kN = 10000;
  auto draw = [](uint64_t seed, uint64_t key) {
    std::vector<float> v(kN);
    fill_uniform(v.data(), kN, seed, key, 0, 0.0f, 1.0f);
    return v;
  };
  const auto base = draw(1, 2);
  EXPECT_EQ(base, draw(1, 2));  // deterministic
  for (auto [seed, key] : {std::pair<uint64_t, uint64_t>{1, 3}, {2, 2}, {2, 1}, {1, 2 + (1ull << 32)},
                           {1 + (1ull << 32), 2}}) {
    const auto other = draw(seed, key);
    size_t same = 0;
    for (size_t i = 0; i < kN; ++i) same += other[i] == base[i];
    EXPECT_LE(same, 2u) << "seed " << seed << " key " << key;
  }
}

TEST(TensorFillTest, ShardsOfATensorMatchTheFullTensor) {
  const uint64_t seed = 5, key = key_from_name("embed");
  Tensor full = Tensor::empty({37, 11}, DType::f32);
  fill_normal(full, seed, key, 0.0, 1.0);
  // Row shard [5, 9): its global indices start at 5 * 11.
  Tensor shard = Tensor::empty({4, 11}, DType::f32);
  fill_normal(shard, seed, key, 0.0, 1.0, 5 * 11);
  EXPECT_EQ(shard.to_vector(), full.narrow(0, 5, 4).to_vector());
  // A non-contiguous destination is filled in its row-major order.
  Tensor colmajor = Tensor::empty({11, 37}, DType::f32).transpose(0, 1);
  fill_normal(colmajor, seed, key, 0.0, 1.0);
  EXPECT_EQ(colmajor.to_vector(), full.to_vector());
  // The pointer API over the same memory agrees.
  std::vector<float> flat(37 * 11);
  fill_normal(flat.data(), flat.size(), seed, key, 0, 0.0f, 1.0f);
  EXPECT_TRUE(same_bits(flat.data(), full.data<float>(), flat.size()));
}

TEST(TensorFillTest, EveryFloatingDTypeRoundsTheCanonicalValue) {
  Tensor d = Tensor::empty({300}, DType::f64);
  fill_uniform(d, 3, 4, -2.0, 2.0);
  for (auto [dt, ulp_below_2] : {std::pair{DType::f32, 0x1p-23}, {DType::bf16, 0x1p-7}, {DType::f16, 0x1p-10}}) {
    Tensor t = Tensor::empty({300}, dt);
    fill_uniform(t, 3, 4, -2.0, 2.0);
    const std::vector<double> got = t.to_vector(), want = d.to(dt).to_vector();
    for (size_t i = 0; i < got.size(); ++i) {
      // A draw that rounds up to hi = 2 becomes the largest value below 2.
      EXPECT_EQ(got[i], want[i] >= 2.0 ? 2.0 - ulp_below_2 : want[i]) << dtype_name(dt) << " " << i;
    }
  }
  Tensor n = Tensor::empty({300}, DType::bf16);
  fill_normal(n, 3, 4, 0.0, 0.02);
  Tensor nd = Tensor::empty({300}, DType::f64);
  fill_normal(nd, 3, 4, 0.0, 0.02);
  EXPECT_EQ(n.to_vector(), nd.to(DType::bf16).to_vector());
  // bf16 near hi: only a few values below 1 + 2^-5, all < hi.
  Tensor tight = Tensor::empty({1000}, DType::bf16);
  fill_uniform(tight, 1, 1, 1.0, 1.0 + 0x1p-5);
  for (double x : tight.to_vector()) ASSERT_TRUE(x >= 1.0 && x < 1.0 + 0x1p-5) << x;
}

TEST(RandomErrorsTest, BadArgumentsThrow) {
  float buf[4];
  EXPECT_THROW(fill_uniform(buf, 4, 0, 0, 0, 1.0f, 1.0f), InvalidArgument);
  EXPECT_THROW(fill_uniform(buf, 4, 0, 0, 0, 2.0f, 1.0f), InvalidArgument);
  EXPECT_THROW(fill_uniform(buf, 4, 0, 0, 0, 0.0f, INFINITY), InvalidArgument);
  EXPECT_THROW(fill_normal(buf, 4, 0, 0, 0, 0.0f, -1.0f), InvalidArgument);
  EXPECT_THROW(fill_normal(static_cast<float*>(nullptr), 4, 0, 0, 0, 0.0f, 1.0f), InvalidArgument);
  fill_normal(static_cast<float*>(nullptr), 0, 0, 0, 0, 0.0f, 1.0f);  // nothing to write: fine
  Tensor i = Tensor::empty({4}, DType::i32);
  try {
    fill_uniform(i, 0, 0, 0.0, 1.0);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "fill_uniform");
    EXPECT_NE(e.detail().find("i32"), std::string::npos);
  }
  EXPECT_THROW(fill_normal(Tensor(), 0, 0, 0.0, 1.0), InvalidArgument);
  double d[2];
  EXPECT_THROW(fill_uniform(d, 2, 0, 0, 0, -1e308, 1e308), InvalidArgument);  // width overflows
  fill_normal(buf, 4, 0, 0, 0, 3.0f, 0.0f);
  for (float x : buf) EXPECT_EQ(x, 3.0f);
}

}  // namespace
}  // namespace meshtrain
