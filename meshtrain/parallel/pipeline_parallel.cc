#include "meshtrain/parallel/pipeline_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"

namespace meshtrain::parallel {

PipelineParallel::PipelineParallel(std::vector<Stage> stages, comm::Communicator& pp)
    : stages_(std::move(stages)), pp_(pp) {
  const char* op = "PipelineParallel";
  if (stages_.empty()) throw InvalidArgument(op, "no stages", "give this rank's stages (at least one)");
  for (size_t i = 0; i < stages_.size(); ++i)
    if (!stages_[i].strategy || (i > 0 && stages_[i].index <= stages_[i - 1].index))
      throw InvalidArgument(op, fmt::format("stage {} (entry {})", stages_[i].index, i),
                            "give each stage a strategy, in ascending stage order");
  // The tied group: every rank that holds a stage with tied parameters. The
  // lowest such stage is the one whose copies count.
  int lowest = 1 << 30;
  for (const Stage& s : stages_)
    if (!s.tied.empty()) lowest = std::min(lowest, s.index);
  int32_t low = lowest;
  pp_.all_reduce(&low, &low, 1, DType::i32, comm::ReduceOp::min);
  if (low == 1 << 30) return;  // nothing tied anywhere
  lowest_tied_stage_ = low;
  tied_comm_ = pp_.split(lowest < (1 << 30) ? 0 : -1, pp_.rank());
  if (!tied_comm_) return;
  for (const Stage& s : stages_)
    for (const std::string& name : s.tied) {
      nn::Parameter* found = nullptr;
      for (nn::Parameter* p : s.strategy->optimizer_parameters())
        if (p->name == name) found = p;
      if (found == nullptr)
        throw InvalidArgument(op, fmt::format("stage {} lists tied parameter '{}' but holds none of it", s.index, name),
                              "list only the stage's own parameters as tied");
      tied_params_.push_back(found);
    }
  // The copies must cover the same elements: compare count and first element.
  std::vector<int64_t> mine;
  for (const nn::Parameter* p : tied_params_) {
    mine.push_back(p->value.numel());
    mine.push_back(p->placement.is_flat() ? p->placement.start : 0);
  }
  int64_t n = static_cast<int64_t>(mine.size()), n_lo = n;
  tied_comm_->all_reduce(&n_lo, &n_lo, 1, DType::i64, comm::ReduceOp::min);
  std::vector<int64_t> lo = mine, hi = mine;
  bool same = n_lo == n;
  if (same) {
    tied_comm_->all_reduce(lo.data(), lo.data(), lo.size(), DType::i64, comm::ReduceOp::min);
    tied_comm_->all_reduce(hi.data(), hi.data(), hi.size(), DType::i64, comm::ReduceOp::max);
    same = lo == hi;
  }
  if (!same)
    throw InvalidArgument(op,
                          fmt::format("the tied parameters of stages {} are held differently on the stages that "
                                      "share them (elements and offset {} here)",
                                      lowest, fmt::join(mine, ", ")),
                          "shard a tied parameter alike on every stage (as its own fsdp unit), or replicate it");
}

std::string PipelineParallel::describe() const {
  std::vector<int> idx;
  for (const Stage& s : stages_) idx.push_back(s.index);
  return fmt::format("pipeline stage{} {} of {} ranks, each {}", idx.size() > 1 ? "s" : "", fmt::join(idx, ", "),
                     pp_.size(), stages_.front().strategy->describe());
}

std::vector<nn::Parameter*> PipelineParallel::optimizer_parameters() {
  std::vector<nn::Parameter*> out;
  for (Stage& s : stages_)
    for (nn::Parameter* p : s.strategy->optimizer_parameters()) out.push_back(p);
  return out;
}

void PipelineParallel::begin_micro_batch(int index, int count) {
  throw InvalidArgument("PipelineParallel::begin_micro_batch", fmt::format("micro-batch {} of {}", index, count),
                        "a pipeline interleaves its stages' backward passes: call stage(k).begin_micro_batch "
                        "before stage k's weight pass");
}

void PipelineParallel::finish() {
  for (Stage& s : stages_) s.strategy->finish();
  for (nn::Parameter* p : tied_params_)
    tied_comm_->all_reduce(p->grad.data_ptr(), p->grad.data_ptr(), static_cast<size_t>(p->grad.numel()),
                           p->grad.dtype(), comm::ReduceOp::sum);
}

bool PipelineParallel::grads_finite() {
  int32_t bad = 0;
  for (Stage& s : stages_) bad |= s.strategy->grads_finite() ? 0 : 1;
  pp_.all_reduce(&bad, &bad, 1, DType::i32, comm::ReduceOp::max);
  return bad == 0;
}

bool PipelineParallel::counted_elsewhere(const Stage& s, const std::string& name) const {
  return s.index != lowest_tied_stage_ && std::find(s.tied.begin(), s.tied.end(), name) != s.tied.end();
}

std::pair<double, double> PipelineParallel::grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) {
  double sq[2] = {0, 0};
  for (Stage& s : stages_) {
    if (s.tied.empty() || s.index == lowest_tied_stage_) {
      const auto [a, b] = s.strategy->grad_sq_split(first);
      sq[0] += a;
      sq[1] += b;
      continue;
    }
    // {first and counted, the rest}, then the copies alone, taken off the rest.
    const auto [a, rest] =
        s.strategy->grad_sq_split([&](const nn::Parameter& p) { return first(p) && !counted_elsewhere(s, p.name); });
    const auto [copies, others] =
        s.strategy->grad_sq_split([&](const nn::Parameter& p) { return counted_elsewhere(s, p.name); });
    (void)others;
    sq[0] += a;
    sq[1] += rest - copies;
  }
  pp_.all_reduce(sq, sq, 2, DType::f64, comm::ReduceOp::sum);
  return {sq[0], std::max(0.0, sq[1])};
}

ExactSquares PipelineParallel::grad_squares_exact(const std::function<bool(const nn::Parameter&)>& counted) {
  ExactSquares mine;
  for (Stage& s : stages_)
    mine.merge(s.strategy->grad_squares_exact(
        [&](const nn::Parameter& p) { return counted(p) && !counted_elsewhere(s, p.name); }));
  return merged_over(pp_, mine);
}

double PipelineParallel::grad_norm() {
  const auto [a, b] = grad_sq_split([](const nn::Parameter&) { return true; });
  return std::sqrt(a + b);
}

void PipelineParallel::after_step() {
  for (Stage& s : stages_) s.strategy->after_step();
}

void PipelineParallel::zero_grad() {
  for (Stage& s : stages_) s.strategy->zero_grad();
}

void PipelineParallel::gather_full_parameters() {
  for (Stage& s : stages_) s.strategy->gather_full_parameters();
}

void PipelineParallel::reshard() {
  for (Stage& s : stages_) s.strategy->reshard();
}

bool PipelineParallel::needs_loss_scaling() const {
  return std::any_of(stages_.begin(), stages_.end(), [](const Stage& s) { return s.strategy->needs_loss_scaling(); });
}

std::optional<double> PipelineParallel::hidden_fraction() const {
  double sum = 0;
  int n = 0;
  for (const Stage& s : stages_)
    if (const auto h = s.strategy->hidden_fraction()) {
      sum += *h;
      ++n;
    }
  if (n == 0) return std::nullopt;
  return sum / n;
}

std::vector<ParamShard> PipelineParallel::parameter_shards() const {
  std::vector<ParamShard> out;
  for (const Stage& s : stages_)
    for (ParamShard& p : s.strategy->parameter_shards()) out.push_back(std::move(p));
  return out;
}

}  // namespace meshtrain::parallel
