#include "meshtrain/sharding/multi_dimensional.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::sharding {
namespace {

int param_rank(StrategyKind k) {
  switch (k) {
    case StrategyKind::pipeline_parallel: return 0;
    case StrategyKind::tensor_parallel: return 1;
    case StrategyKind::other: return 2;
    case StrategyKind::fully_sharded: return 3;
    case StrategyKind::data_parallel: return 4;
  }
  return 2;
}

int batch_rank(StrategyKind k) {
  switch (k) {
    case StrategyKind::data_parallel: return 0;
    case StrategyKind::fully_sharded: return 1;
    case StrategyKind::tensor_parallel: return 2;
    case StrategyKind::pipeline_parallel: return 3;
    case StrategyKind::other: return 4;
  }
  return 4;
}

std::vector<const Strategy*> ordered(const std::vector<std::shared_ptr<const Strategy>>& list, int (*rank)(StrategyKind)) {
  std::vector<const Strategy*> out;
  for (const auto& s : list) out.push_back(s.get());
  std::stable_sort(out.begin(), out.end(),
                   [rank](const Strategy* a, const Strategy* b) { return rank(a->kind()) < rank(b->kind()); });
  return out;
}

bool is_data_like(const Strategy& s) {
  return s.kind() == StrategyKind::data_parallel || s.kind() == StrategyKind::fully_sharded;
}

}  // namespace

MultiDimensionalStrategy::MultiDimensionalStrategy(std::vector<std::shared_ptr<const Strategy>> strategies,
                                                   std::vector<std::string> mesh_axes)
    : strategies_(std::move(strategies)), mesh_axes_(std::move(mesh_axes)) {
  const char* op = "MultiDimensionalStrategy";
  for (size_t i = 0; i < strategies_.size(); ++i)
    if (!strategies_[i]) throw InvalidArgument(op, fmt::format("strategy {} is null", i), "pass a strategy object");
  std::map<std::string, const Strategy*> owners;
  for (const auto& s : strategies_)
    for (const auto& axis : s->axes()) {
      internal::check_axis_name(op, axis);
      auto [it, fresh] = owners.emplace(axis, s.get());
      if (fresh) continue;
      const Strategy& first = *it->second;
      if (&first == s.get())
        throw InvalidArgument(op, fmt::format("{} lists mesh axis '{}' twice", s->name(), axis),
                              "a strategy's axes must be distinct");
      const bool dp_fsdp = is_data_like(first) && is_data_like(*s) && first.kind() != s->kind();
      throw InvalidArgument(
          op, fmt::format("mesh axis '{}' is claimed by both {} and {}", axis, first.name(), s->name()),
          dp_fsdp ? "FSDP already splits the batch over its own axis: drop the DataParallel strategy, or for "
                    "HSDP give them separate axes (e.g. data for replicas, fsdp for shards)"
                  : "give each strategy its own mesh axis; two strategies may still split one dimension, each "
                    "over its own axis");
    }
  if (!mesh_axes_.empty())
    for (const auto& [axis, s] : owners)
      if (std::find(mesh_axes_.begin(), mesh_axes_.end(), axis) == mesh_axes_.end())
        throw InvalidArgument(op,
                              fmt::format("{} uses mesh axis '{}', which the mesh ({}) does not have", s->name(),
                                          axis, fmt::join(mesh_axes_, ", ")),
                              "name one of the mesh's axes, or add the axis to the mesh");
  param_order_ = ordered(strategies_, param_rank);
  batch_order_ = ordered(strategies_, batch_rank);
}

std::string MultiDimensionalStrategy::name() const {
  std::vector<std::string> names;
  for (const auto& s : strategies_) names.push_back(s->name());
  return fmt::format("MultiDimensional[{}]", fmt::join(names, ", "));
}

std::vector<std::string> MultiDimensionalStrategy::axes() const {
  std::vector<std::string> out;
  for (const auto& s : strategies_)
    for (auto& a : s->axes()) out.push_back(std::move(a));
  return out;
}

const Strategy* MultiDimensionalStrategy::owner(const std::string& axis) const {
  for (const auto& s : strategies_) {
    const auto axes = s->axes();
    if (std::find(axes.begin(), axes.end(), axis) != axes.end()) return s.get();
  }
  return nullptr;
}

int64_t MultiDimensionalStrategy::axis_size(const std::string& axis) const {
  const Strategy* s = owner(axis);
  return s ? s->axis_size(axis) : 0;
}

std::vector<MultiDimensionalStrategy::Step> MultiDimensionalStrategy::apply(const ParamInfo& fused) const {
  internal::check_param("MultiDimensionalStrategy::combined_spec", fused);
  const ParamInfo p = fused.layout();  // every strategy sees a fused parameter's view
  std::vector<Step> steps;
  ParamInfo local = p;
  for (const Strategy* s : param_order_) {
    PartitionSpec spec = s->param_spec(local);
    if (spec.ndim() != static_cast<int>(p.shape.size()))
      throw InvalidArgument("MultiDimensionalStrategy::combined_spec",
                            fmt::format("parameter {}: {} returned {} with {} entries for a {}-D tensor",
                                        p.to_string(), s->name(), spec.to_string(), spec.ndim(), p.shape.size()),
                            "a spec needs one entry per tensor dimension");
    steps.push_back({s, local, spec});
    for (int d = 0; d < spec.ndim(); ++d)
      for (const auto& axis : spec.axes(d)) {
        const int64_t n = axis_size(axis);
        if (n > 1) local.shape[d] = (local.shape[d] + n - 1) / n;
      }
  }
  return steps;
}

PartitionSpec MultiDimensionalStrategy::merge(const std::string& what, int ndim, const std::vector<Step>& steps) const {
  const char* op = "MultiDimensionalStrategy::combined_spec";
  struct Use {
    const Strategy* by;
    int dim;
  };
  std::map<std::string, Use> used;
  std::vector<std::vector<std::string>> dims(ndim);
  for (const Step& step : steps)
    for (int d = 0; d < ndim; ++d)
      for (const auto& axis : step.spec.axes(d)) {
        if (auto it = used.find(axis); it != used.end())
          throw InvalidArgument(op,
                                fmt::format("{}: mesh axis '{}' is put on dimension {} by {} and on dimension {} by {}",
                                            what, axis, it->second.dim, it->second.by->name(), d,
                                            step.strategy->name()),
                                "a mesh axis may split only one dimension, for the one strategy that owns it");
        const Strategy* own = owner(axis);
        if (own != step.strategy)
          throw InvalidArgument(op,
                                fmt::format("{}: {} puts mesh axis '{}' on dimension {}, but the axis belongs to {}",
                                            what, step.strategy->name(), axis, d, own ? own->name() : "no strategy"),
                                "a strategy may only use the axes it lists in axes()");
        used.emplace(axis, Use{step.strategy, d});
        dims[d].push_back(axis);
      }
  PartitionSpec spec(std::move(dims));
  if (!mesh_axes_.empty()) spec.validate(mesh_axes_, ndim);
  return spec;
}

PartitionSpec MultiDimensionalStrategy::combined_spec(const ParamInfo& p) const {
  return merge("parameter " + p.to_string(), static_cast<int>(p.layout().shape.size()), apply(p));
}

PartitionSpec MultiDimensionalStrategy::combined_batch_spec(int ndim, int batch_dim) const {
  internal::check_batch("MultiDimensionalStrategy::combined_batch_spec", ndim, batch_dim);
  std::vector<Step> steps;
  for (const Strategy* s : batch_order_) {
    PartitionSpec spec = s->batch_spec(ndim, batch_dim);
    if (spec.ndim() != ndim)
      throw InvalidArgument("MultiDimensionalStrategy::combined_batch_spec",
                            fmt::format("{} returned {} for a {}-D batch", s->name(), spec.to_string(), ndim),
                            "a spec needs one entry per tensor dimension");
    steps.push_back({s, ParamInfo{}, std::move(spec)});
  }
  return merge(fmt::format("batch ({}-D, batch_dim {})", ndim, batch_dim), ndim, steps);
}

std::string MultiDimensionalStrategy::explain(const ParamInfo& p) const {
  const auto steps = apply(p);
  std::string out = fmt::format("{}: {} -> {}", name(), p.to_string(), combined_spec(p).to_string());
  for (const Step& step : steps) out += "\n  " + step.strategy->explain(step.seen);
  return out;
}

std::map<std::string, PartitionSpec> MultiDimensionalStrategy::specs(const std::vector<ParamInfo>& params) const {
  const char* op = "MultiDimensionalStrategy::specs";
  std::map<std::string, PartitionSpec> out;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params[i];
    if (p.name.empty())
      throw InvalidArgument(op, fmt::format("parameter {} {} has no name", i, shape_to_string(p.shape)),
                            "give every parameter its unique name, e.g. h.0.mlp.fc1.weight");
    if (auto [it, fresh] = index.emplace(p.name, i); !fresh)
      throw InvalidArgument(op, fmt::format("parameter '{}' appears twice (entries {} and {})", p.name, it->second, i),
                            "parameter names must be unique");
    out.emplace(p.name, combined_spec(p));
  }
  return out;
}

}  // namespace meshtrain::sharding
