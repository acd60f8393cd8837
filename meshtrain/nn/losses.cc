#include "meshtrain/nn/losses.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

namespace {

// The normalizer to use: the given one (finite, > 0) or `fallback`.
double resolve_normalizer(std::optional<double> normalizer, double fallback, const char* op) {
  if (!normalizer) return fallback > 0.0 ? fallback : 1.0;  // empty input: the sum is 0 anyway
  if (!(*normalizer > 0.0) || !std::isfinite(*normalizer))
    throw InvalidArgument(op, fmt::format("normalizer {}", *normalizer),
                          "pass a finite normalizer > 0 (e.g. the global batch size), or omit it");
  return *normalizer;
}

void check_forward_done(double normalizer, const char* op) {
  if (normalizer == 0.0) throw InvalidArgument(op, "no forward to go back through", "call forward first");
}

// Labels as int64, checked against the class count.
void read_labels(const Tensor& labels, int64_t n, int64_t classes, const char* op, std::vector<int64_t>& out) {
  if (!labels.defined() || labels.dim() != 1 || labels.size(0) != n ||
      (labels.dtype() != DType::i64 && labels.dtype() != DType::i32))
    throw InvalidArgument(op,
                          fmt::format("labels {} for {} rows", labels.defined()
                                                                    ? fmt::format("{} {}", dtype_name(labels.dtype()),
                                                                                  shape_to_string(labels.shape()))
                                                                    : std::string("undefined"),
                                      n),
                          "pass labels as a 1-d i64 or i32 tensor with one entry per row of logits");
  out.resize(static_cast<size_t>(n));
  Tensor lc = labels.contiguous();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = labels.dtype() == DType::i64 ? lc.data<int64_t>()[i] : lc.data<int32_t>()[i];
    if (y < 0 || y >= classes)
      throw InvalidArgument(op, fmt::format("label {} of row {} is outside [0, {})", y, i, classes),
                            "labels are class indices");
    out[static_cast<size_t>(i)] = y;
  }
}

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  if (a.shape() != b.shape())
    throw InvalidArgument(op,
                          fmt::format("input {} and target {} differ in shape", shape_to_string(a.shape()),
                                      shape_to_string(b.shape())),
                          "pass a target of the input's shape");
}

// out = src * factor, element-wise over contiguous f32 tensors of equal size.
void scaled_copy(const Tensor& src, const Tensor& out, float factor) {
  const float* s = src.data<float>();
  float* o = out.data<float>();
  const int64_t n = src.numel();
  for (int64_t i = 0; i < n; ++i) o[i] = s[i] * factor;
}

}  // namespace

// ---- CrossEntropyLoss ----

double CrossEntropyLoss::forward(const Tensor& logits, const Tensor& labels, std::optional<double> normalizer) {
  const char* op = "CrossEntropyLoss::forward";
  Tensor z = internal::f32_contiguous(logits, op, "logits");
  if (z.dim() != 2 || z.size(1) < 1)
    throw InvalidArgument(op, fmt::format("logits shape {}", shape_to_string(z.shape())),
                          "pass logits (N, C) with C >= 1; reshape (B, T, C) to (B * T, C)");
  const int64_t n = z.size(0), c = z.size(1);
  read_labels(labels, n, c, op, labels_);
  const double norm = resolve_normalizer(normalizer, static_cast<double>(n), op);
  Tensor& probs = internal::reuse_or_allocate(probs_, {n, c});  // (N, C)
  const float* pz = z.data<float>();
  float* pp = probs.data<float>();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float* zr = pz + i * c;
    float* pr = pp + i * c;
    const float m = *std::max_element(zr, zr + c);
    double s = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      pr[j] = std::exp(zr[j] - m);
      s += pr[j];
    }
    const float inv = static_cast<float>(1.0 / s);
    for (int64_t j = 0; j < c; ++j) pr[j] *= inv;
    // -log softmax(z)[y] = log sum exp(z - m) - (z[y] - m)
    total += std::log(s) - (static_cast<double>(zr[labels_[static_cast<size_t>(i)]]) - m);
  }
  normalizer_ = norm;
  return total / norm;
}

Tensor CrossEntropyLoss::backward(double grad_output) {
  const char* op = "CrossEntropyLoss::backward";
  check_forward_done(normalizer_, op);
  const int64_t n = probs_.size(0), c = probs_.size(1);
  Tensor& g = internal::reuse_or_allocate(grad_, {n, c});  // (N, C)
  const float f = static_cast<float>(grad_output / normalizer_);
  scaled_copy(probs_, g, f);
  float* pg = g.data<float>();
  for (int64_t i = 0; i < n; ++i) pg[i * c + labels_[static_cast<size_t>(i)]] -= f;
  return g;
}

// ---- MSELoss ----

double MSELoss::forward(const Tensor& input, const Tensor& target, std::optional<double> normalizer) {
  const char* op = "MSELoss::forward";
  Tensor x = internal::f32_contiguous(input, op, "input");
  Tensor t = internal::f32_contiguous(target, op, "target");
  check_same(x, t, op);
  const double norm = resolve_normalizer(normalizer, static_cast<double>(x.numel()), op);
  Tensor& d = internal::reuse_or_allocate(diff_, x.shape());
  const float* px = x.data<float>();
  const float* pt = t.data<float>();
  float* pd = d.data<float>();
  const int64_t n = x.numel();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    pd[i] = px[i] - pt[i];
    total += static_cast<double>(pd[i]) * pd[i];
  }
  normalizer_ = norm;
  return total / norm;
}

Tensor MSELoss::backward(double grad_output) {
  check_forward_done(normalizer_, "MSELoss::backward");
  Tensor& g = internal::reuse_or_allocate(grad_, diff_.shape());
  scaled_copy(diff_, g, static_cast<float>(2.0 * grad_output / normalizer_));
  return g;
}

// ---- BCEWithLogitsLoss ----

double BCEWithLogitsLoss::forward(const Tensor& input, const Tensor& target, std::optional<double> normalizer) {
  const char* op = "BCEWithLogitsLoss::forward";
  Tensor x = internal::f32_contiguous(input, op, "input");
  Tensor t = internal::f32_contiguous(target, op, "target");
  check_same(x, t, op);
  const double norm = resolve_normalizer(normalizer, static_cast<double>(x.numel()), op);
  Tensor& gu = internal::reuse_or_allocate(grad_unscaled_, x.shape());
  const float* px = x.data<float>();
  const float* pt = t.data<float>();
  float* pg = gu.data<float>();
  const int64_t n = x.numel();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = px[i];
    // log(1 + exp(-|v|)) never overflows; max(v, 0) - v t completes the loss.
    const float e = std::exp(-std::fabs(v));
    total += static_cast<double>(std::max(v, 0.0f) - v * pt[i] + std::log1p(e));
    const float s = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);  // sigmoid(v), stable
    pg[i] = s - pt[i];
  }
  normalizer_ = norm;
  return total / norm;
}

Tensor BCEWithLogitsLoss::backward(double grad_output) {
  check_forward_done(normalizer_, "BCEWithLogitsLoss::backward");
  Tensor& g = internal::reuse_or_allocate(grad_, grad_unscaled_.shape());
  scaled_copy(grad_unscaled_, g, static_cast<float>(grad_output / normalizer_));
  return g;
}

// ---- GaussianKLLoss ----

double GaussianKLLoss::forward(const Tensor& mu, const Tensor& logvar, std::optional<double> normalizer) {
  const char* op = "GaussianKLLoss::forward";
  Tensor m = internal::f32_contiguous(mu, op, "mu");
  Tensor lv = internal::f32_contiguous(logvar, op, "logvar");
  if (m.shape() != lv.shape() || m.dim() < 1)
    throw InvalidArgument(op,
                          fmt::format("mu {} and logvar {}", shape_to_string(m.shape()),
                                      shape_to_string(lv.shape())),
                          "pass mu and logvar of one shape (N, latent)");
  const double norm = resolve_normalizer(normalizer, static_cast<double>(m.size(0)), op);
  Tensor& gm = internal::reuse_or_allocate(mu_unscaled_, m.shape());
  Tensor& gl = internal::reuse_or_allocate(logvar_unscaled_, m.shape());
  const float* pm = m.data<float>();
  const float* pl = lv.data<float>();
  float* pgm = gm.data<float>();
  float* pgl = gl.data<float>();
  const int64_t n = m.numel();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float var = std::exp(pl[i]);
    total += -0.5 * (1.0 + static_cast<double>(pl[i]) - static_cast<double>(pm[i]) * pm[i] - var);
    pgm[i] = pm[i];
    pgl[i] = 0.5f * (var - 1.0f);
  }
  normalizer_ = norm;
  return total / norm;
}

GaussianKLLoss::Grads GaussianKLLoss::backward(double grad_output) {
  check_forward_done(normalizer_, "GaussianKLLoss::backward");
  const float f = static_cast<float>(grad_output / normalizer_);
  Tensor& gm = internal::reuse_or_allocate(grads_.mu, mu_unscaled_.shape());
  Tensor& gl = internal::reuse_or_allocate(grads_.logvar, mu_unscaled_.shape());
  scaled_copy(mu_unscaled_, gm, f);
  scaled_copy(logvar_unscaled_, gl, f);
  return grads_;
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  const char* op = "count_correct";
  Tensor z = internal::f32_contiguous(logits, op, "logits");
  if (z.dim() != 2 || z.size(1) < 1)
    throw InvalidArgument(op, fmt::format("logits shape {}", shape_to_string(z.shape())), "pass (N, C), C >= 1");
  const int64_t n = z.size(0), c = z.size(1);
  std::vector<int64_t> ys;
  read_labels(labels, n, c, op, ys);
  const float* pz = z.data<float>();
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* zr = pz + i * c;
    const int64_t arg = std::max_element(zr, zr + c) - zr;
    correct += arg == ys[static_cast<size_t>(i)] ? 1 : 0;
  }
  return correct;
}

}  // namespace meshtrain::nn
