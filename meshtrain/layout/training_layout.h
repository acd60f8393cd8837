// TrainingLayout: the one value that says how a run spreads over its
// devices: the mesh, and the strategy each axis runs with its options.
// Built once at the edge (train::resolve_training, from flags, TOML and the
// launcher's environment: ResolvedTraining::layout; `meshtrain shard
// --model` from its flags) and read by the placement rule
// (placement_rule.h), the trainer and the planner (plan::TrainingLayout::
// set_layout).
//
//   TrainingLayout l{.mesh = mesh::parse_mesh_spec("data=2,fsdp=2,tensor=2"),
//                    .fsdp = parse_fsdp_mode("full")};
//   l.size(mesh::kTensor);    // 2
//   l.shard_axes();           // {"data", "fsdp"}: fsdp's shard group
//   l.describe();             // "mesh data=2,fsdp=2,tensor=2: fsdp full over data x fsdp (4 ranks), ..."
//
// Thread-safety: an immutable value once built.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/mesh/mesh_shape.h"

namespace meshtrain::layout {

struct TrainingLayout {
  mesh::NamedShape mesh;                // axes of size 1 may be listed
  std::optional<FsdpMode> fsdp = std::nullopt;  // fully sharded data parallelism; nullopt: plain data parallelism
  int64_t fsdp_min_weight_size = 1024;  // smaller parameters stay replicated (f32)
  DType param_dtype = DType::f32;       // mixed precision's compute and all-gather dtype (fsdp only)
  std::optional<DType> reduce_dtype = std::nullopt;  // gradients' dtype; nullopt: param_dtype
  ZeroPPParts zeropp = {};              // ZeRO++ under fsdp zero2/zero3
  bool sequence_parallel = false;       // with a tensor axis
  ScheduleKind schedule = ScheduleKind::one_f_one_b;  // with a pipeline axis
  int virtual_stages = 1;               // model chunks per pipeline rank
  int micro_batches = 1;                // per optimizer step
  ContextComm cp_comm = ContextComm::ring;  // with a context axis

  // The size of axis `name`, 1 when the mesh has none.
  int size(std::string_view name) const { return mesh.size_of(name); }
  int devices() const;
  // The axes fully sharded data parallelism shards over, row-major in this
  // order: those whose ranks sum their gradients (data, node, fsdp,
  // context), or fsdp alone when hybrid (replicas over data); none without
  // fsdp, and none for no_shard (a group of one).
  std::vector<std::string_view> shard_axes() const;
  int shard_size() const;
  // One line for logs and errors: the mesh and what each axis runs.
  std::string describe() const;
  bool operator==(const TrainingLayout&) const = default;
};

// The fully sharded mode of a run: parse_fsdp_mode(given), or when `given`
// is empty the default that every entry point (the trainer, `meshtrain
// plan`, `meshtrain shard --model`) takes: "full" with an fsdp axis > 1,
// else "no_shard" when `precision` is not f32 (plain data parallelism is
// f32 only), else none. InvalidArgument for an unknown name.
std::optional<FsdpMode> resolve_fsdp_mode(std::string_view given, const mesh::NamedShape& mesh, DType precision);

}  // namespace meshtrain::layout
