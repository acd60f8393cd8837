#include "meshtrain/train/internal/pipeline_run.h"

#include "meshtrain/train/internal/gather_parameters.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/nn/functional.h"

namespace meshtrain::train::internal {

class PipelineRun::Adapter final : public parallel::PipelineStage {
 public:
  Adapter(PipelineRun& run, RecipeStage& stage, parallel::Parallelism& strategy)
      : run_(run), stage_(stage), strategy_(strategy) {}
  void begin_step(int64_t step, double norm) {
    step_ = step;
    norm_ = norm;
    losses_.assign(static_cast<size_t>(run_.schedule_.micro_batches), 0.0);
  }
  // The micro-batches' losses (the last stage's; 0 elsewhere): summed in
  // micro-batch order, or in the deterministic mode in the canonical tree.
  double loss() const {
    std::vector<double> v = losses_;
    if (nn::functional::deterministic_rows() > 0) return tree_sum(v);
    double sum = 0;
    for (double l : v) sum += l;
    return sum;
  }

  Tensor forward(int mb, const Tensor& input, nn::Saved& saved) override {
    double loss = 0;
    Tensor out = stage_.forward(micro(mb), step_, norm_, input, saved, &loss);
    losses_.at(static_cast<size_t>(mb)) = loss;
    return out;
  }
  Tensor backward_input(int, const Tensor& grad, nn::Saved& saved) override {
    return stage_.backward_input(grad, saved);
  }
  // The strategy's gradient hooks fire in the weight pass: its micro-batch
  // window advances there (the schedule runs a stage's weight passes in
  // micro-batch order).
  void backward_weight(int mb, nn::Saved& saved) override {
    strategy_.begin_micro_batch(mb, run_.schedule_.micro_batches);
    stage_.backward_weight(saved);
  }
  Tensor backward(int mb, const Tensor& grad, nn::Saved& saved) override {
    strategy_.begin_micro_batch(mb, run_.schedule_.micro_batches);
    return stage_.backward(grad, saved);
  }
  std::vector<int64_t> input_shape(int mb) const override { return stage_.input_shape(micro(mb)); }

 private:
  const Batch& micro(int mb) const { return run_.micro_.at(static_cast<size_t>(mb)); }
  PipelineRun& run_;
  RecipeStage& stage_;
  parallel::Parallelism& strategy_;
  int64_t step_ = 0;
  double norm_ = 1;
  std::vector<double> losses_;
};

PipelineRun::PipelineRun(parallel::Schedule schedule, comm::Communicator& pp, std::vector<RecipeStage*> stages,
                         parallel::PipelineParallel& strategies)
    : schedule_(std::move(schedule)), pp_(pp), stages_(std::move(stages)) {
  for (int s = 0; s < schedule_.num_stages(); ++s)
    if (schedule_.stage_rank(s) == pp_.rank()) indices_.push_back(s);
  if (indices_.size() != stages_.size() || static_cast<int>(stages_.size()) != strategies.num_stages_here())
    throw InvalidArgument("PipelineRun",
                          fmt::format("pipeline rank {} holds {} stages of the schedule, got {} model stages and {} "
                                      "strategies",
                                      pp_.rank(), indices_.size(), stages_.size(), strategies.num_stages_here()),
                          "build the model's stages for this rank (ModelOptions::stages)");
  std::map<int, parallel::PipelineStage*> mine;
  for (size_t k = 0; k < stages_.size(); ++k) {
    adapters_.push_back(std::make_unique<Adapter>(*this, *stages_[k], strategies.stage(static_cast<int>(k))));
    mine[indices_[k]] = adapters_.back().get();
  }
  executor_ = std::make_unique<parallel::PipelineExecutor>(schedule_, pp_, std::move(mine));
}

PipelineRun::~PipelineRun() = default;

double PipelineRun::step(const Batch& batch, int64_t step, double norm) {
  const int m = schedule_.micro_batches;
  const int64_t local = batch.size();
  micro_.clear();
  for (int i = 0; i < m; ++i) micro_.push_back(batch.rows(local * i / m, local * (i + 1) / m));
  for (auto& a : adapters_) a->begin_step(step, norm);
  executor_->run();
  double loss = 0;
  for (auto& a : adapters_) loss += a->loss();
  micro_.clear();
  return loss;
}

std::vector<double> PipelineRun::evaluate(const Batch& chunk, int64_t n) {
  const int last = schedule_.num_stages() - 1;
  const int tag_base = 2 * schedule_.num_stages() * schedule_.micro_batches;  // above the executor's tags
  std::vector<double> sums;
  struct Sent {
    Tensor data;  // alive until its send completes (declared before work)
    comm::Work work;
  };
  std::vector<Sent> sent;
  for (size_t k = 0; k < stages_.size(); ++k) {
    const int s = indices_[k];
    Tensor input;
    if (s > 0) {
      input = Tensor::empty(stages_[k]->input_shape(chunk), DType::f32);
      pp_.recv(input.data_ptr(), static_cast<size_t>(input.numel()), DType::f32, schedule_.stage_rank(s - 1),
               tag_base + s);
    }
    const Tensor out = stages_[k]->evaluate(chunk, n, input, &sums);
    if (s == last) continue;
    Sent x{out.to(DType::f32).contiguous(), {}};
    x.work = pp_.send_async(x.data.data_ptr(), static_cast<size_t>(x.data.numel()), DType::f32,
                            schedule_.stage_rank(s + 1), tag_base + s + 1);
    sent.push_back(std::move(x));
  }
  for (Sent& x : sent) x.work.wait();
  return sums;
}

void PipelineRun::share_sums(std::vector<double>& sums) {
  const int holder = schedule_.stage_rank(schedule_.num_stages() - 1);
  int64_t count = static_cast<int64_t>(sums.size());
  pp_.broadcast(&count, 1, DType::i64, holder);
  sums.resize(static_cast<size_t>(count));
  pp_.broadcast(sums.data(), sums.size(), DType::f64, holder);
}

std::string PipelineRun::describe_stages() {
  std::string mine;
  for (size_t k = 0; k < stages_.size(); ++k) {
    const std::vector<nn::Parameter*> ps = stages_[k]->module().parameters();
    int64_t values = 0;
    for (const nn::Parameter* p : ps) {
      int64_t n = 1;
      for (int64_t d : p->info.shape) n *= d;
      values += n;
    }
    mine += fmt::format("  stage {} on pipeline rank {}: {} .. {}, {} tensors, {} values\n", indices_[k], pp_.rank(),
                        ps.empty() ? "-" : ps.front()->name, ps.empty() ? "-" : ps.back()->name, ps.size(), values);
  }
  const std::vector<std::string> all = comm::all_gather_bytes(pp_, mine);
  if (pp_.rank() != 0) return "";
  std::vector<std::string> lines;
  for (const std::string& part : all) {
    size_t at = 0;
    for (size_t nl; (nl = part.find('\n', at)) != std::string::npos; at = nl + 1) lines.push_back(part.substr(at, nl + 1 - at));
  }
  // In stage order (a rank's stages are r, r + p, ...).
  std::sort(lines.begin(), lines.end(), [](const std::string& a, const std::string& b) {
    return std::stoi(a.substr(8)) < std::stoi(b.substr(8));
  });
  std::string out;
  for (const std::string& l : lines) out += l;
  return out;
}

PipelineReport PipelineRun::write_timeline(const RunDirectory* dir, int64_t step) {
  const std::vector<parallel::RankTimeline> all = parallel::gather_timelines(*executor_);
  const parallel::Schedule& sc = schedule_;
  PipelineReport r{.schedule = std::string(parallel::to_string(sc.kind)),
                   .theory = parallel::theoretical_bubble(sc.kind, sc.ranks, sc.micro_batches, sc.virtual_stages),
                   .peak_in_flight = executor_->peak_saved()};
  if (all.empty()) return r;  // not pipeline rank 0
  r.bubble = parallel::measured_bubble(all);
  if (dir == nullptr) return r;
  const std::string title = fmt::format("{} schedule, {} pipeline ranks x {} chunks, {} micro-batches (step {})",
                                        r.schedule, sc.ranks, sc.virtual_stages, sc.micro_batches, step);
  write_file_atomic(dir->file("pipeline.trace.json"), parallel::chrome_trace_json(all, title));
  write_file_atomic(dir->file("pipeline.svg"), parallel::timeline_svg(all, title));
  return r;
}

std::unique_ptr<RecipeModel> assemble_model(const ModelRecipe& recipe, uint64_t seed, const std::string& model,
                                            std::vector<std::pair<std::string, Tensor>>& params) {
  std::unique_ptr<RecipeModel> whole = recipe.build({.seed = seed});
  std::map<std::string, Tensor> by_name(params.begin(), params.end());
  params.clear();
  for (nn::Parameter* p : whole->module().parameters()) {
    const auto it = by_name.find(p->name);
    if (it == by_name.end())
      throw InvalidArgument("meshtrain train",
                            fmt::format("model '{}': no pipeline stage holds parameter '{}'", model, p->name),
                            "build every parameter of the whole model in some stage (see model_recipe.h)");
    p->value.copy_from(it->second);
    params.emplace_back(p->name, p->value);
  }
  // The MoE layers' selection biases, which their stages sent beside their routers.
  const MoELayers layers = whole->moe_layers();
  for (const auto& [block, layer] : layers)
    if (const auto it = by_name.find(layer->bias_name()); it != by_name.end()) {
      const Tensor b = it->second.contiguous();
      layer->set_bias({b.data<float>(), static_cast<size_t>(b.numel())});
    }
  insert_moe_biases(params, layers);
  return whole;
}

std::vector<std::pair<std::string, Tensor>> PipelineRun::collect_parameters(
    const std::vector<std::pair<std::string, Tensor>>& mine) {
  constexpr int kTag = 1 << 14;  // below MPI's smallest tag bound (32767), above the other tags here
  std::vector<std::pair<std::string, Tensor>> out;
  for (NamedTensors& rank : gather_named_tensors(pp_, mine, kTag))
    for (auto& named : rank) out.push_back(std::move(named));
  return out;
}

}  // namespace meshtrain::train::internal
