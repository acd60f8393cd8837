#include "meshtrain/config/sharding_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "meshtrain/core/error.h"

namespace meshtrain::config {
namespace {

constexpr const char* kSharding = "ShardingConfig";
constexpr const char* kParallelism = "ParallelismConfig";

void require_positive(const char* name, int v, const char* hint) {
  if (v < 1) throw InvalidArgument(kSharding, fmt::format("{} must be >= 1, got {}", name, v), hint);
}

}  // namespace

int64_t ShardingConfig::total_device_count() const {
  return int64_t{data_parallel_size} * tensor_parallel_size * pipeline_parallel_size * context_parallel_size;
}

void ShardingConfig::validate() const {
  require_positive("data_parallel_size", data_parallel_size, "use 1 for no data parallelism");
  require_positive("tensor_parallel_size", tensor_parallel_size, "use 1 for no tensor parallelism");
  require_positive("pipeline_parallel_size", pipeline_parallel_size, "use 1 for a single pipeline stage");
  require_positive("context_parallel_size", context_parallel_size, "use 1 for no context parallelism");
  if (fsdp_min_weight_size < 0)
    throw InvalidArgument(kSharding, fmt::format("fsdp_min_weight_size must be >= 0, got {}", fsdp_min_weight_size),
                          "use 0 to shard every weight, or a size such as 1024");
  // Each factor is < 2^31, so the 64-bit product of four can overflow; check stepwise.
  int64_t total = 1;
  for (int s : {data_parallel_size, tensor_parallel_size, pipeline_parallel_size, context_parallel_size}) {
    total *= s;
    if (total > std::numeric_limits<int>::max())
      throw InvalidArgument(kSharding,
                            fmt::format("data {} x tensor {} x pipeline {} x context {} exceeds {} devices",
                                        data_parallel_size, tensor_parallel_size, pipeline_parallel_size,
                                        context_parallel_size, std::numeric_limits<int>::max()),
                            "use smaller parallel sizes");
  }
}

bool ShardingConfig::is_valid() const {
  try {
    validate();
    return true;
  } catch (const InvalidArgument&) {
    return false;
  }
}

ShardingConfig ShardingConfig::from_device_count(int n) {
  if (n < 1)
    throw InvalidArgument("ShardingConfig::from_device_count", fmt::format("device count {} < 1", n),
                          "pass the number of devices, at least 1");
  int tensor = 1;
  for (int t = 2; t <= 8 && t * t <= n; t *= 2)
    if (n % t == 0) tensor = t;
  ShardingConfig c;
  c.data_parallel_size = n / tensor;
  c.tensor_parallel_size = tensor;
  return c;
}

std::string ShardingConfig::to_string() const {
  return fmt::format("data={} tensor={} pipeline={} context={} fsdp={} fsdp_min_weight_size={}", data_parallel_size,
                     tensor_parallel_size, pipeline_parallel_size, context_parallel_size,
                     fsdp_enabled ? "on" : "off", fsdp_min_weight_size);
}

ParallelismConfig ParallelismConfig::from_sharding_config(const ShardingConfig& c) {
  c.validate();
  ParallelismConfig p;
  p.sharding = c;
  const int data = c.fsdp_enabled ? 1 : c.data_parallel_size;
  const int fsdp = c.fsdp_enabled ? c.data_parallel_size : 1;
  const int sizes[] = {c.pipeline_parallel_size, data, fsdp, c.context_parallel_size, c.tensor_parallel_size};
  static_assert(std::size(sizes) == mesh::kMeshAxisOrder.size());
  for (size_t i = 0; i < mesh::kMeshAxisOrder.size(); ++i)
    if (sizes[i] > 1) {
      p.mesh_shape.push_back(sizes[i]);
      p.mesh_axis_names.emplace_back(mesh::kMeshAxisOrder[i]);
    }
  if (p.mesh_shape.empty()) {
    p.mesh_shape = {1};
    p.mesh_axis_names = {std::string(mesh::kData)};
  }
  return p;
}

ParallelismConfig ParallelismConfig::from_mesh_plan(const plan::MeshPlan& plan) {
  const mesh::NamedShape m{plan.shape, plan.axis_names};
  return from_layout({.mesh = m, .fsdp = layout::resolve_fsdp_mode("", m, DType::f32)});
}

ShardingConfig ShardingConfig::from_layout(const layout::TrainingLayout& l) {
  return {.data_parallel_size =
              l.size(mesh::kData) * l.size(mesh::kNode) * l.size(mesh::kFsdp) * l.size(mesh::kExpert),
          .tensor_parallel_size = l.size(mesh::kTensor),
          .pipeline_parallel_size = l.size(mesh::kPipeline),
          .context_parallel_size = l.size(mesh::kContext),
          .fsdp_enabled = l.fsdp.has_value(),
          .fsdp_min_weight_size = l.fsdp_min_weight_size};
}

ParallelismConfig ParallelismConfig::from_layout(const layout::TrainingLayout& l) {
  return {.mesh_shape = l.mesh.shape, .mesh_axis_names = l.mesh.axis_names, .sharding = ShardingConfig::from_layout(l)};
}

layout::TrainingLayout ParallelismConfig::layout() const {
  validate();
  return {.mesh = named_shape(),
          .fsdp = sharding.fsdp_enabled ? std::optional(layout::parse_fsdp_mode("full")) : std::nullopt,
          .fsdp_min_weight_size = sharding.fsdp_min_weight_size};
}

int ParallelismConfig::axis_size(std::string_view name) const { return named_shape().size_of(name); }

void ParallelismConfig::validate() const {
  sharding.validate();
  const ShardingConfig& s = sharding;
  mesh::validate_mesh_config(named_shape(), static_cast<int>(s.total_device_count()), kParallelism);
  struct Axis {
    std::string_view name;
    const char* field;
    int size;
  };
  for (const Axis& a : {Axis{mesh::kTensor, "tensor_parallel_size", s.tensor_parallel_size},
                        Axis{mesh::kPipeline, "pipeline_parallel_size", s.pipeline_parallel_size},
                        Axis{mesh::kContext, "context_parallel_size", s.context_parallel_size}}) {
    const int got = axis_size(a.name);
    if (got == a.size) continue;
    const bool present =
        std::find(mesh_axis_names.begin(), mesh_axis_names.end(), a.name) != mesh_axis_names.end();
    if (!present)
      throw InvalidArgument(kParallelism,
                            fmt::format("mesh {} has no {} axis but {} is {}", to_string(), a.name, a.field, a.size),
                            fmt::format("add {}={} to the mesh, or set {} = 1", a.name, a.size, a.field));
    throw InvalidArgument(kParallelism,
                          fmt::format("mesh {} has {}={} but {} is {}", to_string(), a.name, got, a.field, a.size),
                          fmt::format("make them equal: set {} = {}, or the {} axis to {}", a.field, got, a.name,
                                      a.size));
  }
  // The product check above and the three axes make data x fsdp == data_parallel_size.
  const int fsdp = axis_size(mesh::kFsdp);
  if (fsdp > 1 && !s.fsdp_enabled)
    throw InvalidArgument(kParallelism, fmt::format("mesh {} has fsdp={} but fsdp_enabled is false", to_string(), fsdp),
                          "set fsdp_enabled = true, or rename the axis to data");
}

bool ParallelismConfig::is_valid() const {
  try {
    validate();
    return true;
  } catch (const InvalidArgument&) {
    return false;
  }
}

}  // namespace meshtrain::config
