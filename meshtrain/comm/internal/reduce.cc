#include "meshtrain/comm/internal/reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "meshtrain/core/half.h"

namespace meshtrain::comm::internal {
namespace {

// Storage type T, accumulator type A, and conversions between them.
template <typename T, bool = std::is_integral_v<T>>
struct AccOf {
  using type = T;
};
template <typename T>
struct AccOf<T, true> {
  using type = std::make_unsigned_t<T>;
};

template <typename T>
struct Plain {
  using Acc = typename AccOf<T>::type;
  static Acc load(T v) { return static_cast<Acc>(v); }
  static T store(Acc a) { return static_cast<T>(a); }
};
struct Bf16 {
  using Acc = float;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float a) { return float_to_bf16(a); }
};
struct F16 {
  using Acc = float;
  static float load(uint16_t v) { return f16_to_float(v); }
  static uint16_t store(float a) { return float_to_f16(a); }
};

// Integers accumulate sums/products unsigned (defined wrap-around) but compare
// as the signed type for max/min.
template <typename T, typename Acc>
Acc combine(ReduceOp op, Acc a, Acc b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return static_cast<Acc>(a + b);
    case ReduceOp::prod: return static_cast<Acc>(a * b);
    case ReduceOp::max:
      if constexpr (std::is_floating_point_v<Acc>) {
        return (std::isnan(a) || a > b) ? a : b;  // NaN propagates
      } else {
        return static_cast<T>(a) > static_cast<T>(b) ? a : b;
      }
    case ReduceOp::min:
      if constexpr (std::is_floating_point_v<Acc>) {
        return (std::isnan(a) || a < b) ? a : b;
      } else {
        return static_cast<T>(a) < static_cast<T>(b) ? a : b;
      }
  }
  return a;
}

template <typename T, typename Acc>
Acc divide(Acc a, int d) {
  if constexpr (std::is_floating_point_v<Acc>) {
    return a / static_cast<Acc>(d);
  } else {
    // Divide in the storage type: signed types truncate toward zero.
    return static_cast<Acc>(static_cast<T>(static_cast<T>(a) / static_cast<T>(d)));
  }
}

// The op is a template parameter so the inner loops vectorize.
template <typename T, typename Conv, ReduceOp kOp>
void reduce_typed(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
                  int avg_divisor) {
  using Acc = typename Conv::Acc;
  constexpr size_t kTile = 1024;
  Acc acc[kTile];
  for (size_t base = 0; base < count; base += kTile) {
    const size_t m = std::min(kTile, count - base);
    const T* in0 = static_cast<const T*>(ins[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = Conv::load(in0[i]);
    for (int j = 1; j < n_in; ++j) {
      const T* in = static_cast<const T*>(ins[j]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = combine<T, Acc>(kOp, acc[i], Conv::load(in[i]));
    }
    if constexpr (kOp == ReduceOp::avg)
      for (size_t i = 0; i < m; ++i) acc[i] = divide<T, Acc>(acc[i], avg_divisor);
    for (int j = 0; j < n_out; ++j) {
      T* out = static_cast<T*>(outs[j]) + base;
      for (size_t i = 0; i < m; ++i) out[i] = Conv::store(acc[i]);
    }
  }
}

template <typename T, typename Conv>
void reduce_op(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
               ReduceOp op, int avg_divisor) {
  switch (op) {
    case ReduceOp::sum: return reduce_typed<T, Conv, ReduceOp::sum>(outs, n_out, ins, n_in, count, avg_divisor);
    case ReduceOp::avg: return reduce_typed<T, Conv, ReduceOp::avg>(outs, n_out, ins, n_in, count, avg_divisor);
    case ReduceOp::max: return reduce_typed<T, Conv, ReduceOp::max>(outs, n_out, ins, n_in, count, avg_divisor);
    case ReduceOp::min: return reduce_typed<T, Conv, ReduceOp::min>(outs, n_out, ins, n_in, count, avg_divisor);
    case ReduceOp::prod: return reduce_typed<T, Conv, ReduceOp::prod>(outs, n_out, ins, n_in, count, avg_divisor);
  }
}

}  // namespace

void reduce(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
            DType dtype, ReduceOp op, int avg_divisor) {
  if (count == 0 || n_out == 0) return;
  switch (dtype) {
    case DType::f32: return reduce_op<float, Plain<float>>(outs, n_out, ins, n_in, count, op, avg_divisor);
    case DType::f64: return reduce_op<double, Plain<double>>(outs, n_out, ins, n_in, count, op, avg_divisor);
    case DType::bf16: return reduce_op<uint16_t, Bf16>(outs, n_out, ins, n_in, count, op, avg_divisor);
    case DType::f16: return reduce_op<uint16_t, F16>(outs, n_out, ins, n_in, count, op, avg_divisor);
    case DType::i8: return reduce_op<int8_t, Plain<int8_t>>(outs, n_out, ins, n_in, count, op, avg_divisor);
    case DType::i32: return reduce_op<int32_t, Plain<int32_t>>(outs, n_out, ins, n_in, count, op, avg_divisor);
    case DType::i64: return reduce_op<int64_t, Plain<int64_t>>(outs, n_out, ins, n_in, count, op, avg_divisor);
    case DType::u8: return reduce_op<uint8_t, Plain<uint8_t>>(outs, n_out, ins, n_in, count, op, avg_divisor);
  }
}

}  // namespace meshtrain::comm::internal
