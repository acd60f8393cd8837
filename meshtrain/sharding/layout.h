// Layout: which block of a global tensor every rank of a device mesh holds,
// and the plan that moves a tensor from one layout to another.
//
//   // (8, 7) weight on a (data=2, tensor=2) mesh: rows over data, columns
//   // over tensor (7 is not divisible by 2: the tensor=1 shards get 3 columns).
//   Layout w(mesh, PartitionSpec::parse("data,tensor"), {8, 7});
//   w.local_shape(3);    // {4, 3}: rank 3 = (data 1, tensor 1)
//   w.local_offsets(3);  // {4, 4}
//   // The pure form needs no communicator (the CLI draws 64-device layouts):
//   Layout pure({8, 8}, {"data", "tensor"}, PartitionSpec::parse("(data,tensor)"), {1000});
//   Layout partial(mesh, PartitionSpec::replicated(2), {8, 7},
//                  {.partial = {{"tensor", comm::ReduceOp::sum}}});
//
// Rules (docs/sharding.md has pictures):
// - A dimension of size N split over axes (a1, ..., am) has k = size(a1) * ...
//   * size(am) shards. A rank's shard index j is the row-major index of its
//   coordinates on (a1, ..., am), in the order listed (a1 most significant).
// - Uneven rule (torch.chunk, DTensor): with c = ceil(N / k), shard j covers
//   [j * c, min(N, (j + 1) * c)), possibly empty. Trailing shards may be
//   smaller or empty; e.g. N = 5 over 4 shards gives sizes 2, 2, 1, 0.
//   LayoutOptions::strict rejects any N not divisible by k.
// - Mesh axes not used by the spec replicate: every rank along them holds the
//   same block. A Partial axis (LayoutOptions::partial) holds partial values
//   instead: the tensor's value is the reduction (op) of the blocks over that
//   axis. An axis cannot both shard and be partial. Several partial axes must
//   share one op, except that sum and avg may mix (both are linear).
//
// plan_redistribute(from, to) is pure: it returns the collectives that
// redistribute (sharded_tensor.h) runs, one mesh-axis transition at a time.
//
// Thread-safety: Layout and RedistributeStep are immutable values. A Layout
// may borrow a DeviceMesh (see mesh()); the mesh must outlive it, and the
// mesh's communicators are only used by sharded_tensor.h on the mesh's thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/sharding/partition_spec.h"

namespace meshtrain::sharding {

// Mesh axis name -> the reduction still pending over that axis.
using PartialAxes = std::map<std::string, comm::ReduceOp>;

struct LayoutOptions {
  PartialAxes partial;  // axes holding partial values (see the rules above)
  bool strict = false;  // reject dimensions not divisible by their shard count
};

// The uneven rule above for one dimension: shard `shard` of `shards` of n
// items covers [begin, end). InvalidArgument unless n >= 0, shards >= 1 and
// 0 <= shard < shards.
std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t shard, int64_t shards);

// A block of a global tensor: [offsets[d], offsets[d] + sizes[d]) per dim.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;

  int64_t numel() const;  // 1 for a 0-D box
  bool empty() const { return numel() == 0; }
  // Every element of `other` lies in this box (an empty `other` always does).
  bool contains(const Box& other) const;
  // The common block; sizes 0 where they do not meet.
  Box intersect(const Box& other) const;
  // "[0:4, 3:6]"
  std::string to_string() const;
  bool operator==(const Box&) const = default;
};

class Layout {
 public:
  // Pure layout over a mesh shape and axis names: every query works, but a
  // ShardedTensor needs a Layout built over a DeviceMesh.
  // Throws InvalidArgument when the mesh is invalid (mesh::validate_mesh),
  // the spec's length differs from global_shape's, the spec or a partial axis
  // names an axis the mesh lacks, an axis both shards and is partial, partial
  // ops mix (other than sum with avg), a size is negative, or, when strict, a
  // dimension does not divide into its shards (naming the dimension, its size,
  // the shard count and the axes).
  Layout(std::vector<int> mesh_shape, std::vector<std::string> axis_names, PartitionSpec spec,
         std::vector<int64_t> global_shape, LayoutOptions options = {});
  // Over a live mesh (borrowed: it must outlive this layout and its copies).
  Layout(mesh::DeviceMesh& mesh, PartitionSpec spec, std::vector<int64_t> global_shape,
         LayoutOptions options = {});
  // The layout of `placements` (one per mesh axis; see from_placements for the
  // order of several axes on one dim, and Partial placements become partial).
  static Layout from_placements(mesh::DeviceMesh& mesh, const std::vector<AxisPlacement>& placements,
                                std::vector<int64_t> global_shape, bool strict = false);

  // nullptr for a pure layout.
  mesh::DeviceMesh* mesh() const { return mesh_; }
  const std::vector<int>& mesh_shape() const { return mesh_shape_; }
  const std::vector<std::string>& axis_names() const { return axis_names_; }
  int num_ranks() const;
  const PartitionSpec& spec() const { return spec_; }
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  int ndim() const { return static_cast<int>(global_shape_.size()); }
  const PartialAxes& partial() const { return partial_; }
  bool strict() const { return strict_; }
  bool has_partial() const { return !partial_.empty(); }
  // No dimension split and nothing partial: every rank holds the whole tensor.
  bool is_replicated() const { return spec_.is_replicated() && partial_.empty(); }
  // Every dimension divides evenly into its shards.
  bool is_even() const;

  // Shards of `dim` (product of its axes' sizes; 1 when unsplit).
  int num_shards(int dim) const;
  // ceil(size / num_shards): the size of every shard but the trailing ones.
  int64_t chunk_size(int dim) const;
  // [begin, end) of shard `shard` of `dim` (see the uneven rule).
  std::pair<int64_t, int64_t> shard_range(int dim, int shard) const;
  // The shard of `dim` that world rank `rank` holds (0 when unsplit).
  int shard_index(int rank, int dim) const;
  std::vector<int64_t> local_shape(int rank) const;
  std::vector<int64_t> local_offsets(int rank) const;
  Box local_box(int rank) const;
  int64_t local_numel(int rank) const { return local_box(rank).numel(); }
  // One placement per mesh axis: Shard(d), Replicate or Partial(op).
  std::vector<AxisPlacement> placements() const;
  // Same mesh (and borrowed DeviceMesh) and global shape; another spec.
  Layout with_spec(PartitionSpec spec, LayoutOptions options = {}) const;
  // Same mesh shape and axis names (the DeviceMesh pointers may differ).
  bool same_mesh(const Layout& other) const;

  // "Layout(P(data, tensor), shape [8, 7], mesh (data=2, tensor=2), uneven)",
  // with ", partial {tensor: sum}" when partial.
  std::string to_string() const;
  // Compares mesh shape and names, spec, global shape and partial axes.
  bool operator==(const Layout& other) const;

 private:
  void validate(const char* op) const;
  int axis_index(const std::string& axis) const;

  mesh::DeviceMesh* mesh_ = nullptr;  // borrowed; may be null
  std::vector<int> mesh_shape_;
  std::vector<std::string> axis_names_;
  PartitionSpec spec_;
  std::vector<int64_t> global_shape_;
  PartialAxes partial_;
  bool strict_ = false;
};

// ---- Redistribution plan (pure) --------------------------------------------

enum class StepKind : uint8_t {
  local_slice,     // no communication: every rank's new block lies in its old one
  all_gather,      // every rank of a group needs the same block: gather the pieces
  all_to_all,      // ranks of a group exchange the intersections of old and new blocks
  all_reduce,      // Partial -> Replicate over the step's axis
  reduce_scatter,  // Partial -> Shard over the step's axis
  make_partial,    // Replicate -> Partial, local (see redistribute)
};
std::string_view step_kind_name(StepKind kind);

struct RedistributeStep {
  StepKind kind = StepKind::local_slice;
  // The mesh axes of the step's communicator, in mesh order: the changed
  // axis, or every axis of the affected dimensions for a direct exchange;
  // empty for local_slice.
  std::vector<std::string> axes;
  Layout from;
  Layout to;
  // True on the fallback paths (docs/sharding.md lists them): a direct
  // exchange over several axes, or an all_reduce taken because a
  // reduce_scatter could not land each rank's block in place.
  bool fallback = false;
  // "all_gather over (tensor): P(data, tensor) -> P(data, None)"
  std::string to_string() const;
};

// The steps that take a tensor from `from` to `to` (same mesh shape and names,
// same global shape; else InvalidArgument). Empty when the layouts are equal.
//  1. Partial axes that `to` does not keep with the same op are reduced, in
//     mesh order: reduce_scatter when `to` shards the axis and every rank's
//     new block lies within its old one, else all_reduce.
//  2. The spec changes one mesh axis at a time. Axes that leave their
//     dimension (or are out of order in it), innermost first and then in mesh
//     order, move to their new dimension (all_to_all over the axis) once that
//     dimension's other axes are final, or are removed (all_gather over the
//     axis); then new axes are inserted, outermost first (local_slice when
//     each rank's new block lies in its old one).
//     Fallback: when one of these steps would need data from ranks that differ
//     in another axis (uneven multi-axis dimensions, an axis inserted or
//     removed in front of another on the same dimension) or the moves form a
//     cycle, step 2 is instead one exchange over every axis of the dimensions
//     that change (all_gather if each group needs one block, else all_to_all):
//     still one collective, each element sent at most once.
//  3. New partial axes are made partial (make_partial, local).
// Every data-movement step picks all_gather when all ranks of a group need the
// same block and the group's axes all shard the old layout, else all_to_all.
// Deterministic: every rank computes the same plan.
std::vector<RedistributeStep> plan_redistribute(const Layout& from, const Layout& to);

}  // namespace meshtrain::sharding
