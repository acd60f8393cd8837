#include "meshtrain/comm/mpi/internal/reduce.h"

#include <cstdint>
#include <type_traits>

#include "meshtrain/core/half.h"

namespace meshtrain::comm::mpi::internal {
namespace {

// Integer arithmetic goes through the unsigned type, so it wraps instead of
// overflowing (and C++20 defines the conversion back as modulo 2^bits).
template <class T>
T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <class T>
T mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    // uint8_t would promote to int; widen explicitly so the product is unsigned.
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

template <class T>
bool is_nan(T x) {
  if constexpr (std::is_floating_point_v<T>) {
    return x != x;
  } else {
    (void)x;
    return false;
  }
}

struct Sum {
  template <class T>
  static T apply(T a, T b) { return add(a, b); }
};
struct Prod {
  template <class T>
  static T apply(T a, T b) { return mul(a, b); }
};
struct Max {
  template <class T>
  static T apply(T a, T b) { return (a > b || is_nan(a)) ? a : b; }
};
struct Min {
  template <class T>
  static T apply(T a, T b) { return (a < b || is_nan(a)) ? a : b; }
};

template <class T>
T div(T x, int divisor) {
  if constexpr (std::is_integral_v<T>) {
    // Truncation toward zero, as C++ integer division does.
    return static_cast<T>(static_cast<int64_t>(x) / divisor);
  } else {
    return x / static_cast<T>(divisor);
  }
}

// Same-encoding kernel: f32, f64 and integers (and wide bf16/f16 partials).
template <class F, class T>
void combine_same(const T* a, const T* b, T* out, size_t n, int divisor) {
  if (divisor > 0) {
    for (size_t i = 0; i < n; ++i) out[i] = div(F::apply(a[i], b[i]), divisor);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = F::apply(a[i], b[i]);
  }
}

// bf16/f16: loads widen to f32, stores to 16 bits round (ties to even).
template <bool kBf16>
float load(uint16_t x) { return kBf16 ? bf16_to_float(x) : f16_to_float(x); }
template <bool kBf16>
float load(float x) { return x; }
template <bool kBf16>
void store(uint16_t& dst, float v) { dst = kBf16 ? float_to_bf16(v) : float_to_f16(v); }
template <bool kBf16>
void store(float& dst, float v) { dst = v; }

template <class F, bool kBf16, class A, class O>
void combine_16(const A* a, const uint16_t* b, O* out, size_t n, int divisor) {
  for (size_t i = 0; i < n; ++i) {
    float v = F::apply(load<kBf16>(a[i]), load<kBf16>(b[i]));
    if (divisor > 0) v /= static_cast<float>(divisor);
    store<kBf16>(out[i], v);
  }
}

template <class F, bool kBf16>
void combine_16_dispatch(const void* a, bool a_wide, const void* b, void* out, bool out_wide,
                         size_t n, int divisor) {
  auto* b16 = static_cast<const uint16_t*>(b);
  if (a_wide && out_wide) {
    combine_16<F, kBf16>(static_cast<const float*>(a), b16, static_cast<float*>(out), n, divisor);
  } else if (a_wide) {
    combine_16<F, kBf16>(static_cast<const float*>(a), b16, static_cast<uint16_t*>(out), n, divisor);
  } else if (out_wide) {
    combine_16<F, kBf16>(static_cast<const uint16_t*>(a), b16, static_cast<float*>(out), n, divisor);
  } else {
    combine_16<F, kBf16>(static_cast<const uint16_t*>(a), b16, static_cast<uint16_t*>(out), n,
                         divisor);
  }
}

template <class F>
void combine_op(DType dtype, const void* a, bool a_wide, const void* b, void* out, bool out_wide,
                size_t n, int divisor) {
  switch (dtype) {
#define MESHTRAIN_SAME(D, T)                                                                  \
  case DType::D:                                                                              \
    combine_same<F>(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), \
                    n, divisor);                                                              \
    return;
    MESHTRAIN_SAME(f32, float)
    MESHTRAIN_SAME(f64, double)
    MESHTRAIN_SAME(i8, int8_t)
    MESHTRAIN_SAME(i32, int32_t)
    MESHTRAIN_SAME(i64, int64_t)
    MESHTRAIN_SAME(u8, uint8_t)
#undef MESHTRAIN_SAME
    case DType::bf16:
      combine_16_dispatch<F, true>(a, a_wide, b, out, out_wide, n, divisor);
      return;
    case DType::f16:
      combine_16_dispatch<F, false>(a, a_wide, b, out, out_wide, n, divisor);
      return;
  }
}

template <class T>
void divide_same(T* buf, size_t n, int divisor) {
  for (size_t i = 0; i < n; ++i) buf[i] = div(buf[i], divisor);
}

template <bool kBf16>
void divide_16(uint16_t* buf, size_t n, int divisor) {
  for (size_t i = 0; i < n; ++i)
    store<kBf16>(buf[i], load<kBf16>(buf[i]) / static_cast<float>(divisor));
}

template <class F, bool kBf16>
void reduce_16_op(const uint16_t* in, uint16_t* inout, size_t n) {
  for (size_t i = 0; i < n; ++i)
    store<kBf16>(inout[i], F::apply(load<kBf16>(in[i]), load<kBf16>(inout[i])));
}

template <bool kBf16>
void reduce_16(ReduceOp op, const uint16_t* in, uint16_t* inout, size_t n) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: reduce_16_op<Sum, kBf16>(in, inout, n); return;
    case ReduceOp::prod: reduce_16_op<Prod, kBf16>(in, inout, n); return;
    case ReduceOp::max: reduce_16_op<Max, kBf16>(in, inout, n); return;
    case ReduceOp::min: reduce_16_op<Min, kBf16>(in, inout, n); return;
  }
}

}  // namespace

size_t wide_size(DType dtype) {
  return dtype == DType::bf16 || dtype == DType::f16 ? sizeof(float) : dtype_size(dtype);
}

void combine(DType dtype, ReduceOp op, const void* a, bool a_wide, const void* b, void* out,
             bool out_wide, size_t n, int divisor) {
  if (op != ReduceOp::avg) divisor = 0;
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: combine_op<Sum>(dtype, a, a_wide, b, out, out_wide, n, divisor); return;
    case ReduceOp::prod: combine_op<Prod>(dtype, a, a_wide, b, out, out_wide, n, divisor); return;
    case ReduceOp::max: combine_op<Max>(dtype, a, a_wide, b, out, out_wide, n, divisor); return;
    case ReduceOp::min: combine_op<Min>(dtype, a, a_wide, b, out, out_wide, n, divisor); return;
  }
}

void divide(DType dtype, void* buf, size_t n, int divisor) {
  switch (dtype) {
    case DType::f32: divide_same(static_cast<float*>(buf), n, divisor); return;
    case DType::f64: divide_same(static_cast<double*>(buf), n, divisor); return;
    case DType::i8: divide_same(static_cast<int8_t*>(buf), n, divisor); return;
    case DType::i32: divide_same(static_cast<int32_t*>(buf), n, divisor); return;
    case DType::i64: divide_same(static_cast<int64_t*>(buf), n, divisor); return;
    case DType::u8: divide_same(static_cast<uint8_t*>(buf), n, divisor); return;
    case DType::bf16: divide_16<true>(static_cast<uint16_t*>(buf), n, divisor); return;
    case DType::f16: divide_16<false>(static_cast<uint16_t*>(buf), n, divisor); return;
  }
}

void reduce_16bit(DType dtype, ReduceOp op, const void* in, void* inout, size_t n) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  if (dtype == DType::bf16) {
    reduce_16<true>(op, a, b, n);
  } else {
    reduce_16<false>(op, a, b, n);
  }
}

}  // namespace meshtrain::comm::mpi::internal
