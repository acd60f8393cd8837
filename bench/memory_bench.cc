#include "bench/memory_bench.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/optim/adamw.h"

namespace meshtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kAdamWStateBytes = 8;  // exp_avg + exp_avg_sq, f32

std::string mib(double bytes) { return fmt::format("{:.2f}", bytes / (1 << 20)); }

MemoryBenchRow run_one(const MemoryBenchOptions& o, const std::string& strategy_name, int ranks, DType precision) {
  const parallel::FsdpMode strategy = parallel::parse_fsdp_mode(strategy_name);
  MemoryBenchRow row;
  row.strategy = strategy_name;
  row.ranks = ranks;
  row.precision = precision;
  std::mutex mu;
  set_blas_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks));
  const auto t0 = Clock::now();
  comm::launch({.engine = comm::Engine::threads,
                .ranks = ranks,
                .timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000))},
               [&](comm::Communicator& c) {
                 MemoryTracker tracker;
                 uint64_t first_working = 0;
                 nn::MLPConfig mc;
                 mc.sizes = {784};
                 for (int64_t h : o.hidden) mc.sizes.push_back(h);
                 mc.sizes.push_back(10);
                 mc.seed = 1;
                 mc.defer_init = true;  // each rank builds only what it stores
                 nn::MLP model(mc);
                 int64_t largest = 0;
                 {
                   parallel::FullyShardedDataParallel fsdp(
                       model, c, nullptr,
                       {.stage = strategy.stage, .min_weight_size = o.min_weight_size, .param_dtype = precision,
                        .reduce_dtype = std::nullopt, .reduce = parallel::GradReduce::sum, .tracker = &tracker});
                   optim::AdamW opt(fsdp.optimizer_parameters(), 1e-3, {0.9, 0.999}, 1e-8, 0.0, &tracker);
                   nn::CrossEntropyLoss ce;
                   Tensor x = Tensor::empty({o.batch, 784}, DType::f32);
                   std::vector<int64_t> labels(static_cast<size_t>(o.batch));
                   // Step 0 is a warm-up: its working peak includes the skew of ranks starting at
                   // different times (a rank ahead queues every unit's reduction until the others
                   // arrive). Peaks are then reset at a barrier and each measured step starts at one.
                   for (int step = 0; step <= o.steps; ++step) {
                     if (step == 1) {
                       first_working = tracker.peak(MemoryCategory::working);
                       tracker.reset_peak();  // model state is persistent: its peaks stay
                     }
                     c.barrier();
                     fill_uniform(x, static_cast<uint64_t>(step), key_from_name("bench.memory.x") + c.rank(), 0.0,
                                  1.0);
                     for (int64_t i = 0; i < o.batch; ++i)
                       labels[static_cast<size_t>(i)] = (i * 7 + step + c.rank()) % 10;
                     const Tensor y = Tensor::from_vector(labels, {o.batch}, DType::i64);
                     fsdp.begin_micro_batch(0, 1);
                     ce.forward(model.forward(x), y, static_cast<double>(o.batch) * ranks);
                     model.backward(ce.backward());
                     fsdp.finish();
                     opt.step();
                     fsdp.after_step();
                     fsdp.zero_grad();
                   }
                   for (const auto& u : fsdp.units()) largest = std::max(largest, u.padded);
                   std::lock_guard lock(mu);
                   row.sharded_elements = fsdp.sharded_elements();
                   row.replicated_elements = fsdp.replicated_elements();
                 }
                 std::lock_guard lock(mu);
                 row.parameters = std::max(row.parameters, tracker.peak(MemoryCategory::parameters));
                 row.gradients = std::max(row.gradients, tracker.peak(MemoryCategory::gradients));
                 row.optimizer = std::max(row.optimizer, tracker.peak(MemoryCategory::optimizer));
                 row.working = std::max(row.working, tracker.peak(MemoryCategory::working));
                 row.working_first_step = std::max(row.working_first_step, first_working);
                 row.model_state = std::max(row.model_state, tracker.peak(MemoryCategory::parameters) +
                                                                 tracker.peak(MemoryCategory::gradients) +
                                                                 tracker.peak(MemoryCategory::optimizer));
                 row.working_predicted = working_prediction(strategy.stage, precision, largest);
               });
  row.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  row.predicted = parallel::predicted_model_state(strategy.stage, row.sharded_elements, ranks, precision, precision,
                                                  kAdamWStateBytes);
  const double r = static_cast<double>(row.replicated_elements);
  row.predicted.parameters += 4 * r;
  row.predicted.gradients += 4 * r;
  row.predicted.optimizer += kAdamWStateBytes * r;
  return row;
}

}  // namespace

WorkingPrediction working_prediction(parallel::ZeroStage stage, DType param_dtype, int64_t largest_unit) {
  using parallel::ZeroStage;
  WorkingPrediction w;
  w.largest_unit = largest_unit;
  const bool f32 = param_dtype == DType::f32;
  const double p = static_cast<double>(dtype_size(param_dtype));
  w.in_use = (f32 && stage != ZeroStage::zero3 ? 0 : 4) + (f32 && stage <= ZeroStage::zero1 ? 0 : 4);
  if (stage == ZeroStage::zero3) w.prefetch = p;
  // reduce_dtype = param_dtype; up to max_reductions_in_flight buffers queued.
  if (stage >= ZeroStage::zero2) w.reducing = p * parallel::FullyShardedOptions{}.max_reductions_in_flight;
  return w;
}

std::vector<MemoryBenchRow> run_memory_bench(const MemoryBenchOptions& o) {
  std::vector<MemoryBenchRow> rows;
  for (DType p : o.precisions)
    for (int d : o.ranks)
      for (const auto& s : o.strategies) rows.push_back(run_one(o, s, d, p));
  return rows;
}

std::string format_memory_bench(const std::vector<MemoryBenchRow>& rows, const MemoryBenchOptions& o) {
  std::string out;
  if (rows.empty()) return out;
  out += fmt::format("MLP 784 -> {} -> 10: {} sharded + {} replicated (*) parameters; AdamW; {} steps of {} samples "
                     "per rank; MiB per rank, measured peak (max over ranks) / predicted\n",
                     fmt::join(o.hidden, ","),
                     rows[0].sharded_elements, rows[0].replicated_elements, o.steps, o.batch);
  size_t i = 0;
  while (i < rows.size()) {
    const DType p = rows[i].precision;
    const int d = rows[i].ranks;
    out += fmt::format("\n{} ranks, {}\n", d, layout::precision_name(p));
    out += "| strategy | parameters | gradients | optimizer (state + master) | model state | measured / predicted | "
           "working (warm-up) | Np x (use + prefetch + reducing) (**) | working / predicted |\n";
    out += "|---|---|---|---|---|---|---|---|---|\n";
    for (; i < rows.size() && rows[i].precision == p && rows[i].ranks == d; ++i) {
      const MemoryBenchRow& r = rows[i];
      const auto& w = r.working_predicted;
      out += fmt::format("| {} | {} / {} | {} / {} | {} / {} | {} / {} | {:.3f} | {} ({}) | {} x ({:g}+{:g}+{:g}) = {} "
                         "| {} |\n",
                         r.strategy, mib(static_cast<double>(r.parameters)), mib(r.predicted.parameters),
                         mib(static_cast<double>(r.gradients)), mib(r.predicted.gradients),
                         mib(static_cast<double>(r.optimizer)), mib(r.predicted.optimizer),
                         mib(static_cast<double>(r.model_state)), mib(r.predicted.total()),
                         static_cast<double>(r.model_state) / r.predicted.total(), mib(static_cast<double>(r.working)),
                         mib(static_cast<double>(r.working_first_step)),
                         w.largest_unit, w.in_use, w.prefetch, w.reducing, mib(w.bytes()),
                         w.bytes() > 0 ? fmt::format("{:.3f}", static_cast<double>(r.working) / w.bytes())
                                       : std::string(r.working == 0 ? "0 / 0" : "-"));
    }
  }
  out += "\n(*) parameters with fewer than min_weight_size elements stay replicated in f32 on every "
         "rank; the prediction adds their value, gradient and AdamW state (4 + 4 + 8 bytes per element) to "
         "predicted_model_state(stage, P, d, dtype, dtype, 8).\n";
  out += "(**) the largest unit's padded size Np x bytes per element alive while it is in backward: its f32 value "
         "copy and f32 gradient (none when persistent f32), the next unit's gathered buffer (zero3, prefetch pre) "
         "and the reduce-scatter buffers of earlier units (zero2/3), at most max_reductions_in_flight = 2 of them "
         "(the rate limit): an upper bound, reached when reduce-scatters run slower than backward. In "
         "parentheses: the warm-up step, whose peak includes ranks starting apart.\n";
  return out;
}

}  // namespace meshtrain::bench
