#include "meshtrain/sharding/stage_assignment.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "meshtrain/core/error.h"

namespace meshtrain::sharding {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Contiguous splits of n layers into s non-empty stages. A stage is (first
// layer i, count c). Each search below looks only at splits whose every stage
// passes ok(i, c), and tables hold the best value of each suffix: stages
// s..S-1 covering layers i..n-1, at t[s * (n + 1) + i].
class Splitter {
 public:
  Splitter(const std::vector<double>& costs, int stages)
      : n_(static_cast<int>(costs.size())), s_(stages), prefix_(costs.size() + 1, 0.0) {
    std::partial_sum(costs.begin(), costs.end(), prefix_.begin() + 1);
  }

  double cost(int i, int c) const { return prefix_[i + c] - prefix_[i]; }
  double total() const { return prefix_[n_]; }

  // min over splits of max over stages of value(i, c) (minimize = true), or
  // max over splits of min over stages (minimize = false). Infinite (+ for
  // minimize, - otherwise) when no split passes ok.
  template <class Value, class Ok>
  double bottleneck(Value value, Ok ok, bool minimize) const {
    const double infeasible = minimize ? kInf : -kInf;
    std::vector<double> t(static_cast<size_t>(s_ + 1) * (n_ + 1), infeasible);
    t[at(s_, n_)] = -infeasible;  // the empty suffix: identity of max (min)
    for (int s = s_ - 1; s >= 0; --s)
      for (int i = s; i <= n_ - (s_ - s); ++i)
        for (int c = 1; c <= n_ - i - (s_ - s - 1); ++c) {
          const double sub = t[at(s + 1, i + c)];
          if (sub == infeasible || !ok(i, c)) continue;
          const double v = minimize ? std::max(value(i, c), sub) : std::min(value(i, c), sub);
          double& best = t[at(s, i)];
          best = minimize ? std::min(best, v) : std::max(best, v);
        }
    return t[at(0, 0)];
  }

  // The lexicographically largest counts among splits passing ok.
  template <class Ok>
  std::vector<int> largest_first(Ok ok) const {
    std::vector<char> feasible(static_cast<size_t>(s_ + 1) * (n_ + 1), 0);
    feasible[at(s_, n_)] = 1;
    for (int s = s_ - 1; s >= 0; --s)
      for (int i = s; i <= n_ - (s_ - s); ++i)
        for (int c = 1; c <= n_ - i - (s_ - s - 1) && !feasible[at(s, i)]; ++c)
          feasible[at(s, i)] = feasible[at(s + 1, i + c)] && ok(i, c);
    std::vector<int> counts;
    int i = 0;
    for (int s = 0; s < s_; ++s) {
      int c = n_ - i - (s_ - s - 1);
      while (c > 1 && !(feasible[at(s + 1, i + c)] && ok(i, c))) --c;
      counts.push_back(c);
      i += c;
    }
    return counts;
  }

 private:
  size_t at(int s, int i) const { return static_cast<size_t>(s) * (n_ + 1) + i; }

  int n_;
  int s_;
  std::vector<double> prefix_;
};

}  // namespace

PipelineParallelStrategy::PipelineParallelStrategy(std::string_view axis, int num_stages)
    : axis_(axis), num_stages_(num_stages) {
  internal::check_axis_name("PipelineParallelStrategy", axis_);
  if (num_stages_ <= 0)
    throw InvalidArgument("PipelineParallelStrategy", fmt::format("num_stages {} on axis '{}'", num_stages_, axis_),
                          "a pipeline needs at least 1 stage");
}

std::string PipelineParallelStrategy::name() const {
  return fmt::format("PipelineParallel({}={} stages)", axis_, num_stages_);
}

int64_t PipelineParallelStrategy::axis_size(const std::string& axis) const {
  return axis == axis_ ? num_stages_ : 0;
}

PartitionSpec PipelineParallelStrategy::param_spec(const ParamInfo& p) const {
  internal::check_param("PipelineParallelStrategy::param_spec", p);
  return PartitionSpec::replicated(static_cast<int>(p.shape.size()));
}

std::string PipelineParallelStrategy::explain(const ParamInfo& p) const {
  internal::check_param("PipelineParallelStrategy::explain", p);
  return fmt::format("{}: {} not split: it lives whole on the stage that owns its layer", name(), p.to_string());
}

std::vector<int> PipelineParallelStrategy::assign_layers_to_stages(int num_layers) const {
  if (num_layers < num_stages_)
    throw InvalidArgument("PipelineParallelStrategy::assign_layers_to_stages",
                          fmt::format("{} layers on {} stages would leave stage {} empty", num_layers, num_stages_,
                                      std::max(num_layers, 0)),
                          fmt::format("use at most {} stages, or split the model into more layers",
                                      std::max(num_layers, 1)));
  std::vector<int> counts(num_stages_, num_layers / num_stages_);
  for (int s = 0; s < num_layers % num_stages_; ++s) ++counts[s];
  return counts;
}

std::vector<int> PipelineParallelStrategy::assign_layers_to_stages(const std::vector<double>& layer_costs) const {
  const char* op = "PipelineParallelStrategy::assign_layers_to_stages";
  const int n = static_cast<int>(layer_costs.size());
  if (n < num_stages_)
    throw InvalidArgument(op,
                          fmt::format("{} layers on {} stages would leave stage {} empty", n, num_stages_, n),
                          fmt::format("use at most {} stages, or split the model into more layers", std::max(n, 1)));
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(layer_costs[i]) || layer_costs[i] < 0)
      throw InvalidArgument(op, fmt::format("layer {} has cost {}", i, layer_costs[i]),
                            "costs must be finite and >= 0 (e.g. FLOPs or measured milliseconds)");

  const Splitter split(layer_costs, num_stages_);
  const double tol = 1e-9 * split.total();
  auto all = [](int, int) { return true; };
  // 1. The smallest possible largest stage cost.
  const double max_cost = split.bottleneck([&](int i, int c) { return split.cost(i, c); }, all, true) + tol;
  auto fast = [&](int i, int c) { return split.cost(i, c) <= max_cost; };
  // 2. Among those, the smallest possible largest layer count.
  const double max_count = split.bottleneck([](int, int c) { return static_cast<double>(c); }, fast, true);
  auto few = [&](int i, int c) { return fast(i, c) && c <= max_count; };
  // 3. Among those, the largest possible smallest stage cost.
  const double min_cost = split.bottleneck([&](int i, int c) { return split.cost(i, c); }, few, false) - tol;
  // 4. Among those, earlier stages take more layers.
  return split.largest_first([&](int i, int c) { return few(i, c) && split.cost(i, c) >= min_cost; });
}

void PipelineParallelStrategy::check_stage(const char* op, int stage) const {
  if (stage < 0 || stage >= num_stages_)
    throw InvalidArgument(op, fmt::format("stage {} is not in [0, {})", stage, num_stages_),
                          fmt::format("the pipeline on '{}' has {} stages", axis_, num_stages_));
}

void PipelineParallelStrategy::check_assignment(const char* op, const std::vector<int>& assignment) const {
  if (static_cast<int>(assignment.size()) != num_stages_)
    throw InvalidArgument(op, fmt::format("assignment has {} stages, the pipeline {}", assignment.size(), num_stages_),
                          "pass the counts returned by assign_layers_to_stages");
  for (size_t s = 0; s < assignment.size(); ++s)
    if (assignment[s] < 1)
      throw InvalidArgument(op, fmt::format("stage {} has {} layers", s, assignment[s]),
                            "every stage needs at least one layer");
}

int PipelineParallelStrategy::stage_of_layer(int layer, const std::vector<int>& assignment) const {
  const char* op = "PipelineParallelStrategy::stage_of_layer";
  check_assignment(op, assignment);
  int end = 0;
  for (int s = 0; s < num_stages_; ++s) {
    end += assignment[s];
    if (layer >= 0 && layer < end) return s;
  }
  throw InvalidArgument(op, fmt::format("layer {} is not in [0, {})", layer, end),
                        "layers are numbered from 0 in forward order");
}

std::pair<int, int> PipelineParallelStrategy::layer_range(int stage, const std::vector<int>& assignment) const {
  const char* op = "PipelineParallelStrategy::layer_range";
  check_assignment(op, assignment);
  check_stage(op, stage);
  const int first = std::accumulate(assignment.begin(), assignment.begin() + stage, 0);
  return {first, first + assignment[stage]};
}

int PipelineParallelStrategy::forward_peer(int stage) const {
  check_stage("PipelineParallelStrategy::forward_peer", stage);
  return stage + 1 < num_stages_ ? stage + 1 : -1;
}

int PipelineParallelStrategy::backward_peer(int stage) const {
  check_stage("PipelineParallelStrategy::backward_peer", stage);
  return stage - 1;
}

}  // namespace meshtrain::sharding
