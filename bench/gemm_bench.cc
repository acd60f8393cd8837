#include "bench/gemm_bench.h"

#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <thread>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/gemm_choice.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"

namespace meshtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// ---- peak: independent accumulators, no memory traffic ----
// 12 chains cover the FMA latency (4 cycles) times two pipes with room to spare.

constexpr int kChains = 12;

__attribute__((target("avx512f"))) float fma512_loop(int64_t iters) {
  __m512 acc[kChains];
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0] + out[15];
}

__attribute__((target("avx512f,avx512bf16"))) float dpbf16_loop(int64_t iters) {
  __m512 acc[kChains];
  const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3c00));  // bf16 2^-7
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, x);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0] + out[15];
}

__attribute__((target("avx2,fma"))) float fma256_loop(int64_t iters) {
  __m256 acc[kChains];
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  }
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[7];
}

// GFLOP/s of `loop` on `threads` threads at once (flops_per_iter each), best of 15.
double loop_gflops(float (*loop)(int64_t), double flops_per_iter, int threads) {
  constexpr int64_t kIters = 2'000'000;  // ~10 ms per run at 100 GFLOP/s
  double best = 0;
  volatile float sink = 0;
  for (int run = 0; run < 15; ++run) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back([&] { sink = sink + loop(kIters); });
    sink = sink + loop(kIters);
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, flops_per_iter * static_cast<double>(kIters) * threads / s / 1e9);
  }
  return best;
}

}  // namespace

// The loop of the widest FMA the kernels may use (cpu_isa(): MESHTRAIN_CPU_ISA
// caps it, so the peak is the one an AVX2 machine would reach).
FmaPeak measure_fma_peak(int threads) {
  FmaPeak p;
  const CpuIsa isa = cpu_isa();
  if (isa >= CpuIsa::avx512) {
    p.isa = "avx512f";
    p.f32_gflops = loop_gflops(fma512_loop, kChains * 16 * 2.0, threads);
    if (isa >= CpuIsa::avx512_bf16) p.bf16_gflops = loop_gflops(dpbf16_loop, kChains * 32 * 2.0, threads);
  } else if (isa >= CpuIsa::avx2) {
    p.isa = "avx2+fma";
    p.f32_gflops = loop_gflops(fma256_loop, kChains * 8 * 2.0, threads);
  } else {
    p.isa = "none";
  }
  return p;
}

namespace {

// ---- shapes ----

void linear_shapes(std::vector<GemmShape>& out, const std::string& set, const std::string& name, int64_t m,
                   int64_t in, int64_t o, bool input_grad = true) {
  out.push_back({set, name + " fwd", m, in, o, false, false, 0.0});        // y = x W
  if (input_grad) out.push_back({set, name + " dX", m, o, in, false, true, 0.0});  // dx = dy W^T
  out.push_back({set, name + " dW", in, m, o, true, false, 1.0});          // dW += x^T dy
}

// One variant on the shared operands.
enum class Variant { openblas_f32, onednn_f32, onednn_bf16, auto_f32 };

struct Operands {
  Tensor a, b, c;  // f32
  Tensor ah, bh;   // bf16 copies
};

Tensor random_tensor(std::vector<int64_t> shape, uint64_t key) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  fill_uniform(t, 1, key, -1.0, 1.0);
  return t;
}

double time_call(const GemmShape& s, Operands& o, Variant v) {
  const MatmulBackend backend = v == Variant::openblas_f32 ? MatmulBackend::openblas : MatmulBackend::onednn;
  std::optional<MatmulBackendScope> scope;
  if (v != Variant::auto_f32) scope.emplace(backend);
  const bool half = v == Variant::onednn_bf16;
  const auto t0 = Clock::now();
  matmul(half ? o.ah : o.a, half ? o.bh : o.b, o.c, s.trans_a, s.trans_b, 1.0, s.beta);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

std::vector<GemmShape> gemm_bench_shapes(const GemmBenchOptions& o) {
  std::vector<GemmShape> out;
  for (const std::string& set : o.sets) {
    if (set == "mlp") {
      linear_shapes(out, set, "fc1 784->512", o.m, 784, 512, /*input_grad=*/false);  // the input needs none
      linear_shapes(out, set, "fc2 512->512", o.m, 512, 512);
      linear_shapes(out, set, "fc3 512->10", o.m, 512, 10);
    } else if (set == "gpt") {
      linear_shapes(out, set, "qkv 768->2304", o.m, 768, 2304);
      linear_shapes(out, set, "proj 768->768", o.m, 768, 768);
      linear_shapes(out, set, "fc 768->3072", o.m, 768, 3072);
      linear_shapes(out, set, "fcproj 3072->768", o.m, 3072, 768);
      // The tied head: logits = x E^T with E (V, 768) stored like an embedding.
      const std::string h = fmt::format("head 768->{}", o.vocab);
      out.push_back({set, h + " fwd", o.m, 768, o.vocab, false, true, 0.0});
      out.push_back({set, h + " dX", o.m, o.vocab, 768, false, false, 0.0});
      out.push_back({set, h + " dW", o.vocab, o.m, 768, true, false, 1.0});
    } else {
      throw InvalidArgument("bench gemm", fmt::format("set '{}'", set), "use mlp, gpt or both (comma list)");
    }
  }
  return out;
}

GemmBenchResult run_gemm_bench(const GemmBenchOptions& o) {
  if (o.m < 1 || o.reps < 1 || o.warmup < 0 || o.threads < 1 || o.vocab < 1)
    throw InvalidArgument("bench gemm", fmt::format("m {}, reps {}, warmup {}, threads {}, vocab {}", o.m, o.reps,
                                                    o.warmup, o.threads, o.vocab),
                          "use m, reps, threads, vocab >= 1 and warmup >= 0");
  GemmBenchResult r;
  set_blas_threads(o.threads);
  set_gemm_policy(GemmPolicy::automatic);  // the auto column: core's own choice per shape
  r.openblas_note = openblas_core_note();
  const FmaPeak peak = measure_fma_peak(o.threads);
  r.f32_peak_gflops = peak.f32_gflops;
  r.bf16_peak_gflops = peak.bf16_gflops;
  r.peak_isa = peak.isa;
  const bool onednn = matmul_backend_available(MatmulBackend::onednn);
  if (onednn) r.onednn = matmul_backend_description(MatmulBackend::onednn);
  std::vector<Variant> variants{Variant::openblas_f32};
  if (onednn) variants.insert(variants.end(), {Variant::onednn_f32, Variant::onednn_bf16, Variant::auto_f32});

  const std::vector<GemmShape> shapes = gemm_bench_shapes(o);
  // Every shape's operands live at once (f32 a and b, their bf16 copies, f32 c):
  // refused before anything is allocated when the machine cannot hold them.
  double need = 0;
  for (const GemmShape& s : shapes)
    need += 6.0 * static_cast<double>(s.m * s.k + s.k * s.n) + 4.0 * static_cast<double>(s.m * s.n);
  if (const double have = static_cast<double>(physical_memory_bytes()); have > 0 && need > have)
    throw InvalidArgument("bench gemm",
                          fmt::format("--m {} and --vocab {}: the operands of every GEMM need {:.1f} GiB, more than "
                                      "this machine's {:.1f} GiB",
                                      o.m, o.vocab, need / (1 << 30), have / (1 << 30)),
                          "lower --m or --vocab, or pick one --sets");
  std::vector<Operands> ops;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const GemmShape& s = shapes[i];
    Operands x;
    x.a = random_tensor(s.trans_a ? std::vector<int64_t>{s.k, s.m} : std::vector<int64_t>{s.m, s.k}, 2 * i);
    x.b = random_tensor(s.trans_b ? std::vector<int64_t>{s.n, s.k} : std::vector<int64_t>{s.k, s.n}, 2 * i + 1);
    x.c = Tensor::zeros({s.m, s.n}, DType::f32);
    if (onednn) {
      x.ah = x.a.to(DType::bf16);
      x.bh = x.b.to(DType::bf16);
    }
    ops.push_back(std::move(x));
  }
  std::vector<std::map<Variant, std::vector<double>>> times(shapes.size());
  // The variants' order rotates from round to round, so none always runs
  // right after another touched the same operands.
  for (int round = 0; round < o.warmup + o.reps; ++round)
    for (size_t i = 0; i < shapes.size(); ++i)
      for (size_t j = 0; j < variants.size(); ++j) {
        const Variant v = variants[(j + static_cast<size_t>(round)) % variants.size()];
        const double t = time_call(shapes[i], ops[i], v);
        if (round >= o.warmup) times[i][v].push_back(t);
      }
  for (size_t i = 0; i < shapes.size(); ++i) {
    GemmRow row;
    row.shape = shapes[i];
    row.openblas_f32 = median(times[i][Variant::openblas_f32]);
    if (onednn) {
      row.onednn_f32 = median(times[i][Variant::onednn_f32]);
      row.onednn_bf16 = median(times[i][Variant::onednn_bf16]);
      row.auto_f32 = median(times[i][Variant::auto_f32]);
      const GemmShape& g = shapes[i];
      for (const GemmChoice& c : gemm_choices())
        if (gemm_covers(c, DType::f32, g.m, g.n, g.k, g.trans_a, g.trans_b, o.threads)) {
          row.chosen = matmul_backend_name(c.backend);
          row.chosen_from_cache = c.from_cache;
        }
    }
    r.rows.push_back(row);
  }
  return r;
}

std::string format_gemm_bench(const GemmBenchResult& r, const GemmBenchOptions& o) {
  std::string s = fmt::format("CPU ISA {}\n", cpu_isa_summary());
  s += fmt::format("peak ({} thread{}, {} loop, best of 15): f32 FMA {:.1f} GFLOP/s", o.threads,
                   o.threads == 1 ? "" : "s", r.peak_isa, r.f32_peak_gflops);
  s += r.bf16_peak_gflops > 0 ? fmt::format(", bf16 dot product {:.1f} GFLOP/s\n", r.bf16_peak_gflops)
                              : std::string(", no AVX512-BF16\n");
  s += fmt::format("backends: {}; OpenBLAS sgemm{} ({})\n", r.onednn.empty() ? "no oneDNN in this build" : r.onednn,
                   r.onednn.empty() ? "" : " beside it", matmul_backend_description(MatmulBackend::openblas));
  s += fmt::format("median of {} interleaved rounds, GFLOP/s (% of the f32 peak; bf16: bf16/f32 rate of oneDNN)\n",
                   o.reps);
  auto pct = [&](double gf) { return r.f32_peak_gflops > 0 ? 100 * gf / r.f32_peak_gflops : 0.0; };
  auto cell = [&](double flops, double t) {
    return t > 0 ? fmt::format("{:6.1f} ({:3.0f}%)", flops / t / 1e9, pct(flops / t / 1e9)) : std::string("     -       ");
  };
  const std::string head =
      fmt::format("{:<4} {:<22} {:>6} {:>6} {:>6} {:>2}  {:<13}  {:<13}  {:<13}  {:<8}  {:<13} {:<8} {}\n", "set",
                  "GEMM", "M", "K", "N", "op", "OpenBLAS f32", "oneDNN f32", "oneDNN bf16", "bf16/f32", "auto f32", "chosen",
                  "vs best");
  s += head;
  // Per set: flops; OpenBLAS, oneDNN, bf16 and auto times; the fixed rule's
  // (f32 x^T dy on OpenBLAS, the rest on oneDNN); the better f32 backend per
  // shape; the chosen backend's column.
  std::map<std::string, std::array<double, 8>> total;
  std::vector<std::string> order;
  const auto best_of = [](const GemmRow& row) {
    return row.onednn_f32 > 0 ? std::min(row.openblas_f32, row.onednn_f32) : row.openblas_f32;
  };
  for (const GemmRow& row : r.rows) {
    const GemmShape& g = row.shape;
    const double f = g.flops();
    const std::string op = std::string(g.trans_a ? "T" : "N") + (g.trans_b ? "T" : "N");
    const std::string ratio = row.onednn_bf16 > 0 ? fmt::format("{:.2f}x", row.onednn_f32 / row.onednn_bf16) : "-";
    const std::string chosen = row.chosen.empty() ? "-" : row.chosen + (row.chosen_from_cache ? "*" : "");
    // The chosen backend's own column against the better column: what the choice costs.
    const double chosen_t = row.chosen == "openblas" ? row.openblas_f32 : row.onednn_f32;
    const std::string vs = row.chosen.empty() ? "-" : fmt::format("{:.0f}%", 100 * best_of(row) / chosen_t);
    s += fmt::format("{:<4} {:<22} {:>6} {:>6} {:>6} {:>2}  {}  {}  {}  {:<8}  {} {:<8} {}\n", g.set, g.name, g.m, g.k,
                     g.n, op, cell(f, row.openblas_f32), cell(f, row.onednn_f32), cell(f, row.onednn_bf16), ratio,
                     cell(f, row.auto_f32), chosen, vs);
    if (!total.count(g.set)) order.push_back(g.set);
    auto& t = total[g.set];
    t[0] += f;
    t[1] += row.openblas_f32;
    t[2] += row.onednn_f32;
    t[3] += row.onednn_bf16;
    t[4] += row.auto_f32;
    const internal::GemmKey key{.m = g.m, .n = g.n, .k = g.k, .trans_a = g.trans_a, .trans_b = g.trans_b};
    t[5] += internal::fixed_rule_backend(key, row.onednn_f32 > 0) == MatmulBackend::openblas ? row.openblas_f32
                                                                                             : row.onednn_f32;
    t[6] += best_of(row);
    t[7] += row.chosen.empty() ? 0.0 : chosen_t;
  }
  for (const std::string& set : order) {
    const auto& t = total[set];
    const std::string ratio = t[3] > 0 ? fmt::format("{:.2f}x", t[2] / t[3]) : "-";
    s += fmt::format("{:<4} {:<22} {:>6} {:>6} {:>6} {:>2}  {}  {}  {}  {:<8}  {} {:<8} {}\n", set,
                     "all (time-weighted)", "", "", "", "", cell(t[0], t[1]), cell(t[0], t[2]), cell(t[0], t[3]), ratio,
                     cell(t[0], t[4]), "", t[7] > 0 ? fmt::format("{:.0f}%", 100 * t[6] / t[7]) : "-");
    s += fmt::format("{:<4} {:<22} {:.3f} ms OpenBLAS f32, {:.3f} ms oneDNN f32, {:.3f} ms oneDNN bf16\n", set,
                     "  sum of medians", 1e3 * t[1], 1e3 * t[2], 1e3 * t[3]);
    const auto line = [&](const char* what, double sec) {
      if (sec > 0)
        s += fmt::format("{:<4} {:<22} {:.3f} ms, {:.1f} GFLOP/s ({:.0f}% of the f32 peak)\n", set, what, 1e3 * sec,
                         t[0] / sec / 1e9, r.f32_peak_gflops > 0 ? 100 * t[0] / sec / 1e9 / r.f32_peak_gflops : 0.0);
    };
    line("  f32 auto (chosen)", t[4]);
    line("  f32 best per shape", t[6]);
    line("  f32 fixed rule", t[5]);
  }
  s += "auto f32: core's choice per shape, timed as chosen (MESHTRAIN_GEMM_BACKEND=auto; * read from "
       "MESHTRAIN_GEMM_CACHE); vs best: the better f32 column's rate over the chosen backend's column's\n";
  if (!r.openblas_note.empty()) s += "note: " + r.openblas_note + "\n";
  return s;
}

}  // namespace meshtrain::bench
