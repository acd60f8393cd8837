// resolve_training (trainer.h): the configuration as the run will use it.
#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/train/internal/mesh_roles.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::train {

using internal::axis_size;
using internal::data_parallel_axes;

ResolvedTraining resolve_training(const TrainConfig& tc, const config::DistributedConfig& dc) {
  ResolvedTraining out{tc, {}, {}};
  TrainConfig& c = out.config;
  const mesh::NamedShape mesh = dc.mesh();
  (void)data_parallel_axes(mesh);  // throws for axes training has no use for
  const int fsdp_axis = axis_size(mesh, mesh::kFsdp), data_axis = axis_size(mesh, mesh::kData);
  const std::string precision(config::mixed_precision_name(dc.mixed_precision));
  if (!c.fsdp.enabled()) {
    if (const auto mode = layout::resolve_fsdp_mode("", mesh, dc.mixed_precision)) {
      c.fsdp = {mode->name(), *mode};
      out.notes.push_back(
          fsdp_axis > 1
              ? fmt::format("fsdp = \"full\": the mesh has fsdp={} and no strategy was given", fsdp_axis)
              : fmt::format("fsdp = \"no_shard\": mixed_precision {} needs the fully sharded path (plain data "
                            "parallelism is f32 only)",
                            precision));
    }
  }
  const int pipeline_axis = axis_size(mesh, mesh::kPipeline);
  if (pipeline_axis > 1 && c.pipeline_schedule == layout::ScheduleKind::interleaved_1f1b && c.virtual_stages == 1) {
    c.virtual_stages = 2;
    out.notes.push_back("virtual_stages = 2: the interleaved schedule runs at least 2 model chunks per pipeline rank");
  }
  c.validate();
  if (const int context_axis = axis_size(mesh, mesh::kContext); context_axis > 1) {
    if (pipeline_axis > 1 || c.sequence_parallel)
      throw Unsupported("meshtrain train",
                        fmt::format("a context axis of {} with {}", context_axis,
                                    pipeline_axis > 1 ? fmt::format("a pipeline axis of {}", pipeline_axis)
                                                      : std::string("--sequence-parallel")),
                        "context parallelism composes with data, fsdp and tensor axes (without "
                        "--sequence-parallel); drop the other split");
    // The sequence length against the chunks: the recipe checks it
    // (nn::ContextParallelGroup::check_length) as it builds the model.
  }
  if (c.zeropp.any()) {
    const std::string parts = c.zeropp.to_string();
    auto fail = [&](const std::string& what, const std::string& hint) {
      throw Unsupported("--zeropp " + parts, what, hint);
    };
    if (!c.fsdp.enabled() || c.fsdp.mode->hybrid || c.fsdp.mode->stage < parallel::ZeroStage::zero2)
      fail(fmt::format("fsdp '{}'", c.fsdp.enabled() ? c.fsdp.name : "none"),
           "ZeRO++ quantizes zero2/zero3's collectives: use --fsdp zero3 (or zero2 with qgz)");
    if (c.zeropp.hpz && c.fsdp.mode->stage != parallel::ZeroStage::zero3)
      fail(fmt::format("hpz with fsdp '{}'", c.fsdp.name), "hpZ shards zero3's gathered parameters: use --fsdp zero3");
    if (c.zeropp.hpz && axis_size(mesh, mesh::kNode) == 0)
      fail(fmt::format("hpz on mesh {} without a node axis", mesh.to_spec()),
           "hpZ keeps a copy of the parameters sharded within each node: use --mesh node=K,fsdp=L");
    if (c.zeropp.qwz &&
        (c.fsdp.mode->stage != parallel::ZeroStage::zero3 || dc.mixed_precision != DType::f32))
      fail("qwz needs zero3 with fp32 parameters", "use --fsdp zero3 without --precision, or drop qwz");
    if (c.zeropp.qgz && c.reduce_precision.value_or(DType::f32) != DType::f32)
      fail("qgz needs fp32 gradients (it sums dequantized values in f32)", "drop --reduce-precision, or drop qgz");
    if (c.zeropp.qgz && dc.mixed_precision != DType::f32 &&
        !c.reduce_precision)
      fail("qgz with half-precision gradients", "add --reduce-precision fp32");
    for (const std::string_view other : {mesh::kData, mesh::kContext, mesh::kTensor, mesh::kPipeline})
      if (axis_size(mesh, other) > 1)
        fail(fmt::format("mesh {} has a {} axis", mesh.to_spec(), other),
             "ZeRO++ shards over node x fsdp alone here: use --mesh node=K,fsdp=L");
    if (axis_size(mesh, mesh::kNode) > 0 && axis_size(mesh, mesh::kFsdp) == 0)
      fail(fmt::format("mesh {} has a node axis but no fsdp axis", mesh.to_spec()), "use --mesh node=K,fsdp=L");
  }
  if (c.fsdp.enabled()) {
    if (c.fsdp.mode->hybrid && (fsdp_axis == 0 || data_axis == 0))
      throw InvalidArgument("meshtrain train",
                            fmt::format("fsdp '{}' shards over the fsdp axis and replicates over the data axis, but "
                                        "mesh {} lacks {}",
                                        c.fsdp.name, mesh.to_spec(), fsdp_axis == 0 ? mesh::kFsdp : mesh::kData),
                            "use a mesh with both axes (e.g. --mesh data=2,fsdp=2), or a non-hybrid strategy "
                            "such as --fsdp full");
    if (dc.mixed_precision == DType::f16)
      out.notes.push_back("fp16: dynamic loss scaling (initial scale 2^15, x2 after 2000 good steps, x0.5 and "
                          "the step skipped on inf/NaN gradients)");
  }
  out.layout = {.mesh = mesh,
                .fsdp = c.fsdp.mode,
                .fsdp_min_weight_size = c.fsdp_min_weight_size,
                .param_dtype = dc.mixed_precision,
                .reduce_dtype = c.reduce_precision,
                .zeropp = c.zeropp,
                .sequence_parallel = c.sequence_parallel,
                .schedule = c.pipeline_schedule,
                .virtual_stages = c.virtual_stages,
                .micro_batches = c.micro_batches,
                .cp_comm = c.cp_comm};
  return out;
}

}  // namespace meshtrain::train
