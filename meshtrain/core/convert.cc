#include "meshtrain/core/internal/convert.h"

#include "meshtrain/core/half.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace meshtrain::internal {

void f32_to_f16_portable(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = float_to_f16(in[i]);
}

void f16_to_f32_portable(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_float(in[i]);
}

#if defined(__x86_64__)

namespace {

__attribute__((target("avx,f16c"))) void f32_to_f16_f16c(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  f32_to_f16_portable(in + i, out + i, n - i);
}

__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  f16_to_f32_portable(in + i, out + i, n - i);
}

const bool kF16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");

}  // namespace

bool have_f16c() { return kF16c; }

void f32_to_f16(const float* in, uint16_t* out, size_t n) {
  if (kF16c) f32_to_f16_f16c(in, out, n);
  else f32_to_f16_portable(in, out, n);
}

void f16_to_f32(const uint16_t* in, float* out, size_t n) {
  if (kF16c) f16_to_f32_f16c(in, out, n);
  else f16_to_f32_portable(in, out, n);
}

#else

bool have_f16c() { return false; }
void f32_to_f16(const float* in, uint16_t* out, size_t n) { f32_to_f16_portable(in, out, n); }
void f16_to_f32(const uint16_t* in, float* out, size_t n) { f16_to_f32_portable(in, out, n); }

#endif

}  // namespace meshtrain::internal
