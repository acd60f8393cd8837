#include "meshtrain/layout/placement_rule.h"

#include <fmt/format.h>

#include <map>
#include <memory>

#include "meshtrain/core/error.h"
#include "meshtrain/mesh/device_mesh.h"

namespace meshtrain::layout {

namespace {

int coordinate(const mesh::NamedShape& m, const std::vector<int>& c, std::string_view axis) {
  for (size_t i = 0; i < m.axis_names.size(); ++i)
    if (m.axis_names[i] == axis) return c[i];
  return 0;
}

// Whether expert-axis rank `at` of `ranks` holds the parameter: every rank
// holds what is not a routed expert; expert e of E is on rank e / (E / ranks).
bool holds_expert(const sharding::ParamInfo& p, int ranks, int at) {
  if (!p.routed_expert() || ranks == 1) return true;
  if (p.experts % ranks != 0)
    throw InvalidArgument("held_parameters",
                          fmt::format("{}: {} experts over an expert axis of {}", p.to_string(), p.experts, ranks),
                          "give the expert axis a size that divides the experts");
  return p.expert / (p.experts / ranks) == at;
}

}  // namespace

std::vector<HeldParameter> held_parameters(const TrainingLayout& layout, std::span<const ModelParameter> params,
                                           int rank) {
  const mesh::NamedShape& m = layout.mesh;
  const std::vector<int> c = mesh::unravel(rank, m.shape);  // InvalidArgument outside the mesh
  const int pipeline = m.size_of(mesh::kPipeline), tensor = m.size_of(mesh::kTensor);
  const int expert = m.size_of(mesh::kExpert);
  const sharding::TensorParallelStrategy tp(mesh::kTensor, tensor, /*uneven=*/true);
  // The fully sharded group: its size and this rank's index in it.
  int64_t d = 1, shard_rank = 0;
  for (std::string_view a : layout.shard_axes()) {
    shard_rank = shard_rank * m.size_of(a) + coordinate(m, c, a);
    d *= m.size_of(a);
  }
  const sharding::FSDPStrategy fsdp(mesh::kFsdp, d, layout.fsdp_min_weight_size);

  // 1-2: the stages this rank runs, each parameter's block.
  std::vector<HeldParameter> out;
  std::vector<int64_t> block_numel;
  std::vector<bool> shard;
  for (const ModelParameter& p : params) {
    if (p.stage % pipeline != coordinate(m, c, mesh::kPipeline)) continue;
    if (!holds_expert(p.info, expert, coordinate(m, c, mesh::kExpert))) continue;
    sharding::Placement where = sharding::Placement::whole(p.info.shape);
    const std::vector<int64_t> view = p.info.layout().shape;
    if (tensor > 1 && p.info.num_heads > 0 && p.info.num_heads < tensor && tensor % p.info.num_heads == 0) {
      // Fewer heads than tensor ranks (Llama's key/value heads, Megatron's
      // rule): split over num_heads ranks, each block on tensor / num_heads.
      const int heads = static_cast<int>(p.info.num_heads);
      const sharding::TensorParallelStrategy over_heads(mesh::kTensor, heads, /*uneven=*/true);
      sharding::Box box = over_heads.block(p.info, coordinate(m, c, mesh::kTensor) / (tensor / heads));
      if (box.sizes != view) where = sharding::Placement::block(std::move(box), view, p.info.shape);
    } else if (tensor > 1) {
      sharding::Box box = tp.block(p.info, coordinate(m, c, mesh::kTensor));
      if (box.sizes != view) where = sharding::Placement::block(std::move(box), view, p.info.shape);
    }
    const int64_t n = where.block_numel();
    block_numel.push_back(n);
    // FSDP decides on the block a tensor-parallel rank holds.
    shard.push_back(layout.fsdp.has_value() &&
                    fsdp.should_shard({.name = p.info.name, .shape = where.block_box().sizes}));
    out.push_back({p.info.name, p.stage, std::move(where)});
  }
  if (!layout.fsdp) return out;

  // 3: each unit's sharded parameters packed flat, in order.
  std::map<std::pair<int, int>, std::vector<size_t>> units;  // (stage, unit) -> indices into out
  size_t k = 0;
  for (const ModelParameter& p : params) {
    if (p.stage % pipeline != coordinate(m, c, mesh::kPipeline)) continue;
    if (!holds_expert(p.info, expert, coordinate(m, c, mesh::kExpert))) continue;
    if (shard[k]) units[{p.stage, p.unit}].push_back(k);
    ++k;
  }
  for (const auto& [unit, members] : units) {
    std::vector<int64_t> numels;
    for (size_t i : members) numels.push_back(block_numel[i]);
    const sharding::FlatShards flat(std::move(numels), d);
    for (size_t j = 0; j < members.size(); ++j) {
      const auto [start, count] = flat.owned(j, shard_rank);
      out[members[j]].placement = out[members[j]].placement.flat(start, count);
    }
  }
  return out;
}

sharding::MultiDimensionalStrategy seed_strategies(const TrainingLayout& layout) {
  const mesh::NamedShape& m = layout.mesh;
  std::vector<std::shared_ptr<const sharding::Strategy>> out;
  for (size_t i = 0; i < m.shape.size(); ++i) {
    const std::string& a = m.axis_names[i];
    if (a == mesh::kData)
      out.push_back(std::make_shared<sharding::DataParallelStrategy>(a));
    else if (a == mesh::kFsdp)
      out.push_back(std::make_shared<sharding::FSDPStrategy>(a, m.shape[i], layout.fsdp_min_weight_size));
    else if (a == mesh::kTensor)
      out.push_back(std::make_shared<sharding::TensorParallelStrategy>(a, m.shape[i], /*uneven=*/true));
  }
  return sharding::MultiDimensionalStrategy(std::move(out), m.axis_names);
}

}  // namespace meshtrain::layout
