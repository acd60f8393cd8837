#include "meshtrain/sharding/placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/core/error.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::sharding {

Placement Placement::block(Box box, std::vector<int64_t> view, std::vector<int64_t> shape) {
  if (shape.empty()) shape = view;
  return {std::move(shape), std::move(view), std::move(box), 0, -1};
}

Placement Placement::flat(int64_t first, int64_t n) const {
  if (first < 0 || n < 0 || first > block_numel() - n)
    throw InvalidArgument("Placement::flat",
                          fmt::format("elements [{}, {}) of {} ({} elements)", first, first + n, to_string(),
                                      block_numel()),
                          "give a range inside the block");
  Placement out = *this;
  out.start = first;
  out.count = n;
  return out;
}

Box Placement::block_box() const {
  if (is_block()) return box;
  const std::vector<int64_t>& v = view_shape();
  return {std::vector<int64_t>(v.size(), 0), v};
}

int64_t Placement::block_numel() const {
  if (is_block()) return box.numel();
  int64_t n = 1;
  for (int64_t d : view_shape()) n *= d;
  return n;
}

std::string Placement::to_string() const {
  std::string out =
      is_block() ? fmt::format("{} of {}", box.to_string(), meshtrain::shape_to_string(view_shape())) : "";
  if (is_flat()) out += fmt::format("{}flat[{}:{}]", out.empty() ? "" : " ", start, start + count);
  return out.empty() ? "whole" : out;
}

FlatShards::FlatShards(std::vector<int64_t> sizes, int64_t d) : numels(std::move(sizes)) {
  if (d < 1) throw InvalidArgument("FlatShards", fmt::format("{} shards", d), "shard over at least one rank");
  for (int64_t n : numels) {
    if (n < 0) throw InvalidArgument("FlatShards", fmt::format("a parameter of {} elements", n), "");
    offsets.push_back(numel);
    numel += n;
  }
  padded = (numel + d - 1) / d * d;
  shard = padded / d;
}

std::pair<int64_t, int64_t> FlatShards::owned(size_t i, int64_t r) const {
  const int64_t lo = r * shard, a = std::max(offsets.at(i), lo), b = std::min(offsets[i] + numels[i], lo + shard);
  return a < b ? std::pair{a - offsets[i], b - a} : std::pair<int64_t, int64_t>{0, 0};
}

}  // namespace meshtrain::sharding
