// fit_device_memory (device_memory.h): a run against its devices' memory,
// re-planned with the planner's memory model when a resumed run no longer
// fits.
#include "meshtrain/train/device_memory.h"

#include <fmt/format.h>

#include <cmath>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/plan/layout_search.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/train/internal/mesh_roles.h"
#include "meshtrain/train/model_parameters.h"

namespace meshtrain::train {
namespace {

constexpr const char* kFlag = "--device-memory";

std::string gib(double bytes) { return format_bytes(static_cast<uint64_t>(bytes)); }
std::string devices(int n) { return fmt::format("{} device{}", n, n == 1 ? "" : "s"); }

// The axes the re-plan keeps (the user's fixed choices), as "keeping
// tensor=2" ("" when there are none).
std::string keeping(const mesh::NamedShape& mesh) {
  std::string out;
  for (size_t i = 0; i < mesh.shape.size(); ++i)
    if (mesh.axis_names[i] != mesh::kData && mesh.axis_names[i] != mesh::kFsdp && mesh.shape[i] > 1)
      out += fmt::format("{}{}={}", out.empty() ? " keeping " : ",", mesh.axis_names[i], mesh.shape[i]);
  return out;
}

// A layout to try: the run's configuration with some knobs changed.
struct Option {
  TrainConfig config;
  mesh::NamedShape mesh;
  std::string what;  // "zero3, 4 micro-batches, recompute"
};

struct Priced {
  ResolvedTraining resolved;
  mesh::NamedShape mesh;
  std::string what;
  double peak = 0;
};

// The option resolved and priced; nullopt when the trainer refuses it.
std::optional<Priced> price(const Option& o, const config::DistributedConfig& dc) {
  try {
    config::DistributedConfig d = dc;
    d.set_mesh(o.mesh);
    ResolvedTraining r = resolve_training(o.config, d);
    const double peak = predicted_peak_bytes(r);
    return Priced{std::move(r), o.mesh, o.what, peak};
  } catch (const Error&) {
    return std::nullopt;  // e.g. zero3 with a pipeline axis, or an empty micro-batch
  }
}

// The data axis renamed fsdp (the data ranks shard the model).
mesh::NamedShape data_as_fsdp(mesh::NamedShape mesh) {
  for (auto& name : mesh.axis_names)
    if (name == mesh::kData) name = std::string(mesh::kFsdp);
  return mesh;
}

}  // namespace

void keep_micro_batch_size(TrainConfig& tc, const mesh::NamedShape& before, const mesh::NamedShape& after,
                           std::vector<std::string>* notes) {
  auto ranks = [](const mesh::NamedShape& m) {
    int n = 1;
    for (const std::string& axis : internal::data_parallel_axes(m)) n *= m.size_of(axis);
    return n;
  };
  const int was = ranks(before), now = ranks(after);
  if (now == was || (tc.micro_batches * was) % now != 0) return;
  const int micro = tc.micro_batches * was / now;
  if (notes != nullptr)
    notes->push_back(fmt::format("micro_batches = {} (was {}): each micro-batch keeps its size on {} data-parallel "
                                 "rank{} instead of {}",
                                 micro, tc.micro_batches, now, now == 1 ? "" : "s", was));
  tc.micro_batches = micro;
}

double predicted_peak_bytes(const ResolvedTraining& resolved) {
  const TrainConfig& tc = resolved.config;
  if (tc.model != "gpt") return 0;
  plan::TrainingLayout l;
  l.set_layout(resolved.layout);
  l.recompute = tc.recompute;
  l.batch = tc.batch_size;
  l.bucket_bytes = tc.bucket_mb * (1 << 20);
  l.dropout = tc.dropout;
  l.adamw = tc.optimizer == "adamw";
  return plan::predict_memory(with_gpt_model(gpt_shape(tc)), l).worst().total();
}

ResolvedTraining fit_device_memory(const ResolvedTraining& resolved, config::DistributedConfig& dc, bool may_replan,
                                   std::vector<std::string>* notes) {
  const TrainConfig& tc = resolved.config;
  if (tc.device_memory.empty()) return resolved;
  const plan::SearchOptions limits{.device_memory = plan::parse_memory_size(tc.device_memory, kFlag)};
  const double usable = limits.usable();
  auto note = [&](std::string text) {
    if (notes != nullptr) notes->push_back(std::move(text));
  };
  if (tc.model != "gpt") {
    note(fmt::format("device_memory = {}: the planner has no memory model of the {} recipe; not checked",
                     tc.device_memory, tc.model));
    return resolved;
  }
  const mesh::NamedShape mesh = dc.mesh();
  const double needed = predicted_peak_bytes(resolved);
  if (needed <= usable) {
    note(fmt::format("device_memory = {}: predicted peak {} per device of {} usable ({}% kept free)",
                     tc.device_memory, gib(needed), gib(usable), static_cast<int>(limits.reserve * 100)));
    return resolved;
  }
  const std::string over = fmt::format(
      "the run needs {} per device on {} (mesh {}, the planner's predicted peak), more than the {} usable "
      "of {} ({}% kept free)",
      gib(needed), devices(dc.world_size), mesh.to_spec(), gib(usable), tc.device_memory,
      static_cast<int>(limits.reserve * 100));
  if (!may_replan)
    throw InvalidArgument(kFlag, over,
                          fmt::format("give more devices, a larger {}, or a layout that shards more (meshtrain plan "
                                      "--devices {} --device-memory {} --hardware H100 lists the ones that fit)",
                                      kFlag, dc.world_size, tc.device_memory));

  // The knobs, cheapest first (device_memory.h).
  const std::string& own = tc.fsdp.name;  // "": plain data parallelism
  std::vector<std::string> stages = {own};
  if (mesh.size_of(mesh::kData) * mesh.size_of(mesh::kFsdp) > 1) {
    const std::string ladder[] = {"zero1", "zero2", "zero3"};
    const size_t from = own.empty() || own == "no_shard"         ? 0
                        : own == "zero1"                         ? 1
                        : own == "zero2" || own == "shard_grad_op" ? 2
                                                                 : 3;  // zero3, full, hybrid: as they are
    for (size_t i = from; i < std::size(ladder); ++i) stages.push_back(ladder[i]);
  }
  std::vector<bool> recomputes = {tc.recompute};
  if (!tc.recompute) recomputes.push_back(true);
  std::optional<Priced> least;
  for (const bool recompute : recomputes) {
    for (const std::string& stage : stages) {
      for (int micro = tc.micro_batches; micro <= tc.batch_size; micro *= 2) {
        Option o{tc, stage == own ? mesh : data_as_fsdp(mesh), ""};
        if (stage != own) o.config.set("fsdp", stage, kFlag);
        o.config.micro_batches = micro;
        o.config.recompute = recompute;
        std::vector<std::string> parts;
        if (stage != own) parts.push_back(stage);
        if (micro != tc.micro_batches) parts.push_back(fmt::format("{} micro-batches", micro));
        if (recompute != tc.recompute) parts.push_back("recompute");
        o.what = fmt::format("{}", fmt::join(parts, ", "));
        const std::optional<Priced> p = price(o, dc);
        if (!p) continue;
        if (p->peak <= usable) {
          dc.set_mesh(p->mesh);
          note(fmt::format("device_memory = {}: {}; re-planned{}: mesh {}{}{}, predicted peak {} per device",
                           tc.device_memory, over, keeping(mesh), p->mesh.to_spec(), o.what.empty() ? "" : ", ",
                           o.what, gib(p->peak)));
          return p->resolved;
        }
        if (!least || p->peak < least->peak) least = p;
      }
    }
  }
  const double least_peak = least ? least->peak : needed;
  // The device memory whose usable part holds it, rounded up to 0.01 MiB.
  const double enough = std::ceil(least_peak / (1 - limits.reserve) / (1 << 20) * 100) / 100;
  throw InvalidArgument(
      kFlag,
      fmt::format("{}; the least any layout on {}{} needs is {}{}", over, devices(dc.world_size), keeping(mesh),
                  gib(least_peak),
                  least ? fmt::format(" (mesh {}{}{})", least->mesh.to_spec(), least->what.empty() ? "" : ", ",
                                      least->what)
                        : ""),
      fmt::format("the last checkpoint is kept: resume the run on more devices, or on devices of at least "
                  "{:.2f} MiB each ({} {:.2f}MiB)",
                  enough, kFlag, enough));
}

}  // namespace meshtrain::train
