// The placement rule: what every rank of a mesh holds of every parameter of
// a model, from the parameters' global descriptions, their fully sharded
// units and pipeline stages, and the layout's strategies. The runtime builds
// exactly this (placement_property_test checks it rank by rank against what
// the trainer holds), and `meshtrain shard --model` prints it.
//
//   TrainingLayout layout{.mesh = mesh::parse_mesh_spec("fsdp=2,tensor=2"), .fsdp = parse_fsdp_mode("full")};
//   std::vector<ModelParameter> params = ...;   // parallel::model_parameters(recipe model)
//   for (const HeldParameter& h : held_parameters(layout, params, /*rank=*/3))
//     fmt::print("{} {}\n", h.name, h.placement.to_string());
//
// The rule, for world rank r with mesh coordinates c (row-major):
//  1. pipeline axis of size P: r holds the parameters of the stages s with
//     s % P == c[pipeline] (one stage each, or several virtual stages of an
//     interleaved schedule); a parameter two stages share (a tied
//     embedding) is listed once per stage.
//  2. tensor axis of size k > 1: the block TensorParallelStrategy (uneven,
//     torch.chunk) gives tensor rank c[tensor] of the parameter's layout()
//     view; a parameter it does not split is whole. A parameter of h < k
//     heads (h dividing k: Llama's key/value heads replicated as Megatron
//     does) is split over h ranks, rank c[tensor] holding block
//     c[tensor] / (k / h).
//  3. fully sharded: the shard group is TrainingLayout::shard_axes(), the
//     axes whose ranks sum their gradients, data, node, fsdp and context
//     (row-major in that order: a context rank holds the same parameters
//     as its peers, so fsdp shards over it too, as torchtitan shards over
//     dp_shard x cp), or the fsdp axis alone when hybrid (HSDP replicates
//     over data); no_shard is a group of one. Per unit, the
//     parameters whose block FSDPStrategy::should_shard (min_weight_size
//     counts the block's elements) are packed flat (sharding::FlatShards),
//     and r holds its range of each, possibly empty.
//  4. expert axis of size E > 1: a routed expert's parameter
//     (ParamInfo::expert e of its layer's n experts) is held by the rank
//     with c[expert] == e / (n / E) alone; fsdp does not shard over the
//     expert axis (its ranks hold different experts), so each expert is
//     sharded over the shard group of the ranks holding it.
//  5. every other axis (data and context without fsdp, expert for what is
//     not an expert) replicates.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/layout/training_layout.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/sharding/multi_dimensional.h"
#include "meshtrain/sharding/placement.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::layout {

// One parameter of a model as the rule sees it: its global description,
// its fully sharded unit (an index, the same for the parameters gathered
// together) and its pipeline stage.
struct ModelParameter {
  sharding::ParamInfo info;
  int unit = 0;
  int stage = 0;
};

// What a rank holds of one parameter.
struct HeldParameter {
  std::string name;
  int stage = 0;
  sharding::Placement placement;
  bool operator==(const HeldParameter&) const = default;
};

// What world rank `rank` holds, in the order of `params` (the parameters of
// stages it does not run left out). InvalidArgument for a rank outside the
// mesh or a split the strategies refuse (heads the tensor axis does not
// divide), naming the parameter.
std::vector<HeldParameter> held_parameters(const TrainingLayout& layout, std::span<const ModelParameter> params,
                                           int rank);

// The seeds' per-dimension picture of the layout (MultiDimensionalStrategy
// over a DataParallelStrategy, FSDPStrategy and TensorParallelStrategy for
// the data, fsdp and tensor axes; node and context replicate, a pipeline
// splits no tensor): the PartitionSpec a parameter gets per mesh axis.
// What a rank really holds is held_parameters' (fsdp's flat ranges, not the
// spec's per-dimension split). The mesh's axes are known ones
// (mesh::validate_mesh_config).
sharding::MultiDimensionalStrategy seed_strategies(const TrainingLayout& layout);

}  // namespace meshtrain::layout
