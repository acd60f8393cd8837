#include "bench/train_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/core/error.h"
#include "meshtrain/nn/deterministic.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"

namespace meshtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

nn::MLPConfig mlp_config() {
  nn::MLPConfig c;
  c.sizes = {784, 512, 512, 10};
  c.seed = 1;
  return c;
}

struct Data {
  Tensor x, y;
  explicit Data(int64_t batch, uint64_t seed) {
    x = Tensor::empty({batch, 784}, DType::f32);
    fill_uniform(x, seed, key_from_name("bench.x"), 0.0, 1.0);
    std::vector<int64_t> labels(batch);
    for (int64_t i = 0; i < batch; ++i) labels[i] = (i * 7 + static_cast<int64_t>(seed)) % 10;
    y = Tensor::from_vector(labels, {batch}, DType::i64);
  }
};

// Median seconds per call of fn over `steps` calls after `warmup`.
template <typename Fn>
double time_median(int warmup, int steps, Fn&& fn) {
  std::vector<double> t;
  for (int i = 0; i < warmup + steps; ++i) {
    const auto t0 = Clock::now();
    fn();
    if (i >= warmup) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(t);
}

// Data-parallel training with `ranks` ranks (threads; 0: the mpirun world on
// the mpi engine), `batch` per rank: DataParallel when `fsdp` is empty, else
// FullyShardedDataParallel with that strategy and parameter dtype.
DataParallelRun dp_run(int ranks, const TrainBenchOptions& o, const std::string& fsdp = "",
                       DType dtype = DType::f32) {
  DataParallelRun out;
  std::mutex mu;
  const comm::LaunchOptions launch = ranks > 0 ? comm::LaunchOptions{.engine = comm::Engine::threads, .ranks = ranks}
                                               : comm::LaunchOptions{.engine = comm::Engine::mpi, .ranks = 0,
                                                                     .abort_on_error = true};
  comm::launch(launch, [&](comm::Communicator& c) {
    const int n = c.size();
    nn::MLP model(mlp_config());
    std::unique_ptr<parallel::DataParallel> ddp;
    std::unique_ptr<parallel::FullyShardedDataParallel> sharded;
    std::vector<nn::Parameter*> params = model.parameters();
    if (fsdp.empty()) {
      ddp = std::make_unique<parallel::DataParallel>(
          model, c,
          parallel::DataParallelOptions{.bucket_bytes = static_cast<size_t>(o.bucket_mb * (1 << 20)),
                                        .reduce = parallel::GradReduce::sum});
    } else {
      parallel::FullyShardedOptions fo;
      fo.stage = parallel::parse_fsdp_mode(fsdp).stage;
      fo.param_dtype = dtype;
      sharded = std::make_unique<parallel::FullyShardedDataParallel>(model, c, nullptr, fo);
      params = sharded->optimizer_parameters();
    }
    optim::AdamW opt(params, 1e-3);
    nn::CrossEntropyLoss ce;
    Data d(o.batch, static_cast<uint64_t>(c.rank()));
    const double norm = static_cast<double>(o.batch) * n;
    auto step = [&] {
      ce.forward(model.forward(d.x), d.y, norm);
      model.backward(ce.backward());
      if (ddp) {
        ddp->finish();
        opt.step();
        opt.zero_grad();
      } else {
        sharded->finish();
        opt.step();
        sharded->after_step();
        sharded->zero_grad();
      }
    };
    for (int i = 0; i < o.warmup; ++i) step();
    c.barrier();
    const parallel::DataParallelStats before = ddp ? ddp->stats() : parallel::DataParallelStats{};
    const auto t0 = Clock::now();
    for (int i = 0; i < o.steps; ++i) step();
    c.barrier();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (c.rank() == 0) {
      std::lock_guard l(mu);
      out.ranks = n;
      out.samples_per_s = static_cast<double>(o.steps) * o.batch * n / s;
      if (ddp) {
        const parallel::DataParallelStats& after = ddp->stats();
        const double comm = (after.total_comm_time - before.total_comm_time).count();
        const double exposed = (after.total_exposed_time - before.total_exposed_time).count();
        out.comm_ms = 1e3 * comm / o.steps;
        out.exposed_ms = 1e3 * exposed / o.steps;
        out.hidden_fraction = comm > 0 ? 1.0 - exposed / comm : 0.0;
        out.buckets = static_cast<int>(after.buckets.size());
        out.exact_timing = after.timing == parallel::CommTiming::exact;
      }
    }
  });
  return out;
}

}  // namespace

TrainBenchResult run_train_bench(const TrainBenchOptions& o) {
  TrainBenchResult r;
  set_blas_threads(1);
  r.peak = measure_fma_peak(1);
  // The step's 8 GEMMs: forward and weight gradient of the 3 layers, input
  // gradients of the last 2 (the first layer's input needs none).
  r.step_flops = 2.0 * o.batch * (2.0 * (784 * 512 + 512 * 512 + 512 * 10) + (512 * 512 + 512 * 10));
  {
    // fp32 and bf16 (the MLP's Linear layers compute in bf16: bf16 GEMMs
    // with f32 accumulation) interleaved in blocks of 10 steps, so a slow
    // phase of a shared machine hits both.
    nn::MLP model(mlp_config()), model16(mlp_config()), model_det(mlp_config());
    model16.set_compute_dtype(DType::bf16);
    optim::AdamW opt(model.parameters(), 1e-3), opt16(model16.parameters(), 1e-3);
    optim::AdamW opt_det(model_det.parameters(), 1e-3);
    nn::CrossEntropyLoss ce;
    Data d(o.batch, 0);
    // The deterministic mode as the trainer runs the MLP: blocks of 32 samples.
    constexpr int64_t kBlock = 32;
    if (o.deterministic && o.batch % kBlock != 0)
      throw InvalidArgument("bench train --deterministic", fmt::format("batch {} in blocks of {}", o.batch, kBlock),
                            "use a --batch that is a multiple of 32");
    auto step = [&](nn::MLP& m, optim::AdamW& op) {
      const bool det = &m == &model_det;
      const nn::functional::DeterministicRowsScope mode(det ? kBlock : 0);
      if (det) nn::begin_deterministic_step(kBlock, o.batch / kBlock, {0, o.batch / kBlock});
      op.zero_grad();
      ce.forward(m.forward(d.x), d.y);
      m.backward(ce.backward());
      op.step();
    };
    std::vector<double> t32, t16, tdet;
    std::vector<std::tuple<nn::MLP*, optim::AdamW*, std::vector<double>*>> runs = {{&model, &opt, &t32},
                                                                                   {&model16, &opt16, &t16}};
    if (o.deterministic) runs.emplace_back(&model_det, &opt_det, &tdet);
    for (int done = 0; done < o.warmup + o.steps; done += 10) {
      const int n = std::min(10, o.warmup + o.steps - done);
      for (auto [m, op, t] : runs)
        for (int i = 0; i < n; ++i) {
          const auto t0 = Clock::now();
          step(*m, *op);
          if (done + i >= o.warmup) t->push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
    }
    r.step_ms = 1e3 * median(t32);
    r.step_bf16_ms = 1e3 * median(t16);
    if (o.deterministic) r.step_deterministic_ms = 1e3 * median(tdet);
  }
  {
    // The step's GEMMs with their shapes: (M, K) x (K, N).
    const int64_t B = o.batch;
    Tensor x = Tensor::zeros({B, 784}, DType::f32), h1 = Tensor::zeros({B, 512}, DType::f32),
           h2 = Tensor::zeros({B, 512}, DType::f32), out = Tensor::zeros({B, 10}, DType::f32);
    Tensor w1 = Tensor::zeros({784, 512}, DType::f32), w2 = Tensor::zeros({512, 512}, DType::f32),
           w3 = Tensor::zeros({512, 10}, DType::f32);
    Tensor g1 = w1.clone(), g2 = w2.clone(), g3 = w3.clone(), d1 = h1.clone(), d2 = h2.clone();
    const double flops = 2.0 * B * (784 * 512 + 512 * 512 + 512 * 10) * 2 + 2.0 * B * (512 * 512 + 512 * 10);
    const double t = time_median(o.warmup, o.steps, [&] {
      matmul(x, w1, h1);                           // forward
      matmul(h1, w2, h2);
      matmul(h2, w3, out);
      matmul(h2, out, g3, true, false);            // dW3 = h2^T dout
      matmul(out, w3, d2, false, true);            // dh2 = dout W3^T
      matmul(h1, d2, g2, true, false);             // dW2
      matmul(d2, w2, d1, false, true);             // dh1
      matmul(x, d1, g1, true, false);              // dW1 (no dx: the input needs no gradient)
    });
    r.gemm_ms = 1e3 * t;
    r.gemm_gflops = flops / t / 1e9;
    // The same 8 GEMMs on bf16 operands (f32 outputs), as the bf16 step runs them.
    auto h = [](const Tensor& t) { return t.to(DType::bf16); };
    const Tensor xh = h(x), h1h = h(h1), h2h = h(h2), outh = h(out), w1h = h(w1), w2h = h(w2), w3h = h(w3),
                 d1h = h(d1), d2h = h(d2);
    const double t16 = time_median(o.warmup, o.steps, [&] {
      matmul(xh, w1h, h1);
      matmul(h1h, w2h, h2);
      matmul(h2h, w3h, out);
      matmul(h2h, outh, g3, true, false);
      matmul(outh, w3h, d2, false, true);
      matmul(h1h, d2h, g2, true, false);
      matmul(d2h, w2h, d1, false, true);
      matmul(xh, d1h, g1, true, false);
    });
    r.gemm_bf16_ms = 1e3 * t16;
    r.gemm_bf16_gflops = flops / t16 / 1e9;
  }
  r.dp1 = dp_run(1, o);
  r.dp2 = dp_run(2, o);
  if (o.sharded)
    for (const char* fsdp : {"no_shard", "zero1", "zero2", "zero3"})
      for (DType dt : {DType::f32, DType::bf16})
        r.sharded.push_back({fsdp, dt, dp_run(2, o, fsdp, dt).samples_per_s});
  return r;
}

DataParallelRun run_train_bench_mpi(const TrainBenchOptions& options) {
  set_blas_threads(1);
  return dp_run(0, options);
}

std::string format_hidden(const DataParallelRun& r) {
  return fmt::format("  communication        {:8.3f} ms per step in flight, {:.3f} ms exposed: {:.0f}% hidden behind "
                     "backward ({} buckets, {} timing)\n",
                     r.comm_ms, r.exposed_ms, 100 * r.hidden_fraction, r.buckets, r.exact_timing ? "exact" : "polled");
}

std::string format_train_bench_mpi(const DataParallelRun& r, const TrainBenchOptions& o) {
  return fmt::format("data parallel, {} samples per rank per step (mpi engine, {} ranks, {} MiB buckets):\n"
                     "  {} ranks              {:8.0f} samples/s\n",
                     o.batch, r.ranks, o.bucket_mb, r.ranks, r.samples_per_s) +
         format_hidden(r);
}

std::string format_train_bench(const TrainBenchResult& r, const TrainBenchOptions& o) {
  std::string s;
  s += fmt::format("MLP 784-512-512-10, batch {}, 1 GEMM thread, AdamW ({} timed steps, median)\nGEMMs {}\n", o.batch,
                   o.steps, gemm_policy_summary());
  if (const std::string note = openblas_core_note(); !note.empty()) s += "note: " + note + "\n";
  // A rate as GFLOP/s and its share of the FMA peak measured in this run.
  const auto rate = [&](double gflops, bool bf16) {
    const double peak = r.peak.for_dtype(bf16);
    return peak > 0 ? fmt::format("{:.1f} GFLOP/s, {:.0f}% of the FMA peak", gflops, 100 * gflops / peak)
                    : fmt::format("{:.1f} GFLOP/s", gflops);
  };
  s += fmt::format("  FMA peak now ({} loop, 1 thread): f32 {:.1f} GFLOP/s{}\n", r.peak.isa, r.peak.f32_gflops,
                   r.peak.bf16_gflops > 0 ? fmt::format(", bf16 dot product {:.1f} GFLOP/s", r.peak.bf16_gflops)
                                          : std::string(", no bf16 instructions"));
  s += fmt::format("  fp32 step time       {:8.3f} ms   ({:.0f} samples/s; {})\n", r.step_ms, o.batch / r.step_ms * 1e3,
                   rate(r.step_flops / (r.step_ms * 1e6), false));
  s += fmt::format("  its 8 GEMMs alone    {:8.3f} ms   ({} f32)\n", r.gemm_ms, rate(r.gemm_gflops, false));
  s += fmt::format("  GEMM share of step   {:8.1f} %\n", 100 * r.gemm_ms / r.step_ms);
  s += fmt::format("  bf16 step time       {:8.3f} ms   ({:.0f} samples/s, {:.2f}x the fp32 step; {})\n",
                   r.step_bf16_ms, o.batch / r.step_bf16_ms * 1e3, r.step_bf16_ms / r.step_ms,
                   rate(r.step_flops / (r.step_bf16_ms * 1e6), true));
  s += fmt::format("  its 8 GEMMs alone    {:8.3f} ms   ({} bf16)\n", r.gemm_bf16_ms, rate(r.gemm_bf16_gflops, true));
  s += fmt::format("  GEMM share of step   {:8.1f} %\n", 100 * r.gemm_bf16_ms / r.step_bf16_ms);
  if (const std::string note = gemm_dtype_note(DType::bf16); !note.empty()) s += fmt::format("  note: {}\n", note);
  if (r.step_deterministic_ms > 0)
    s += fmt::format(
        "  fp32 deterministic   {:8.3f} ms   ({:.0f} samples/s, {:.2f}x the fp32 step; blocks of 32 samples, "
        "docs/determinism.md)\n",
        r.step_deterministic_ms, o.batch / r.step_deterministic_ms * 1e3, r.step_deterministic_ms / r.step_ms);
  s += fmt::format("data parallel, {} samples per rank per step (threads engine, {} MiB buckets):\n", o.batch,
                   o.bucket_mb);
  s += fmt::format("  1 rank               {:8.0f} samples/s\n", r.dp1.samples_per_s);
  s += fmt::format("  2 ranks              {:8.0f} samples/s   ({:.2f}x)\n", r.dp2.samples_per_s,
                   r.dp2.samples_per_s / r.dp1.samples_per_s);
  s += format_hidden(r.dp2);
  if (!r.sharded.empty()) {
    s += "fully sharded, 2 ranks (min_weight_size 1024: weights sharded, biases replicated):\n";
    for (const auto& row : r.sharded)
      s += fmt::format("  {:<8} {:<4}        {:8.0f} samples/s   ({:.2f}x data parallel)\n", row.strategy,
                       dtype_name(row.dtype), row.samples_per_s, row.samples_per_s / r.dp2.samples_per_s);
  }
  return s;
}

}  // namespace meshtrain::bench
