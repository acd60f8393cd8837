#include "meshtrain/nn/losses.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/internal/loss_args.h"

namespace meshtrain::nn {

using internal::check_forward_done;
using internal::read_labels;
using internal::resolve_normalizer;

namespace {

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  if (a.shape() != b.shape())
    throw InvalidArgument(op,
                          fmt::format("input {} and target {} differ in shape", shape_to_string(a.shape()),
                                      shape_to_string(b.shape())),
                          "pass a target of the input's shape");
}

}  // namespace

// ---- CrossEntropyLoss ----

double CrossEntropyLoss::forward(const Tensor& logits, const Tensor& labels, Saved& saved,
                                 std::optional<double> normalizer) {
  const char* op = "CrossEntropyLoss::forward";
  Tensor z = internal::f32_contiguous(logits, op, "logits");
  if (z.dim() != 2 || z.size(1) < 1)
    throw InvalidArgument(op, fmt::format("logits shape {}", shape_to_string(z.shape())),
                          "pass logits (N, C) with C >= 1; reshape (B, T, C) to (B * T, C)");
  const int64_t n = z.size(0), c = z.size(1);
  State& st = saved.state<State>();
  read_labels(labels, n, c, op, st.labels);
  const double norm = resolve_normalizer(normalizer, static_cast<double>(n), op);
  Tensor& probs = internal::reuse_or_allocate(st.probs, {n, c});  // (N, C)
  st.normalizer = norm;
  return functional::cross_entropy_forward(z, st.labels, probs, norm);
}

Tensor CrossEntropyLoss::backward(Saved& saved, double grad_output) {
  State& st = saved.state<State>();
  check_forward_done(st.normalizer, "CrossEntropyLoss::backward");
  Tensor& g = internal::reuse_or_allocate(st.grad, st.probs.shape());  // (N, C)
  functional::cross_entropy_backward(st.probs, st.labels, static_cast<float>(grad_output / st.normalizer), g);
  return g;
}

// ---- MSELoss ----

double MSELoss::forward(const Tensor& input, const Tensor& target, Saved& saved, std::optional<double> normalizer) {
  const char* op = "MSELoss::forward";
  Tensor x = internal::f32_contiguous(input, op, "input");
  Tensor t = internal::f32_contiguous(target, op, "target");
  check_same(x, t, op);
  const double norm = resolve_normalizer(normalizer, static_cast<double>(x.numel()), op);
  State& st = saved.state<State>();
  Tensor& d = internal::reuse_or_allocate(st.diff, x.shape());
  const double total = functional::mse_forward(x, t, d);
  st.normalizer = norm;
  return total / norm;
}

Tensor MSELoss::backward(Saved& saved, double grad_output) {
  State& st = saved.state<State>();
  check_forward_done(st.normalizer, "MSELoss::backward");
  Tensor& g = internal::reuse_or_allocate(st.grad, st.diff.shape());
  functional::scaled_copy(st.diff, static_cast<float>(2.0 * grad_output / st.normalizer), g);
  return g;
}

// ---- BCEWithLogitsLoss ----

double BCEWithLogitsLoss::forward(const Tensor& input, const Tensor& target, Saved& saved,
                                  std::optional<double> normalizer) {
  const char* op = "BCEWithLogitsLoss::forward";
  Tensor x = internal::f32_contiguous(input, op, "input");
  Tensor t = internal::f32_contiguous(target, op, "target");
  check_same(x, t, op);
  const double norm = resolve_normalizer(normalizer, static_cast<double>(x.numel()), op);
  State& st = saved.state<State>();
  Tensor& gu = internal::reuse_or_allocate(st.grad_unscaled, x.shape());
  const double total = functional::bce_with_logits_forward(x, t, gu);
  st.normalizer = norm;
  return total / norm;
}

Tensor BCEWithLogitsLoss::backward(Saved& saved, double grad_output) {
  State& st = saved.state<State>();
  check_forward_done(st.normalizer, "BCEWithLogitsLoss::backward");
  Tensor& g = internal::reuse_or_allocate(st.grad, st.grad_unscaled.shape());
  functional::scaled_copy(st.grad_unscaled, static_cast<float>(grad_output / st.normalizer), g);
  return g;
}

// ---- GaussianKLLoss ----

double GaussianKLLoss::forward(const Tensor& mu, const Tensor& logvar, Saved& saved,
                               std::optional<double> normalizer) {
  const char* op = "GaussianKLLoss::forward";
  Tensor m = internal::f32_contiguous(mu, op, "mu");
  Tensor lv = internal::f32_contiguous(logvar, op, "logvar");
  if (m.shape() != lv.shape() || m.dim() < 1)
    throw InvalidArgument(op,
                          fmt::format("mu {} and logvar {}", shape_to_string(m.shape()),
                                      shape_to_string(lv.shape())),
                          "pass mu and logvar of one shape (N, latent)");
  const double norm = resolve_normalizer(normalizer, static_cast<double>(m.size(0)), op);
  State& st = saved.state<State>();
  Tensor& gm = internal::reuse_or_allocate(st.mu_unscaled, m.shape());
  Tensor& gl = internal::reuse_or_allocate(st.logvar_unscaled, m.shape());
  const double total = functional::gaussian_kl_forward(m, lv, gm, gl);
  st.normalizer = norm;
  return total / norm;
}

GaussianKLLoss::Grads GaussianKLLoss::backward(Saved& saved, double grad_output) {
  State& st = saved.state<State>();
  check_forward_done(st.normalizer, "GaussianKLLoss::backward");
  const float f = static_cast<float>(grad_output / st.normalizer);
  Tensor& gm = internal::reuse_or_allocate(st.grads.mu, st.mu_unscaled.shape());
  Tensor& gl = internal::reuse_or_allocate(st.grads.logvar, st.mu_unscaled.shape());
  functional::scaled_copy(st.mu_unscaled, f, gm);
  functional::scaled_copy(st.logvar_unscaled, f, gl);
  return st.grads;
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  const char* op = "count_correct";
  Tensor z = internal::f32_contiguous(logits, op, "logits");
  if (z.dim() != 2 || z.size(1) < 1)
    throw InvalidArgument(op, fmt::format("logits shape {}", shape_to_string(z.shape())), "pass (N, C), C >= 1");
  Tensor ys;
  read_labels(labels, z.size(0), z.size(1), op, ys);
  return functional::count_correct(z, ys);
}

}  // namespace meshtrain::nn
