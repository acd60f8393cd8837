// DeviceMesh: the world's ranks arranged as an n-D grid with named axes, and
// one sub-communicator per axis (or per set of axes), in the style of JAX's
// Mesh and PyTorch's DeviceMesh.
//
//   void step(meshtrain::comm::Communicator& world) {  // 8 ranks
//     meshtrain::mesh::DeviceMesh mesh(world, {4, 2}, {"data", "tensor"});
//     auto& tp = mesh.comm("tensor");  // 2 ranks: this rank's row
//     auto& dp = mesh.comm("data");    // 4 ranks: this rank's column
//     ...
//   }
//
// Rank order: row-major, last axis fastest. rank = sum_i coords[i] * stride[i]
// with stride[n-1] = 1 and stride[i] = stride[i+1] * shape[i+1]. For shape
// (4, 2) with names (data, tensor), rank 5 = coords (2, 1): data 2, tensor 1.
// render_mesh draws it as
//
//             tensor
//             0     1
//          ┌─────┬─────┐
//   data 0 │  0  │  1  │
//          ├─────┼─────┤
//        1 │  2  │  3  │
//          ├─────┼─────┤
//        2 │  4  │  5  │
//          ├─────┼─────┤
//        3 │  6  │  7  │
//          └─────┴─────┘
//   data groups (vary data, fixed tensor): [0 2 4 6] [1 3 5 7]
//   tensor groups (vary tensor, fixed data): [0 1] [2 3] [4 5] [6 7]
//
//
// A sub-communicator's rank order is row-major over the axes it spans, in the
// order they are listed; for one axis its rank is this rank's coordinate on
// that axis.
//
// The pure functions below (ravel, unravel, group_of, groups_along,
// validate_mesh, render_mesh) do no communication and can be used without
// a communicator (the CLI prints meshes with render_mesh).
//
// Thread-safety: a DeviceMesh belongs to one rank and is used by that rank's
// thread, like its communicators. Determinism: everything but the
// communicators is a pure function of (shape, axis names, world rank).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::mesh {

// ---- Pure rank/coordinate math (no communication) --------------------------

// Product of the sizes (1 for an empty shape). Computed in 64 bits so that a
// bad shape cannot overflow before validation rejects it.
int64_t num_ranks(const std::vector<int>& shape);

// Throws InvalidArgument unless: shape is not empty; shape and axis_names
// have the same length; every size is >= 1; every name is non-empty, made of
// letters, digits, '_' and '-' (so `--mesh data=2,tensor=2` can spell it), and
// unique; and, if world_size is given, num_ranks(shape) == *world_size.
void validate_mesh(const std::vector<int>& shape, const std::vector<std::string>& axis_names,
                   std::optional<int> world_size = std::nullopt);

// "(data=4, tensor=2)"; sizes only "(4, 2)" when names is empty.
std::string format_mesh(const std::vector<int>& shape, const std::vector<std::string>& axis_names = {});

// Coordinates of `rank` (row-major, last axis fastest).
// Precondition: every size >= 1 and 0 <= rank < num_ranks(shape); else throws
// InvalidArgument. Example: unravel(5, {4, 2}) == {2, 1}.
std::vector<int> unravel(int rank, const std::vector<int>& shape);

// Inverse of unravel. Precondition: coords.size() == shape.size() and
// 0 <= coords[i] < shape[i]; else throws InvalidArgument.
// Example: ravel({2, 1}, {4, 2}) == 5.
int ravel(const std::vector<int>& coords, const std::vector<int>& shape);

// The ranks of the group through `rank` that varies along `axes` (indices
// into shape, distinct, any order) and keeps the other coordinates fixed, in
// sub-communicator rank order: row-major over `axes` in the order given.
// Example: group_of(5, {4, 2}, {0}) == {1, 3, 5, 7};
//          group_of(5, {2, 2, 2}, {2, 1}) == {4, 6, 5, 7}.
// Empty `axes`: {rank}. Throws InvalidArgument on a bad rank or axis.
std::vector<int> group_of(int rank, const std::vector<int>& shape, const std::vector<int>& axes);

// Every such group, ordered by the row-major index of the fixed coordinates
// (the other axes, in mesh order). Example: groups_along({4, 2}, {0}) ==
// {{0, 2, 4, 6}, {1, 3, 5, 7}}.
std::vector<std::vector<int>> groups_along(const std::vector<int>& shape, const std::vector<int>& axes);

// A text picture of the mesh. Validates first (throws like validate_mesh).
// Every line ends with '\n' and has no trailing spaces. Layout:
// - a title line: "mesh (data=4, tensor=2): 8 ranks";
// - 1-D: one row of cells; 2-D: a grid, rows along the first axis and columns
//   along the second, with the axis names and coordinates as headers and the
//   world rank in each cell; n-D: one such grid per index of the leading
//   n-2 axes, each under a heading like "pipeline=0:" ("a=0, b=1:" for 4-D);
// - one line per axis listing its groups:
//   "data groups (vary data, fixed tensor): [0 2 4 6] [1 3 5 7]".
// See mesh_test.cc for a complete example.
// Meshes of more than kMaxRenderRanks ranks get the title, a line saying the
// picture is left out, and one line per axis with the number and size of its
// groups instead of their members, so the text stays bounded (a 16M-rank
// mesh drew 1.2 GB).
inline constexpr int kMaxRenderRanks = 4096;
std::string render_mesh(const std::vector<int>& shape, const std::vector<std::string>& axis_names);

// ---- DeviceMesh -------------------------------------------------------------

class DeviceMesh {
 public:
  // Collective over `world`: every rank constructs its mesh with the same
  // shape and names. `world` is borrowed and must outlive the mesh.
  // Validates with validate_mesh(shape, axis_names, world.size()) before any
  // communication, so a bad shape raises the same InvalidArgument on every
  // rank. Then it checks that all ranks passed the same shape and names (one
  // all_gather of a 64-bit digest; InvalidArgument on every rank naming the
  // ranks that differ from rank 0) and splits one sub-communicator per axis,
  // in axis order. Sub-communicators inherit world.timeout().
  DeviceMesh(comm::Communicator& world, std::vector<int> shape, std::vector<std::string> axis_names);
  ~DeviceMesh();

  DeviceMesh(DeviceMesh&&) noexcept;
  DeviceMesh& operator=(DeviceMesh&&) noexcept;
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& axis_names() const { return axis_names_; }
  int size() const;                                           // world size == product of shape
  int rank() const;                                           // world rank
  const std::vector<int>& coords() const { return coords_; }  // of this rank

  std::vector<int> coords_of(int rank) const { return unravel(rank, shape_); }
  int rank_of(const std::vector<int>& coords) const { return ravel(coords, shape_); }

  // Position of `name` in axis_names(). Throws InvalidArgument listing the
  // valid names when there is no such axis.
  int axis_index(std::string_view name) const;
  int axis_size(std::string_view name) const { return shape_[axis_index(name)]; }
  // This rank's coordinate along `name` (== comm(name).rank()).
  int axis_rank(std::string_view name) const { return coords_[axis_index(name)]; }

  // The world communicator this mesh was built over.
  comm::Communicator& world() const { return *world_; }

  // The communicator of the ranks that share every coordinate with this rank
  // except along `axis`; its rank is axis_rank(axis), its size axis_size(axis).
  // Created in the constructor: calling this does not communicate. The mesh's
  // constness covers its shape, not the communicators' state.
  comm::Communicator& comm(std::string_view axis) const;

  // The communicator spanning several axes (distinct, any order): its ranks
  // are group_ranks(axes), ranked row-major over `axes` in the order given.
  // A single axis returns comm(axis); all axes in mesh order return world();
  // no axes, a communicator of this rank alone. Otherwise the first call for a
  // given list is collective over the world (a split): every rank must make
  // it, in the same order relative to the other collectives on world(). The
  // result is cached; later calls do not communicate.
  comm::Communicator& comm(const std::vector<std::string>& axes);
  // Makes `mesh.comm({"data", "tensor"})` and `mesh.comm({mesh::kData,
  // mesh::kTensor})` unambiguous (std::string has a two-pointer constructor
  // too).
  comm::Communicator& comm(std::initializer_list<std::string_view> axes) {
    return comm(std::vector<std::string>(axes.begin(), axes.end()));
  }

  // World ranks of this rank's group along `axes`, in that communicator's rank
  // order (see group_of). Pure computation; throws on unknown/repeated axes.
  std::vector<int> group_ranks(const std::vector<std::string>& axes) const;
  // Every group along `axes` (see groups_along).
  std::vector<std::vector<int>> all_groups(const std::vector<std::string>& axes) const;

  // Every communicator the mesh holds, named by its axes joined with '+' in
  // the order they were asked for ("data", "data+context"; "self" for no
  // axes): one per axis in mesh order, then the multi-axis ones made so
  // far, then "world". The same
  // list on every rank that made the same calls (traffic per axis:
  // Communicator::traffic).
  std::vector<std::pair<std::string, comm::Communicator*>> communicators() const;

  // render_mesh(shape(), axis_names()): the same text on every rank.
  std::string to_string() const;

 private:
  std::vector<int> axis_indices(const std::vector<std::string>& axes, const char* op) const;

  comm::Communicator* world_;  // borrowed
  std::vector<int> shape_;
  std::vector<std::string> axis_names_;
  std::vector<int> coords_;
  std::vector<std::unique_ptr<comm::Communicator>> axis_comms_;                  // one per axis
  std::map<std::vector<int>, std::unique_ptr<comm::Communicator>> group_comms_;  // by axis indices
};

}  // namespace meshtrain::mesh
