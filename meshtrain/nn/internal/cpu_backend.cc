#include "meshtrain/nn/internal/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "meshtrain/core/internal/convert.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/half.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/cpu_attention.h"
#include "meshtrain/nn/internal/deterministic_kernels.h"
#include "meshtrain/nn/internal/fast_math.h"
#include "meshtrain/nn/internal/softmax_row.h"

namespace meshtrain::nn::internal {

namespace {

using functional::ActivationKind;

constexpr float kSqrtHalf = 0.70710678118654752f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;


// Per-thread f32 scratch of n elements (column sums), zeroed.
float* zeroed_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  buf.assign(static_cast<size_t>(n), 0.0f);
  return buf.data();
}

// acc[j] (zeroed scratch) = sum over rows of m[r][j], in row order; then out[j] += acc[j].
template <typename T, float (*Widen)(T)>
void add_column_sums(const T* m, int64_t rows, int64_t cols, float* out) {
  float* acc = zeroed_scratch(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = m + r * cols;
    for (int64_t j = 0; j < cols; ++j) acc[j] += Widen(row[j]);
  }
  for (int64_t j = 0; j < cols; ++j) out[j] += acc[j];
}
inline float as_float(float v) { return v; }

// The column sums of an f32, bf16 or f16 matrix dy (R, C) into db (C).
void add_column_sums(const Tensor& dy, const Tensor& db) {
  const int64_t rows = dy.size(0), cols = dy.size(1);
  switch (dy.dtype()) {
    case DType::bf16: return add_column_sums<uint16_t, bf16_to_float>(dy.data<uint16_t>(), rows, cols, db.data<float>());
    case DType::f16: return add_column_sums<uint16_t, f16_to_float>(dy.data<uint16_t>(), rows, cols, db.data<float>());
    default: return add_column_sums<float, as_float>(dy.data<float>(), rows, cols, db.data<float>());
  }
}

// Calls update(offset, len, g) over [begin, end) with g = float(grad) *
// float(grad_scale): the grad itself when it is f32 at scale 1, else widened
// and scaled a chunk at a time into a stack buffer (the same f32 factor and
// multiply as core's scale(), so scaling grads first or passing the scale
// agree bit for bit).
// Runs update(o, n) over [off, off + len) and, when `rounded` is defined,
// writes each updated piece of p rounded to its dtype while the piece is
// still in cache (4096 elements at a time); in one call otherwise.
template <typename Update>
void for_rounded_pieces(const Tensor& rounded, const float* p, int64_t off, int64_t len, Update update) {
  if (!rounded.defined()) {
    update(off, len);
    return;
  }
  constexpr int64_t kPiece = 4096;
  auto* out = static_cast<uint16_t*>(rounded.data_ptr());
  for (int64_t o = off; o < off + len; o += kPiece) {
    const int64_t n = std::min(kPiece, off + len - o);
    update(o, n);
    if (rounded.dtype() == DType::bf16)
      meshtrain::internal::f32_to_bf16(p + o, out + o, static_cast<size_t>(n));
    else
      meshtrain::internal::f32_to_f16(p + o, out + o, static_cast<size_t>(n));
  }
}

template <typename Update>
void for_grad_chunks(const Tensor& grad, double grad_scale, int64_t begin, int64_t end, Update update) {
  if (grad.dtype() == DType::f32 && grad_scale == 1.0) {
    update(begin, end - begin, grad.data<float>() + begin);
    return;
  }
  constexpr int64_t kChunk = 2048;
  float scratch[kChunk];
  const float s = static_cast<float>(grad_scale);
  for (int64_t off = begin; off < end; off += kChunk) {
    const int64_t len = std::min(kChunk, end - off);
    switch (grad.dtype()) {
      case DType::f32: {
        const float* src = grad.data<float>() + off;
        for (int64_t k = 0; k < len; ++k) scratch[k] = src[k] * s;
        break;
      }
      case DType::bf16: {
        const uint16_t* src = grad.data<uint16_t>() + off;
        for (int64_t k = 0; k < len; ++k) scratch[k] = bf16_to_float(src[k]) * s;
        break;
      }
      default: {  // f16 (checked by the caller)
        const uint16_t* src = grad.data<uint16_t>() + off;
        for (int64_t k = 0; k < len; ++k) scratch[k] = f16_to_float(src[k]) * s;
        break;
      }
    }
    update(off, len, scratch);
  }
}

// One AdamW update of n elements in place (torch.optim.AdamW, single tensor);
// adamw_update runs it vectorized at the widest width (run_widest), with the
// same bits.
[[gnu::always_inline]] inline void adamw_update_at(float* p, const float* g, float* m, float* v, int64_t n,
                                                   const functional::AdamWStep& h) {
  // Python-side scalars (double), each rounded to f32 where the tensor op uses it.
  const double t = static_cast<double>(h.step);
  const double bias_correction1 = 1.0 - std::pow(h.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, t);
  const float decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float w1 = static_cast<float>(1.0 - h.beta1);  // lerp weight
  const bool small_weight = std::abs(w1) < 0.5f;
  const float beta2 = static_cast<float>(h.beta2);
  const float c2 = static_cast<float>(1.0 - h.beta2);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float eps = static_cast<float>(h.eps);
  const float neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  const bool decay_on = h.weight_decay != 0.0;
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    if (decay_on) pi = pi * decay;  // param.mul_(1 - lr * weight_decay)
    const float gi = g[i];
    // exp_avg.lerp_(grad, 1 - beta1), with torch.lerp's two branches.
    const float mi = small_weight ? m[i] + w1 * (gi - m[i]) : gi - (gi - m[i]) * (1.0f - w1);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    float vi = v[i] * beta2;
    vi = vi + c2 * gi * gi;
    // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    p[i] = pi + neg_step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const functional::AdamWStep& h) {
  run_widest([&] { adamw_update_at(p, g, m, v, n, h); });
}

// One SGD update of n elements in place (torch.optim.SGD, single tensor);
// sgd_update runs it at the widest width, as AdamW's.
[[gnu::always_inline]] inline void sgd_update_at(float* p, const float* g, float* buf, int64_t n,
                                                 const functional::SgdStep& h) {
  // PyTorch casts each Python-float hyperparameter to the tensor's dtype.
  const float wd = static_cast<float>(h.weight_decay);
  const float momentum = static_cast<float>(h.momentum);
  const float blend = static_cast<float>(1.0 - h.dampening);
  const float neg_lr = static_cast<float>(-h.lr);
  const bool decay = h.weight_decay != 0.0, use_momentum = h.momentum != 0.0;
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if (decay) d = d + wd * p[i];  // grad.add(param, alpha=weight_decay)
    if (use_momentum) {
      float b;
      if (h.first) {
        b = d;  // torch.clone(grad)
      } else {
        b = buf[i] * momentum;  // buf.mul_(momentum)
        b = b + blend * d;      // .add_(grad, alpha=1 - dampening)
      }
      buf[i] = b;
      d = h.nesterov ? d + momentum * b : b;
    }
    p[i] = p[i] + neg_lr * d;  // param.add_(grad, alpha=-lr)
  }
}
void sgd_update(float* p, const float* g, float* buf, int64_t n, const functional::SgdStep& h) {
  run_widest([&] { sgd_update_at(p, g, buf, n, h); });
}

int64_t id_at(const Tensor& ids, int64_t i) {
  return ids.dtype() == DType::i64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i];
}

// y = f(x) over n elements.
void activation_forward_range(ActivationKind kind, const float* x, float* y, int64_t n) {
  switch (kind) {
    case ActivationKind::relu:
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
      break;
    case ActivationKind::gelu:
      for (int64_t i = 0; i < n; ++i) y[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kSqrtHalf));
      break;
    case ActivationKind::gelu_tanh:
      // 0.5 v (1 + tanh u) = v sigmoid(2u), u = k (v + c v^3)
      map_f32(x, y, n, [](auto v) { return v * sigmoid_approx(2.0f * kSqrt2OverPi * (v + kGeluCubic * v * v * v)); });
      break;
    case ActivationKind::silu:
      map_f32(x, y, n, [](auto v) { return v * sigmoid_approx(v); });
      break;
    case ActivationKind::tanh:
      for (int64_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
      break;
    case ActivationKind::sigmoid:
      map_f32(x, y, n, [](auto v) { return sigmoid_approx(v); });
      break;
  }
}

// dx = dy f'(x) over n elements, given y = f(x).
void activation_backward_range(ActivationKind kind, const float* x, const float* y, const float* dy, float* dx,
                               int64_t n) {
  switch (kind) {
    case ActivationKind::relu:
      for (int64_t i = 0; i < n; ++i) {
        const float g = dy[i];  // loaded unconditionally so the select vectorizes
        dx[i] = x[i] > 0.0f ? g : 0.0f;
      }
      break;
    case ActivationKind::gelu:
      // d/dx x Phi(x) = Phi(x) + x phi(x)
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        const float cdf = 0.5f * (1.0f + std::erf(v * kSqrtHalf));
        const float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
        dx[i] = dy[i] * (cdf + v * pdf);
      }
      break;
    case ActivationKind::gelu_tanh:
      // u = k (v + c v^3), t = tanh u, s = sigmoid(2u) = (1 + t) / 2:
      // d/dv = 0.5 (1 + t) + 0.5 v (1 - t^2) u' = s + 2 v s (1 - s) u', u' = k (1 + 3 c v^2)
      map2_f32(x, dy, dx, n, [](auto v, auto g) {
        const auto s = sigmoid_approx(2.0f * kSqrt2OverPi * (v + kGeluCubic * v * v * v));
        const auto du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v * v);
        return g * (s + 2.0f * v * s * (1.0f - s) * du);
      });
      break;
    case ActivationKind::silu:
      // d/dx x s(x) = s + x s (1 - s)
      map2_f32(x, dy, dx, n, [](auto v, auto g) {
        const auto s = sigmoid_approx(v);
        return g * (s + v * s * (1.0f - s));
      });
      break;
    case ActivationKind::tanh:
      for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
      break;
    case ActivationKind::sigmoid:
      for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
      break;
  }
}

class CpuBackend final : public functional::Backend {
 public:
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) const override {
    const int64_t block = deterministic_block(y.size(0), "functional::linear_forward");
    double beta = 0.0;
    if (b.defined()) {
      // Every row starts as b; the GEMM then adds x W on top (beta = 1).
      const int64_t rows = y.size(0), out = y.size(1);
      const float* pb = b.data<float>();
      float* py = y.data<float>();
      for (int64_t r = 0; r < rows; ++r) std::memcpy(py + r * out, pb, static_cast<size_t>(out) * sizeof(float));
      beta = 1.0;
    }
    if (block > 0) return matmul_fixed_blocks(x, w, y, false, beta, block);
    matmul(x, w, y, false, false, 1.0, beta);  // (R, in) x (in, out) -> (R, out)
  }

  void bias_add(const Tensor& b, const Tensor& y) const override {
    const int64_t rows = y.size(0), out = y.size(1);
    const float* pb = b.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      float* py = y.data<float>() + r * out;
      map2_f32(py, pb, py, out, [](auto a, auto c) { return a + c; });
    }
  }

  void linear_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx) const override {
    const int64_t block = deterministic_block(dy.size(0), "functional::linear_backward_input");
    if (block > 0) return matmul_fixed_blocks(dy, w, dx, true, 0.0, block);
    matmul(dy, w, dx, false, true);  // (R, out) x (in, out)^T -> (R, in)
  }

  void linear_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw, const Tensor& db) const override {
    const int64_t block = deterministic_block(dy.size(0), "functional::linear_backward_weight");
    if (block > 0) {
      if (db.defined()) add_column_sums_tree(dy, db, block);
      return matmul_tn_tree(x, dy, dw, block);  // dW += the tree over blocks of x_l^T dy_l
    }
    if (db.defined()) add_column_sums(dy, db);
    matmul(x, dy, dw, true, false, 1.0, 1.0);  // dW += (R, in)^T x (R, out) -> (in, out)
  }

  void bias_backward(const Tensor& dy, const Tensor& db) const override {
    const int64_t block = deterministic_block(dy.size(0), "functional::bias_backward");
    if (block > 0) return add_column_sums_tree(dy, db, block);
    add_column_sums(dy, db);
  }

  void activation_forward(ActivationKind kind, const Tensor& xt, const Tensor& yt) const override {
    const float* x = xt.data<float>();
    float* y = yt.data<float>();
    // Element by element: the same numbers on any split over the rank's threads.
    parallel_for(xt.numel(), int64_t{1} << 15,
                 [&](int64_t b, int64_t e) { activation_forward_range(kind, x + b, y + b, e - b); });
  }

  void activation_backward(ActivationKind kind, const Tensor& xt, const Tensor& yt, const Tensor& dyt,
                           const Tensor& dxt) const override {
    const float* x = xt.data<float>();
    const float* y = yt.data<float>();
    const float* dy = dyt.data<float>();
    float* dx = dxt.data<float>();
    parallel_for(xt.numel(), int64_t{1} << 15, [&](int64_t b, int64_t e) {
      activation_backward_range(kind, x + b, y + b, dy + b, dx + b, e - b);
    });
  }

  void layer_norm_forward(const Tensor& xt, const Tensor& gamma, const Tensor& beta, double eps, const Tensor& yt,
                          const Tensor& xhat, const Tensor& rstdt) const override {
    const int64_t rows = xt.size(0), dim = xt.size(1);
    const float* px = xt.data<float>();
    float* ph = xhat.data<float>();
    float* py = yt.data<float>();
    float* prstd = rstdt.data<float>();
    const float* g = gamma.defined() ? gamma.data<float>() : nullptr;
    const float* b = beta.defined() ? beta.data<float>() : nullptr;
    const float inv_dim = 1.0f / static_cast<float>(dim);
    // Rows over the rank's threads; each row's sums in 8 f32 lanes (two
    // passes: no cancellation for large means), the same on any split.
    parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(dim, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = px + r * dim;
        const float m = lane_sum(dim, [xr](int64_t j) { return load4(xr + j); }, [xr](int64_t j) { return xr[j]; }) *
                        inv_dim;
        const float var = lane_sum(
                              dim,
                              [xr, m](int64_t j) {
                                const f32x4 d = load4(xr + j) - m;
                                return d * d;
                              },
                              [xr, m](int64_t j) { return (xr[j] - m) * (xr[j] - m); }) *
                          inv_dim;
        const float rstd = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var) + eps));
        prstd[r] = rstd;
        float* hr = ph + r * dim;
        float* yr = py + r * dim;
        map_f32(xr, hr, dim, [m, rstd](auto v) { return (v - m) * rstd; });
        if (g != nullptr) {
          map2_f32(hr, g, yr, dim, [](auto h, auto w) { return h * w; });
          map2_f32(yr, b, yr, dim, [](auto y, auto c) { return y + c; });
        } else {
          std::copy(hr, hr + dim, yr);
        }
      }
    });
  }

  void layer_norm_backward_input(const Tensor& dyt, const Tensor& xhat, const Tensor& rstdt, const Tensor& gamma,
                                 const Tensor& dxt) const override {
    const int64_t rows = xhat.size(0), dim = xhat.size(1);
    const float* pdy = dyt.data<float>();
    const float* ph = xhat.data<float>();
    const float* prstd = rstdt.data<float>();
    float* pdx = dxt.data<float>();
    const float* g = gamma.defined() ? gamma.data<float>() : nullptr;
    const float inv_dim = 1.0f / static_cast<float>(dim);
    parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(dim, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* dyr = pdy + r * dim;
        const float* hr = ph + r * dim;
        float* dxr = pdx + r * dim;
        // dxhat = dy * gamma (written into dx first);
        // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        if (g != nullptr)
          map2_f32(dyr, g, dxr, dim, [](auto d, auto w) { return d * w; });
        else
          std::copy(dyr, dyr + dim, dxr);
        const float mean_dh =
            lane_sum(dim, [dxr](int64_t j) { return load4(dxr + j); }, [dxr](int64_t j) { return dxr[j]; }) * inv_dim;
        const float mean_dh_h = lane_sum(
                                    dim, [dxr, hr](int64_t j) { return load4(dxr + j) * load4(hr + j); },
                                    [dxr, hr](int64_t j) { return dxr[j] * hr[j]; }) *
                                inv_dim;
        const float rstd = prstd[r];
        map2_f32(dxr, hr, dxr, dim,
                 [rstd, mean_dh, mean_dh_h](auto d, auto h) { return rstd * (d - mean_dh - h * mean_dh_h); });
      }
    });
  }

  void layer_norm_backward_weight(const Tensor& dyt, const Tensor& xhat, const Tensor& dgamma,
                                  const Tensor& dbeta) const override {
    const int64_t rows = xhat.size(0), dim = xhat.size(1);
    if (const int64_t block = deterministic_block(rows, "functional::layer_norm_backward_weight"); block > 0)
      return layer_norm_weight_tree(dyt, xhat, dgamma, dbeta, block);
    const float* pdy = dyt.data<float>();
    const float* ph = xhat.data<float>();
    // Two per-column sums in f32 in row order, then added to the grads
    // (beta's first: the order the gradients are reported in).
    thread_local std::vector<float> sg, sb;
    sg.assign(static_cast<size_t>(dim), 0.0f);
    sb.assign(static_cast<size_t>(dim), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* dyr = pdy + r * dim;
      const float* hr = ph + r * dim;
      if (dbeta.defined()) map2_f32(sb.data(), dyr, sb.data(), dim, [](auto s, auto d) { return s + d; });
      int64_t j = 0;
      for (; j + 4 <= dim; j += 4) store4(sg.data() + j, load4(sg.data() + j) + load4(dyr + j) * load4(hr + j));
      for (; j < dim; ++j) sg[static_cast<size_t>(j)] += dyr[j] * hr[j];
    }
    if (dbeta.defined()) {
      float* gb = dbeta.data<float>();
      map2_f32(gb, sb.data(), gb, dim, [](auto a, auto c) { return a + c; });
    }
    float* gg = dgamma.data<float>();
    map2_f32(gg, sg.data(), gg, dim, [](auto a, auto c) { return a + c; });
  }

  void rms_norm_forward(const Tensor& xt, const Tensor& gamma, double eps, const Tensor& yt, const Tensor& xhat,
                        const Tensor& rstdt) const override {
    const int64_t rows = xt.size(0), dim = xt.size(1);
    const float* px = xt.data<float>();
    float* ph = xhat.data<float>();
    float* py = yt.data<float>();
    float* prstd = rstdt.data<float>();
    const float* g = gamma.defined() ? gamma.data<float>() : nullptr;
    const float inv_dim = 1.0f / static_cast<float>(dim);
    // As LayerNorm's: rows over the rank's threads, each row's sum of
    // squares in 8 f32 lanes, the same on any split.
    parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(dim, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = px + r * dim;
        const float ms = lane_sum(
                             dim,
                             [xr](int64_t j) {
                               const f32x4 v = load4(xr + j);
                               return v * v;
                             },
                             [xr](int64_t j) { return xr[j] * xr[j]; }) *
                         inv_dim;
        const float rstd = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ms) + eps));
        prstd[r] = rstd;
        float* hr = ph + r * dim;
        float* yr = py + r * dim;
        map_f32(xr, hr, dim, [rstd](auto v) { return v * rstd; });
        if (g != nullptr)
          map2_f32(hr, g, yr, dim, [](auto h, auto w) { return h * w; });
        else
          std::copy(hr, hr + dim, yr);
      }
    });
  }

  void rms_norm_backward_input(const Tensor& dyt, const Tensor& xhat, const Tensor& rstdt, const Tensor& gamma,
                               const Tensor& dxt) const override {
    const int64_t rows = xhat.size(0), dim = xhat.size(1);
    const float* pdy = dyt.data<float>();
    const float* ph = xhat.data<float>();
    const float* prstd = rstdt.data<float>();
    float* pdx = dxt.data<float>();
    const float* g = gamma.defined() ? gamma.data<float>() : nullptr;
    const float inv_dim = 1.0f / static_cast<float>(dim);
    parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(dim, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* dyr = pdy + r * dim;
        const float* hr = ph + r * dim;
        float* dxr = pdx + r * dim;
        // dxhat = dy * gamma (written into dx first); dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
        if (g != nullptr)
          map2_f32(dyr, g, dxr, dim, [](auto d, auto w) { return d * w; });
        else
          std::copy(dyr, dyr + dim, dxr);
        const float mean_dh_h = lane_sum(
                                    dim, [dxr, hr](int64_t j) { return load4(dxr + j) * load4(hr + j); },
                                    [dxr, hr](int64_t j) { return dxr[j] * hr[j]; }) *
                                inv_dim;
        const float rstd = prstd[r];
        map2_f32(dxr, hr, dxr, dim, [rstd, mean_dh_h](auto d, auto h) { return rstd * (d - h * mean_dh_h); });
      }
    });
  }

  void rotary_embedding(const Tensor& xt, const Tensor& positions, double base, bool inverse,
                        const Tensor& yt) const override {
    const int64_t n = xt.size(0), t = xt.size(1), d = xt.size(2), half = d / 2;
    const int64_t* pos = positions.data<int64_t>();
    // cos and sin per (step, pair), in double rounded once; then every row.
    std::vector<float> cs(static_cast<size_t>(t * half)), sn(static_cast<size_t>(t * half));
    for (int64_t j = 0; j < t; ++j)
      for (int64_t i = 0; i < half; ++i) {
        const double theta = static_cast<double>(pos[j]) * std::pow(base, -2.0 * static_cast<double>(i) / d);
        cs[static_cast<size_t>(j * half + i)] = static_cast<float>(std::cos(theta));
        sn[static_cast<size_t>(j * half + i)] = static_cast<float>(inverse ? -std::sin(theta) : std::sin(theta));
      }
    const float* px = xt.data<float>();
    float* py = yt.data<float>();
    parallel_for(n * t, std::max<int64_t>(1, (int64_t{1} << 14) / d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* x = px + r * d;
        float* y = py + r * d;
        const float* c = cs.data() + (r % t) * half;
        const float* s = sn.data() + (r % t) * half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          y[i] = a * c[i] - b * s[i];
          y[i + half] = b * c[i] + a * s[i];
        }
      }
    });
  }

  void dropout_mask(uint64_t seed, uint64_t key, uint64_t start, double p, const Tensor& scale) const override {
    float* s = scale.data<float>();
    const int64_t n = scale.numel();
    fill_uniform(s, static_cast<size_t>(n), seed, key, start, 0.0f, 1.0f);
    const float pf = static_cast<float>(p);
    const float keep_scale = p == 1.0 ? 0.0f : static_cast<float>(1.0 / (1.0 - p));
    for (int64_t i = 0; i < n; ++i) s[i] = s[i] >= pf ? keep_scale : 0.0f;
  }

  double cross_entropy_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                               double normalizer) const override {
    const int64_t n = logits.size(0), c = logits.size(1);
    const float* pz = logits.data<float>();
    const int64_t* y = labels.data<int64_t>();
    float* pp = probs.data<float>();
    // Rows in parallel over the rank's threads; their terms summed in row
    // order after, so the total does not depend on the split.
    std::vector<double> terms(static_cast<size_t>(n));
    parallel_for(n, std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(c, 1)), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float* zr = pz + i * c;
        const SoftmaxRow row = softmax_row(zr, pp + i * c, c);
        // -log softmax(z)[y] = log sum exp(z - m) - (z[y] - m)
        terms[static_cast<size_t>(i)] = std::log(row.sum) - (static_cast<double>(zr[y[i]]) - row.max);
      }
    });
    return sum_rows(terms, deterministic_block(n, "functional::cross_entropy_forward"), normalizer);
  }

  void cross_entropy_backward(const Tensor& probs, const Tensor& labels, double factor,
                              const Tensor& grad) const override {
    vocab_parallel_ce_backward(probs, labels, /*begin=*/0, factor, grad);  // every label in the one shard
  }

  void row_max(const Tensor& logits, const Tensor& max) const override {
    const int64_t n = logits.size(0), c = logits.size(1);
    for (int64_t i = 0; i < n; ++i)
      max.data<float>()[i] = c == 0 ? -std::numeric_limits<float>::infinity() : max_f32(logits.data<float>() + i * c, c);
  }

  void vocab_parallel_ce_partial(const Tensor& logits, const Tensor& labels, int64_t begin, const Tensor& max,
                                 const Tensor& probs, const Tensor& stats) const override {
    const int64_t n = logits.size(0), c = logits.size(1);
    const int64_t* y = labels.data<int64_t>();
    double* st = stats.data<double>();
    for (int64_t i = 0; i < n; ++i) {
      const float* zr = logits.data<float>() + i * c;
      float* pr = probs.data<float>() + i * c;
      const float m = max.data<float>()[i];
      map_f32(zr, pr, c, [m](auto v) { return exp_approx(v - m); });
      st[2 * i] = sum_f64(pr, c);
      const int64_t local = y[i] - begin;
      st[2 * i + 1] = local >= 0 && local < c ? static_cast<double>(zr[local]) - m : 0.0;
    }
  }

  double vocab_parallel_ce_finish(const Tensor& stats, const Tensor& probs) const override {
    const int64_t n = probs.size(0), c = probs.size(1);
    const double* st = stats.data<double>();
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const float inv = static_cast<float>(1.0 / st[2 * i]);
      float* pr = probs.data<float>() + i * c;
      map_f32(pr, pr, c, [inv](auto v) { return v * inv; });
      total += std::log(st[2 * i]) - st[2 * i + 1];
    }
    return total;
  }

  void vocab_parallel_ce_backward(const Tensor& probs, const Tensor& labels, int64_t begin, double factor,
                                  const Tensor& grad) const override {
    const int64_t n = probs.size(0), c = probs.size(1);
    const float f = static_cast<float>(factor);
    scaled_copy(probs, f, grad);
    float* pg = grad.data<float>();
    const int64_t* y = labels.data<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      if (y[i] >= begin && y[i] < begin + c) pg[i * c + (y[i] - begin)] -= f;
  }

  double mse_forward(const Tensor& xt, const Tensor& tt, const Tensor& diff) const override {
    const float* px = xt.data<float>();
    const float* pt = tt.data<float>();
    float* pd = diff.data<float>();
    const int64_t n = xt.numel();
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      pd[i] = px[i] - pt[i];
      total += static_cast<double>(pd[i]) * pd[i];
    }
    return total;
  }

  double bce_with_logits_forward(const Tensor& xt, const Tensor& tt, const Tensor& gu) const override {
    const float* px = xt.data<float>();
    const float* pt = tt.data<float>();
    float* pg = gu.data<float>();
    const int64_t n = xt.numel();
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const float v = px[i];
      // log(1 + exp(-|v|)) never overflows; max(v, 0) - v t completes the loss.
      const float e = std::exp(-std::fabs(v));
      total += static_cast<double>(std::max(v, 0.0f) - v * pt[i] + std::log1p(e));
      const float s = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);  // sigmoid(v), stable
      pg[i] = s - pt[i];
    }
    return total;
  }

  double gaussian_kl_forward(const Tensor& mu, const Tensor& logvar, const Tensor& dmu,
                             const Tensor& dlogvar) const override {
    const float* pm = mu.data<float>();
    const float* pl = logvar.data<float>();
    float* pgm = dmu.data<float>();
    float* pgl = dlogvar.data<float>();
    const int64_t n = mu.numel();
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const float var = std::exp(pl[i]);
      total += -0.5 * (1.0 + static_cast<double>(pl[i]) - static_cast<double>(pm[i]) * pm[i] - var);
      pgm[i] = pm[i];
      pgl[i] = 0.5f * (var - 1.0f);
    }
    return total;
  }

  void scaled_copy(const Tensor& src, double factor, const Tensor& out) const override {
    const float f = static_cast<float>(factor);
    const float* s = src.data<float>();
    float* o = out.data<float>();
    const int64_t n = src.numel();
    for (int64_t i = 0; i < n; ++i) o[i] = s[i] * f;
  }

  int64_t count_correct(const Tensor& logits, const Tensor& labels) const override {
    const int64_t n = logits.size(0), c = logits.size(1);
    const float* pz = logits.data<float>();
    const int64_t* y = labels.data<int64_t>();
    int64_t correct = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* zr = pz + i * c;
      correct += (std::max_element(zr, zr + c) - zr) == y[i] ? 1 : 0;
    }
    return correct;
  }

  void reparameterize(const Tensor& mu, const Tensor& logvar, const Tensor& eps, const Tensor& stdt,
                      const Tensor& z) const override {
    const float* pm = mu.data<float>();
    const float* pl = logvar.data<float>();
    const float* pe = eps.data<float>();
    float* ps = stdt.data<float>();
    float* pz = z.data<float>();
    const int64_t n = mu.numel();
    for (int64_t i = 0; i < n; ++i) {
      ps[i] = std::exp(0.5f * pl[i]);
      pz[i] = pm[i] + ps[i] * pe[i];
    }
  }

  void reparameterize_backward_logvar(const Tensor& dz, const Tensor& eps, const Tensor& stdt,
                                      const Tensor& dlogvar) const override {
    const float* pdz = dz.data<float>();
    const float* pe = eps.data<float>();
    const float* ps = stdt.data<float>();
    float* pdl = dlogvar.data<float>();
    const int64_t n = dz.numel();
    for (int64_t i = 0; i < n; ++i) pdl[i] = pdz[i] * pe[i] * 0.5f * ps[i];
  }

  void unembed_forward(const Tensor& x, const Tensor& w, const Tensor& y) const override {
    const int64_t block = deterministic_block(x.size(0), "functional::unembed_forward");
    if (block > 0) return matmul_fixed_blocks(x, w, y, true, 0.0, block);
    matmul(x, w, y, false, true);  // (R, C) x (V, C)^T -> (R, V)
  }
  void unembed_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx) const override {
    const int64_t block = deterministic_block(dy.size(0), "functional::unembed_backward_input");
    if (block > 0) return matmul_fixed_blocks(dy, w, dx, false, 0.0, block);
    matmul(dy, w, dx);  // (R, V) x (V, C) -> (R, C)
  }
  void unembed_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw) const override {
    const int64_t block = deterministic_block(dy.size(0), "functional::unembed_backward_weight");
    if (block > 0) return matmul_tn_tree(dy, x, dw, block);  // dW += the tree over blocks of dy_l^T x_l
    matmul(dy, x, dw, true, false, 1.0, 1.0);  // dW += (R, V)^T x (R, C) -> (V, C)
  }

  void embedding_forward(const Tensor& ids, const Tensor& weight, const Tensor& out, int64_t begin) const override {
    const int64_t n = ids.size(0), rows = weight.size(0), c = weight.size(1);
    float* o = out.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = id_at(ids, i) - begin;
      if (r >= 0 && r < rows && weight.dtype() == DType::f32)
        std::memcpy(o + i * c, weight.data<float>() + r * c, static_cast<size_t>(c) * sizeof(float));
      else if (r >= 0 && r < rows)
        out.narrow(0, i, 1).copy_from(weight.narrow(0, r, 1));  // a half-precision row, widened
      else
        std::fill(o + i * c, o + (i + 1) * c, 0.0f);
    }
  }

  void embedding_backward(const Tensor& ids, const Tensor& dy, const Tensor& dweight, int64_t begin) const override {
    const int64_t n = ids.size(0), rows = dweight.size(0), c = dweight.size(1);
    // The deterministic mode: the tree over blocks; ids that each appear
    // once (a position table's, summed over samples by its caller) have
    // nothing to sum, and need no blocks.
    if (const int64_t block = functional::deterministic_rows(); block > 0 && (n % block == 0 || !distinct_ids(ids)))
      return embedding_backward_tree(ids, dy, dweight, begin, deterministic_block(n, "functional::embedding_backward"));
    const float* g = dy.data<float>();
    float* dw = dweight.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = id_at(ids, i) - begin;
      if (r < 0 || r >= rows) continue;
      float* row = dw + r * c;
      const float* gi = g + i * c;
      for (int64_t j = 0; j < c; ++j) row[j] += gi[j];
    }
  }

  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                         const Tensor& out, const Tensor& lse) const override {
    attention_forward_cpu(q, k, v, causal, scale, out, lse);
  }

  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                          const Tensor& dout, bool causal, double scale, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, bool accumulate) const override {
    attention_backward_cpu(q, k, v, out, lse, dout, causal, scale, dq, dk, dv, accumulate);
  }

  void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b) const override {
    attention_merge_cpu(out, lse, out_b, lse_b);
  }

  void attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                           const Tensor& out) const override {
    attention_reference_cpu(q, k, v, causal, scale, out);
  }

  void adamw_step(const Tensor& value, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const functional::AdamWStep& h, const Tensor& rounded) const override {
    float* p = value.data<float>();
    float* m = exp_avg.data<float>();
    float* v = exp_avg_sq.data<float>();
    // Element by element: the same numbers on any split over the rank's threads.
    parallel_for(value.numel(), int64_t{1} << 16, [&](int64_t b, int64_t e) {
      for_grad_chunks(grad, h.grad_scale, b, e, [&](int64_t off, int64_t len, const float* g) {
        for_rounded_pieces(rounded, p, off, len, [&](int64_t o, int64_t n) {
          adamw_update(p + o, g + (o - off), m + o, v + o, n, h);
        });
      });
    });
  }

  void sgd_step(const Tensor& value, const Tensor& grad, const Tensor& momentum_buffer, const functional::SgdStep& h,
                const Tensor& rounded) const override {
    float* p = value.data<float>();
    float* buf = momentum_buffer.defined() ? momentum_buffer.data<float>() : nullptr;
    parallel_for(value.numel(), int64_t{1} << 16, [&](int64_t b, int64_t e) {
      for_grad_chunks(grad, h.grad_scale, b, e, [&](int64_t off, int64_t len, const float* g) {
        for_rounded_pieces(rounded, p, off, len, [&](int64_t o, int64_t n) {
          sgd_update(p + o, g + (o - off), buf != nullptr ? buf + o : nullptr, n, h);
        });
      });
    });
  }
};

}  // namespace

std::unique_ptr<functional::Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace meshtrain::nn::internal
