// Test helpers: central finite differences against analytic gradients (and
// a hook that records grad_ready), for the tests of nn and above.
//
//   Tensor w = random_tensor({4, 3}, 7);                 // fixed weights of the probe
//   auto loss = [&] { return weighted_sum(layer.forward(x), w); };  // sum(w * y), in double
//   layer.zero_grad(); layer.forward(x); Tensor dx = layer.backward(w);
//   expect_grad_matches(loss, x, dx);                    // perturbs x in place
//
// The probe perturbs one f32 element by +-h, evaluates the scalar in double
// and divides by the perturbation actually stored in f32 ((x+h) - (x-h) after
// rounding), which removes the representation error of the step.
// Thread-safety: test code, one thread.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/random.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::testing {

// f32 tensor of `shape` with values U(lo, hi) from the counter-based generator.
inline Tensor random_tensor(std::vector<int64_t> shape, uint64_t key, double lo = -1.0, double hi = 1.0) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  fill_uniform(t, /*seed=*/1234, key, lo, hi);
  return t;
}

// sum(w * y) in double; shapes must match.
inline double weighted_sum(const Tensor& y, const Tensor& w) {
  EXPECT_EQ(y.shape(), w.shape());
  const std::vector<double> a = y.to_vector(), b = w.to_vector();
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// d f / d t[i] by central differences; t must be contiguous f32 and is restored.
inline double numeric_grad(const std::function<double()>& f, const Tensor& t, int64_t i, double h) {
  float* p = t.data<float>() + i;
  const float orig = *p;
  const float plus = static_cast<float>(orig + h), minus = static_cast<float>(orig - h);
  *p = plus;
  const double fp = f();
  *p = minus;
  const double fm = f();
  *p = orig;
  return (fp - fm) / (static_cast<double>(plus) - static_cast<double>(minus));
}

// Analytic vs numeric gradients at chosen elements.
struct GradComparison {
  std::vector<int64_t> indices;
  std::vector<double> analytic, numeric;
  double relative_error = 0.0;  // ||a - n|| / max(||a||, ||n||)
};

// Central differences at `indices` (all elements when empty) next to `analytic`
// (same shape as t).
inline GradComparison compare_grads(const std::function<double()>& f, const Tensor& t, const Tensor& analytic,
                                    double h = 1e-2, std::vector<int64_t> indices = {}) {
  GradComparison c;
  EXPECT_TRUE(analytic.defined());
  EXPECT_EQ(t.shape(), analytic.shape());
  if (!analytic.defined() || t.shape() != analytic.shape()) return c;
  if (indices.empty()) {
    for (int64_t i = 0; i < t.numel(); ++i) indices.push_back(i);
  }
  const std::vector<double> a_all = analytic.contiguous().to_vector();
  double diff2 = 0.0, a2 = 0.0, n2 = 0.0;
  for (int64_t i : indices) {
    const double a = a_all[static_cast<size_t>(i)], n = numeric_grad(f, t, i, h);
    c.analytic.push_back(a);
    c.numeric.push_back(n);
    diff2 += (a - n) * (a - n);
    a2 += a * a;
    n2 += n * n;
  }
  c.indices = std::move(indices);
  c.relative_error = std::sqrt(diff2) / std::max({std::sqrt(a2), std::sqrt(n2), 1e-30});
  return c;
}

// Passes when compare_grads' relative error < rtol and every element has
// |a - n| <= rtol * (|n| + max|n|) + 1e-7.
inline void expect_grad_matches(const std::function<double()>& f, const Tensor& t, const Tensor& analytic,
                                double h = 1e-2, double rtol = 1e-3, std::vector<int64_t> indices = {}) {
  const GradComparison c = compare_grads(f, t, analytic, h, std::move(indices));
  double nmax = 0.0;
  for (double n : c.numeric) nmax = std::max(nmax, std::fabs(n));
  EXPECT_LT(c.relative_error, rtol) << "relative gradient error over " << c.indices.size() << " elements";
  for (size_t k = 0; k < c.indices.size(); ++k) {
    EXPECT_LE(std::fabs(c.analytic[k] - c.numeric[k]), rtol * (std::fabs(c.numeric[k]) + nmax) + 1e-7)
        << "element " << c.indices[k] << ": analytic " << c.analytic[k] << ", numeric " << c.numeric[k];
  }
}

// Records grad_ready calls in order (parameter names).
class RecordingHook : public nn::ParamHook {
 public:
  void grad_ready(nn::Parameter& p) override { names.push_back(p.name); }
  std::vector<std::string> names;
};

}  // namespace meshtrain::testing
