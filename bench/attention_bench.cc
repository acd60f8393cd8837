#include "bench/attention_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>

#include "meshtrain/core/random.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/functional.h"

namespace meshtrain::bench {

namespace {

namespace F = nn::functional;

double median_ms(int reps, const std::function<void()>& body) {
  body();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Tensor random(std::vector<int64_t> shape, uint64_t key) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  fill_normal(t, 7, key, 0.0, 1.0);
  return t;
}

}  // namespace

std::vector<AttentionBenchRow> run_attention_bench(const AttentionBenchOptions& o) {
  std::vector<AttentionBenchRow> rows;
  for (int64_t t : o.lengths) {
    const int64_t n = o.batch * o.heads, d = o.head_dim;
    const Tensor q = random({n, t, d}, 1), k = random({n, t, d}, 2), v = random({n, t, d}, 3);
    const Tensor dout = random({n, t, d}, 4);
    Tensor out = Tensor::empty({n, t, d}, DType::f32), lse = Tensor::empty({n, t}, DType::f32);
    Tensor ref = Tensor::empty({n, t, d}, DType::f32);
    Tensor dq = Tensor::empty({n, t, d}, DType::f32), dk = Tensor::empty({n, t, d}, DType::f32),
           dv = Tensor::empty({n, t, d}, DType::f32);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    AttentionBenchRow r;
    r.t = t;
    r.forward_ms = median_ms(o.reps, [&] { F::attention_forward(q, k, v, o.causal, scale, out, lse); });
    r.backward_ms = median_ms(o.reps, [&] {
      F::attention_backward(q, k, v, out, lse, dout, o.causal, scale, dq, dk, dv);
    });
    r.reference_ms = median_ms(o.reps, [&] { F::attention_reference(q, k, v, o.causal, scale, ref); });
    const std::vector<double> a = out.to_vector(), b = ref.to_vector();
    for (size_t i = 0; i < a.size(); ++i) r.max_abs_diff = std::max(r.max_abs_diff, std::abs(a[i] - b[i]));
    // Two GEMMs of 2 T T D FLOPs each per head; causal needs half.
    const double flops = 4.0 * static_cast<double>(n) * static_cast<double>(t * t * d) * (o.causal ? 0.5 : 1.0);
    r.gflops_forward = flops / (r.forward_ms * 1e6);
    const double f = sizeof(float);
    r.kept_bytes = f * static_cast<double>(n) * (4.0 * static_cast<double>(t * d) + static_cast<double>(t));
    r.reference_kept_bytes = r.kept_bytes + f * static_cast<double>(n) * static_cast<double>(t * t);
    rows.push_back(r);
  }
  return rows;
}

std::string format_attention_bench(const std::vector<AttentionBenchRow>& rows, const AttentionBenchOptions& o) {
  std::string s = fmt::format(
      "attention, batch {} x {} heads x head_dim {}, {}, f32, 1 BLAS thread (median of {})\n"
      "{:>6} {:>12} {:>12} {:>10} {:>14} {:>12} {:>14} {:>10}\n",
      o.batch, o.heads, o.head_dim, o.causal ? "causal" : "full", o.reps, "T", "forward ms", "backward ms",
      "GFLOP/s", "reference ms", "kept MiB", "reference MiB", "max diff");
  for (const AttentionBenchRow& r : rows)
    s += fmt::format("{:>6} {:>12.3f} {:>12.3f} {:>10.1f} {:>14.3f} {:>12.2f} {:>14.2f} {:>10.1e}\n", r.t,
                     r.forward_ms, r.backward_ms, r.gflops_forward, r.reference_ms, r.kept_bytes / (1 << 20),
                     r.reference_kept_bytes / (1 << 20), r.max_abs_diff);
  s += "(kept: what the backward needs between the passes: blockwise q, k, v, out + log-sum-exp; the reference "
       "also the T x T probabilities)\n";
  return s;
}

}  // namespace meshtrain::bench
