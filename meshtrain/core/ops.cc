#include "meshtrain/core/ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>

#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/convert.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/internal/elements.h"
#include "meshtrain/core/internal/operands.h"

namespace meshtrain {
namespace {

using internal::dispatch;
using internal::check_operand;


// Same storage, offset and strides: an exact alias, which element-wise
// kernels handle (each element is read before it is written).
bool same_view(const Tensor& a, const Tensor& b) {
  return a.storage() == b.storage() && a.storage_offset() == b.storage_offset() &&
         a.strides() == b.strides() && a.dtype() == b.dtype();
}

void check_no_partial_overlap(const Tensor& out, const Tensor& in, const char* op, const char* what) {
  if (may_overlap(out, in) && !same_view(out, in))
    throw InvalidArgument(op, fmt::format("the output partly overlaps {}", what),
                          "write to a separate tensor, or in place to the very same view");
}

void check_same(const Tensor& a, const Tensor& b, const char* op, const char* na, const char* nb) {
  if (a.dtype() != b.dtype())
    throw InvalidArgument(op, fmt::format("{} is {} but {} is {}", na, dtype_name(a.dtype()), nb,
                                          dtype_name(b.dtype())),
                          "convert one with to(); kernels do not promote types");
  if (a.shape() != b.shape())
    throw InvalidArgument(op, fmt::format("{} has shape {} but {} has shape {}", na,
                                          shape_to_string(a.shape()), nb, shape_to_string(b.shape())),
                          "operands must have the same shape; there is no broadcasting");
}

// ---- element arithmetic: the compute type of each storage type ----

template <typename T>
using Compute = std::conditional_t<internal::kIsHalf<T>, float, T>;

template <typename T>
Compute<T> load(T v) {
  if constexpr (internal::kIsHalf<T>) return internal::to_float(v);
  else return v;
}

template <typename T>
T store(Compute<T> c) {
  if constexpr (internal::kIsHalf<T>) return internal::from_float<T>(c);
  else return c;
}

// Integer arithmetic in the unsigned type wraps instead of overflowing (UB).
template <typename T>
T wrap_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}
template <typename T>
T wrap_mul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;  // no promotion to int
  return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
}
template <typename T>
T wrap_axpy(uint64_t alpha, T x, T y) {  // y + alpha * x mod 2^64, then mod 2^bits
  return static_cast<T>(static_cast<uint64_t>(static_cast<int64_t>(y)) +
                        alpha * static_cast<uint64_t>(static_cast<int64_t>(x)));
}

uint64_t integral_alpha(double alpha, DType dtype, const char* op) {
  if (!(std::trunc(alpha) == alpha && std::fabs(alpha) < 0x1p63))
    throw InvalidArgument(op, fmt::format("alpha {} is not a whole number for a {} tensor", alpha,
                                          dtype_name(dtype)),
                          "use a whole alpha, or convert the tensor to a floating dtype");
  return static_cast<uint64_t>(static_cast<int64_t>(alpha));
}

// out[i] = f(a[i], b[i]) over any strides; contiguous rows take the unit-stride loop.
template <typename T, typename F>
void binary_kernel(const Tensor& a, const Tensor& b, const Tensor& out, F f) {
  const T* pa = static_cast<const T*>(a.data_ptr());
  const T* pb = static_cast<const T*>(b.data_ptr());
  T* po = static_cast<T*>(out.data_ptr());
  if (a.is_contiguous() && b.is_contiguous() && out.is_contiguous()) {
    const int64_t n = out.numel();
    for (int64_t i = 0; i < n; ++i) po[i] = f(pa[i], pb[i]);
    return;
  }
  const std::array<const std::vector<int64_t>*, 3> strides{&a.strides(), &b.strides(), &out.strides()};
  internal::for_each_row<3>(out.shape(), strides, [&](auto off, int64_t len, auto in) {
    const T* ra = pa + off[0];
    const T* rb = pb + off[1];
    T* ro = po + off[2];
    if (in[0] == 1 && in[1] == 1 && in[2] == 1) {
      for (int64_t i = 0; i < len; ++i) ro[i] = f(ra[i], rb[i]);
    } else {
      for (int64_t i = 0; i < len; ++i) ro[i * in[2]] = f(ra[i * in[0]], rb[i * in[1]]);
    }
  });
}

template <typename T, typename F>
void unary_inplace_kernel(const Tensor& x, F f) {
  T* px = static_cast<T*>(x.data_ptr());
  const std::array<const std::vector<int64_t>*, 1> strides{&x.strides()};
  internal::for_each_row<1>(x.shape(), strides, [&](auto off, int64_t len, auto in) {
    T* r = px + off[0];
    if (in[0] == 1) {
      for (int64_t i = 0; i < len; ++i) r[i] = f(r[i]);
    } else {
      for (int64_t i = 0; i < len; ++i) r[i * in[0]] = f(r[i * in[0]]);
    }
  });
}

// Calls f(value as double) for every element in row-major order.
template <typename F>
void for_each_value(const Tensor& x, F f) {
  dispatch(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.data_ptr());
    const std::array<const std::vector<int64_t>*, 1> strides{&x.strides()};
    internal::for_each_row<1>(x.shape(), strides, [&](auto off, int64_t len, auto in) {
      const T* r = p + off[0];
      for (int64_t i = 0; i < len; ++i) {
        if constexpr (internal::kIsHalf<T>) f(internal::to_double(r[i * in[0]]));
        else f(static_cast<double>(r[i * in[0]]));
      }
    });
  });
}

}  // namespace

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  check_operand(a, "add", "a");
  check_operand(b, "add", "b");
  check_operand(out, "add", "out");
  check_same(a, b, "add", "a", "b");
  check_same(a, out, "add", "a", "out");
  check_no_partial_overlap(out, a, "add", "a");
  check_no_partial_overlap(out, b, "add", "b");
  dispatch(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (internal::kIsInt<T>)
      binary_kernel<T>(a, b, out, [](T x, T y) { return wrap_add(x, y); });
    else
      binary_kernel<T>(a, b, out, [](T x, T y) { return store<T>(load(x) + load(y)); });
  });
}

void mul(const Tensor& a, const Tensor& b, const Tensor& out) {
  check_operand(a, "mul", "a");
  check_operand(b, "mul", "b");
  check_operand(out, "mul", "out");
  check_same(a, b, "mul", "a", "b");
  check_same(a, out, "mul", "a", "out");
  check_no_partial_overlap(out, a, "mul", "a");
  check_no_partial_overlap(out, b, "mul", "b");
  dispatch(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (internal::kIsInt<T>)
      binary_kernel<T>(a, b, out, [](T x, T y) { return wrap_mul(x, y); });
    else
      binary_kernel<T>(a, b, out, [](T x, T y) { return store<T>(load(x) * load(y)); });
  });
}

namespace {

// One element of a float tensor as f32, and back (rounded to nearest even).
template <DType T>
float widen(const void* p, int64_t i) {
  if constexpr (T == DType::f32) return static_cast<const float*>(p)[i];
  else if constexpr (T == DType::bf16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  else return f16_to_float(static_cast<const uint16_t*>(p)[i]);
}
template <DType T>
void narrow_store(void* p, int64_t i, float v) {
  if constexpr (T == DType::f32) static_cast<float*>(p)[i] = v;
  else if constexpr (T == DType::bf16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  else static_cast<uint16_t*>(p)[i] = float_to_f16(v);
}
template <DType D, DType S>
void accumulate_as(void* dst, const void* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) narrow_store<D>(dst, i, widen<D>(dst, i) + widen<S>(src, i));
}
template <DType D>
void accumulate_from(void* dst, const Tensor& src, int64_t n) {
  switch (src.dtype()) {
    case DType::f32: return accumulate_as<D, DType::f32>(dst, src.data_ptr(), n);
    case DType::bf16: return accumulate_as<D, DType::bf16>(dst, src.data_ptr(), n);
    default: return accumulate_as<D, DType::f16>(dst, src.data_ptr(), n);
  }
}
bool is_float(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

}  // namespace

namespace {

// Sum of float(g)^2 in double, in element order.
template <float (*Widen)(uint16_t)>
double sq_norm_half(const uint16_t* g, size_t n) {
  double acc = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double x = Widen(g[i]);
    acc += x * x;
  }
  return acc;
}

double sum_of_squares_impl(const Tensor& g) {
  const size_t n = static_cast<size_t>(g.numel());
  switch (g.dtype()) {
    case DType::bf16: return sq_norm_half<bf16_to_float>(g.data<uint16_t>(), n);
    case DType::f16: return sq_norm_half<f16_to_float>(g.data<uint16_t>(), n);
    default: {  // f32 (checked by the caller)
      const float* x = g.data<float>();
      double acc = 0.0;
      for (size_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * static_cast<double>(x[i]);
      return acc;
    }
  }
}

// True when no element of bits[0, n) has an all-ones exponent field (inf or
// NaN) under `exp_mask`. An OR of per-element compares instead of a branch
// per element, so the loop vectorizes with the baseline x86-64 instruction
// set (a max reduction needs SSE4.1's pmaxud and ran 4x slower: 198 vs 54 us
// for the MLP's 670K f32 parameters, scanned twice per training step).
template <typename U>
bool exponents_finite(const U* bits, size_t n, U exp_mask) {
  U bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<U>((bits[i] & exp_mask) == exp_mask);
  return bad == 0;
}

bool all_finite_impl(const Tensor& g) {
  const size_t n = static_cast<size_t>(g.numel());
  switch (g.dtype()) {
    case DType::bf16: return exponents_finite<uint16_t>(g.data<uint16_t>(), n, 0x7f80u);
    case DType::f16: return exponents_finite<uint16_t>(g.data<uint16_t>(), n, 0x7c00u);
    default: {  // f32, read as bits (no aliasing through uint32_t*)
      const float* x = g.data<float>();
      uint32_t bad = 0;
      for (size_t i = 0; i < n; ++i)
        bad |= static_cast<uint32_t>((std::bit_cast<uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u);
      return bad == 0;
    }
  }
}


void check_float_contiguous(const Tensor& x, const char* op) {
  check_operand(x, op, "x");
  if ((x.dtype() != DType::f32 && x.dtype() != DType::bf16 && x.dtype() != DType::f16) || !x.is_contiguous())
    throw InvalidArgument(op, fmt::format("x is {} {}", dtype_name(x.dtype()), x.is_contiguous() ? "" : "(strided)"),
                          "pass a contiguous f32, bf16 or f16 tensor");
}

}  // namespace

bool all_finite(const Tensor& x) {
  check_float_contiguous(x, "all_finite");
  return all_finite_impl(x);
}

double sum_of_squares(const Tensor& x) {
  check_float_contiguous(x, "sum_of_squares");
  return sum_of_squares_impl(x);
}

void accumulate(const Tensor& src, const Tensor& dst) {
  check_operand(src, "accumulate", "src");
  check_operand(dst, "accumulate", "dst");
  if (!is_float(src.dtype()) || !is_float(dst.dtype()) || !src.is_contiguous() || !dst.is_contiguous() ||
      src.numel() != dst.numel())
    throw InvalidArgument("accumulate",
                          fmt::format("src {} {} into dst {} {}", dtype_name(src.dtype()), shape_to_string(src.shape()),
                                      dtype_name(dst.dtype()), shape_to_string(dst.shape())),
                          "pass contiguous f32/bf16/f16 tensors of the same number of elements");
  const int64_t n = dst.numel();
  switch (dst.dtype()) {
    case DType::f32: return accumulate_from<DType::f32>(dst.data_ptr(), src, n);
    case DType::bf16: return accumulate_from<DType::bf16>(dst.data_ptr(), src, n);
    default: return accumulate_from<DType::f16>(dst.data_ptr(), src, n);
  }
}

void axpy(double alpha, const Tensor& x, const Tensor& y) {
  check_operand(x, "axpy", "x");
  check_operand(y, "axpy", "y");
  check_same(x, y, "axpy", "x", "y");
  check_no_partial_overlap(y, x, "axpy", "x");
  dispatch(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (internal::kIsInt<T>) {
      const uint64_t a = integral_alpha(alpha, y.dtype(), "axpy");
      binary_kernel<T>(x, y, y, [a](T xv, T yv) { return wrap_axpy(a, xv, yv); });
    } else {
      const Compute<T> a = static_cast<Compute<T>>(alpha);
      binary_kernel<T>(x, y, y, [a](T xv, T yv) { return store<T>(load(yv) + a * load(xv)); });
    }
  });
}

void scale(const Tensor& x, double alpha) {
  check_operand(x, "scale", "x");
  dispatch(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (internal::kIsInt<T>) {
      const T a = static_cast<T>(integral_alpha(alpha, x.dtype(), "scale"));  // mod 2^bits
      unary_inplace_kernel<T>(x, [a](T v) { return wrap_mul(v, a); });
    } else {
      const Compute<T> a = static_cast<Compute<T>>(alpha);
      unary_inplace_kernel<T>(x, [a](T v) { return store<T>(load(v) * a); });
    }
  });
}

void round_to(const Tensor& x, DType dtype) {
  check_operand(x, "round_to", "x");
  if (x.dtype() != DType::f32 || (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16))
    throw InvalidArgument("round_to", fmt::format("x is {}, dtype {}", dtype_name(x.dtype()), dtype_name(dtype)),
                          "round an f32 tensor to bf16, f16 (or f32: no-op)");
  if (dtype == DType::bf16 && x.is_contiguous()) {
    float* p = x.data<float>();
    parallel_for(x.numel(), 1 << 16,
                 [p](int64_t b, int64_t e) { internal::round_f32_to_bf16(p + b, static_cast<size_t>(e - b)); });
  }
  else if (dtype == DType::bf16)
    unary_inplace_kernel<float>(x, [](float v) { return bf16_to_float(float_to_bf16(v)); });
  else if (dtype == DType::f16 && x.is_contiguous()) {  // through F16C when present, in cache-sized chunks
    float* p = x.data<float>();
    uint16_t h[1024];
    for (int64_t i = 0, n = x.numel(); i < n; i += 1024) {
      const size_t m = static_cast<size_t>(std::min<int64_t>(1024, n - i));
      internal::f32_to_f16(p + i, h, m);
      internal::f16_to_f32(h, p + i, m);
    }
  } else if (dtype == DType::f16) {
    unary_inplace_kernel<float>(x, [](float v) { return f16_to_float(float_to_f16(v)); });
  }
}

double sum(const Tensor& x) {
  check_operand(x, "sum", "x");
  double acc = 0.0;
  for_each_value(x, [&](double v) { acc += v; });
  return acc;
}

double max(const Tensor& x) {
  check_operand(x, "max", "x");
  if (x.numel() == 0)
    throw InvalidArgument("max", fmt::format("tensor of shape {} is empty", shape_to_string(x.shape())),
                          "max of no elements is undefined; check numel() first");
  double best = -std::numeric_limits<double>::infinity();
  bool nan = false;
  for_each_value(x, [&](double v) {
    if (std::isnan(v)) nan = true;
    else if (v > best) best = v;
  });
  return nan ? std::numeric_limits<double>::quiet_NaN() : best;
}

double l2_norm(const Tensor& x) {
  check_operand(x, "l2_norm", "x");
  // Squares of every dtype but f64 stay far inside double's range
  // (f32: 3.4e38^2 = 1.2e77, smallest subnormal^2 = 2e-90), so only f64 can
  // overflow or underflow and needs the scaled sum.
  double scale_by = 1.0;
  if (x.dtype() == DType::f64) {
    double amax = 0.0;
    bool nan = false;
    for_each_value(x, [&](double v) {
      nan = nan || std::isnan(v);
      amax = std::max(amax, std::fabs(v));
    });
    if (nan) return std::numeric_limits<double>::quiet_NaN();
    if (std::isinf(amax) || amax == 0.0) return amax;
    if (amax > 0x1p450 || amax < 0x1p-450) scale_by = amax;
  }
  double acc = 0.0;
  for_each_value(x, [&](double v) {
    const double s = v / scale_by;
    acc += s * s;
  });
  return scale_by * std::sqrt(acc);
}

}  // namespace meshtrain
