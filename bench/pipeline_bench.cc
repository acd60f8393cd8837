#include "bench/pipeline_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/matmul.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/parallel/pipeline_executor.h"
#include "meshtrain/parallel/pipeline_timeline.h"

namespace meshtrain::bench {
namespace {

using parallel::ActionKind;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// `blocks` GPT blocks: the same work on every stage.
class BlockStage final : public parallel::PipelineStage {
 public:
  BlockStage(const PipelineBenchOptions& o, int stage, int stages)
      : gpt_(config(o, stage, stages)),
        first_(stage == 0),
        last_(stage == stages - 1),
        shape_({o.rows, o.context, o.width}) {
    input_ = Tensor::empty(shape_, DType::f32);
    fill_normal(input_, 1, key_from_name("bench.pipeline.x"), 0.0, 1.0);
    weight_ = Tensor::empty(shape_, DType::f32);
    fill_normal(weight_, 1, key_from_name("bench.pipeline.w"), 0.0, 1.0 / static_cast<double>(input_.numel()));
  }
  Tensor forward(int, const Tensor& input, nn::Saved& saved) override {
    const Tensor y = gpt_.forward(first_ ? input_ : input, saved);
    return last_ ? Tensor() : y;  // the last stage's loss sum(y * w) needs nothing more
  }
  Tensor backward_input(int, const Tensor& grad, nn::Saved& saved) override {
    return gpt_.backward_input(last_ ? weight_ : grad, saved);
  }
  void backward_weight(int, nn::Saved& saved) override { gpt_.backward_weight(saved); }
  std::vector<int64_t> input_shape(int) const override { return shape_; }

 private:
  static nn::GPTConfig config(const PipelineBenchOptions& o, int stage, int stages) {
    return nn::GPTConfig{.vocab = 2, .block_size = o.context, .layers = o.blocks_per_stage * stages, .heads = o.heads,
                         .width = o.width, .seed = 1, .first_block = stage * o.blocks_per_stage,
                         .last_block = (stage + 1) * o.blocks_per_stage, .embed = false, .head = false};
  }
  nn::GPT gpt_;
  bool first_, last_;
  std::vector<int64_t> shape_;
  Tensor input_, weight_;
};

struct Measured {
  std::vector<double> bubbles, makespans, forward, backward;
  std::vector<parallel::RankTimeline> median_timeline;
};

Measured run_schedule(const PipelineBenchOptions& o, const parallel::Schedule& schedule) {
  Measured m;
  std::vector<std::vector<parallel::RankTimeline>> steps;
  std::mutex mu;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool bind = cores >= static_cast<unsigned>(o.ranks);
  comm::launch({.engine = comm::Engine::threads, .ranks = o.ranks, .bind_to_cores = bind},
               [&](comm::Communicator& world) {
                 std::vector<std::unique_ptr<BlockStage>> mine;
                 std::map<int, parallel::PipelineStage*> stages;
                 for (int s = 0; s < schedule.num_stages(); ++s)
                   if (schedule.stage_rank(s) == world.rank()) {
                     mine.push_back(std::make_unique<BlockStage>(o, s, schedule.num_stages()));
                     stages[s] = mine.back().get();
                   }
                 parallel::PipelineExecutor exec(schedule, world, stages);
                 for (int step = 0; step < o.warmup + o.steps; ++step) {
                   exec.run();
                   std::vector<parallel::RankTimeline> t = parallel::gather_timelines(exec);
                   if (world.rank() == 0 && step >= o.warmup) {
                     std::lock_guard lock(mu);
                     steps.push_back(std::move(t));
                   }
                 }
               });
  for (const auto& t : steps) {
    m.bubbles.push_back(parallel::measured_bubble(t));
    m.makespans.push_back(parallel::makespan_us(t) / 1000.0);
    for (const parallel::RankTimeline& r : t)
      for (const parallel::PipelineEvent& e : r.events) {
        const double ms = (e.end_us - e.start_us) / 1000.0;
        if (e.action.kind == ActionKind::forward) m.forward.push_back(ms);
        if (e.action.kind == ActionKind::backward) m.backward.push_back(ms);
        if (e.action.kind == ActionKind::backward_input || e.action.kind == ActionKind::backward_weight)
          m.backward.push_back(2 * ms);  // one unit each: comparable with a fused backward
      }
  }
  // The step whose bubble is the median, for the pictures.
  std::vector<size_t> order(steps.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return m.bubbles[a] < m.bubbles[b]; });
  if (!order.empty()) m.median_timeline = steps[order[order.size() / 2]];
  return m;
}

}  // namespace

std::vector<PipelineBenchRow> run_pipeline_bench(const PipelineBenchOptions& o) {
  const char* op = "meshtrain bench pipeline";
  if (o.ranks < 1 || o.micro_batches < 1 || o.steps < 1 || o.warmup < 0 || o.blocks_per_stage < 1 || o.rows < 1 ||
      o.context < 1 || o.width < 1 || o.heads < 1 || o.width % o.heads != 0)
    throw InvalidArgument(op,
                          fmt::format("ranks {}, micro-batches {}, steps {}, warmup {}, blocks per stage {}, rows {}, "
                                      "context {}, width {}, heads {}",
                                      o.ranks, o.micro_batches, o.steps, o.warmup, o.blocks_per_stage, o.rows,
                                      o.context, o.width, o.heads),
                          "use positive sizes (warmup >= 0) and heads dividing the width");
  std::vector<PipelineBenchRow> rows;
  const int saved_threads = blas_threads();
  set_blas_threads(1);
  for (const std::string& name : o.schedules) {
    const parallel::ScheduleKind kind = parallel::parse_schedule_kind(name);
    const int v = kind == parallel::ScheduleKind::interleaved_1f1b ? o.virtual_stages : 1;
    const parallel::Schedule schedule = parallel::make_schedule(kind, o.ranks, o.micro_batches, v);
    const Measured m = run_schedule(o, schedule);
    PipelineBenchRow r{.schedule = name,
                       .stages = schedule.num_stages(),
                       .step_ms = median(m.makespans),
                       .measured = median(m.bubbles),
                       .theory = parallel::theoretical_bubble(kind, o.ranks, o.micro_batches, v),
                       .forward_ms = median(m.forward),
                       .backward_ms = median(m.backward),
                       .files = {}};
    if (!o.out_dir.empty() && !m.median_timeline.empty()) {
      std::filesystem::create_directories(o.out_dir);
      const std::string title = fmt::format("{} on {} ranks, {} micro-batches{}", name, o.ranks, o.micro_batches,
                                            v > 1 ? fmt::format(", {} chunks per rank", v) : "");
      const std::pair<std::string, std::string> files[] = {
          {"json", parallel::chrome_trace_json(m.median_timeline, title)},
          {"svg", parallel::timeline_svg(m.median_timeline, title)}};
      for (const auto& [ext, text] : files) {
        const std::string path = (std::filesystem::path(o.out_dir) / fmt::format("pipeline_{}.{}", name, ext)).string();
        std::ofstream out(path);
        if (!(out << text))
          throw IoError(op, fmt::format("cannot write '{}'", path), "check that the --out directory is writable");
        r.files.push_back(path);
      }
    }
    rows.push_back(std::move(r));
  }
  set_blas_threads(saved_threads);
  return rows;
}

std::string format_pipeline_bench(const std::vector<PipelineBenchRow>& rows, const PipelineBenchOptions& o) {
  std::string s = fmt::format(
      "pipeline schedules on {} ranks of the threads engine, {} micro-batches; each stage {} GPT block(s) of width "
      "{}, {} heads, {} x {} tokens per micro-batch; 1 GEMM thread per rank; medians over {} steps\n\n",
      o.ranks, o.micro_batches, o.blocks_per_stage, o.width, o.heads, o.rows, o.context, o.steps);
  s += "| schedule | stages | step ms | forward ms | backward ms | bubble measured | bubble theory | difference |\n";
  s += "|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const PipelineBenchRow& r : rows)
    s += fmt::format("| {} | {} | {:.1f} | {:.2f} | {:.2f} | {:.1f}% | {:.1f}% | {:+.1f} points |\n", r.schedule,
                     r.stages, r.step_ms, r.forward_ms, r.backward_ms, 100 * r.measured, 100 * r.theory,
                     100 * (r.measured - r.theory));
  s += "\ntheory: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v m+p-1) interleaved, ZB-H1 1 - 3m/(2m+p-1+max(m,p)), "
       "with a backward costing twice a forward (docs/pipeline.md); the measured share is idle rank-time over the "
       "step's makespan, from the executor's timelines.\n";
  for (const PipelineBenchRow& r : rows)
    for (const std::string& f : r.files) s += fmt::format("wrote {}\n", f);
  return s;
}

}  // namespace meshtrain::bench
