#include "meshtrain/core/exact_squares.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

#include "meshtrain/core/error.h"
#include "meshtrain/core/parallel_for.h"

namespace meshtrain {

void ExactSquares::add_square(int bin, uint64_t square) {
  const uint64_t lo = lo_[static_cast<size_t>(bin)] + square;
  hi_[static_cast<size_t>(bin)] += lo < square ? 1 : 0;  // the carry
  lo_[static_cast<size_t>(bin)] = lo;
}

void ExactSquares::add(const float* x, int64_t n) {
  std::mutex mu;
  parallel_for(n, int64_t{1} << 16, [&](int64_t b, int64_t e) {
    ExactSquares part;
    for (int64_t i = b; i < e; ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      const int exponent = static_cast<int>((bits >> 23) & 0xffu);
      const uint64_t frac = bits & 0x7fffffu;
      if (exponent == 0xff) {  // inf (counted in bin 255) or NaN
        if (frac != 0) ++part.nans_;
        else part.add_square(kBins - 1, 1);
        continue;
      }
      const uint64_t m = exponent == 0 ? frac : (frac | 0x800000u);
      part.add_square(exponent == 0 ? 1 : exponent, m * m);
    }
    std::lock_guard lock(mu);
    merge(part);
  });
}

void ExactSquares::merge(const ExactSquares& other) {
  for (int b = 0; b < kBins; ++b) {
    const uint64_t lo = lo_[static_cast<size_t>(b)] + other.lo_[static_cast<size_t>(b)];
    hi_[static_cast<size_t>(b)] += other.hi_[static_cast<size_t>(b)] + (lo < other.lo_[static_cast<size_t>(b)] ? 1 : 0);
    lo_[static_cast<size_t>(b)] = lo;
  }
  nans_ += other.nans_;
}

double ExactSquares::value() const {
  if (nans_ > 0) return std::numeric_limits<double>::quiet_NaN();
  if (lo_[kBins - 1] != 0 || hi_[kBins - 1] != 0) return std::numeric_limits<double>::infinity();
  double sum = 0;
  for (int b = 1; b < kBins - 1; ++b) {
    const double bin = std::ldexp(static_cast<double>(hi_[static_cast<size_t>(b)]), 64) +
                       static_cast<double>(lo_[static_cast<size_t>(b)]);
    sum += std::ldexp(bin, 2 * (b - 150));
  }
  return sum;
}

std::vector<uint64_t> ExactSquares::words() const {
  std::vector<uint64_t> w(2 * kBins + 1);
  for (int b = 0; b < kBins; ++b) {
    w[2 * static_cast<size_t>(b)] = lo_[static_cast<size_t>(b)];
    w[2 * static_cast<size_t>(b) + 1] = hi_[static_cast<size_t>(b)];
  }
  w.back() = nans_;
  return w;
}

ExactSquares ExactSquares::from_words(std::span<const uint64_t> words) {
  if (words.size() != 2 * kBins + 1)
    throw InvalidArgument("ExactSquares::from_words", std::to_string(words.size()) + " words",
                          "pass what words() returned");
  ExactSquares s;
  for (int b = 0; b < kBins; ++b) {
    s.lo_[static_cast<size_t>(b)] = words[2 * static_cast<size_t>(b)];
    s.hi_[static_cast<size_t>(b)] = words[2 * static_cast<size_t>(b) + 1];
  }
  s.nans_ = words.back();
  return s;
}

}  // namespace meshtrain
