// Placement: what one rank holds of one parameter (or of any global tensor),
// the one description the runtime, checkpoints, the planner and the
// pictures share.
//
//   Placement::whole({768, 2304})                         // replicated, or one device
//   Placement::block(box, {768, 3, 768}, {768, 2304})     // a tensor-parallel block of
//                                                         // c_attn's (in, 3, C) view
//   Placement::block(box, view, shape).flat(0, 442368)    // fully sharded: the first
//                                                         // 442368 elements of that block
//
// A placement is a block (`box`) of the tensor viewed as `view` (its own
// shape, or a reshape of it: a fused q|k|v weight (in, 3 C) split by heads
// is the block [0:in, 0:3, c0:c1] of its (in, 3, C) view), and optionally a
// range [start, start + count) of that block's row-major elements (a fully
// sharded flat shard). The rank's data is those elements, contiguous, in
// row-major order of the block.
//
// The rule that gives each rank its placement is the strategies' spec
// (strategy.h, multi_dimensional.h: a box per rank through Layout) and,
// under fully sharded data parallelism, the flat packing below
// (flat_shards: the range of each parameter inside its unit's shard).
//
// Thread-safety: immutable values; the functions are pure.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/sharding/layout.h"

namespace meshtrain::sharding {

struct Placement {
  std::vector<int64_t> shape;  // the global tensor's shape
  std::vector<int64_t> view;   // the shape `box` lies in (shape's numel); empty: `shape`
  Box box;                     // the block of view held; empty offsets and sizes: the whole view
  int64_t start = 0;           // row-major elements [start, start + count) of the box
  int64_t count = -1;          // -1: the whole box

  static Placement whole(std::vector<int64_t> shape) { return {std::move(shape), {}, {}, 0, -1}; }
  // `shape`: the tensor's own shape when `view` is a reshape of it (default: view).
  static Placement block(Box box, std::vector<int64_t> view, std::vector<int64_t> shape = {});
  // This placement narrowed to elements [start, start + count) of its box.
  Placement flat(int64_t start, int64_t count) const;

  // A block smaller than the tensor (a box is given).
  bool is_block() const { return !box.offsets.empty(); }
  // A range of the block's elements (count given).
  bool is_flat() const { return count >= 0; }
  const std::vector<int64_t>& view_shape() const { return view.empty() ? shape : view; }
  // The block as a box of view_shape() (the whole view when none is given).
  Box block_box() const;
  // The elements of the block, and the elements held (count, or the block's).
  int64_t block_numel() const;
  int64_t numel() const { return is_flat() ? count : block_numel(); }

  // "whole", "[0:4, 3:6] of [8, 6]", "flat[10:42]", "[0:4, 3:6] of [8, 6] flat[10:42]"
  std::string to_string() const;
  bool operator==(const Placement&) const = default;
};

// Fully sharded data parallelism's flat packing of one unit (parallel/
// fully_sharded.h, "Flat shards and padding"): the unit's sharded parameters,
// of numels[i] elements each, concatenated in order into a vector of `numel`
// elements, zero-padded to `padded` = ceil(numel / d) * d and cut into d
// shards of `shard` elements; rank r owns [r * shard, (r + 1) * shard).
struct FlatShards {
  std::vector<int64_t> offsets;  // where each parameter starts in the flat vector
  std::vector<int64_t> numels;
  int64_t numel = 0, padded = 0, shard = 0;

  // d >= 1, every numel >= 0.
  FlatShards(std::vector<int64_t> numels, int64_t d);
  // The elements of parameter i that rank r owns, as (start, count) within
  // the parameter (count 0: none).
  std::pair<int64_t, int64_t> owned(size_t i, int64_t r) const;
};

}  // namespace meshtrain::sharding
