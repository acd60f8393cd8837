// Whole-model parameters for the run's files (model.safetensors, the
// recipe's artifacts), gathered from the ranks that hold different parts:
// the point-to-point transport (pipeline stages send theirs to pipeline
// rank 0: PipelineRun::collect_parameters) and the expert axis's merge (each
// expert rank holds its experts; rank 0 of the axis puts every rank's in
// the whole model's order); the MoE layers' selection biases placed beside
// their routers. Internal to the trainer.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/train/model_recipe.h"

namespace meshtrain::train::internal {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Collective over c: every rank's `mine` (f32 copies) to rank 0, which
// returns them indexed by rank (its own first); the others return {}.
// Point-to-point with tag `tag` (names, shapes, then values).
std::vector<NamedTensors> gather_named_tensors(comm::Communicator& c, const NamedTensors& mine, int tag);

// Collective over the expert axis: rank 0 returns `mine` with each MoE
// layer's run of routed experts ("<layer>.experts.<e>...", `expert` marks
// them) replaced by every rank's run of that layer in rank order (rank r
// holds experts [r E/k, (r+1) E/k), so that is the experts' order); the
// others return {}. `expert[i]` tells whether mine[i] is a routed expert's.
NamedTensors merge_expert_parameters(comm::Communicator& expert_axis, const NamedTensors& mine,
                                     const std::vector<bool>& expert);

// `params` (a model's, or a stage's) with each of `layers`' selection bias
// (a buffer, nn::MoE::bias_name(): "<layer>.gate.e_score_correction_bias")
// inserted after its router's weight ("<layer>.gate.weight"), so a model
// file carries it where any layout puts it. A bias whose router is not in
// `params` is left out.
void insert_moe_biases(NamedTensors& params, const MoELayers& layers);

}  // namespace meshtrain::train::internal
