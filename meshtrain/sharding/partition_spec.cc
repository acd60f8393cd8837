#include "meshtrain/sharding/partition_spec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::sharding {
namespace {

void check_unique(const std::vector<std::vector<std::string>>& dims, const char* op) {
  std::set<std::string> seen;
  for (size_t d = 0; d < dims.size(); ++d)
    for (const auto& a : dims[d]) {
      if (a.empty()) throw InvalidArgument(op, fmt::format("dimension {} names an empty axis", d), "remove it");
      if (!seen.insert(a).second)
        throw InvalidArgument(op, fmt::format("mesh axis '{}' is used twice", a),
                              "a mesh axis can split at most one dimension of a tensor");
    }
}

}  // namespace

PartitionSpec::PartitionSpec(std::vector<std::vector<std::string>> dims) : dims_(std::move(dims)) {
  check_unique(dims_, "PartitionSpec");
}

PartitionSpec PartitionSpec::replicated(int ndim) {
  if (ndim < 0) throw InvalidArgument("PartitionSpec::replicated", fmt::format("ndim {}", ndim), "ndim >= 0");
  return PartitionSpec(std::vector<std::vector<std::string>>(ndim));
}

PartitionSpec PartitionSpec::parse(std::string_view text) {
  std::vector<std::vector<std::string>> dims;
  std::string s(trim(text));
  if (s.size() >= 3 && s.substr(0, 2) == "P(" && s.back() == ')') s = s.substr(2, s.size() - 3);
  if (trim(s).empty()) return PartitionSpec(dims);
  size_t i = 0;
  auto fail = [&](const std::string& why) -> void {
    throw InvalidArgument("PartitionSpec::parse", fmt::format("'{}': {}", text, why),
                          "write one entry per dimension, e.g. data,None or (data,fsdp),tensor");
  };
  while (i <= s.size()) {
    std::string entry;
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;  // "a, (b, c)": the '(' may follow spaces
    if (i < s.size() && s[i] == '(') {
      const size_t close = s.find(')', i);
      if (close == std::string::npos) fail("unclosed '('");
      entry = s.substr(i + 1, close - i - 1);
      i = close + 1;
      while (i < s.size() && s[i] == ' ') ++i;
      if (i < s.size() && s[i] != ',') fail("expected ',' after ')'");
      ++i;
      std::replace(entry.begin(), entry.end(), ',', '+');
    } else {
      const size_t comma = std::min(s.find(',', i), s.size());
      entry = s.substr(i, comma - i);
      i = comma + 1;
    }
    std::vector<std::string> axes;
    entry = std::string(trim(entry));
    if (!(entry.empty() || entry == "None" || entry == "none" || entry == "_")) {
      size_t j = 0;
      while (j <= entry.size()) {
        const size_t plus = std::min(entry.find('+', j), entry.size());
        std::string a(trim(std::string_view(entry).substr(j, plus - j)));
        if (a.empty()) fail("empty axis name");
        axes.push_back(a);
        j = plus + 1;
      }
    }
    dims.push_back(std::move(axes));
  }
  return PartitionSpec(std::move(dims));
}

const std::vector<std::string>& PartitionSpec::axes(int dim) const {
  if (dim < 0 || dim >= ndim())
    throw InvalidArgument("PartitionSpec::axes", fmt::format("dim {} of a {}-dim spec", dim, ndim()),
                          "pass a dimension in range");
  return dims_[dim];
}

std::vector<std::string> PartitionSpec::used_axes() const {
  std::vector<std::string> out;
  for (const auto& d : dims_) out.insert(out.end(), d.begin(), d.end());
  return out;
}

int PartitionSpec::dim_of(const std::string& axis) const {
  for (int d = 0; d < ndim(); ++d)
    if (std::find(dims_[d].begin(), dims_[d].end(), axis) != dims_[d].end()) return d;
  return -1;
}

void PartitionSpec::validate(const std::vector<std::string>& mesh_axes, int tensor_ndim) const {
  if (ndim() != tensor_ndim)
    throw InvalidArgument("PartitionSpec::validate",
                          fmt::format("{} has {} entries but the tensor has {} dimensions", to_string(), ndim(),
                                      tensor_ndim),
                          "give one entry per dimension (None for unsplit ones)");
  for (const auto& a : used_axes())
    if (std::find(mesh_axes.begin(), mesh_axes.end(), a) == mesh_axes.end())
      throw InvalidArgument("PartitionSpec::validate",
                            fmt::format("{} uses axis '{}', which the mesh ({}) does not have", to_string(), a,
                                        fmt::join(mesh_axes, ", ")),
                            "use the mesh's axis names");
}

std::string PartitionSpec::to_string() const {
  std::vector<std::string> parts;
  for (const auto& d : dims_) {
    if (d.empty()) parts.push_back("None");
    else if (d.size() == 1) parts.push_back(d[0]);
    else parts.push_back(fmt::format("({})", fmt::join(d, ", ")));
  }
  return fmt::format("P({})", fmt::join(parts, ", "));
}

std::string AxisPlacement::to_string() const {
  switch (kind) {
    case Kind::replicate: return "R";
    case Kind::shard: return fmt::format("S({})", dim);
    case Kind::partial: return fmt::format("P({})", comm::reduce_op_name(reduce));
  }
  return "?";
}

std::vector<AxisPlacement> to_placements(const PartitionSpec& spec, const std::vector<std::string>& mesh_axes) {
  spec.validate(mesh_axes, spec.ndim());
  std::vector<AxisPlacement> out;
  for (const auto& a : mesh_axes) {
    const int d = spec.dim_of(a);
    out.push_back(d < 0 ? AxisPlacement::Replicate() : AxisPlacement::Shard(d));
  }
  return out;
}

PartitionSpec from_placements(const std::vector<AxisPlacement>& placements, const std::vector<std::string>& mesh_axes,
                              int tensor_ndim) {
  if (placements.size() != mesh_axes.size())
    throw InvalidArgument("from_placements",
                          fmt::format("{} placements for {} mesh axes", placements.size(), mesh_axes.size()),
                          "give one placement per mesh axis");
  std::vector<std::vector<std::string>> dims(tensor_ndim);
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!placements[i].is_shard()) continue;
    const int d = placements[i].dim;
    if (d < 0 || d >= tensor_ndim)
      throw InvalidArgument("from_placements",
                            fmt::format("axis '{}' shards dim {} of a {}-dim tensor", mesh_axes[i], d, tensor_ndim),
                            "shard a dimension the tensor has");
    dims[d].push_back(mesh_axes[i]);
  }
  return PartitionSpec(std::move(dims));
}

}  // namespace meshtrain::sharding
