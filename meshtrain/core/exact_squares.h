// The exact sum of squares of f32 values (the deterministic mode's global
// gradient norm, docs/determinism.md): integer arithmetic, so the sum does
// not depend on the order of the values, how they were split over threads,
// ranks or shards, or how partial sums were merged.
//
// A finite f32 x is m * 2^(e - 150) with an integer m < 2^24 (e the biased
// exponent, 1 for subnormals); x^2 = m^2 * 2^(2(e - 150)) with m^2 < 2^48 is
// added, exactly, to a 128-bit integer bin of its e. value() rounds each
// bin to double and adds the bins in ascending e: equal bins, equal bits.
//
//   ExactSquares s;
//   s.add(grad.data<float>(), grad.numel());   // over the rank's threads
//   s.merge(other);                             // another shard's
//   const double norm = std::sqrt(s.value());
//   comm.all_gather(s.words().data(), ...);     // words(): 2 per bin, from_words() back
//
// Thread-safety: a value; add() runs over the rank's threads internally.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace meshtrain {

class ExactSquares {
 public:
  static constexpr int kBins = 256;  // bin 255: inf and NaN (their count)
  // Adds x[i]^2 for i < n (parallel_for over the rank's threads).
  void add(const float* x, int64_t n);
  void merge(const ExactSquares& other);
  // The sum, rounded: inf when any value was inf, NaN when one was NaN.
  double value() const;
  // 2 * kBins + 1 words (each bin's low and high 64 bits, then NaN's count),
  // for sending; from_words reads them back.
  std::vector<uint64_t> words() const;
  static ExactSquares from_words(std::span<const uint64_t> words);

 private:
  void add_square(int bin, uint64_t square);
  std::array<uint64_t, kBins> lo_{}, hi_{};
  uint64_t nans_ = 0;
};

}  // namespace meshtrain
