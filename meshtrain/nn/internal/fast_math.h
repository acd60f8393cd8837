// Branch-free float exp and sigmoid, four lanes at a time (SSE2, the
// baseline x86-64 the project builds for), for the CPU
// kernels' GELU, softmax rows and attention (libm's expf and tanhf are
// calls, one element at a time, and GCC 12 does not vectorize a scalar
// version of this code: a select on a bit-cast value defeats its
// if-conversion). Written once over float and over GCC's 4 x f32 vector
// type; map_f32 runs a lambda over arrays 4 at a time with a scalar tail.
// Not for use outside nn.
//
//   map_f32(x, y, n, [](auto v) { return v * sigmoid_approx(v); });  // SiLU
//
// exp_approx: Cody-Waite range reduction x = n ln2 + r (|r| <= ln2 / 2, n
// rounded by the 1.5 * 2^23 trick) and Cephes's degree-6 polynomial for
// e^r, scaled by 2^n through the exponent bits. Relative error below 3e-7
// (about 2 ulp; nn/functional_test.cc checks it against exp over
// [-87, 88]); 0 below -87 and +inf above 88 (the float range ends at
// e^88.7); NaN gives NaN. The vector and scalar forms give the same bits.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

namespace meshtrain::nn::internal {

using f32x4 = float __attribute__((vector_size(16)));
using i32x4 = int32_t __attribute__((vector_size(16)));

template <typename F, typename I>
inline F exp_approx_t(F x) {
  constexpr float kLo = -87.0f, kHi = 88.0f;
  const F lo = F{} + kLo, hi = F{} + kHi;
  const F xc = x < lo ? lo : (x > hi ? hi : x);  // NaN passes through
  constexpr float kRound = 12582912.0f;          // 1.5 * 2^23: t's low mantissa bits hold n
  const F t = xc * 1.44269504088896341f + kRound;
  const F n = t - kRound;
  const I ni = std::bit_cast<I>(t) - 0x4B400000;  // the bits of kRound
  F r = xc - n * 0.693359375f;                    // ln 2 in two parts (Cody-Waite)
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  F y = p * std::bit_cast<F>((ni + 127) << 23);
  y = x < lo ? F{} : y;
  y = x > hi ? F{} + std::numeric_limits<float>::infinity() : y;
  return y;
}

inline float exp_approx(float x) { return exp_approx_t<float, int32_t>(x); }
inline f32x4 exp_approx(f32x4 x) { return exp_approx_t<f32x4, i32x4>(x); }

// 1 / (1 + e^-x); 0 below -88, 1 above 87.
template <typename F>
inline F sigmoid_approx(F x) {
  return 1.0f / (1.0f + exp_approx(-x));
}

inline f32x4 load4(const float* p) {
  f32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, f32x4 v) { std::memcpy(p, &v, sizeof v); }

// y[i] = fn(x[i]) for i in [0, n); fn takes and returns float and f32x4
// alike (a generic lambda). y may be x.
template <typename Fn>
inline void map_f32(const float* x, float* y, int64_t n, Fn fn) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) store4(y + i, fn(load4(x + i)));
  for (; i < n; ++i) y[i] = fn(x[i]);
}

// y[i] = fn(a[i], b[i]); y may be a or b.
template <typename Fn>
inline void map2_f32(const float* a, const float* b, float* y, int64_t n, Fn fn) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) store4(y + i, fn(load4(a + i), load4(b + i)));
  for (; i < n; ++i) y[i] = fn(a[i], b[i]);
}

// The largest of x[0, n) (n >= 1), 4 lanes at a time; NaNs are skipped
// unless x[0] is one (as std::max_element), which is enough for a softmax
// row: a NaN input still makes its exp, and so the row, NaN.
inline float max_f32(const float* x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
  if (n >= 8) {
    f32x4 mv = load4(x);
    for (i = 4; i + 4 <= n; i += 4) {
      const f32x4 v = load4(x + i);
      mv = v > mv ? v : mv;
    }
    for (int k = 0; k < 4; ++k) m = mv[k] > m ? mv[k] : m;
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// Sum of term(j) over j in [0, n) in f32: two 4-lane accumulators over
// blocks of 8 (vec(j) gives terms j..j+3 as a vector), a scalar tail
// (one(j)), lanes added in a fixed order: a row reduction that vectorizes
// and covers the add latency, the same on every call.
template <typename Vec, typename One>
inline float lane_sum(int64_t n, Vec vec, One one) {
  f32x4 a{}, b{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    a += vec(j);
    b += vec(j + 4);
  }
  for (; j + 4 <= n; j += 4) a += vec(j);
  a += b;
  float s = (a[0] + a[1]) + (a[2] + a[3]);
  for (; j < n; ++j) s += one(j);
  return s;
}

// Sum of x[0, n) in double: four running sums over the indices mod 4,
// added as (s0 + s1) + (s2 + s3) (a fixed order: the same bits every call).
inline double sum_f64(const float* x, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) s[k] += x[i + k];
  for (; i < n; ++i) s[i % 4] += x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace meshtrain::nn::internal
