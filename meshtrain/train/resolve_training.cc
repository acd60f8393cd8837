// resolve_training (trainer.h): the configuration as the run will use it.
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "meshtrain/core/error.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/parallel/pipeline_schedule.h"
#include "meshtrain/train/model_recipe.h"
#include "meshtrain/train/internal/mesh_roles.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::train {

using internal::axis_size;
using internal::data_parallel_axes;

namespace {

// The global batch over the data-parallel ranks (data x fsdp; context
// ranks share samples), each rank's share over the micro-batches.
void check_batch_split(const TrainConfig& c, const mesh::NamedShape& mesh) {
  int64_t ranks = 1;
  for (const std::string& axis : data_parallel_axes(mesh)) ranks *= mesh.size_of(axis);
  if (c.batch_size % ranks != 0)
    throw InvalidArgument("--batch-size",
                          fmt::format("a global batch of {} over {} data-parallel ranks (mesh {})", c.batch_size,
                                      ranks, mesh.to_spec()),
                          fmt::format("use a multiple of {}, e.g. {} or {}", ranks,
                                      std::max<int64_t>(c.batch_size / ranks, 1) * ranks,
                                      (c.batch_size / ranks + 1) * ranks));
  if (c.batch_size / ranks < c.micro_batches)
    throw InvalidArgument("--micro-batches",
                          fmt::format("{} micro-batches with a batch of {} over {} data-parallel ranks ({} samples per "
                                      "rank): a micro-batch would be empty",
                                      c.micro_batches, c.batch_size, ranks, c.batch_size / ranks),
                          "use at most as many micro-batches as samples per data-parallel rank, or a larger "
                          "--batch-size");
}

// The deterministic mode (docs/determinism.md): what it supports so far,
// its block (resolved when 0), and every rank's and micro-batch's share a
// node of the canonical tree over the global batch's blocks.
void check_deterministic(TrainConfig& c, const mesh::NamedShape& mesh, const config::DistributedConfig& dc,
                         std::vector<std::string>& notes) {
  if (!c.deterministic) return;
  auto refuse = [](const std::string& what, const std::string& hint) {
    throw Unsupported("--deterministic", what, hint + " (docs/determinism.md says what the mode supports)");
  };
  if (c.model != "mlp" && c.model != "gpt")
    refuse(fmt::format("model '{}'", c.model), "the mode trains the MLP and the GPT so far");
  if (c.model == "gpt" && c.moe.experts > 0)
    refuse(fmt::format("{} experts", c.moe.experts),
           "mixture-of-experts layers are not in the mode yet: drop --experts");
  for (const std::string_view axis : {mesh::kTensor, mesh::kContext, mesh::kExpert, mesh::kNode})
    if (axis_size(mesh, axis) > 1)
      refuse(fmt::format("mesh {} has a {} axis", mesh.to_spec(), axis),
             "the mode spreads a run over data, fsdp and pipeline axes: drop the " + std::string(axis) + " axis");
  if (c.fsdp.enabled() && c.fsdp.mode->hybrid)
    refuse(fmt::format("fsdp '{}' (hybrid sharding)", c.fsdp.name), "use full, zero1, zero2, zero3 or no_shard");
  if (c.zeropp.any()) refuse("--zeropp", "ZeRO++'s quantization and secondary shards are not in the mode yet");
  if (dc.mixed_precision != DType::f32)
    refuse(fmt::format("precision {}", config::mixed_precision_name(dc.mixed_precision)),
           "the mode computes in fp32: drop --precision");
  if (!c.drop_last)
    refuse("drop_last = false (a partial last batch)", "keep --drop-last true: every step's batch is whole blocks");
  const int64_t rows = rows_per_sample(c);
  if (c.deterministic_block == 0) {
    int64_t block = 1;
    while (block * rows < 32) block *= 2;
    c.deterministic_block = static_cast<int>(block);
    notes.push_back(fmt::format("deterministic_block = {}: the fewest samples (a power of two) of at least 32 rows "
                                "({} per sample)",
                                block, rows));
  }
  const int64_t block = c.deterministic_block;
  int64_t ranks = 1;
  for (const std::string& axis : data_parallel_axes(mesh)) ranks *= mesh.size_of(axis);
  const int64_t local = c.batch_size / ranks, micro = local / c.micro_batches;
  if (c.batch_size % block != 0 || micro % block != 0 || local % c.micro_batches != 0)
    throw InvalidArgument("--deterministic-block",
                          fmt::format("blocks of {} samples with a global batch of {} over {} data-parallel ranks "
                                      "and {} micro-batches ({} samples each): a micro-batch must be whole blocks",
                                      block, c.batch_size, ranks, c.micro_batches, micro),
                          "use a block that divides every micro-batch, or a --batch-size that is a multiple of "
                          "ranks x micro-batches x block");
  const int64_t total = c.batch_size / block, per_micro = micro / block;
  for (int64_t m = 0; m < ranks * c.micro_batches; ++m)
    if (!is_tree_node(total, m * per_micro, per_micro) ||
        !is_tree_node(total, (m / c.micro_batches) * per_micro * c.micro_batches, per_micro * c.micro_batches))
      throw InvalidArgument("--deterministic",
                            fmt::format("{} blocks of {} samples over {} data-parallel ranks x {} micro-batches: "
                                        "each share of {} blocks must be a node of the canonical reduction tree",
                                        total, block, ranks, c.micro_batches, per_micro),
                            "give every micro-batch a power-of-two number of blocks (--batch-size, "
                            "--deterministic-block)");
}

}  // namespace

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
    // Each pipeline stage and tensor rank shards over its own node x fsdp
    // ranks; data (HSDP) and context ranks would join the shard group
    // beside the node hierarchy.
    for (const std::string_view other : {mesh::kData, mesh::kContext, mesh::kExpert})
      if (axis_size(mesh, other) > 1)
        fail(fmt::format("mesh {} has a {} axis", mesh.to_spec(), other),
             "ZeRO++ shards over node x fsdp (per pipeline stage and tensor rank): use --mesh node=K,fsdp=L "
             "(with pipeline and tensor axes if wanted)");
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
  check_batch_split(c, mesh);
  check_deterministic(c, mesh, dc, out.notes);
  if (pipeline_axis > 1)  // throws InvalidArgument for micro-batches the schedule cannot run
    (void)parallel::make_schedule(c.pipeline_schedule, pipeline_axis, c.micro_batches, c.virtual_stages);
  if (const RecipeRegistration& recipe = find_model_recipe(c.model); recipe.check) recipe.check(c, out.layout);
  return out;
}

}  // namespace meshtrain::train
