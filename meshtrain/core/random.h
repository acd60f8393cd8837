// Counter-based random numbers (Philox4x32-10) for layout-invariant
// initialization: the value at global index i is a pure function of
// (seed, key, i), so a rank that holds elements [a, b) of a parameter fills
// exactly those and gets the same bits as the same slice of the full tensor.
//
//   const uint64_t key = key_from_name("layers.0.mlp.w1");
//   Tensor w = Tensor::empty({1024, 4096}, DType::f32);
//   fill_normal(w, /*seed=*/42, key, 0.0, 0.02);            // whole tensor
//   std::vector<float> shard(1000);                          // elements [5000, 6000)
//   fill_normal(shard.data(), shard.size(), 42, key, 5000, 0.0f, 0.02f);
//   // shard[j] == w.data<float>()[5000 + j], bit for bit.
//
// Stream layout (stable; changing it changes every initialized model):
//   block b = i / 4 is philox4x32_10(counter = {b lo32, b hi32, key lo32, key hi32},
//                                    philox key = {seed lo32, seed hi32}),
//   four 32-bit words w[0..3]; element i uses the words of block i / 4 only:
//   uniform  u = w[i % 4] * 2^-32 in [0, 1); value = lo + (hi - lo) * u;
//   normal   pair p = (i % 4) / 2, u1 = (w[2p] + 0.5) * 2^-32 in (0, 1),
//            u2 = w[2p + 1] * 2^-32, r = sqrt(-2 ln u1), z = r cos(2 pi u2) for
//            even i, r sin(2 pi u2) for odd i; value = mean + std * z.
// Values are computed in double (the canonical value) and rounded once to the
// output dtype (round to nearest even), so an f32 fill equals the f64 fill
// rounded to float, and a bf16 fill equals the f64 fill rounded to bf16.
// Uniform values rounded up to hi are replaced by the largest value below hi,
// so outputs lie in [lo, hi) when lo and hi are representable in the dtype.
// Bit-identical across runs and ranks of one build; the normal's ln/cos/sin
// come from the C library, so another libm may differ in the last bit.
//
// Thread-safety: pure functions; concurrent fills of disjoint outputs are safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "meshtrain/core/tensor.h"

namespace meshtrain {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// The Philox4x32 bijection with 10 rounds (Salmon et al., SC'11; Random123).
PhiloxCounter philox4x32_10(PhiloxCounter counter, PhiloxKey key);

// FNV-1a 64-bit hash of `name`: a stable key for a parameter name. Stable
// across versions and platforms (checkpoints and shards depend on it).
uint64_t key_from_name(std::string_view name);

// The canonical (double) value at global index `index`; fills round it.
double uniform_at(uint64_t seed, uint64_t key, uint64_t index, double lo, double hi);
double normal_at(uint64_t seed, uint64_t key, uint64_t index, double mean, double std);

// out[j] = value at global index start_index + j, for j in [0, n).
// Uniform needs finite lo < hi; normal needs finite mean and finite std >= 0.
// Throws InvalidArgument otherwise, or when out is null and n > 0.
void fill_uniform(float* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, float lo,
                  float hi);
void fill_uniform(double* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, double lo,
                  double hi);
void fill_normal(float* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, float mean,
                 float std);
void fill_normal(double* out, size_t n, uint64_t seed, uint64_t key, uint64_t start_index, double mean,
                 double std);

// Fills a floating tensor (f32, f64, bf16, f16; any strides) treating its
// elements, in row-major order, as global indices [start_index,
// start_index + numel). Integer dtypes throw InvalidArgument.
void fill_uniform(const Tensor& t, uint64_t seed, uint64_t key, double lo, double hi,
                  uint64_t start_index = 0);
void fill_normal(const Tensor& t, uint64_t seed, uint64_t key, double mean, double std,
                 uint64_t start_index = 0);

}  // namespace meshtrain
