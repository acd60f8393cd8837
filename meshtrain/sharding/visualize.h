// Pictures of a layout: which ranks hold each block of a 1-D or 2-D tensor,
// as a text grid (like JAX's visualize_array_sharding) or an SVG.
//
//   Layout l({2, 2}, {"data", "tensor"}, PartitionSpec::parse("data,None"), {8, 6});
//   std::cout << visualize_sharding(l);
//
//   P(data, None) on mesh (data=2, tensor=2), shape [8, 6]
//   ┌────────────────────────────────────────────────┐
//   │                                                │
//   │                      0,1                       │
//   │                                                │
//   │                                                │
//   ├────────────────────────────────────────────────┤
//   │                                                │
//   │                      2,3                       │
//   │                                                │
//   │                                                │
//   └────────────────────────────────────────────────┘
//   dim 0 (size 8) over (data): 2 shards, sizes 4 x2
//
//   Layout({2, 2}, {"data", "tensor"}, PartitionSpec::parse("(data,tensor)"), {5})
//
//   P((data, tensor)) on mesh (data=2, tensor=2), shape [5]
//   ┌───────────────────┬───────────────────┬──────────┐
//   │         0         │         1         │    2     │
//   └───────────────────┴───────────────────┴──────────┘
//   dim 0 (size 5) over (data, tensor): 4 shards, sizes 2 x2, 1, 0
//   empty blocks on rank 3
//
// Blocks are laid out by global position: rows are shards of dim 0 and
// columns shards of dim 1 (a 1-D tensor is one row of columns). Each block
// lists the world ranks that hold it, in order; runs of three or more
// consecutive ranks read "4-7". Block widths (and, for 2-D, heights) are
// proportional to the shards' extents within options.width x options.height,
// widened where a label needs it. Empty shards (uneven layouts) have no block:
// a footer names the ranks holding them, and one line per split dimension gives
// its shard sizes. Partial axes are named in the header (each block is the
// reduction of the listed ranks' values over them).
//
// Pure functions of the layout's mesh shape, axis names, spec, global shape
// and partial axes: a pure Layout (no DeviceMesh) is enough, so a 64-device
// layout can be drawn without launching ranks. Lines end with '\n' and carry no
// trailing spaces.
//
// Thread-safety: pure functions.
#pragma once

#include <string>

#include "meshtrain/sharding/layout.h"

namespace meshtrain::sharding {

// Limits that keep a picture's size bounded: width in [1, 1000] columns,
// height in [1, 200] lines, meshes of at most 4096 ranks (a block is at
// least as wide as its rank label, so more ranks draw wider than asked).
inline constexpr int kMaxPictureWidth = 1000;
inline constexpr int kMaxPictureHeight = 200;
inline constexpr int kMaxPictureRanks = 4096;

struct VisualizeOptions {
  // Text: interior columns of the grid, 1..kMaxPictureWidth. SVG: the grid
  // is 10 * width pixels wide and, for 2-D, as tall as the tensor's aspect
  // ratio makes it, within [96, 10 * width] pixels (48 for 1-D).
  int width = 48;
  int height = 8;  // text only: interior lines of a 2-D grid, 1..kMaxPictureHeight
};

// Throws InvalidArgument unless the layout's tensor is 1-D or 2-D, the
// options are inside the limits above and the mesh has at most
// kMaxPictureRanks ranks.
std::string visualize_sharding(const Layout& layout, const VisualizeOptions& options = {});

// A standalone SVG document: one rectangle per block (colored per block,
// labelled with its ranks, with a <title> giving its global index range), the
// header above and the dimension lines below. Throws like visualize_sharding.
std::string visualize_sharding_svg(const Layout& layout, const VisualizeOptions& options = {});

}  // namespace meshtrain::sharding
