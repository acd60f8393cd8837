#include "meshtrain/comm/internal/reduce.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "meshtrain/core/half.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
    // The wrapped sum as the storage type, divided in int64: signed types
    // truncate toward zero, and the divisor is never narrowed (an i8 avg over
    // 128 ranks divided by -128, a u8 one over 256 ranks by zero).
    return static_cast<Acc>(static_cast<T>(static_cast<int64_t>(static_cast<T>(a)) / d));
  }
}

void stream(std::byte* dst, const std::byte* src, size_t bytes) {
#if defined(__SSE2__)
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  for (; bytes >= 64; dst += 64, src += 64, bytes -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
#endif
  std::memcpy(dst, src, bytes);
}

void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

// Fused path for sums of same-width types (f32, f64, wrapping integers): each
// 64-byte step loads every input once, adds in registers and stores to every
// output, with no staging. It carries most of the training traffic
// (gradient sums and averages). Needs 16-byte aligned outputs.
#if defined(__SSE2__)
struct SseF32 {
  using T = float;
  using V = __m128;
  static V load(const T* p) { return _mm_loadu_ps(p); }
  static V add(V a, V b) { return _mm_add_ps(a, b); }
  static V div(V a, V d) { return _mm_div_ps(a, d); }
  static V splat(T x) { return _mm_set1_ps(x); }
  static void store(T* p, V v, bool nt) { nt ? _mm_stream_ps(p, v) : _mm_store_ps(p, v); }
};
struct SseF64 {
  using T = double;
  using V = __m128d;
  static V load(const T* p) { return _mm_loadu_pd(p); }
  static V add(V a, V b) { return _mm_add_pd(a, b); }
  static V div(V a, V d) { return _mm_div_pd(a, d); }
  static V splat(T x) { return _mm_set1_pd(x); }
  static void store(T* p, V v, bool nt) { nt ? _mm_stream_pd(p, v) : _mm_store_pd(p, v); }
};
template <typename U, bool k64>
struct SseInt {  // wrapping sums of 32- or 64-bit integers (no avg)
  using T = U;
  using V = __m128i;
  static V load(const T* p) { return _mm_loadu_si128(reinterpret_cast<const V*>(p)); }
  static V add(V a, V b) { return k64 ? _mm_add_epi64(a, b) : _mm_add_epi32(a, b); }
  static V div(V a, V) { return a; }
  static V splat(T) { return _mm_setzero_si128(); }
  static void store(T* p, V v, bool nt) {
    nt ? _mm_stream_si128(reinterpret_cast<V*>(p), v) : _mm_store_si128(reinterpret_cast<V*>(p), v);
  }
};

template <typename S>
bool fused_sum(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count, bool avg,
               int avg_divisor, bool streaming) {
  using T = typename S::T;
  using V = typename S::V;
  constexpr size_t kLanes = sizeof(V) / sizeof(T), kStep = 4 * kLanes;
  for (int j = 0; j < n_out; ++j)
    if (reinterpret_cast<uintptr_t>(outs[j]) % sizeof(V) != 0) return false;
  const size_t body = count / kStep * kStep;
  const T div = static_cast<T>(avg_divisor);
  const V vdiv = S::splat(div);
  for (size_t i = 0; i < body; i += kStep) {
    const T* in0 = static_cast<const T*>(ins[0]) + i;
    V v0 = S::load(in0), v1 = S::load(in0 + kLanes), v2 = S::load(in0 + 2 * kLanes), v3 = S::load(in0 + 3 * kLanes);
    for (int k = 1; k < n_in; ++k) {
      const T* in = static_cast<const T*>(ins[k]) + i;
      v0 = S::add(v0, S::load(in));
      v1 = S::add(v1, S::load(in + kLanes));
      v2 = S::add(v2, S::load(in + 2 * kLanes));
      v3 = S::add(v3, S::load(in + 3 * kLanes));
    }
    if (avg) v0 = S::div(v0, vdiv), v1 = S::div(v1, vdiv), v2 = S::div(v2, vdiv), v3 = S::div(v3, vdiv);
    for (int j = 0; j < n_out; ++j) {
      T* out = static_cast<T*>(outs[j]) + i;
      S::store(out, v0, streaming);
      S::store(out + kLanes, v1, streaming);
      S::store(out + 2 * kLanes, v2, streaming);
      S::store(out + 3 * kLanes, v3, streaming);
    }
  }
  // The tail (fewer than kStep elements), element by element in the same order.
  for (size_t i = body; i < count; ++i) {
    T acc = static_cast<const T*>(ins[0])[i];
    for (int k = 1; k < n_in; ++k) acc += static_cast<const T*>(ins[k])[i];
    if (avg) acc /= div;
    for (int j = 0; j < n_out; ++j) static_cast<T*>(outs[j])[i] = acc;
  }
  return true;
}
#endif

// Whether the fused path computes exactly what the generic one does.
bool try_fused(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count, DType dtype,
               ReduceOp op, int avg_divisor, bool streaming) {
#if defined(__SSE2__)
  const bool avg = op == ReduceOp::avg;
  if (op != ReduceOp::sum && !avg) return false;
  switch (dtype) {
    case DType::f32: return fused_sum<SseF32>(outs, n_out, ins, n_in, count, avg, avg_divisor, streaming);
    case DType::f64: return fused_sum<SseF64>(outs, n_out, ins, n_in, count, avg, avg_divisor, streaming);
    // Integer avg truncates in the signed type: the generic path does it.
    case DType::i32:
      return !avg && fused_sum<SseInt<uint32_t, false>>(outs, n_out, ins, n_in, count, false, 1, streaming);
    case DType::i64:
      return !avg && fused_sum<SseInt<uint64_t, true>>(outs, n_out, ins, n_in, count, false, 1, streaming);
    default: return false;
  }
#else
  (void)outs, (void)n_out, (void)ins, (void)n_in, (void)count, (void)dtype, (void)op, (void)avg_divisor,
      (void)streaming;
  return false;
#endif
}

// The op is a template parameter so the inner loops vectorize.
template <typename T, typename Conv, ReduceOp kOp>
void reduce_typed(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
                  int avg_divisor, bool streaming) {
  using Acc = typename Conv::Acc;
  constexpr size_t kTile = 1024;
  Acc acc[kTile];
  alignas(64) T staged[kTile];  // streaming: the converted tile, copied out with NT stores
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
    if (streaming) {
      for (size_t i = 0; i < m; ++i) staged[i] = Conv::store(acc[i]);
      for (int j = 0; j < n_out; ++j)
        stream(reinterpret_cast<std::byte*>(static_cast<T*>(outs[j]) + base),
               reinterpret_cast<const std::byte*>(staged), m * sizeof(T));
      continue;
    }
    for (int j = 0; j < n_out; ++j) {
      T* out = static_cast<T*>(outs[j]) + base;
      for (size_t i = 0; i < m; ++i) out[i] = Conv::store(acc[i]);
    }
  }
}

template <typename T, typename Conv>
void reduce_op(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
               ReduceOp op, int avg_divisor, bool streaming) {
  switch (op) {
    case ReduceOp::sum: return reduce_typed<T, Conv, ReduceOp::sum>(outs, n_out, ins, n_in, count, avg_divisor, streaming);
    case ReduceOp::avg: return reduce_typed<T, Conv, ReduceOp::avg>(outs, n_out, ins, n_in, count, avg_divisor, streaming);
    case ReduceOp::max: return reduce_typed<T, Conv, ReduceOp::max>(outs, n_out, ins, n_in, count, avg_divisor, streaming);
    case ReduceOp::min: return reduce_typed<T, Conv, ReduceOp::min>(outs, n_out, ins, n_in, count, avg_divisor, streaming);
    case ReduceOp::prod: return reduce_typed<T, Conv, ReduceOp::prod>(outs, n_out, ins, n_in, count, avg_divisor, streaming);
  }
}

void reduce_dispatch(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
                     DType dtype, ReduceOp op, int avg_divisor, bool streaming) {
  switch (dtype) {
    case DType::f32: return reduce_op<float, Plain<float>>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
    case DType::f64: return reduce_op<double, Plain<double>>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
    case DType::bf16: return reduce_op<uint16_t, Bf16>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
    case DType::f16: return reduce_op<uint16_t, F16>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
    case DType::i8: return reduce_op<int8_t, Plain<int8_t>>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
    case DType::i32: return reduce_op<int32_t, Plain<int32_t>>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
    case DType::i64: return reduce_op<int64_t, Plain<int64_t>>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
    case DType::u8: return reduce_op<uint8_t, Plain<uint8_t>>(outs, n_out, ins, n_in, count, op, avg_divisor, streaming);
  }
}

}  // namespace

void copy(void* dst, const void* src, size_t bytes, bool streaming) {
  if (!streaming) return (void)std::memcpy(dst, src, bytes);
  stream(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes);
  store_fence();
}

void reduce(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
            DType dtype, ReduceOp op, int avg_divisor, bool streaming) {
  if (count == 0 || n_out == 0) return;
  // One input reduced onto itself (an in-place collective of one rank): nothing to do.
  if (n_in == 1 && std::all_of(outs, outs + n_out, [&](void* o) { return o == ins[0]; }) &&
      (op != ReduceOp::avg || avg_divisor == 1))
    return;
  if (!try_fused(outs, n_out, ins, n_in, count, dtype, op, avg_divisor, streaming))
    reduce_dispatch(outs, n_out, ins, n_in, count, dtype, op, avg_divisor, streaming);
  if (streaming) store_fence();
}

}  // namespace meshtrain::comm::internal
