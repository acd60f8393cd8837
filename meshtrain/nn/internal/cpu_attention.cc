#include "meshtrain/nn/internal/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "meshtrain/core/ops.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/nn/internal/fast_math.h"
#include "meshtrain/nn/internal/softmax_row.h"

namespace meshtrain::nn::internal {

namespace {

// Query and key rows per block: a 64 x 64 score tile and its 64 x D
// operands stay in L1/L2 while the GEMMs run.
constexpr int64_t kBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A (rows, cols) f32 matrix view of raw memory, for the GEMMs.
Tensor mat(float* p, int64_t rows, int64_t cols) { return Tensor::from_blob(p, {rows, cols}, DType::f32); }
Tensor mat(const float* p, int64_t rows, int64_t cols) { return mat(const_cast<float*>(p), rows, cols); }

// Sets s[r][c] = -inf where key j0 + c lies after query i0 + r (causal mask).
void mask_tile(float* s, int64_t rows, int64_t cols, int64_t i0, int64_t j0) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = std::max<int64_t>(0, i0 + r - j0 + 1); c < cols; ++c) s[r * cols + c] = kNegInf;
}

// The key blocks query block [i0, i1) attends to: all, or under the causal
// mask those starting at or before its last row (fully masked blocks are
// skipped, which also halves the work).
int64_t key_end(bool causal, int64_t i1, int64_t t) { return causal ? std::min(i1, t) : t; }

}  // namespace

void attention_forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                           const Tensor& out, const Tensor& lse) {
  const int64_t n = q.size(0), t = q.size(1), d = q.size(2);
  // Heads (and batch rows) are independent: split over the rank's threads.
  parallel_for(n, 1, [&](int64_t b0, int64_t b1) {
  std::vector<float> s(static_cast<size_t>(kBlock * kBlock)), acc(static_cast<size_t>(kBlock * d));
  std::vector<float> m(kBlock), l(kBlock);
  for (int64_t b = b0; b < b1; ++b) {
    const float* qb = q.data<float>() + b * t * d;
    const float* kb = k.data<float>() + b * t * d;
    const float* vb = v.data<float>() + b * t * d;
    float* ob = out.data<float>() + b * t * d;
    float* lb = lse.data<float>() + b * t;
    for (int64_t i0 = 0; i0 < t; i0 += kBlock) {
      const int64_t rows = std::min(kBlock, t - i0);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j0 = 0; j0 < key_end(causal, i0 + rows, t); j0 += kBlock) {
        const int64_t cols = std::min(kBlock, t - j0);
        // S = scale * Q_i K_j^T
        matmul(mat(qb + i0 * d, rows, d), mat(kb + j0 * d, cols, d), mat(s.data(), rows, cols), false, true, scale);
        if (causal && j0 + cols - 1 > i0) mask_tile(s.data(), rows, cols, i0, j0);
        // Online softmax: rescale what was accumulated to the new row max.
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.data() + r * cols;
          const float mx = std::max(m[r], *std::max_element(sr, sr + cols));
          const float correction = m[r] == kNegInf ? 0.0f : exp_approx(m[r] - mx);
          map_f32(sr, sr, cols, [mx](auto x) { return exp_approx(x - mx); });
          float sum = 0.0f;
          for (int64_t c = 0; c < cols; ++c) sum += sr[c];
          l[r] = l[r] * correction + sum;
          m[r] = mx;
          float* ar = acc.data() + r * d;
          for (int64_t e = 0; e < d; ++e) ar[e] *= correction;
        }
        // acc += P V_j
        matmul(mat(s.data(), rows, cols), mat(vb + j0 * d, cols, d), mat(acc.data(), rows, d), false, false, 1.0,
               1.0);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / l[r];
        for (int64_t e = 0; e < d; ++e) ob[(i0 + r) * d + e] = acc[r * d + e] * inv;
        lb[i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
  });
}

void attention_backward_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, bool causal, double scale, const Tensor& dq, const Tensor& dk,
                            const Tensor& dv, bool accumulate) {
  const int64_t n = q.size(0), t = q.size(1), d = q.size(2);
  if (!accumulate) {
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
  }
  parallel_for(n, 1, [&](int64_t b0, int64_t b1) {
  std::vector<float> p(static_cast<size_t>(kBlock * kBlock)), dp(static_cast<size_t>(kBlock * kBlock));
  std::vector<float> delta(static_cast<size_t>(t));
  for (int64_t b = b0; b < b1; ++b) {
    const size_t off = static_cast<size_t>(b * t * d);
    const float* qb = q.data<float>() + off;
    const float* kb = k.data<float>() + off;
    const float* vb = v.data<float>() + off;
    const float* ob = out.data<float>() + off;
    const float* gb = dout.data<float>() + off;
    const float* lb = lse.data<float>() + b * t;
    float* dqb = dq.data<float>() + off;
    float* dkb = dk.data<float>() + off;
    float* dvb = dv.data<float>() + off;
    // delta_i = sum_e dO[i][e] O[i][e] (= sum_j P_ij dP_ij, the softmax's
    // backward term), once per row instead of per tile.
    for (int64_t i = 0; i < t; ++i) {
      float acc = 0.0f;
      for (int64_t e = 0; e < d; ++e) acc += gb[i * d + e] * ob[i * d + e];
      delta[static_cast<size_t>(i)] = acc;
    }
    for (int64_t i0 = 0; i0 < t; i0 += kBlock) {
      const int64_t rows = std::min(kBlock, t - i0);
      for (int64_t j0 = 0; j0 < key_end(causal, i0 + rows, t); j0 += kBlock) {
        const int64_t cols = std::min(kBlock, t - j0);
        // P = exp(scale * Q_i K_j^T - lse_i): the forward's probabilities,
        // rebuilt from the saved log-sum-exp (no T x T matrix is kept).
        matmul(mat(qb + i0 * d, rows, d), mat(kb + j0 * d, cols, d), mat(p.data(), rows, cols), false, true, scale);
        if (causal && j0 + cols - 1 > i0) mask_tile(p.data(), rows, cols, i0, j0);
        for (int64_t r = 0; r < rows; ++r) {
          const float l = lb[i0 + r];
          map_f32(p.data() + r * cols, p.data() + r * cols, cols, [l](auto x) { return exp_approx(x - l); });
        }
        // dV_j += P^T dO_i
        matmul(mat(p.data(), rows, cols), mat(gb + i0 * d, rows, d), mat(dvb + j0 * d, cols, d), true, false, 1.0,
               1.0);
        // dP = dO_i V_j^T; dS = P (dP - delta_i)
        matmul(mat(gb + i0 * d, rows, d), mat(vb + j0 * d, cols, d), mat(dp.data(), rows, cols), false, true);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            dp[r * cols + c] = p[r * cols + c] * (dp[r * cols + c] - delta[static_cast<size_t>(i0 + r)]);
        // dQ_i += scale dS K_j;  dK_j += scale dS^T Q_i
        matmul(mat(dp.data(), rows, cols), mat(kb + j0 * d, cols, d), mat(dqb + i0 * d, rows, d), false, false, scale,
               1.0);
        matmul(mat(dp.data(), rows, cols), mat(qb + i0 * d, rows, d), mat(dkb + j0 * d, cols, d), true, false, scale,
               1.0);
      }
    }
  }
  });
}

void attention_merge_cpu(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  const int64_t rows = lse.numel(), d = out.size(2);
  float* o = out.data<float>();
  float* l = lse.data<float>();
  const float* ob = out_b.data<float>();
  const float* lb = lse_b.data<float>();
  parallel_for(rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* orow = o + r * d;
      const float* brow = ob + r * d;
      if (lb[r] == kNegInf) continue;  // the block saw no key of this row
      if (l[r] == kNegInf) {
        std::copy(brow, brow + d, orow);
        l[r] = lb[r];
        continue;
      }
      // In double: the weights of the two parts sum to one exactly enough
      // that merging in any order stays within f32 rounding of one softmax.
      const double mx = std::max(l[r], lb[r]);
      const double ea = std::exp(static_cast<double>(l[r]) - mx), eb = std::exp(static_cast<double>(lb[r]) - mx);
      const double sum = ea + eb;
      const float wa = static_cast<float>(ea / sum), wb = static_cast<float>(eb / sum);
      for (int64_t e = 0; e < d; ++e) orow[e] = orow[e] * wa + brow[e] * wb;
      l[r] = static_cast<float>(mx + std::log(sum));
    }
  });
}

void attention_reference_cpu(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                             const Tensor& out) {
  const int64_t n = q.size(0), t = q.size(1), d = q.size(2);
  std::vector<float> s(static_cast<size_t>(t * t));
  for (int64_t b = 0; b < n; ++b) {
    const size_t off = static_cast<size_t>(b * t * d);
    matmul(mat(q.data<float>() + off, t, d), mat(k.data<float>() + off, t, d), mat(s.data(), t, t), false, true,
           scale);
    if (causal) mask_tile(s.data(), t, t, 0, 0);
    for (int64_t r = 0; r < t; ++r) softmax_row(s.data() + r * t, s.data() + r * t, t);
    matmul(mat(s.data(), t, t), mat(v.data<float>() + off, t, d), mat(out.data<float>() + off, t, d));
  }
}

}  // namespace meshtrain::nn::internal
