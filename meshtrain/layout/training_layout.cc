#include "meshtrain/layout/training_layout.h"

#include <fmt/format.h>

namespace meshtrain::layout {

int TrainingLayout::devices() const {
  int n = 1;
  for (int s : mesh.shape) n *= s;
  return n;
}

std::vector<std::string_view> TrainingLayout::shard_axes() const {
  if (!fsdp || fsdp->stage == ZeroStage::no_shard) return {};
  if (fsdp->hybrid) return {mesh::kFsdp};
  return {mesh::kData, mesh::kNode, mesh::kFsdp, mesh::kContext};
}

int TrainingLayout::shard_size() const {
  int n = 1;
  for (std::string_view a : shard_axes()) n *= size(a);
  return n;
}

std::string TrainingLayout::describe() const {
  std::vector<std::string> parts;
  if (fsdp) {
    std::vector<std::string> over;
    for (std::string_view a : shard_axes())
      if (mesh.has(a)) over.emplace_back(a);
    parts.push_back(fmt::format("fsdp {}{}{}", fsdp->name(),
                                over.empty() ? "" : fmt::format(" over {} ({} ranks)", fmt::join(over, " x "),
                                                                shard_size()),
                                param_dtype == DType::f32
                                    ? ""
                                    : fmt::format(", {} parameters", precision_name(param_dtype))));
    if (zeropp.any()) parts.push_back("ZeRO++ " + zeropp.to_string());
  } else if (size(mesh::kData) > 1) {
    parts.push_back(fmt::format("data parallel {}", size(mesh::kData)));
  }
  if (size(mesh::kTensor) > 1)
    parts.push_back(fmt::format("tensor {}{}", size(mesh::kTensor), sequence_parallel ? " (sequence parallel)" : ""));
  if (size(mesh::kPipeline) > 1)
    parts.push_back(fmt::format("pipeline {} ({}{}, {} micro-batches)", size(mesh::kPipeline), to_string(schedule),
                                virtual_stages > 1 ? fmt::format(" x {} chunks", virtual_stages) : "",
                                micro_batches));
  if (size(mesh::kContext) > 1)
    parts.push_back(fmt::format("context {} ({})", size(mesh::kContext), context_comm_name(cp_comm)));
  return fmt::format("mesh {}: {}", mesh.to_spec().empty() ? "one device" : mesh.to_spec(),
                     parts.empty() ? "one device's work on each rank" : fmt::format("{}", fmt::join(parts, ", ")));
}

std::optional<FsdpMode> resolve_fsdp_mode(std::string_view given, const mesh::NamedShape& mesh, DType precision) {
  if (!given.empty()) return parse_fsdp_mode(given);
  if (mesh.size_of(mesh::kFsdp) > 1) return FsdpMode{ZeroStage::zero3, false};
  if (precision != DType::f32) return FsdpMode{ZeroStage::no_shard, false};
  return std::nullopt;
}

}  // namespace meshtrain::layout
