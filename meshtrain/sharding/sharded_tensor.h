// ShardedTensor: this rank's block of a global tensor plus the Layout that
// says which block it is; distribute, gather, redistribute and the
// layout-invariant fills.
//
//   void step(mesh::DeviceMesh& mesh) {  // (data=2, tensor=2)
//     Layout rows(mesh, PartitionSpec::parse("data,None"), {8, 6});
//     ShardedTensor w = distribute(global, rows, /*src_rank=*/0);  // (4, 6) each
//     ShardedTensor cols = redistribute(w, PartitionSpec::parse("None,(data,tensor)"));
//     Tensor full = gather(cols);                                 // (8, 6) on every rank
//     fill_normal(w, /*seed=*/42, "layers.0.w", 0.0, 0.02);        // same bits as unsharded
//   }
//
// Local tensors are contiguous cpu tensors of any dtype; data moves as bytes,
// so every dtype redistributes exactly. Reductions (Partial axes) use the
// communicator's reduction for the dtype (see communicator.h).
//
// Partial layouts. Making a replicated value partial over an axis with op
// sum keeps it on the rank at coordinate 0 of that axis and zeroes the others;
// prod keeps it at coordinate 0 and puts ones elsewhere; avg, max and min keep
// it on every rank. distribute, distribute_replicated, the fills and
// redistribute's Replicate -> Partial steps all follow this rule, so gather
// gives back the original value (bit for bit for sum, prod, max and min; avg
// of n equal copies may round in the last bit for floats).
//
// Collectives: every function marked "collective" must be called by every
// rank of the layout's mesh with equal arguments (layouts, src/dst ranks);
// other ranks' tensors are only described by their layout. They run on the
// mesh's sub-communicators and may create (collectively, on first use) a
// multi-axis communicator through DeviceMesh::comm({axes}).
//
// Thread-safety: a ShardedTensor is a value handle like Tensor (copies share
// the local storage). Collective functions run on the mesh's thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/tensor.h"
#include "meshtrain/sharding/layout.h"

namespace meshtrain::sharding {

class ShardedTensor {
 public:
  ShardedTensor() = default;
  // Wraps this rank's block. Requires layout.mesh() (not a pure layout) and
  // local to be a defined, contiguous cpu tensor of shape
  // layout.local_shape(mesh rank); throws InvalidArgument otherwise.
  ShardedTensor(Tensor local, Layout layout);

  // Uninitialized / zero local blocks for `layout` on this rank.
  static ShardedTensor empty(const Layout& layout, DType dtype, MemoryTracker* tracker = nullptr,
                             MemoryCategory category = MemoryCategory::other);
  static ShardedTensor zeros(const Layout& layout, DType dtype, MemoryTracker* tracker = nullptr,
                             MemoryCategory category = MemoryCategory::other);

  bool defined() const { return local_.defined(); }
  const Tensor& local() const { return local_; }
  // Throws InvalidArgument when undefined.
  const Layout& layout() const;
  DType dtype() const { return local_.dtype(); }
  const std::vector<int64_t>& global_shape() const { return layout().global_shape(); }
  int rank() const { return layout().mesh()->rank(); }
  // This rank's block in global coordinates.
  Box local_box() const { return layout().local_box(rank()); }
  // "ShardedTensor(f32, Layout(...), local [0:4, 0:6])"
  std::string to_string() const;

 private:
  Tensor local_;
  std::optional<Layout> layout_;  // set when defined
};

// Every rank takes its block of a global tensor that all ranks hold
// identically (no communication). Requires global.shape() ==
// layout.global_shape(). A partial layout follows the rule in the header
// comment. The block is a copy (new storage).
ShardedTensor distribute_replicated(const Tensor& global, const Layout& layout);

// Collective. World rank `src_rank` holds the global tensor (other ranks pass
// any tensor, e.g. Tensor(), which is ignored) and sends every rank its block
// (point-to-point; broadcast when the engine lacks send/recv). Every rank
// throws InvalidArgument (src's names the shapes) when src's tensor is
// undefined, not on the cpu or not of the layout's global shape. Partial layouts follow the rule in the header comment.
ShardedTensor distribute(const Tensor& global, const Layout& layout, int src_rank);

inline constexpr int kAllRanks = -1;

// Collective. The global tensor, reduced over the partial axes. With
// dst_rank == kAllRanks every rank gets it (redistribute to replicated);
// otherwise only dst_rank does (the others get an undefined Tensor): partial
// axes are all-reduced, then one holder of each block sends it to dst.
Tensor gather(const ShardedTensor& t, int dst_rank = kAllRanks);

// Collective. The same global tensor in layout `to` (same mesh and global
// shape; a pure `to` is taken on t's mesh). Runs plan_redistribute(t.layout(),
// to) step by step: local slicing, all_gather, all_to_all, all_reduce and
// reduce_scatter on the steps' communicators, padding uneven blocks to equal
// counts. The result may share storage with t when no data moves (like
// Tensor::contiguous); clone() it to own the bytes.
ShardedTensor redistribute(const ShardedTensor& t, const Layout& to);
// The same with to = t.layout().with_spec(spec, {partial, t.layout().strict()}).
ShardedTensor redistribute(const ShardedTensor& t, const PartitionSpec& spec, const PartialAxes& partial = {});

// Layout-invariant initialization (docs/design.md, contract 1). Fills t's block so
// that, once gathered, the tensor equals meshtrain::fill_normal/fill_uniform
// of the unsharded tensor with key_from_name(name), bit for bit, whatever the
// layout: each local row is the run of global row-major indices it covers.
// Floating dtypes only (InvalidArgument otherwise). Partial layouts follow
// the rule in the header comment. Local; no communication.
void fill_normal(ShardedTensor& t, uint64_t seed, std::string_view name, double mean, double std);
void fill_uniform(ShardedTensor& t, uint64_t seed, std::string_view name, double lo, double hi);

}  // namespace meshtrain::sharding
