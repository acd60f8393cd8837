#include "bench/moe_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/matmul.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/expert_parallel.h"
#include "meshtrain/plan/device_placement.h"

namespace meshtrain::bench {
namespace {

namespace F = nn::functional;
using Clock = std::chrono::steady_clock;

Tensor random_ids(int64_t b, int64_t t, int64_t vocab, uint64_t key) {
  Tensor u = Tensor::empty({b, t}, DType::f32);
  fill_uniform(u, 11, key, 0.0, static_cast<double>(vocab));
  std::vector<int64_t> ids(static_cast<size_t>(b * t));
  const float* p = u.data<float>();
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = std::min<int64_t>(vocab - 1, static_cast<int64_t>(p[i]));
  return Tensor::from_vector(ids, {b, t});
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct RankTimes {
  std::vector<double> step_ms;
  std::vector<F::OpTime> profile;
  double finish_ms = 0;  // per step
  int64_t parameters = 0;
};

// One rank's steps: the batch's rows by its data or expert coordinate.
RankTimes run_rank(const MoeBenchOptions& o, bool expert_axis, comm::Communicator* world) {
  const int ranks = world == nullptr ? 1 : world->size(), rank = world == nullptr ? 0 : world->rank();
  nn::GPTConfig c{.arch = layout::DecoderArch::llama, .kv_heads = o.kv_heads, .vocab = o.vocab,
                  .block_size = o.context, .layers = o.layers, .heads = o.heads, .width = o.width, .seed = 1,
                  .moe = {.experts = o.experts, .top_k = o.top_k, .expert_hidden = o.expert_hidden,
                          .capacity_factor = o.capacity_factor}};
  if (expert_axis) c.expert.comm = world;
  nn::GPT gpt(c);
  RankTimes r;
  for (const nn::Parameter* p : gpt.parameters()) r.parameters += p->value.numel();
  std::unique_ptr<parallel::Parallelism> wrapper;
  std::unique_ptr<comm::Communicator> self;  // expert=E: the replicas of this rank's parameters (itself)
  if (world != nullptr && expert_axis) {
    self = world->split(rank, 0);
    wrapper = std::make_unique<parallel::ExpertParallel>(
        std::make_unique<parallel::DataParallel>(gpt, *self,
                                                 parallel::DataParallelOptions{.reduce = parallel::GradReduce::sum}),
        *world, gpt.parameters());
  } else if (world != nullptr) {
    wrapper = std::make_unique<parallel::DataParallel>(
        gpt, *world, parallel::DataParallelOptions{.reduce = parallel::GradReduce::sum});
  }
  const std::vector<nn::Parameter*> params = wrapper ? wrapper->optimizer_parameters() : gpt.parameters();
  optim::AdamW opt(params, 1e-4, {0.9, 0.999}, 1e-8, 0.1);
  nn::CrossEntropyLoss ce;
  const int64_t rows = o.batch / ranks, first = rank * rows;
  const Tensor x = random_ids(o.batch, o.context, o.vocab, 1).narrow(0, first, rows).contiguous();
  const Tensor y = random_ids(o.batch, o.context, o.vocab, 2).narrow(0, first, rows).contiguous();
  const Tensor targets = y.view({y.numel()});
  const double tokens = static_cast<double>(o.batch * o.context);
  gpt.set_batch_context(nn::BatchContext{.global_samples = static_cast<double>(o.batch)});
  double finish_ms = 0;  // the gradient reductions left after backward (timed here: they hold scopes of their own)
  const auto step = [&] {
    if (wrapper) wrapper->begin_micro_batch(0, 1);
    ce.forward(gpt.forward(x), targets, tokens);
    gpt.backward(ce.backward());
    if (wrapper) {
      const auto t0 = Clock::now();
      wrapper->finish();
      finish_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    }
    opt.step();
    if (wrapper) wrapper->after_step();
    for (const auto& [block, layer] : gpt.moe_layers()) (void)layer->take_load();
    if (wrapper)
      wrapper->zero_grad();
    else
      opt.zero_grad();
  };
  for (int i = 0; i < o.warmup; ++i) step();
  if (world != nullptr) world->barrier();
  F::reset_op_profile();
  F::set_op_profiling(true);
  finish_ms = 0;
  for (int i = 0; i < o.steps; ++i) {
    const auto t0 = Clock::now();
    step();
    r.step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  F::set_op_profiling(false);
  r.profile = F::op_profile();
  r.finish_ms = finish_ms / o.steps;
  F::reset_op_profile();
  return r;
}

MoeBenchRow run_mesh(const MoeBenchOptions& o, const std::string& axis, int ranks) {
  std::vector<RankTimes> all(static_cast<size_t>(ranks));
  if (ranks == 1) {
    all[0] = run_rank(o, false, nullptr);
  } else {
    set_blas_threads(std::max(1, o.threads / ranks));
    std::mutex mu;
    comm::launch({.engine = comm::Engine::threads, .ranks = ranks, .bind_to_cores = o.threads / ranks == 1},
                 [&](comm::Communicator& world) {
                   RankTimes t = run_rank(o, axis == "expert", &world);
                   std::lock_guard lock(mu);
                   all[static_cast<size_t>(world.rank())] = std::move(t);
                 });
    set_blas_threads(o.threads);
  }
  const RankTimes& zero = all[0];
  MoeBenchRow row;
  row.mesh = ranks == 1 ? "none" : fmt::format("{}={}", axis, ranks);
  row.step_ms = median(zero.step_ms);
  for (double t : zero.step_ms) row.mean_step_ms += t / static_cast<double>(o.steps);
  row.tokens_per_s = static_cast<double>(o.batch * o.context) / (row.step_ms / 1e3);
  for (const F::OpTime& op : zero.profile) {
    const double ms = op.seconds * 1e3 / o.steps;
    if (op.op == "ep all_to_all") row.all_to_all_ms += ms;
  }
  row.gradient_ms = zero.finish_ms;
  row.parameters_per_rank = zero.parameters;
  return row;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::stringstream text;
  text << in.rdbuf();
  const std::string name = plan::parse_cpu_model(text.str());
  return name.empty() ? "unknown CPU" : name;
}

}  // namespace

MoeBenchResult run_moe_bench(const MoeBenchOptions& o) {
  if (o.ranks < 2 || o.experts % o.ranks != 0 || o.batch % o.ranks != 0)
    throw InvalidArgument("bench moe", fmt::format("{} ranks for {} experts and a batch of {}", o.ranks, o.experts,
                                                   o.batch),
                          "use 2 or more ranks that divide --experts and --batch");
  MoeBenchResult r;
  r.cpu = cpu_name();
  r.peak = measure_fma_peak(o.threads);
  set_blas_threads(o.threads);
  {
    nn::GPT whole({.arch = layout::DecoderArch::llama, .kv_heads = o.kv_heads, .vocab = o.vocab,
                   .block_size = o.context, .layers = o.layers, .heads = o.heads, .width = o.width,
                   .defer_init = true,
                   .moe = {.experts = o.experts, .top_k = o.top_k, .expert_hidden = o.expert_hidden}});
    for (const nn::Parameter* p : whole.parameters()) {
      r.parameters += p->info.numel();
      if (!p->info.routed_expert()) r.active_parameters += p->info.numel();
    }
    r.active_parameters += o.layers * o.top_k * 3 * o.width * o.expert_hidden;
  }
  r.rows.push_back(run_mesh(o, "", 1));
  r.rows.push_back(run_mesh(o, "data", o.ranks));
  r.rows.push_back(run_mesh(o, "expert", o.ranks));
  return r;
}

std::string format_moe_bench(const MoeBenchResult& r, const MoeBenchOptions& o) {
  std::string s = fmt::format(
      "MoE GPT (Llama blocks) {} layers x {} width, {} heads ({} key/value), {} experts of {} hidden, top-{}, "
      "vocab {}, T = {}, global batch {}: {:.2f}M parameters, {:.2f}M active per token; AdamW, {} GEMM thread{} "
      "split over each mesh's ranks\n\n",
      o.layers, o.width, o.heads, o.kv_heads, o.experts, o.expert_hidden, o.top_k, o.vocab, o.context, o.batch,
      r.parameters / 1e6, r.active_parameters / 1e6, o.threads, o.threads == 1 ? "" : "s");
  s += "| mesh | step ms (median) | tokens/s | vs data | all-to-all share | gradient sync share | parameters / rank |\n"
       "|---|---:|---:|---:|---:|---:|---:|\n";
  double data_rate = 0;
  for (const MoeBenchRow& row : r.rows)
    if (row.mesh.rfind("data", 0) == 0) data_rate = row.tokens_per_s;
  for (const MoeBenchRow& row : r.rows)
    s += fmt::format("| {} | {:.1f} | {:.0f} | {} | {:.1f}% | {:.1f}% | {:.2f}M |\n", row.mesh, row.step_ms,
                     row.tokens_per_s,
                     row.mesh == "none" || data_rate == 0 ? "" : fmt::format("{:.2f}x", row.tokens_per_s / data_rate),
                     100 * row.all_to_all_ms / row.mean_step_ms, 100 * row.gradient_ms / row.mean_step_ms,
                     row.parameters_per_rank / 1e6);
  s += fmt::format("\nCPU: {}; FMA peak now ({} loop, {} thread{}): f32 {:.1f} GFLOP/s\n", r.cpu, r.peak.isa,
                   o.threads, o.threads == 1 ? "" : "s", r.peak.f32_gflops);
  s += "all-to-all: the experts' token exchange (counts, dispatch and combine, forward and backward), rank 0's "
       "share of its mean step, waiting for the slowest rank included; gradient sync: DataParallel's finish "
       "(data) or ExpertParallel's replicated gradients (expert)\n";
  return s;
}

}  // namespace meshtrain::bench
