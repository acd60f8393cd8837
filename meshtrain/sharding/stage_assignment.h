// PipelineParallelStrategy: which consecutive layers each pipeline stage runs,
// and which stages exchange activations and gradients.
//
//   PipelineParallelStrategy pp("pipeline", 4);
//   pp.assign_layers_to_stages(24);                   // [6, 6, 6, 6]
//   pp.assign_layers_to_stages(10);                   // [3, 3, 2, 2]
//   PipelineParallelStrategy("pipeline", 2)
//       .assign_layers_to_stages({1, 1, 1, 1, 4, 4}); // [4, 2]: stage costs 4 and 8
//   pp.stage_of_layer(7, {3, 3, 2, 2});               // 2
//   pp.forward_peer(3);                               // -1: the last stage sends nothing on
//
// Stages are contiguous, in layer order, and never empty: fewer layers than
// stages is an error, not a stage with no layers.
//
// Balancing by count: every stage gets num_layers / num_stages layers and the
// first num_layers % num_stages stages one more.
//
// Balancing by cost (exact, O(num_stages * num_layers^2)): the split minimises
// the largest stage cost (the pipeline's step time). Among splits with that
// cost (within a relative 1e-9 of the total, to absorb rounding), it takes the
// one whose largest stage has the fewest layers (activation memory grows with
// layers, not with cost), and among those the one that gives earlier stages
// more layers (lexicographically largest counts), so equal costs reproduce the
// count rule exactly.
//
// Parameters: param_spec is replicated, i.e. no dimension is split over the
// pipeline axis. A parameter lives whole on the ranks of the stage that owns its
// layer (stage_of_layer); placing it there is the pipeline runtime's job, not
// the spec's. The batch is not split over the pipeline axis either
// (micro-batches move through the stages in time).
//
// Thread-safety: immutable; all methods are const and pure.
#pragma once

#include <utility>
#include <vector>

#include "meshtrain/sharding/strategy.h"

namespace meshtrain::sharding {

class PipelineParallelStrategy final : public Strategy {
 public:
  // num_stages >= 1.
  explicit PipelineParallelStrategy(std::string_view axis = mesh::kPipeline, int num_stages = 1);

  std::string name() const override;
  StrategyKind kind() const override { return StrategyKind::pipeline_parallel; }
  std::vector<std::string> axes() const override { return {axis_}; }
  int64_t axis_size(const std::string& axis) const override;
  PartitionSpec param_spec(const ParamInfo& p) const override;
  std::string explain(const ParamInfo& p) const override;

  // Layers per stage, balanced by count. num_layers >= num_stages.
  std::vector<int> assign_layers_to_stages(int num_layers) const;
  // Layers per stage, balanced by cost (rules above). Every cost finite and
  // >= 0; layer_costs.size() >= num_stages.
  std::vector<int> assign_layers_to_stages(const std::vector<double>& layer_costs) const;

  // The stage that runs `layer` under `assignment` (one count per stage, each
  // >= 1, as returned above).
  int stage_of_layer(int layer, const std::vector<int>& assignment) const;
  // The layers [first, last) that `stage` runs under `assignment`.
  std::pair<int, int> layer_range(int stage, const std::vector<int>& assignment) const;

  // The stage that receives `stage`'s activations in forward, or -1 for the last.
  int forward_peer(int stage) const;
  // The stage that receives `stage`'s input gradients in backward, or -1 for the first.
  int backward_peer(int stage) const;

  int num_stages() const { return num_stages_; }
  const std::string& axis() const { return axis_; }

 private:
  void check_stage(const char* op, int stage) const;
  void check_assignment(const char* op, const std::vector<int>& assignment) const;

  std::string axis_;
  int num_stages_;
};

}  // namespace meshtrain::sharding
