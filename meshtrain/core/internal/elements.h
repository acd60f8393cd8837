// Implementation detail of the core layer; do not include outside meshtrain/core.
//
// Element-level building blocks shared by tensor.cc, ops.cc and random.cc:
// storage tags for the 16-bit floats, the runtime-dtype switch that turns a
// DType into a C++ type, the one set of conversion rules every dtype change
// uses, and a strided row iterator. Example:
//
//   internal::dispatch(t.dtype(), [&](auto tag) {
//     using T = decltype(tag);
//     T* p = static_cast<T*>(t.data_ptr());
//     p[0] = internal::from_double<T>(1.5);
//   });
//
// Thread-safety: pure functions over caller-owned memory.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/core/half.h"

namespace meshtrain::internal {

// bf16/f16 elements are stored as their bit patterns; distinct types so that
// overloads and `if constexpr` can tell them apart from each other and from
// uint16_t. Same size and alignment as uint16_t.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2 && sizeof(F16) == 2);

template <typename T>
inline constexpr bool kIsHalf = std::is_same_v<T, Bf16> || std::is_same_v<T, F16>;
template <typename T>
inline constexpr bool kIsFloat = std::is_floating_point_v<T> || kIsHalf<T>;
template <typename T>
inline constexpr bool kIsInt = std::is_integral_v<T>;

// Calls f(T{}) with T the storage type of `t` and returns its result.
template <typename F>
decltype(auto) dispatch(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::bf16: return f(Bf16{});
    case DType::f16: return f(F16{});
    case DType::f64: return f(double{});
    case DType::i8: return f(int8_t{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
  }
  return f(float{});  // unreachable: every enumerator is handled above
}

// Exact widening of a floating element to double.
template <typename T>
inline double to_double(T v) {
  if constexpr (std::is_same_v<T, Bf16>) return bf16_to_float(v.bits);
  else if constexpr (std::is_same_v<T, F16>) return f16_to_float(v.bits);
  else return static_cast<double>(v);
}

// The float compute value of a floating element (bf16/f16 widen exactly).
template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, Bf16>) return bf16_to_float(v.bits);
  else if constexpr (std::is_same_v<T, F16>) return f16_to_float(v.bits);
  else return static_cast<float>(v);
}

// double -> float with IEEE overflow (to +-inf past FLT_MAX + half an ulp)
// spelled out, because an out-of-range floating conversion is undefined in C++.
inline float double_to_float(double d) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (std::isfinite(d) && std::fabs(d) > kMax) {
    const bool overflow = std::fabs(d) >= 0x1.ffffffp127;  // FLT_MAX + ulp/2 ties to inf
    const float mag = overflow ? std::numeric_limits<float>::infinity()
                               : std::numeric_limits<float>::max();
    return d < 0 ? -mag : mag;
  }
  return static_cast<float>(d);
}

// double -> float rounded to odd (truncate, then set the last bit if inexact).
// Rounding that result to bf16/f16 (RNE) equals rounding the double directly,
// because float keeps more than two extra bits; plain double->float->half
// rounding can turn "just above a tie" into a tie and round the wrong way.
inline float double_to_float_round_odd(double d) {
  float f = double_to_float(d);
  if (!std::isfinite(d) || static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d))  // RNE went away from zero
    f = std::nextafter(f, 0.0f);
  uint32_t bits = std::bit_cast<uint32_t>(f);
  return std::bit_cast<float>(bits | 1u);
}

// Saturating truncation toward zero for float -> integer: NaN -> 0, values
// past the range clamp to min/max (a plain cast would be undefined).
template <typename I>
inline I saturate_cast(double v) {
  if (std::isnan(v)) return 0;
  constexpr double kHi = static_cast<double>(std::numeric_limits<I>::max()) + 1.0;  // 2^k, exact
  constexpr double kLo = static_cast<double>(std::numeric_limits<I>::min());
  if (v >= kHi) return std::numeric_limits<I>::max();
  if (v <= kLo) return std::numeric_limits<I>::min();
  return static_cast<I>(v);
}

// Correctly rounded double -> T (saturating truncation for integers).
template <typename T>
inline T from_double(double d) {
  if constexpr (std::is_same_v<T, double>) return d;
  else if constexpr (std::is_same_v<T, float>) return double_to_float(d);
  else if constexpr (std::is_same_v<T, Bf16>) return Bf16{float_to_bf16(double_to_float_round_odd(d))};
  else if constexpr (std::is_same_v<T, F16>) return F16{float_to_f16(double_to_float_round_odd(d))};
  else return saturate_cast<T>(d);
}

// float compute value -> T (bf16/f16 round once, RNE).
template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, Bf16>) return Bf16{float_to_bf16(f)};
  else if constexpr (std::is_same_v<T, F16>) return F16{float_to_f16(f)};
  else if constexpr (std::is_same_v<T, float>) return f;
  else return from_double<T>(f);
}

// The conversion rule for every dtype change (Tensor::to, copy_from, fill):
//   float -> float   correctly rounded (RNE), overflow to inf, NaN stays NaN;
//   float -> int     truncation toward zero, saturating, NaN -> 0;
//   int   -> int     two's complement wrap-around (as static_cast);
//   int   -> float   rounded to nearest (exact below 2^24 for f32, 2^53 for f64;
//                    bf16/f16 are correctly rounded for |v| < 2^53).
template <typename Dst, typename Src>
inline Dst convert(Src s) {
  if constexpr (std::is_same_v<Dst, Src>) return s;
  else if constexpr (kIsInt<Src> && kIsInt<Dst>) return static_cast<Dst>(s);
  else if constexpr (kIsInt<Src> && std::is_floating_point_v<Dst>) return static_cast<Dst>(s);
  else if constexpr (kIsInt<Src>) return from_double<Dst>(static_cast<double>(s));
  // Among f32, bf16 and f16 every value is exact in f32: one rounding from
  // there (fast: no double, vectorizable).
  else if constexpr (!std::is_same_v<Src, double> && !std::is_same_v<Dst, double> && !kIsInt<Dst>)
    return from_float<Dst>(to_float(s));
  else return from_double<Dst>(to_double(s));
}

// Visits every innermost row of a tensor shape for N operands that share the
// shape but may have different strides. Calls
//   row(std::array<int64_t, N> offsets, int64_t length, std::array<int64_t, N> inner_strides)
// with element offsets relative to each operand's data pointer. Rows are
// visited in row-major order; a 0-d shape is one row of length 1; a shape
// with a zero size visits nothing.
template <size_t N, typename F>
void for_each_row(const std::vector<int64_t>& shape,
                  const std::array<const std::vector<int64_t>*, N>& strides, F&& row) {
  const size_t nd = shape.size();
  for (int64_t s : shape)
    if (s == 0) return;
  std::array<int64_t, N> inner{};
  if (nd == 0) {
    row(std::array<int64_t, N>{}, int64_t{1}, inner);
    return;
  }
  for (size_t k = 0; k < N; ++k) inner[k] = (*strides[k])[nd - 1];
  const int64_t len = shape[nd - 1];
  std::vector<int64_t> idx(nd, 0);
  std::array<int64_t, N> off{};
  for (;;) {
    row(off, len, inner);
    // Advance the outer index (all dims but the last), odometer style.
    size_t d = nd - 1;
    for (;;) {
      if (d == 0) return;
      --d;
      ++idx[d];
      for (size_t k = 0; k < N; ++k) off[k] += (*strides[k])[d];
      if (idx[d] < shape[d]) break;
      for (size_t k = 0; k < N; ++k) off[k] -= idx[d] * (*strides[k])[d];
      idx[d] = 0;
    }
  }
}

}  // namespace meshtrain::internal
