#include "meshtrain/core/random.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <numbers>
#include <type_traits>

#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/elements.h"

namespace meshtrain {
namespace {

constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

inline PhiloxCounter philox_round(PhiloxCounter c, PhiloxKey k) {
  const uint64_t p0 = uint64_t{kMul0} * c[0];
  const uint64_t p1 = uint64_t{kMul1} * c[2];
  const auto hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
  const auto hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
  return {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
}

// The four words of block `block` of stream (seed, key): see random.h.
inline PhiloxCounter block_words(uint64_t seed, uint64_t key, uint64_t block) {
  return philox4x32_10({static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                        static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

inline double uniform_from(const PhiloxCounter& w, unsigned lane, double lo, double hi) {
  return lo + (hi - lo) * (static_cast<double>(w[lane]) * 0x1p-32);
}

inline double normal_from(const PhiloxCounter& w, unsigned lane, double mean, double std) {
  const unsigned p = lane / 2;
  const double u1 = (static_cast<double>(w[2 * p]) + 0.5) * 0x1p-32;  // never 0: ln stays finite
  const double u2 = static_cast<double>(w[2 * p + 1]) * 0x1p-32;
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 2.0 * std::numbers::pi * u2;
  const double z = (lane % 2 == 0) ? r * std::cos(theta) : r * std::sin(theta);
  return mean + std * z;
}

// Calls emit(j, words, lane) for j in [0, n) with index start + j, computing
// each Philox block once.
template <typename Emit>
void for_each_index(size_t n, uint64_t seed, uint64_t key, uint64_t start, Emit emit) {
  size_t j = 0;
  uint64_t i = start;
  while (j < n) {
    const PhiloxCounter w = block_words(seed, key, i / 4);
    for (unsigned lane = static_cast<unsigned>(i % 4); lane < 4 && j < n; ++lane, ++j, ++i) emit(j, w, lane);
  }
}

void check_uniform_args(double lo, double hi, const char* op) {
  if (!(std::isfinite(lo) && std::isfinite(hi) && lo < hi && std::isfinite(hi - lo)))
    throw InvalidArgument(op, fmt::format("bounds lo {} and hi {}", lo, hi),
                          "need finite lo < hi with a finite width hi - lo");
}

void check_normal_args(double mean, double std, const char* op) {
  if (!(std::isfinite(mean) && std::isfinite(std) && std >= 0))
    throw InvalidArgument(op, fmt::format("mean {} and std {}", mean, std), "need finite mean and finite std >= 0");
}

void check_out(const void* out, size_t n, const char* op) {
  if (out == nullptr && n > 0)
    throw InvalidArgument(op, fmt::format("null output for {} values", n), "pass a buffer of n elements");
}

// The largest T below v (v finite).
template <typename T>
T next_down(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::nextafter(v, -std::numeric_limits<T>::infinity());
  } else {  // bf16/f16 bit patterns are sign-magnitude, like float
    if (v.bits == 0x0000) return T{0x8001};
    if (v.bits & 0x8000) return T{static_cast<uint16_t>(v.bits + 1)};  // -0 -> -min subnormal
    return T{static_cast<uint16_t>(v.bits - 1)};
  }
}

// Canonical uniform value rounded to T, kept below hi.
template <typename T>
T round_uniform(double v, double hi) {
  T r = internal::from_double<T>(v);
  while (internal::to_double(r) >= hi) r = next_down(r);
  return r;
}

template <typename T>
void fill_uniform_typed(T* out, size_t n, uint64_t seed, uint64_t key, uint64_t start, double lo, double hi) {
  for_each_index(n, seed, key, start, [&](size_t j, const PhiloxCounter& w, unsigned lane) {
    out[j] = round_uniform<T>(uniform_from(w, lane, lo, hi), hi);
  });
}

template <typename T>
void fill_normal_typed(T* out, size_t n, uint64_t seed, uint64_t key, uint64_t start, double mean,
                       double std) {
  for_each_index(n, seed, key, start, [&](size_t j, const PhiloxCounter& w, unsigned lane) {
    out[j] = internal::from_double<T>(normal_from(w, lane, mean, std));
  });
}

// Runs fill(T* contiguous_buffer) for the tensor's dtype, writing through a
// contiguous copy when the tensor is strided.
template <typename Fill>
void fill_tensor(const Tensor& t, const char* op, Fill fill) {
  if (!t.defined())
    throw InvalidArgument(op, "the tensor is undefined", "create it with Tensor::empty first");
  if (t.device().type != DeviceType::cpu)
    throw Unsupported(op, fmt::format("tensor on {}", t.device().to_string()), "random fills run on cpu tensors");
  if (!is_floating(t.dtype()))
    throw InvalidArgument(op, fmt::format("dtype {} is not floating", dtype_name(t.dtype())),
                          "fill an f32 tensor and convert with to()");
  Tensor buf = t.is_contiguous() ? t : Tensor::empty(t.shape(), t.dtype());
  internal::dispatch(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (internal::kIsFloat<T>) fill(static_cast<T*>(buf.data_ptr()), static_cast<size_t>(t.numel()));
  });
  if (!t.is_contiguous()) t.copy_from(buf);
}

}  // namespace

PhiloxCounter philox4x32_10(PhiloxCounter counter, PhiloxKey key) {
  counter = philox_round(counter, key);
  for (int r = 1; r < 10; ++r) {
    key[0] += kWeyl0;
    key[1] += kWeyl1;
    counter = philox_round(counter, key);
  }
  return counter;
}

uint64_t key_from_name(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;  // FNV 64 prime
  }
  return h;
}

double uniform_at(uint64_t seed, uint64_t key, uint64_t index, double lo, double hi) {
  return uniform_from(block_words(seed, key, index / 4), static_cast<unsigned>(index % 4), lo, hi);
}

double normal_at(uint64_t seed, uint64_t key, uint64_t index, double mean, double std) {
  return normal_from(block_words(seed, key, index / 4), static_cast<unsigned>(index % 4), mean, std);
}

void fill_uniform(float* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, float lo, float hi) {
  check_out(out, n, "fill_uniform");
  check_uniform_args(lo, hi, "fill_uniform");
  fill_uniform_typed(out, n, seed, key, start_index, lo, hi);
}

void fill_uniform(double* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, double lo,
                  double hi) {
  check_out(out, n, "fill_uniform");
  check_uniform_args(lo, hi, "fill_uniform");
  fill_uniform_typed(out, n, seed, key, start_index, lo, hi);
}

void fill_normal(float* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, float mean,
                 float std) {
  check_out(out, n, "fill_normal");
  check_normal_args(mean, std, "fill_normal");
  fill_normal_typed(out, n, seed, key, start_index, mean, std);
}

void fill_normal(double* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, double mean,
                 double std) {
  check_out(out, n, "fill_normal");
  check_normal_args(mean, std, "fill_normal");
  fill_normal_typed(out, n, seed, key, start_index, mean, std);
}

void fill_uniform(const Tensor& t, uint64_t seed, uint64_t key, double lo, double hi, uint64_t start_index) {
  check_uniform_args(lo, hi, "fill_uniform");
  fill_tensor(t, "fill_uniform", [&](auto* p, size_t n) { fill_uniform_typed(p, n, seed, key, start_index, lo, hi); });
}

void fill_normal(const Tensor& t, uint64_t seed, uint64_t key, double mean, double std, uint64_t start_index) {
  check_normal_args(mean, std, "fill_normal");
  fill_tensor(t, "fill_normal",
              [&](auto* p, size_t n) { fill_normal_typed(p, n, seed, key, start_index, mean, std); });
}

}  // namespace meshtrain
