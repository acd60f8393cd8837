// apply_job_overrides (job_overrides.h).
#include "meshtrain/config/job_overrides.h"

#include <fmt/format.h>

#include <cstdint>
#include <string_view>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/mesh/mesh_shape.h"

namespace meshtrain::config {
namespace {

constexpr const char* kOp = "meshtrain train";

// Sets one key through its row of the field table, so the value is parsed
// and range-checked as TOML and flags are, with errors naming `source`.
void set_field(DistributedConfig& dc, std::string_view key, const std::string& text, std::string_view source) {
  for (const auto& f : distributed_config_fields())
    if (f.key == key) return f.parse(dc, text, source);
  throw Error(kOp, fmt::format("no distributed field '{}'", key), "");
}

// Training runs data parallelism over data, node and fsdp axes, context
// parallelism over a context axis, tensor parallelism over a tensor axis
// and pipelines over a pipeline axis; other axes are refused first, before
// DistributedConfig::validate would suggest a size setting that only leads
// to the same refusal.
void require_trainable_mesh(const DistributedConfig& dc, std::string_view source) {
  for (size_t i = 0; i < dc.mesh_axis_names.size() && i < dc.mesh_shape.size(); ++i) {
    const std::string& a = dc.mesh_axis_names[i];
    if (!mesh::is_known_axis(a) && dc.mesh_shape[i] != 1)
      throw Unsupported(kOp,
                        fmt::format("{}: mesh {} has a {} axis of size {}, which training cannot use", source,
                                    mesh::NamedShape{dc.mesh_shape, dc.mesh_axis_names}.to_spec(), a,
                                    dc.mesh_shape[i]),
                        fmt::format("training uses {} axes (e.g. --mesh data=4, data=2,fsdp=2, node=2,fsdp=2, "
                                    "data=2,tensor=2, context=2 or data=2,pipeline=2)",
                                    mesh::known_axes_list()));
  }
}

}  // namespace

DistributedConfig apply_job_overrides(DistributedConfig dc, const JobOverrides& o) {
  const bool mpirun = dc.launcher == Launcher::mpirun;
  const bool torchrun = dc.launcher == Launcher::torchrun && o.gloo_available;
  const std::string engine = !o.engine.empty() ? o.engine
                             : mpirun         ? "mpi"
                             : torchrun       ? "gloo"
                                              : std::string(comm::engine_name(dc.backend));
  set_field(dc, "backend", engine, o.engine.empty() ? "environment" : "--engine");
  if (!o.devices.empty()) {
    if (engine != "threads")
      throw InvalidArgument("--devices", fmt::format("the {} engine takes its ranks from its launcher", engine),
                            "start N processes instead (mpirun -np N, or meshtrain launch --nproc-per-node N)");
    set_field(dc, "world_size", o.devices, "--devices");
    set_field(dc, "num_processes_per_node", o.devices, "--devices");
    dc.num_nodes = 1;  // one process (a resumed run's config may say otherwise)
  }
  if (!o.mesh.empty()) {
    // A new mesh replaces the configuration's, its parallel sizes included.
    set_field(dc, "mesh", o.mesh, "--mesh");
    dc.set_mesh(dc.mesh());
    // Threads engine without --devices: one simulated device per mesh position.
    if (engine == "threads" && o.devices.empty()) {
      int64_t devices = 1;  // saturates: world_size's range check then names --mesh
      for (int size : dc.mesh().shape) devices = checked_mul(devices, size).value_or(INT64_MAX);
      const std::string n = std::to_string(devices);
      set_field(dc, "world_size", n, "--mesh");
      set_field(dc, "num_processes_per_node", n, "--mesh");
      dc.num_nodes = 1;
    }
  }
  // On the threads engine --mesh sets the world size, so it always fits.
  if (o.resuming && !dc.mesh_shape.empty()) {
    const mesh::NamedShape saved = dc.mesh();
    int64_t positions = 1;
    for (int size : saved.shape) positions *= size;
    if (positions != dc.world_size) {
      const std::optional<mesh::NamedShape> resized = mesh::resize_data_axis(saved, dc.world_size);
      if (!resized)
        throw InvalidArgument("--mesh",
                              fmt::format("the run was saved on mesh {} ({} devices); its axes other than data do "
                                          "not divide the {} devices it resumes on",
                                          saved.to_spec(), positions, dc.world_size),
                              fmt::format("give --mesh for {} devices (the checkpoint reshards onto any mesh)",
                                          dc.world_size));
      dc.set_mesh(*resized);
      if (o.notes != nullptr)
        o.notes->push_back(fmt::format("resuming on {} devices: mesh {} -> {} (the data-parallel axes take the "
                                       "change; the global batch stays)",
                                       dc.world_size, saved.to_spec(), resized->to_spec()));
    }
  }
  require_trainable_mesh(dc, !o.mesh.empty()             ? std::string_view("--mesh")
                             : o.config_source.empty() ? std::string_view("configuration")
                                                       : std::string_view(o.config_source));
  // A tensor (pipeline, context) axis in the mesh is that parallel size.
  for (size_t i = 0; i < dc.mesh_axis_names.size() && i < dc.mesh_shape.size(); ++i)
    for (const std::string_view axis : {mesh::kTensor, mesh::kPipeline, mesh::kContext})
      if (dc.mesh_axis_names[i] == axis)
        set_field(dc, fmt::format("{}_parallel_size", axis), std::to_string(dc.mesh_shape[i]), "--mesh");
  if (dc.backend == comm::Engine::threads && dc.world_size > comm::kMaxThreadsRanks)
    throw InvalidArgument(kOp,
                          fmt::format("{}: {} devices, more than the threads engine's {}",
                                      !o.devices.empty() ? "--devices" : "--mesh", dc.world_size,
                                      comm::kMaxThreadsRanks),
                          fmt::format("simulate at most {} devices, or run with mpirun --engine mpi",
                                      comm::kMaxThreadsRanks));
  if (!o.mixed_precision.empty() && !o.precision.empty() &&
      layout::parse_precision(o.mixed_precision, "--mixed-precision") !=
          layout::parse_precision(o.precision, "--precision"))
    throw InvalidArgument(kOp,
                          fmt::format("--mixed-precision {} and --precision {} disagree", o.mixed_precision,
                                      o.precision),
                          "give one of them");
  if (!o.mixed_precision.empty()) set_field(dc, "mixed_precision", o.mixed_precision, "--mixed-precision");
  if (!o.precision.empty()) set_field(dc, "mixed_precision", o.precision, "--precision");
  dc.validate();
  return dc;
}

}  // namespace meshtrain::config
