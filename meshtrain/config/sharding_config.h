// ShardingConfig (how many devices each parallelism uses) and
// ParallelismConfig (the named mesh built from it), the C++ form of the
// reference's configs, validated and without its device-dropping rules.
//
//   ShardingConfig s{.data_parallel_size = 2, .tensor_parallel_size = 2, .fsdp_enabled = true};
//   s.total_device_count();                                  // 4
//   auto p = ParallelismConfig::from_sharding_config(s);
//   p.mesh_shape;       // {2, 2}
//   p.mesh_axis_names;  // {"fsdp", "tensor"}  (FSDP shards over the data-parallel devices)
//   ShardingConfig::from_device_count(32);                   // data 8 x tensor 4: all 32 used
//   layout::TrainingLayout l = p.layout();                   // the one layout value: fsdp full over fsdp=2
//   ParallelismConfig::from_layout(l) == p;                  // and back: the configs are views of it
//
// Axis names and order are mesh::kMeshAxisOrder: pipeline, data, fsdp,
// context, tensor; size-1 axes are left out, so a pipeline-only config keeps
// its pipeline axis (the reference dropped it).
// Thread-safety: plain values; const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/layout/training_layout.h"
#include "meshtrain/plan/mesh_planning.h"

namespace meshtrain::config {

struct ShardingConfig {
  int data_parallel_size = 1;      // replicas of the batch (sharded state when fsdp_enabled)
  int tensor_parallel_size = 1;    // shards of every layer
  int pipeline_parallel_size = 1;  // stages
  int context_parallel_size = 1;   // shards of the sequence
  bool fsdp_enabled = false;       // the data-parallel devices shard weights, grads, optimizer state
  int64_t fsdp_min_weight_size = 1024;  // parameters with fewer ELEMENTS stay replicated (as everywhere)

  // data x tensor x pipeline x context, in 64 bits (not validated).
  int64_t total_device_count() const;

  // Throws InvalidArgument (op "ShardingConfig") unless every size >= 1,
  // fsdp_min_weight_size >= 0 and the total fits an int.
  void validate() const;
  bool is_valid() const;

  // A config that uses all n devices (n >= 1, else InvalidArgument):
  // tensor = the largest power of two t <= 8 with t * t <= n that divides n,
  // data = n / t. 1 -> 1x1, 5 -> 5x1, 8 -> 4x2, 16 -> 4x4, 32 -> 8x4,
  // 64 -> 8x8, 128 -> 16x8. (The reference gave 5 -> 2x2 and 32 -> 6x5,
  // idling devices.) For a workload-aware choice use
  // plan::optimize_for_transformer and ParallelismConfig::from_mesh_plan.
  static ShardingConfig from_device_count(int n);

  // A view of a training layout: its axes' sizes (data_parallel_size: data
  // x node x fsdp, the ranks that split the batch), fsdp_enabled when it
  // runs fully sharded data parallelism, its fsdp_min_weight_size.
  static ShardingConfig from_layout(const layout::TrainingLayout& layout);

  // "data=4 tensor=2 pipeline=1 context=1 fsdp=on fsdp_min_weight_size=1024"
  std::string to_string() const;
  bool operator==(const ShardingConfig&) const = default;
};

struct ParallelismConfig {
  std::vector<int> mesh_shape;
  std::vector<std::string> mesh_axis_names;
  ShardingConfig sharding;

  // The mesh of `c`: axes pipeline, data (named fsdp when fsdp_enabled),
  // context, tensor with their sizes, size-1 axes left out; (data=1) when
  // every size is 1. Validates `c` first (throws InvalidArgument).
  static ParallelismConfig from_sharding_config(const ShardingConfig& c);

  // The mesh of a plan; the sharding has data_parallel_size = data x fsdp
  // and fsdp_enabled = (fsdp > 1).
  static ParallelismConfig from_mesh_plan(const plan::MeshPlan& p);

  // A view of a training layout: its mesh and ShardingConfig::from_layout.
  static ParallelismConfig from_layout(const layout::TrainingLayout& layout);
  // The training layout this config describes (the seeds' configs as a
  // constructor of the one layout value): the mesh, fsdp "full" when
  // fsdp_enabled (else plain data parallelism), fsdp_min_weight_size;
  // every other option at its default. Validates first.
  layout::TrainingLayout layout() const;

  // Throws InvalidArgument (op "ParallelismConfig") naming what to change
  // unless: the sharding is valid; one known, distinct name per axis; sizes
  // >= 1; the product equals sharding.total_device_count(); the tensor,
  // pipeline and context axes (1 when absent) equal their sharding sizes;
  // data x fsdp equals data_parallel_size; an fsdp axis > 1 has fsdp_enabled.
  void validate() const;
  bool is_valid() const;

  // Size of the axis called `name`, 1 if the mesh has none.
  int axis_size(std::string_view name) const;
  mesh::NamedShape named_shape() const { return {mesh_shape, mesh_axis_names}; }
  // "data=2,tensor=2"
  std::string to_string() const { return named_shape().to_spec(); }
  bool operator==(const ParallelismConfig&) const = default;
};

}  // namespace meshtrain::config
