// Branch-free float exp and sigmoid over GCC's vector types, for the CPU
// kernels' GELU, softmax rows and attention (libm's expf and tanhf are
// calls, one element at a time, and GCC 12 does not vectorize a scalar
// version of this code: a select on a bit-cast value defeats its
// if-conversion). Written once over float and over vectors of 4, 8 and 16
// floats. map_f32 / map2_f32 run a lambda over arrays a vector at a time
// with a scalar tail, at the width of the instruction set core/cpu_isa.h
// reports (honouring MESHTRAIN_CPU_ISA): 16 lanes compiled for AVX-512, 8
// for AVX2, else 4 (SSE2, the baseline x86-64 the project builds for). An
// element's result does not depend on the width: the same operations in
// the same order (nn builds with -ffp-contract=off: no a * b + c becomes
// an FMA in the AVX2 and AVX-512 code), so every width gives the same bits. The reductions below (max, sums) keep 4 lanes: their order is part
// of their result. Vectors of 8 and 16 floats are passed by value only
// inside the AVX2 and AVX-512 functions, where everything is inlined (this
// header and nn build without GCC's note on their ABI in baseline code). Not
// for use outside nn.
//
//   map_f32(x, y, n, [](auto v) { return v * sigmoid_approx(v); });  // SiLU
//
// exp_approx: Cody-Waite range reduction x = n ln2 + r (|r| <= ln2 / 2, n
// rounded by the 1.5 * 2^23 trick) and Cephes's degree-6 polynomial for
// e^r, scaled by 2^n through the exponent bits. Relative error below 3e-7
// (about 2 ulp; nn/functional_test.cc checks it against exp over
// [-87, 88]); 0 below -87 and +inf above 88 (the float range ends at
// e^88.7); NaN gives NaN. The vector and scalar forms give the same bits
// (but for a NaN's sign).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

#include "meshtrain/core/cpu_isa.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // see above

namespace meshtrain::nn::internal {

using f32x4 = float __attribute__((vector_size(16)));
using i32x4 = int32_t __attribute__((vector_size(16)));
using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));
using f32x16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));

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
[[gnu::always_inline]] inline f32x8 exp_approx(f32x8 x) { return exp_approx_t<f32x8, i32x8>(x); }
[[gnu::always_inline]] inline f32x16 exp_approx(f32x16 x) { return exp_approx_t<f32x16, i32x16>(x); }

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

template <typename V>
[[gnu::always_inline]] inline V load_v(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
[[gnu::always_inline]] inline void store_v(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// The maps at one vector type V (W lanes), with a scalar tail.
template <typename V, typename Fn>
[[gnu::always_inline]] inline void map_f32_at(const float* x, float* y, int64_t n, Fn& fn) {
  constexpr int64_t w = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + w <= n; i += w) store_v(y + i, fn(load_v<V>(x + i)));
  for (; i < n; ++i) y[i] = fn(x[i]);
}
template <typename V, typename Fn>
[[gnu::always_inline]] inline void map2_f32_at(const float* a, const float* b, float* y, int64_t n, Fn& fn) {
  constexpr int64_t w = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + w <= n; i += w) store_v(y + i, fn(load_v<V>(a + i), load_v<V>(b + i)));
  for (; i < n; ++i) y[i] = fn(a[i], b[i]);
}
template <typename Fn>
__attribute__((target("avx512f"), flatten)) void map_f32_avx512(const float* x, float* y, int64_t n, Fn& fn) {
  map_f32_at<f32x16>(x, y, n, fn);
}
template <typename Fn>
__attribute__((target("avx2"), flatten)) void map_f32_avx2(const float* x, float* y, int64_t n, Fn& fn) {
  map_f32_at<f32x8>(x, y, n, fn);
}
template <typename Fn>
__attribute__((target("avx512f"), flatten)) void map2_f32_avx512(const float* a, const float* b, float* y, int64_t n,
                                                                  Fn& fn) {
  map2_f32_at<f32x16>(a, b, y, n, fn);
}
template <typename Fn>
__attribute__((target("avx2"), flatten)) void map2_f32_avx2(const float* a, const float* b, float* y, int64_t n,
                                                              Fn& fn) {
  map2_f32_at<f32x8>(a, b, y, n, fn);
}

// The lanes the maps use on this process's instruction set: 16, 8 or 4.
inline int map_lanes() {
  static const int lanes = cpu_isa() >= CpuIsa::avx512 ? 16 : cpu_isa() >= CpuIsa::avx2 ? 8 : 4;
  return lanes;
}

// Runs fn() built for the widest instruction set map_lanes() allows: a
// loop inlined into fn (mark its function always_inline) is vectorized by
// GCC at that width; element-wise, correctly rounded operations keep the
// baseline's bits (the optimizers' updates).
template <typename Fn>
__attribute__((target("avx512f"), flatten)) void run_avx512(Fn& fn) {
  fn();
}
template <typename Fn>
__attribute__((target("avx2"), flatten)) void run_avx2(Fn& fn) {
  fn();
}
template <typename Fn>
inline void run_widest(Fn fn) {
  if (map_lanes() == 16) return run_avx512(fn);
  if (map_lanes() == 8) return run_avx2(fn);
  fn();
}

// y[i] = fn(x[i]) for i in [0, n); fn takes and returns float and the
// vector types alike (a generic lambda). y may be x.
template <typename Fn>
inline void map_f32(const float* x, float* y, int64_t n, Fn fn) {
  if (n >= 16 && map_lanes() == 16) return map_f32_avx512(x, y, n, fn);
  if (n >= 8 && map_lanes() == 8) return map_f32_avx2(x, y, n, fn);
  map_f32_at<f32x4>(x, y, n, fn);
}

// y[i] = fn(a[i], b[i]); y may be a or b.
template <typename Fn>
inline void map2_f32(const float* a, const float* b, float* y, int64_t n, Fn fn) {
  if (n >= 16 && map_lanes() == 16) return map2_f32_avx512(a, b, y, n, fn);
  if (n >= 8 && map_lanes() == 8) return map2_f32_avx2(a, b, y, n, fn);
  map2_f32_at<f32x4>(a, b, y, n, fn);
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

#pragma GCC diagnostic pop
