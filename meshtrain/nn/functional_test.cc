// nn::functional: the blockwise attention against the plain reference and
// finite differences, its log-sum-exp, the embedding kernels, and dispatch
// through the registered backend.
#include "meshtrain/nn/functional.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <memory>
#include <vector>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/internal/cpu_backend.h"
#include "meshtrain/nn/internal/fast_math.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/testing/grad_check.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::nn {
namespace {

namespace F = functional;
using ::testing::HasSubstr;
using meshtrain::testing::compare_grads;
using meshtrain::testing::error_of;
using meshtrain::testing::random_tensor;

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

TEST(Attention, BlockwiseEqualsTheReferenceAcrossBlockEdges) {
  for (bool causal : {false, true})
    for (int64_t t : {1, 7, 64, 65, 130}) {
      const int64_t n = 3, d = 8;
      const Tensor q = random_tensor({n, t, d}, 1), k = random_tensor({n, t, d}, 2), v = random_tensor({n, t, d}, 3);
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      Tensor out = Tensor::empty({n, t, d}, DType::f32), lse = Tensor::empty({n, t}, DType::f32);
      Tensor ref = Tensor::empty({n, t, d}, DType::f32);
      F::attention_forward(q, k, v, causal, scale, out, lse);
      F::attention_reference(q, k, v, causal, scale, ref);
      EXPECT_LT(max_abs_diff(out, ref), 2e-6) << "T " << t << (causal ? " causal" : "");
      // lse in double from the definition.
      const std::vector<double> qs = q.to_vector(), ks = k.to_vector(), ls = lse.to_vector();
      for (int64_t b = 0; b < n; ++b)
        for (int64_t i = 0; i < t; ++i) {
          double sum = 0;
          for (int64_t j = 0; j < (causal ? i + 1 : t); ++j) {
            double dot = 0;
            for (int64_t e = 0; e < d; ++e)
              dot += qs[static_cast<size_t>((b * t + i) * d + e)] * ks[static_cast<size_t>((b * t + j) * d + e)];
            sum += std::exp(scale * dot);
          }
          ASSERT_NEAR(ls[static_cast<size_t>(b * t + i)], std::log(sum), 2e-5) << "row " << i << " of " << b;
        }
    }
}

// Two key blocks attended separately and merged by log-sum-exp equal one
// attention over all keys; the backward of each block given the merged
// out and lse, accumulated, equals the whole backward (what ring attention
// relies on).
TEST(Attention, MergedKeyBlocksEqualTheWholeAttentionForwardAndBackward) {
  const int64_t n = 3, t = 70, d = 8;
  const double scale = 0.3;
  const Tensor q = random_tensor({n, t, d}, 21), k = random_tensor({n, 2 * t, d}, 22),
               v = random_tensor({n, 2 * t, d}, 23), dout = random_tensor({n, t, d}, 24);
  // Keys [0, t) and [t, 2t) as two blocks: the whole is a (n, 2t) problem
  // with the queries in rows [t, 2t) (rows [0, t) are zero queries with a
  // zero dout: they add nothing to dk and dv).
  Tensor qq = Tensor::zeros({n, 2 * t, d}, DType::f32), gg = Tensor::zeros({n, 2 * t, d}, DType::f32);
  qq.narrow(1, t, t).copy_from(q);
  gg.narrow(1, t, t).copy_from(dout);
  Tensor whole = Tensor::empty({n, 2 * t, d}, DType::f32), wlse = Tensor::empty({n, 2 * t}, DType::f32);
  F::attention_forward(qq, k, v, false, scale, whole, wlse);
  Tensor wdq = Tensor::empty({n, 2 * t, d}, DType::f32), wdk = Tensor::empty({n, 2 * t, d}, DType::f32),
         wdv = Tensor::empty({n, 2 * t, d}, DType::f32);
  F::attention_backward(qq, k, v, whole, wlse, gg, false, scale, wdq, wdk, wdv);

  Tensor out = Tensor::zeros({n, t, d}, DType::f32), lse = Tensor::full({n, t}, -INFINITY, DType::f32);
  Tensor ob = Tensor::empty({n, t, d}, DType::f32), lb = Tensor::empty({n, t}, DType::f32);
  std::vector<Tensor> kb, vb;
  for (int b = 0; b < 2; ++b) {
    kb.push_back(k.narrow(1, b * t, t).contiguous());
    vb.push_back(v.narrow(1, b * t, t).contiguous());
  }
  for (int b : {1, 0}) {  // any order
    F::attention_forward(q, kb[b], vb[b], false, scale, ob, lb);
    F::attention_merge(out, lse, ob, lb);
  }
  EXPECT_LT(max_abs_diff(out, whole.narrow(1, t, t).contiguous()), 2e-6);
  EXPECT_LT(max_abs_diff(lse, wlse.narrow(1, t, t).contiguous()), 2e-6);
  Tensor dq = Tensor::full({n, t, d}, 0.5, DType::f32);  // accumulate adds onto what is there
  std::vector<Tensor> dk, dv;
  for (int b = 0; b < 2; ++b) {
    dk.push_back(Tensor::zeros({n, t, d}, DType::f32));
    dv.push_back(Tensor::zeros({n, t, d}, DType::f32));
    F::attention_backward(q, kb[b], vb[b], out, lse, dout, false, scale, dq, dk[b], dv[b], /*accumulate=*/true);
  }
  Tensor want_dq = wdq.narrow(1, t, t).contiguous();
  const std::vector<double> got_dq = dq.to_vector(), want = want_dq.to_vector();
  for (size_t i = 0; i < got_dq.size(); ++i) ASSERT_NEAR(got_dq[i] - 0.5, want[i], 2e-5) << i;
  for (int b = 0; b < 2; ++b) {
    EXPECT_LT(max_abs_diff(dk[b], wdk.narrow(1, b * t, t).contiguous()), 2e-5) << b;
    EXPECT_LT(max_abs_diff(dv[b], wdv.narrow(1, b * t, t).contiguous()), 2e-5) << b;
  }
  // A block that saw none of a row's keys (lse -inf) leaves the row alone.
  Tensor none = Tensor::full({n, t}, -INFINITY, DType::f32), before = out.clone();
  F::attention_merge(out, lse, ob, none);
  EXPECT_EQ(out.to_vector(), before.to_vector());
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (bool causal : {true, false}) {
    const int64_t n = 2, t = 70, d = 4;  // 70 > one 64-row block: the tiles' seams are crossed
    const double scale = 0.5;
    Tensor q = random_tensor({n, t, d}, 11), k = random_tensor({n, t, d}, 12), v = random_tensor({n, t, d}, 13);
    const Tensor w = random_tensor({n, t, d}, 14);  // loss = sum(w * out)
    Tensor out = Tensor::empty({n, t, d}, DType::f32), lse = Tensor::empty({n, t}, DType::f32);
    auto loss = [&] {
      F::attention_forward(q, k, v, causal, scale, out, lse);
      return testing::weighted_sum(out, w);
    };
    loss();
    Tensor dq = Tensor::empty({n, t, d}, DType::f32), dk = Tensor::empty({n, t, d}, DType::f32),
           dv = Tensor::empty({n, t, d}, DType::f32);
    F::attention_backward(q, k, v, out, lse, w, causal, scale, dq, dk, dv);
    // A spread of elements, including rows past the first block.
    const std::vector<int64_t> idx = {0, 5, 63 * d + 1, 64 * d + 2, 69 * d + 3, (t + 3) * d, (2 * t - 1) * d + 1};
    for (auto [name, x, g] : {std::tuple{"q", &q, &dq}, {"k", &k, &dk}, {"v", &v, &dv}}) {
      const auto c = compare_grads(loss, *x, *g, 1e-2, idx);
      EXPECT_LT(c.relative_error, 2e-3) << name << (causal ? " causal" : "");
    }
  }
}

TEST(Embedding, GathersRowsAndAccumulatesRepeatedIds) {
  const Tensor w = Tensor::from_vector(std::vector<float>{0, 1, 10, 11, 20, 21}, {3, 2});
  const Tensor ids = Tensor::from_vector(std::vector<int64_t>{2, 0, 2}, {3});
  Tensor out = Tensor::empty({3, 2}, DType::f32);
  F::embedding_forward(ids, w, out);
  EXPECT_EQ(out.to_vector(), (std::vector<double>{20, 21, 0, 1, 20, 21}));
  Tensor dw = Tensor::full({3, 2}, 0.5, DType::f32);
  F::embedding_backward(ids.to(DType::i32), Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2}), dw);
  EXPECT_EQ(dw.to_vector(), (std::vector<double>{3.5, 4.5, 0.5, 0.5, 6.5, 8.5}));
  EXPECT_THAT(error_of([&] { F::embedding_forward(Tensor::from_vector(std::vector<int64_t>{1, 3}, {2}), w,
                                                  Tensor::empty({2, 2}, DType::f32)); }),
              HasSubstr("id 3 at position 1 is outside [0, 3)"));
}

// Wraps the CPU kernels and counts the linear forwards that reach it.
class CountingBackend final : public F::Backend {
 public:
  explicit CountingBackend(int* calls) : cpu_(internal::make_cpu_backend()), calls_(calls) {}
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) const override {
    ++*calls_;
    cpu_->linear_forward(x, w, b, y);
  }
#define MT_FORWARD(name, params, args) \
  void name params const override { cpu_->name args; }
  MT_FORWARD(linear_backward_input, (const Tensor& dy, const Tensor& w, const Tensor& dx), (dy, w, dx))
  MT_FORWARD(linear_backward_weight, (const Tensor& x, const Tensor& dy, const Tensor& dw, const Tensor& db),
             (x, dy, dw, db))
  MT_FORWARD(bias_backward, (const Tensor& dy, const Tensor& db), (dy, db))
  MT_FORWARD(bias_add, (const Tensor& b, const Tensor& y), (b, y))
  MT_FORWARD(activation_forward, (F::ActivationKind k, const Tensor& x, const Tensor& y), (k, x, y))
  MT_FORWARD(activation_backward,
             (F::ActivationKind k, const Tensor& x, const Tensor& y, const Tensor& dy, const Tensor& dx),
             (k, x, y, dy, dx))
  MT_FORWARD(layer_norm_forward,
             (const Tensor& x, const Tensor& g, const Tensor& b, double eps, const Tensor& y, const Tensor& h,
              const Tensor& r),
             (x, g, b, eps, y, h, r))
  MT_FORWARD(layer_norm_backward_input,
             (const Tensor& dy, const Tensor& h, const Tensor& r, const Tensor& g, const Tensor& dx),
             (dy, h, r, g, dx))
  MT_FORWARD(layer_norm_backward_weight, (const Tensor& dy, const Tensor& h, const Tensor& dg, const Tensor& db),
             (dy, h, dg, db))
  MT_FORWARD(rotary_embedding, (const Tensor& x, const Tensor& p, double base, bool inv, const Tensor& y),
             (x, p, base, inv, y))
  MT_FORWARD(rms_norm_forward,
             (const Tensor& x, const Tensor& g, double eps, const Tensor& y, const Tensor& h, const Tensor& r),
             (x, g, eps, y, h, r))
  MT_FORWARD(rms_norm_backward_input,
             (const Tensor& dy, const Tensor& h, const Tensor& r, const Tensor& g, const Tensor& dx),
             (dy, h, r, g, dx))
  MT_FORWARD(dropout_mask, (uint64_t s, uint64_t k, uint64_t st, double p, const Tensor& sc), (s, k, st, p, sc))
  MT_FORWARD(cross_entropy_backward, (const Tensor& p, const Tensor& l, double f, const Tensor& g), (p, l, f, g))
  MT_FORWARD(scaled_copy, (const Tensor& s, double f, const Tensor& o), (s, f, o))
  MT_FORWARD(reparameterize,
             (const Tensor& m, const Tensor& l, const Tensor& e, const Tensor& s, const Tensor& z), (m, l, e, s, z))
  MT_FORWARD(reparameterize_backward_logvar, (const Tensor& dz, const Tensor& e, const Tensor& s, const Tensor& dl),
             (dz, e, s, dl))
  MT_FORWARD(unembed_forward, (const Tensor& x, const Tensor& w, const Tensor& y), (x, w, y))
  MT_FORWARD(unembed_backward_input, (const Tensor& dy, const Tensor& w, const Tensor& dx), (dy, w, dx))
  MT_FORWARD(unembed_backward_weight, (const Tensor& x, const Tensor& dy, const Tensor& dw), (x, dy, dw))
  MT_FORWARD(embedding_forward, (const Tensor& i, const Tensor& w, const Tensor& o, int64_t b), (i, w, o, b))
  MT_FORWARD(embedding_backward, (const Tensor& i, const Tensor& dy, const Tensor& dw, int64_t b), (i, dy, dw, b))
  MT_FORWARD(attention_forward,
             (const Tensor& q, const Tensor& k, const Tensor& v, bool c, double s, const Tensor& o, const Tensor& l),
             (q, k, v, c, s, o, l))
  MT_FORWARD(attention_backward,
             (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& l, const Tensor& d,
              bool c, double s, const Tensor& dq, const Tensor& dk, const Tensor& dv, bool a),
             (q, k, v, o, l, d, c, s, dq, dk, dv, a))
  MT_FORWARD(attention_merge, (const Tensor& o, const Tensor& l, const Tensor& ob, const Tensor& lb), (o, l, ob, lb))
  MT_FORWARD(attention_reference,
             (const Tensor& q, const Tensor& k, const Tensor& v, bool c, double s, const Tensor& o),
             (q, k, v, c, s, o))
  MT_FORWARD(adamw_step,
             (const Tensor& v, const Tensor& g, const Tensor& m, const Tensor& s, const F::AdamWStep& h,
              const Tensor& r),
             (v, g, m, s, h, r))
  MT_FORWARD(sgd_step, (const Tensor& v, const Tensor& g, const Tensor& b, const F::SgdStep& h, const Tensor& r),
             (v, g, b, h, r))
  MT_FORWARD(row_max, (const Tensor& z, const Tensor& m), (z, m))
  MT_FORWARD(vocab_parallel_ce_partial,
             (const Tensor& z, const Tensor& l, int64_t b, const Tensor& m, const Tensor& p, const Tensor& s),
             (z, l, b, m, p, s))
  MT_FORWARD(vocab_parallel_ce_backward, (const Tensor& p, const Tensor& l, int64_t b, double f, const Tensor& g),
             (p, l, b, f, g))
#undef MT_FORWARD
  double vocab_parallel_ce_finish(const Tensor& s, const Tensor& p) const override {
    return cpu_->vocab_parallel_ce_finish(s, p);
  }
  double cross_entropy_forward(const Tensor& z, const Tensor& l, const Tensor& p, double n) const override {
    return cpu_->cross_entropy_forward(z, l, p, n);
  }
  double mse_forward(const Tensor& x, const Tensor& t, const Tensor& d) const override {
    return cpu_->mse_forward(x, t, d);
  }
  double bce_with_logits_forward(const Tensor& x, const Tensor& t, const Tensor& g) const override {
    return cpu_->bce_with_logits_forward(x, t, g);
  }
  double gaussian_kl_forward(const Tensor& m, const Tensor& l, const Tensor& dm, const Tensor& dl) const override {
    return cpu_->gaussian_kl_forward(m, l, dm, dl);
  }
  int64_t count_correct(const Tensor& z, const Tensor& l) const override { return cpu_->count_correct(z, l); }

 private:
  std::unique_ptr<F::Backend> cpu_;
  int* calls_;
};

// Rotary embedding: Hugging Face Llama's rotate_half formula in double;
// the inverse undoes it (it is the backward: a rotation's transpose), so
// the gradient of sum(w y) is rotary(w, inverse) (finite differences); a
// query-key dot product depends only on their positions' difference; bad
// shapes and positions are refused.
TEST(RotaryEmbedding, RotatesPairsAndDependsOnRelativePositions) {
  const int64_t n = 2, t = 5, d = 8;
  const double base = 10000.0;
  const Tensor x = testing::random_tensor({n, t, d}, 3);
  const Tensor pos = Tensor::from_vector(std::vector<int64_t>{0, 1, 2, 7, 100}, {t});
  Tensor y = Tensor::empty({n, t, d}, DType::f32);
  F::rotary_embedding(x, pos, base, false, y);
  const std::vector<double> xv = x.to_vector(), yv = y.to_vector();
  const std::vector<int64_t> p = {0, 1, 2, 7, 100};
  for (int64_t r = 0; r < n * t; ++r)
    for (int64_t i = 0; i < d / 2; ++i) {
      const double theta = static_cast<double>(p[static_cast<size_t>(r % t)]) * std::pow(base, -2.0 * i / d);
      const double a = xv[static_cast<size_t>(r * d + i)], b = xv[static_cast<size_t>(r * d + i + d / 2)];
      EXPECT_NEAR(yv[static_cast<size_t>(r * d + i)], a * std::cos(theta) - b * std::sin(theta), 1e-6);
      EXPECT_NEAR(yv[static_cast<size_t>(r * d + i + d / 2)], b * std::cos(theta) + a * std::sin(theta), 1e-6);
    }
  Tensor back = Tensor::empty({n, t, d}, DType::f32);
  F::rotary_embedding(y, pos, base, true, back);
  const std::vector<double> bv = back.to_vector();
  for (size_t i = 0; i < bv.size(); ++i) EXPECT_NEAR(bv[i], xv[i], 1e-6);
  // Gradient: d sum(w * rotary(x)) / dx = rotary(w, inverse).
  const Tensor w = testing::random_tensor({n, t, d}, 4);
  Tensor grad = Tensor::empty({n, t, d}, DType::f32);
  F::rotary_embedding(w, pos, base, true, grad);
  Tensor xr = x.clone();
  auto f = [&] {
    Tensor out = Tensor::empty({n, t, d}, DType::f32);
    F::rotary_embedding(xr, pos, base, false, out);
    return testing::weighted_sum(out, w);
  };
  testing::expect_grad_matches(f, xr, grad);
  // q at position p and k at position p - 3 give the same dot product for every p.
  const Tensor q = testing::random_tensor({1, 1, d}, 5), k = testing::random_tensor({1, 1, d}, 6);
  auto dot_at = [&](int64_t pq, int64_t pk) {
    Tensor rq = Tensor::empty({1, 1, d}, DType::f32), rk = Tensor::empty({1, 1, d}, DType::f32);
    F::rotary_embedding(q, Tensor::from_vector(std::vector<int64_t>{pq}, {1}), base, false, rq);
    F::rotary_embedding(k, Tensor::from_vector(std::vector<int64_t>{pk}, {1}), base, false, rk);
    double s = 0;
    const std::vector<double> a = rq.to_vector(), b = rk.to_vector();
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  for (const int64_t at : {3, 10, 50}) EXPECT_NEAR(dot_at(at, at - 3), dot_at(3, 0), 1e-5) << at;
  EXPECT_THAT(testing::error_of([&] { F::rotary_embedding(testing::random_tensor({1, 5, 7}, 1), pos, base, false,
                                                          Tensor::empty({1, 5, 7}, DType::f32)); }),
              ::testing::HasSubstr("even head dim"));
  EXPECT_THAT(testing::error_of([&] { F::rotary_embedding(x, pos.narrow(0, 0, 4).contiguous(), base, false, y); }),
              ::testing::HasSubstr("i64 positions"));
  EXPECT_THAT(testing::error_of([&] { F::rotary_embedding(x, pos, 1.0, false, y); }), ::testing::HasSubstr("base"));
}

// exp_approx within 3e-7 relative of libm's exp (in double) over the whole
// float range it covers, and its edges: 0 below -87, inf above 88, NaN.
TEST(FastMath, ExpApproxIsWithinTwoUlps) {
  double worst = 0;
  for (double x = -87.0; x <= 88.0; x += 1e-4) {
    const double want = std::exp(static_cast<double>(static_cast<float>(x)));
    worst = std::max(worst, std::fabs(internal::exp_approx(static_cast<float>(x)) - want) / want);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(internal::exp_approx(0.0f), 1.0f);
  EXPECT_EQ(internal::exp_approx(-100.0f), 0.0f);
  EXPECT_EQ(internal::exp_approx(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(internal::exp_approx(100.0f), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(internal::exp_approx(std::nanf(""))));
  EXPECT_NEAR(internal::sigmoid_approx(0.0f), 0.5f, 1e-7);
  EXPECT_EQ(internal::sigmoid_approx(-200.0f), 0.0f);
  EXPECT_EQ(internal::sigmoid_approx(200.0f), 1.0f);
}

// The maps give the same bits at every vector width this CPU runs (4
// lanes always; 8 with AVX2; 16 with AVX-512), for every length around
// the blocks (the scalar tail too): an element's operations do not depend
// on the width (a NaN's sign may: vector and scalar forms differ there).
TEST(FastMath, EveryVectorWidthGivesTheSameBits) {
  std::vector<float> x(1000), b(1000);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = -25.0f + 50.0f * static_cast<float>(i * 7919 % 1000) / 1000.0f;
    b[i] = 0.001f * static_cast<float>(i) - 0.4f;
  }
  x[3] = std::numeric_limits<float>::infinity();
  x[5] = -std::numeric_limits<float>::infinity();
  x[9] = std::nanf("");
  auto gelu = [](auto v) { return v * internal::sigmoid_approx(1.5957691f * (v + 0.044715f * v * v * v)); };
  auto grad = [](auto v, auto g) {
    const auto s = internal::sigmoid_approx(v);
    return g * (s + v * s * (1.0f - s)) + internal::exp_approx(v - 3.0f);
  };
  const auto bits = [](const std::vector<float>& v) {  // any NaN as one (its sign may differ)
    std::vector<uint32_t> out(v.size());
    std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
    for (size_t i = 0; i < v.size(); ++i)
      if (std::isnan(v[i])) out[i] = 0x7fc00000u;
    return out;
  };
  for (const int64_t n : {1, 7, 8, 15, 16, 17, 33, 1000}) {
    std::vector<float> want(x.size()), want2(x.size()), got(x.size()), got2(x.size());
    internal::map_f32_at<internal::f32x4>(x.data(), want.data(), n, gelu);
    internal::map2_f32_at<internal::f32x4>(x.data(), b.data(), want2.data(), n, grad);
    if (cpu_isa() >= CpuIsa::avx2) {
      internal::map_f32_avx2(x.data(), got.data(), n, gelu);
      internal::map2_f32_avx2(x.data(), b.data(), got2.data(), n, grad);
      EXPECT_EQ(bits(got), bits(want)) << "avx2, n " << n;
      EXPECT_EQ(bits(got2), bits(want2)) << "avx2, n " << n;
    }
    if (cpu_isa() >= CpuIsa::avx512) {
      internal::map_f32_avx512(x.data(), got.data(), n, gelu);
      internal::map2_f32_avx512(x.data(), b.data(), got2.data(), n, grad);
      EXPECT_EQ(bits(got), bits(want)) << "avx512, n " << n;
      EXPECT_EQ(bits(got2), bits(want2)) << "avx512, n " << n;
    }
    internal::map_f32(x.data(), got.data(), n, gelu);  // the process's width
    EXPECT_EQ(bits(got), bits(want)) << "map_f32, n " << n;
  }
}

// The softmax row's reductions: max over every length around the 4-lane
// blocks (the largest anywhere, negative rows too), and the double sum.
TEST(FastMath, MaxAndSumCoverEveryElement) {
  for (int64_t n = 1; n <= 19; ++n)
    for (int64_t at = 0; at < n; ++at) {
      std::vector<float> x(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = -100.0f - static_cast<float>(i);
      x[static_cast<size_t>(at)] = -1.5f;
      EXPECT_EQ(internal::max_f32(x.data(), n), -1.5f) << n << " " << at;
      double want = 0;
      for (float v : x) want += v;
      EXPECT_NEAR(internal::sum_f64(x.data(), n), want, 1e-9) << n;
    }
}

// GELU (tanh form) computed as v sigmoid(2u) equals 0.5 v (1 + tanh u) in
// double, and its backward matches the derivative of that formula.
TEST(FastMath, GeluTanhMatchesTheTanhFormula) {
  std::vector<float> xs;
  for (float v = -12.0f; v <= 12.0f; v += 0.01f) xs.push_back(v);
  const int64_t n = static_cast<int64_t>(xs.size());
  const Tensor x = Tensor::from_vector(xs, {n});
  Tensor y = Tensor::empty({n}, DType::f32), dx = Tensor::empty({n}, DType::f32);
  const Tensor dy = Tensor::full({n}, 1.0, DType::f32);
  F::activation_forward(F::ActivationKind::gelu_tanh, x, y);
  F::activation_backward(F::ActivationKind::gelu_tanh, x, y, dy, dx);
  const double k = std::sqrt(2.0 / M_PI), c = 0.044715;
  for (int64_t i = 0; i < n; ++i) {
    const double v = xs[static_cast<size_t>(i)], u = k * (v + c * v * v * v), t = std::tanh(u);
    EXPECT_NEAR(y.data<float>()[i], 0.5 * v * (1 + t), 2e-6 * std::max(1.0, std::fabs(v))) << v;
    const double d = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * c * v * v);
    EXPECT_NEAR(dx.data<float>()[i], d, 2e-6 * std::max(1.0, std::fabs(v))) << v;
  }
}

// Kernels that split their work over the rank's threads (set_blas_threads)
// give the same bits on 1 and 2 threads: AdamW, GELU forward and backward,
// the cross-entropy, attention forward and backward. The GEMM backend is
// held to one rule here: the auto policy measures each shape per thread
// count (core/matmul.h), so it may pick another library for 2 threads.
TEST(Threads, SplitKernelsGiveTheSameBitsOnAnyThreadCount) {
  set_gemm_policy(GemmPolicy::fixed);
  const auto rnd = [](std::vector<int64_t> shape, const char* key) {
    Tensor t = Tensor::empty(std::move(shape), DType::f32);
    fill_normal(t, 5, key_from_name(key), 0.0, 1.0);
    return t;
  };
  const Tensor q = rnd({6, 70, 16}, "q"), k = rnd({6, 70, 16}, "k"), v = rnd({6, 70, 16}, "v"),
               dout = rnd({6, 70, 16}, "dout"), x = rnd({300000}, "x"), z = rnd({40, 5000}, "z");
  std::vector<int64_t> labels(40);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int64_t>(i * 97 % 5000);
  const Tensor y = Tensor::from_vector(labels, {40});
  std::vector<std::vector<double>> results[2];
  for (int threads : {1, 2}) {
    set_blas_threads(threads);
    auto& r = results[threads - 1];
    Tensor out = Tensor::empty({6, 70, 16}, DType::f32), lse = Tensor::empty({6, 70}, DType::f32);
    Tensor dq = Tensor::empty({6, 70, 16}, DType::f32), dk = Tensor::empty({6, 70, 16}, DType::f32),
           dv = Tensor::empty({6, 70, 16}, DType::f32);
    F::attention_forward(q, k, v, true, 0.25, out, lse);
    F::attention_backward(q, k, v, out, lse, dout, true, 0.25, dq, dk, dv);
    for (const Tensor* t : {&out, &lse, &dq, &dk, &dv}) r.push_back(t->to_vector());
    Tensor g = Tensor::empty({300000}, DType::f32), dx = Tensor::empty({300000}, DType::f32);
    F::activation_forward(F::ActivationKind::gelu_tanh, x, g);
    F::activation_backward(F::ActivationKind::gelu_tanh, x, g, x, dx);
    r.push_back(g.to_vector());
    r.push_back(dx.to_vector());
    Tensor probs = Tensor::empty({40, 5000}, DType::f32);
    r.push_back({F::cross_entropy_forward(z, y, probs)});
    r.push_back(probs.to_vector());
    Tensor m = Tensor::zeros({300000}, DType::f32), s2 = Tensor::zeros({300000}, DType::f32);
    Tensor pc = Tensor::empty({300000}, DType::f32);
    pc.copy_from(x);
    F::adamw_step(pc, g, m, s2, F::AdamWStep{.weight_decay = 0.1});
    r.push_back(pc.to_vector());
    r.push_back(s2.to_vector());
  }
  set_blas_threads(1);
  set_gemm_policy(GemmPolicy::automatic);
  ASSERT_EQ(results[0].size(), results[1].size());
  for (size_t i = 0; i < results[0].size(); ++i) EXPECT_EQ(results[0][i], results[1][i]) << "result " << i;
}

// While a thread profiles, each kernel it calls is counted under its name;
// other threads and calls after profiling stops are not.
TEST(OpProfile, CountsThisThreadsKernels) {
  const Tensor x = Tensor::full({4, 3}, 1.0, DType::f32), w = Tensor::full({3, 2}, 1.0, DType::f32);
  Tensor y = Tensor::empty({4, 2}, DType::f32);
  F::reset_op_profile();
  F::set_op_profiling(true);
  F::linear_forward(x, w, Tensor(), y);
  F::linear_forward(x, w, Tensor(), y);
  std::thread([&] { F::linear_forward(x, w, Tensor(), Tensor::empty({4, 2}, DType::f32)); }).join();
  F::set_op_profiling(false);
  F::linear_forward(x, w, Tensor(), y);
  const auto profile = F::op_profile();
  ASSERT_EQ(profile.size(), 1u);
  EXPECT_EQ(profile[0].op, "functional::linear_forward");
  EXPECT_EQ(profile[0].calls, 2);
  EXPECT_GT(profile[0].seconds, 0);
  F::reset_op_profile();
  EXPECT_TRUE(F::op_profile().empty());
}

// A ProfileScope adds its wall time under its name beside the kernels; one
// opened while the thread does not profile adds nothing, even if profiling
// starts before it closes.
TEST(OpProfile, ScopesTimeCodeOutsideTheKernels) {
  F::reset_op_profile();
  { const F::ProfileScope off("tp all_reduce"); }
  F::set_op_profiling(true);
  for (int i = 0; i < 3; ++i) {
    const F::ProfileScope scope("tp all_reduce");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  F::set_op_profiling(false);
  {
    const F::ProfileScope late("tp all_gather");
    F::set_op_profiling(true);
  }
  F::set_op_profiling(false);
  const auto profile = F::op_profile();
  ASSERT_EQ(profile.size(), 1u);
  EXPECT_EQ(profile[0].op, "tp all_reduce");
  EXPECT_EQ(profile[0].calls, 3);
  EXPECT_GE(profile[0].seconds, 0.006);
  F::reset_op_profile();
}

TEST(Backend, ModulesRunTheKernelsRegisteredForTheirDevice) {
  int calls = 0;
  F::register_backend(DeviceType::cpu, std::make_unique<CountingBackend>(&calls));
  Linear fc(4, 3, "fc", 1);
  fc.forward(random_tensor({2, 4}, 1));
  fc.forward(random_tensor({5, 4}, 2));
  F::register_backend(DeviceType::cpu, internal::make_cpu_backend());  // restore
  EXPECT_EQ(calls, 2);
  fc.forward(random_tensor({2, 4}, 1));
  EXPECT_EQ(calls, 2);
  EXPECT_THROW(F::backend_for(Device::cuda(0)), Unsupported);
}

}  // namespace
}  // namespace meshtrain::nn
