// Pictures for `meshtrain plan`: a training layout's mesh laid over nodes
// (SVG). The memory picture (--svg with --mesh) is plan_command.cc's.
//
//   plan::TrainingLayout l{.data = 4, .tensor = 8, .pipeline = 2};
//   write(mesh_svg(l, {.devices_per_node = 8, .title = "pipeline=2,data=4,tensor=8"}));
//   mesh_axis_captions(l, {});   // {"pipeline=2: 32 groups of 2 ranks 32 apart, across nodes ...", ...}
//
// World ranks are numbered as the runtime's DeviceMesh numbers them: row-major
// over the mesh axes in the order --mesh lists them (the last axis varies
// fastest), and a node holds devices_per_node consecutive ranks. The search's
// layouts list their axes in mesh::kMeshAxisOrder (pipeline, data, fsdp,
// context, tensor), so tensor groups are consecutive ranks.
//
// The picture: one rounded box per node with its devices as squares labelled
// with their world rank and coloured by pipeline stage (a legend), every
// tensor-parallel group outlined (black within a node, red where the group is
// split over nodes: its all-reduces, on every layer's critical path, then use
// the slow link), and a caption line per axis saying where its groups sit.
// At most max_nodes nodes are drawn; a line names the rest, so a
// 1024-device mesh stays a picture of bounded size (captions cover every rank).
//
// Pure functions (but write_picture); thread-safe. Errors: InvalidArgument for devices_per_node
// < 1, max_nodes < 1, or an order naming an unknown or repeated axis.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/plan/memory_model.h"

namespace meshtrain::cli {

struct MeshPictureOptions {
  int devices_per_node = 8;
  std::string title = {};
  // The axes, slowest first, as --mesh lists them; axes left out have size 1
  // (or are placed after the listed ones). Empty: the layout's axis_order
  // (TrainingLayout::set_mesh keeps --mesh's), else mesh::kMeshAxisOrder.
  std::vector<std::string> order = {};
  std::string note = {};  // one more caption line (e.g. where devices_per_node comes from)
  int max_nodes = 32;     // nodes drawn in full
};

// One line per axis of size > 1, in rank order (slowest first), e.g.
// "tensor=8: 8 groups of 8 consecutive ranks, within a node; ..." or
// "data=8: 8 groups of 8 ranks 8 apart, across nodes (one rank per node); ...".
// One line "one device" when every axis has size 1.
std::vector<std::string> mesh_axis_captions(const plan::TrainingLayout& layout, const MeshPictureOptions& options);

// The number of tensor-parallel groups with ranks on more than one node.
int tensor_groups_split_over_nodes(const plan::TrainingLayout& layout, const MeshPictureOptions& options);

// A standalone SVG document (see the top).
std::string mesh_svg(const plan::TrainingLayout& layout, const MeshPictureOptions& options);

// A picture file a flag named ("--svg", "--mesh-svg").
struct PictureFile {
  std::string flag, path;
};
// Writes `svg` to the file; IoError "FLAG PATH: cannot write it" when it cannot.
void write_picture(const PictureFile& file, const std::string& svg);

}  // namespace meshtrain::cli
