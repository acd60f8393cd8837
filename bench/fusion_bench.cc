#include "bench/fusion_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <unordered_map>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/functional.h"

#if MESHTRAIN_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace meshtrain::bench {

#if MESHTRAIN_HAVE_ONEDNN
namespace {

namespace F = nn::functional;
using Clock = std::chrono::steady_clock;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

double median_ms(int reps, const std::function<void()>& fn) {
  for (int i = 0; i < 2; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Tensor normal(std::vector<int64_t> shape, uint64_t key, double stddev, DType dtype = DType::f32) {
  Tensor t = Tensor::empty(shape, DType::f32);
  fill_normal(t, 5, key, 0.0, stddev);
  return dtype == DType::f32 ? t : t.to(dtype);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double d = 0;
  for (size_t i = 0; i < x.size(); ++i) d = std::max(d, std::abs(x[i] - y[i]));
  return d;
}

dnnl::memory mem(const dnnl::memory::desc& md, dnnl::engine& eng, const Tensor& t) {
  return dnnl::memory(md, eng, t.data_ptr());
}

dnnl::memory::desc md2(int64_t r, int64_t c, DType t) {
  return dnnl::memory::desc({r, c}, t == DType::bf16 ? dt::bf16 : dt::f32, tag::ab);
}

// out = x W + b, then post-op: none, GELU (tanh), or + out's old values.
enum class Post { none, gelu, residual };

FusionBenchRow gemm_case(const FusionBenchOptions& o, dnnl::engine& eng, dnnl::stream& s, const char* name,
                         int64_t in, int64_t out, Post post, DType dtype) {
  const int64_t r = o.rows;
  const Tensor x = normal({r, in}, 1, 1.0, dtype), w = normal({in, out}, 2, 0.02, dtype), b = normal({out}, 3, 0.1);
  const Tensor resid = normal({r, out}, 4, 1.0);
  Tensor y = Tensor::empty({r, out}, DType::f32), a = Tensor::empty({r, out}, DType::f32);
  auto ours = [&] {
    F::linear_forward(x, w, b, y);
    if (post == Post::gelu) F::activation_forward(F::ActivationKind::gelu_tanh, y, a);
    if (post == Post::residual) add(resid, y, a);
  };
  dnnl::post_ops po;
  if (post == Post::gelu) po.append_eltwise(1.0f, dnnl::algorithm::eltwise_gelu_tanh, 0.0f, 0.0f);
  if (post == Post::residual) po.append_sum(1.0f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(po);
  const auto src_md = md2(r, in, dtype), wei_md = md2(in, out, dtype), dst_md = md2(r, out, DType::f32);
  const dnnl::memory::desc bias_md({1, out}, dt::f32, tag::ab);
  FusionBenchRow row{.name = name,
                     .shape = fmt::format("({}, {}) x ({}, {})", r, in, in, out),
                     .dtype = std::string(dtype_name(dtype))};
  // oneDNN 2.x has no bf16 matmul below AVX-512 (or only a reference
  // kernel, which times nothing worth comparing): skip the row, say why.
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(src_md, wei_md, bias_md, dst_md), attr, eng);
  } catch (const dnnl::error& e) {
    if (e.status != dnnl_unimplemented) throw;
  }
  if (!pd || std::string(pd.impl_info_str()).rfind("ref", 0) == 0) {
    row.skipped = fmt::format("oneDNN has no {} kernel for it on {}", row.dtype, cpu_isa_summary());
    return row;
  }
  const dnnl::matmul mm(pd);
  Tensor d = Tensor::empty({r, out}, DType::f32);
  const std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, mem(src_md, eng, x)},
                                                   {DNNL_ARG_WEIGHTS, mem(wei_md, eng, w)},
                                                   {DNNL_ARG_BIAS, mem(bias_md, eng, b)},
                                                   {DNNL_ARG_DST, mem(dst_md, eng, d)}};
  auto theirs = [&] {
    if (post == Post::residual) d.copy_from(resid);  // the sum post-op adds onto dst
    mm.execute(s, args);
    s.wait();
  };
  row.ours_ms = median_ms(o.reps, ours);
  row.onednn_ms = median_ms(o.reps, theirs);
  row.max_abs_diff = max_abs_diff(post == Post::none ? y : a, d);
  return row;
}

std::vector<FusionBenchRow> layer_norm_cases(const FusionBenchOptions& o, dnnl::engine& eng, dnnl::stream& s) {
  const int64_t r = o.rows, c = o.width;
  const double eps = 1e-5;
  const Tensor x = normal({r, c}, 5, 1.0), g = normal({c}, 6, 0.1), be = normal({c}, 7, 0.1), dy = normal({r, c}, 8, 1.0);
  Tensor y = Tensor::empty({r, c}, DType::f32), xhat = Tensor::empty({r, c}, DType::f32);
  Tensor rstd = Tensor::empty({r}, DType::f32), dx = Tensor::empty({r, c}, DType::f32);
  Tensor dg = Tensor::zeros({c}, DType::f32), db = Tensor::zeros({c}, DType::f32);
  const auto data_md = md2(r, c, DType::f32);
  const dnnl::memory::desc stat_md({r}, dt::f32, tag::a), ss_md({c}, dt::f32, tag::a);
  const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
  const dnnl::layer_normalization_forward::primitive_desc fpd(
      dnnl::layer_normalization_forward::desc(dnnl::prop_kind::forward_training, data_md, stat_md,
                                              static_cast<float>(eps), flags),
      eng);
  const dnnl::layer_normalization_backward::primitive_desc bpd(
      dnnl::layer_normalization_backward::desc(dnnl::prop_kind::backward, data_md, data_md, stat_md,
                                               static_cast<float>(eps), flags),
      eng, fpd);
  Tensor d = Tensor::empty({r, c}, DType::f32), mean = Tensor::empty({r}, DType::f32),
         var = Tensor::empty({r}, DType::f32), ddx = Tensor::empty({r, c}, DType::f32),
         ddg = Tensor::empty({c}, DType::f32), ddb = Tensor::empty({c}, DType::f32);
  const dnnl::layer_normalization_forward fwd(fpd);
  const dnnl::layer_normalization_backward bwd(bpd);
  const std::unordered_map<int, dnnl::memory> fargs{
      {DNNL_ARG_SRC, mem(data_md, eng, x)},       {DNNL_ARG_DST, mem(data_md, eng, d)},
      {DNNL_ARG_MEAN, mem(stat_md, eng, mean)},   {DNNL_ARG_VARIANCE, mem(stat_md, eng, var)},
      {DNNL_ARG_SCALE, mem(ss_md, eng, g)},       {DNNL_ARG_SHIFT, mem(ss_md, eng, be)}};
  const std::unordered_map<int, dnnl::memory> bargs{
      {DNNL_ARG_SRC, mem(data_md, eng, x)},          {DNNL_ARG_DIFF_DST, mem(data_md, eng, dy)},
      {DNNL_ARG_MEAN, mem(stat_md, eng, mean)},      {DNNL_ARG_VARIANCE, mem(stat_md, eng, var)},
      {DNNL_ARG_SCALE, mem(ss_md, eng, g)},          {DNNL_ARG_SHIFT, mem(ss_md, eng, be)},
      {DNNL_ARG_DIFF_SRC, mem(data_md, eng, ddx)},   {DNNL_ARG_DIFF_SCALE, mem(ss_md, eng, ddg)},
      {DNNL_ARG_DIFF_SHIFT, mem(ss_md, eng, ddb)}};
  const std::string shape = fmt::format("({}, {})", r, c);
  FusionBenchRow f{.name = "LayerNorm forward", .shape = shape, .dtype = "f32"};
  f.ours_ms = median_ms(o.reps, [&] { F::layer_norm_forward(x, g, be, eps, y, xhat, rstd); });
  f.onednn_ms = median_ms(o.reps, [&] {
    fwd.execute(s, fargs);
    s.wait();
  });
  f.max_abs_diff = max_abs_diff(y, d);
  FusionBenchRow b{.name = "LayerNorm backward (dx, dgamma, dbeta)", .shape = shape, .dtype = "f32"};
  b.ours_ms = median_ms(o.reps, [&] {
    F::layer_norm_backward_input(dy, xhat, rstd, g, dx);
    dg.fill(0.0);  // ours accumulates; oneDNN overwrites
    db.fill(0.0);
    F::layer_norm_backward_weight(dy, xhat, dg, db);
  });
  b.onednn_ms = median_ms(o.reps, [&] {
    bwd.execute(s, bargs);
    s.wait();
  });
  b.max_abs_diff = std::max({max_abs_diff(dx, ddx), max_abs_diff(dg, ddg), max_abs_diff(db, ddb)});
  return {f, b};
}

FusionBenchRow softmax_case(const FusionBenchOptions& o, dnnl::engine& eng, dnnl::stream& s) {
  const int64_t r = o.rows, v = o.vocab;
  const Tensor z = normal({r, v}, 9, 2.0);
  Tensor labels = Tensor::empty({r}, DType::i64), probs = Tensor::empty({r, v}, DType::f32);
  for (int64_t i = 0; i < r; ++i) labels.data<int64_t>()[i] = (i * 7919) % v;
  const auto md = md2(r, v, DType::f32);
  const dnnl::logsoftmax_forward::primitive_desc pd(
      dnnl::logsoftmax_forward::desc(dnnl::prop_kind::forward_inference, md, 1), eng);
  const dnnl::logsoftmax_forward prim(pd);
  Tensor logp = Tensor::empty({r, v}, DType::f32);
  const std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, mem(md, eng, z)}, {DNNL_ARG_DST, mem(md, eng, logp)}};
  FusionBenchRow row{.name = "softmax + loss / log-softmax", .shape = fmt::format("({}, {})", r, v), .dtype = "f32"};
  row.ours_ms = median_ms(o.reps, [&] { F::cross_entropy_forward(z, labels, probs); });
  row.onednn_ms = median_ms(o.reps, [&] {
    prim.execute(s, args);
    s.wait();
  });
  Tensor p = Tensor::empty({r, v}, DType::f32);
  const float* lp = logp.data<float>();
  float* pp = p.data<float>();
  for (int64_t i = 0; i < r * v; ++i) pp[i] = std::exp(lp[i]);
  row.max_abs_diff = max_abs_diff(probs, p);
  return row;
}

}  // namespace

std::vector<FusionBenchRow> run_fusion_bench(const FusionBenchOptions& o) {
  if (o.rows < 1 || o.width < 1 || o.vocab < 1 || o.threads < 1 || o.reps < 1)
    throw InvalidArgument("bench fusions", "rows, width, vocab, threads and reps must be >= 1", "pass positive sizes");
  set_blas_threads(o.threads);  // meshtrain's GEMMs and element-wise kernels
#if defined(_OPENMP)
  omp_set_num_threads(o.threads);  // oneDNN's primitives, run from this thread (OpenMP runtime)
#endif
  (void)cpu_isa();  // caps oneDNN's ISA (MESHTRAIN_CPU_ISA) before it picks one
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  const int64_t c = o.width;
  std::vector<FusionBenchRow> rows;
  for (DType t : {DType::f32, DType::bf16}) {
    rows.push_back(gemm_case(o, eng, s, "fc + bias", c, 4 * c, Post::none, t));
    rows.push_back(gemm_case(o, eng, s, "fc + bias + GELU", c, 4 * c, Post::gelu, t));
    rows.push_back(gemm_case(o, eng, s, "proj + bias + residual", c, c, Post::residual, t));
  }
  for (FusionBenchRow& r : layer_norm_cases(o, eng, s)) rows.push_back(std::move(r));
  rows.push_back(softmax_case(o, eng, s));
  return rows;
}

#else

std::vector<FusionBenchRow> run_fusion_bench(const FusionBenchOptions&) {
  throw Unsupported("bench fusions", "this build has no oneDNN (the configure summary says which GEMM backend it uses)",
                    "install libdnnl-dev and configure again");
}

#endif

std::string format_fusion_bench(const std::vector<FusionBenchRow>& rows, const FusionBenchOptions& o) {
  std::string s = fmt::format(
      "meshtrain's kernels against oneDNN's fused post-ops, layer normalization and log-softmax: {} rows, width {}, "
      "vocabulary {}, {} thread(s), median of {}; CPU ISA {}\n\n",
      o.rows, o.width, o.vocab, o.threads, o.reps, cpu_isa_summary());
  s += "| work | shape | GEMM dtype | meshtrain ms | oneDNN ms | oneDNN / meshtrain | max abs diff |\n";
  s += "|---|---|---|---:|---:|---:|---:|\n";
  std::string skipped;
  for (const FusionBenchRow& r : rows) {
    if (!r.skipped.empty()) {
      s += fmt::format("| {} | {} | {} | skipped | skipped | - | - |\n", r.name, r.shape, r.dtype);
      skipped += fmt::format("skipped {} {}: {}\n", r.name, r.dtype, r.skipped);
      continue;
    }
    s += fmt::format("| {} | {} | {} | {:.3f} | {:.3f} | {:.2f}x | {:.1e} |\n", r.name, r.shape, r.dtype, r.ours_ms,
                     r.onednn_ms, r.onednn_ms / r.ours_ms, r.max_abs_diff);
  }
  s += "\nmeshtrain: separate passes as a training step runs them (the GELU row also keeps the pre-activation its "
       "backward needs; the fused form keeps only the activation). oneDNN: one primitive per row.\n";
  if (!skipped.empty()) s += "\n" + skipped;
  return s;
}

}  // namespace meshtrain::bench
