#include "meshtrain/core/internal/convert.h"

#include "meshtrain/core/cpu_isa.h"
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

void f32_to_bf16_portable(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

namespace {
void bf16_to_f32_portable(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void round_f32_to_bf16_portable(float* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = bf16_to_float(float_to_bf16(p[i]));
}
}  // namespace

#if defined(__x86_64__)

namespace {

// 16 floats' bits rounded as float_to_bf16 does, kept in the top 16 bits:
// NaN -> quiet (bit 22 set), else x + 0x7fff + bit 16 (ties to even). The
// maskz forms with a full mask are the plain instructions; they avoid GCC
// 12's headers' _mm512_undefined_epi32, which -Wmaybe-uninitialized flags.
constexpr __mmask16 kAll = 0xffff;
__attribute__((target("avx512f"))) inline __m512i bf16_round16(__m512i x) {
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_maskz_srli_epi32(kAll, x, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(x, _mm512_set1_epi32(0x00400000)));
}

__attribute__((target("avx512f"))) void f32_to_bf16_avx512(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = bf16_round16(_mm512_loadu_si512(in + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_maskz_cvtepi32_epi16(kAll, _mm512_maskz_srli_epi32(kAll, r, 16)));
  }
  f32_to_bf16_portable(in + i, out + i, n - i);
}

__attribute__((target("avx512f"))) void round_f32_to_bf16_avx512(float* p, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = bf16_round16(_mm512_loadu_si512(p + i));
    _mm512_storeu_si512(p + i, _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  round_f32_to_bf16_portable(p + i, n - i);
}

// GCC 12's avx512fintrin.h builds _mm512_cvtepu16_epi32's result from an
// _mm512_undefined_epi32() and then warns that it may be uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) void bf16_to_f32_avx512(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    _mm512_storeu_si512(out + i, _mm512_maskz_slli_epi32(kAll, w, 16));
  }
  bf16_to_f32_portable(in + i, out + i, n - i);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

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

// The vector paths follow cpu_isa() (MESHTRAIN_CPU_ISA caps them): AVX2
// implies F16C there.
bool use_avx512() {
  static const bool b = cpu_isa() >= CpuIsa::avx512;
  return b;
}
bool use_f16c() {
  static const bool b = cpu_isa() >= CpuIsa::avx2;
  return b;
}

}  // namespace

bool have_f16c() { return use_f16c(); }

void f32_to_f16(const float* in, uint16_t* out, size_t n) {
  if (use_f16c()) f32_to_f16_f16c(in, out, n);
  else f32_to_f16_portable(in, out, n);
}

void f16_to_f32(const uint16_t* in, float* out, size_t n) {
  if (use_f16c()) f16_to_f32_f16c(in, out, n);
  else f16_to_f32_portable(in, out, n);
}

bool have_avx512_bf16_rounding() { return use_avx512(); }

void f32_to_bf16(const float* in, uint16_t* out, size_t n) {
  if (use_avx512()) f32_to_bf16_avx512(in, out, n);
  else f32_to_bf16_portable(in, out, n);
}

void round_f32_to_bf16(float* p, size_t n) {
  if (use_avx512()) round_f32_to_bf16_avx512(p, n);
  else round_f32_to_bf16_portable(p, n);
}

void bf16_to_f32(const uint16_t* in, float* out, size_t n) {
  if (use_avx512()) bf16_to_f32_avx512(in, out, n);
  else bf16_to_f32_portable(in, out, n);
}

#else

bool have_f16c() { return false; }
void f32_to_f16(const float* in, uint16_t* out, size_t n) { f32_to_f16_portable(in, out, n); }
void f16_to_f32(const uint16_t* in, float* out, size_t n) { f16_to_f32_portable(in, out, n); }
bool have_avx512_bf16_rounding() { return false; }
void f32_to_bf16(const float* in, uint16_t* out, size_t n) { f32_to_bf16_portable(in, out, n); }
void round_f32_to_bf16(float* p, size_t n) { round_f32_to_bf16_portable(p, n); }
void bf16_to_f32(const uint16_t* in, float* out, size_t n) { bf16_to_f32_portable(in, out, n); }

#endif

}  // namespace meshtrain::internal
