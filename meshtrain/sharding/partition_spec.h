// PartitionSpec and AxisPlacement: how a tensor's dimensions map onto mesh axes.
//
//   // A (batch, hidden) activation on a (data=4, tensor=2) mesh: batch split
//   // over data, hidden over tensor.
//   PartitionSpec spec({{"data"}, {"tensor"}});          // P(data, tensor)
//   PartitionSpec fsdp_tp({{"data", "fsdp"}, {}});        // P((data, fsdp), None)
//   PartitionSpec parsed = PartitionSpec::parse("(data,fsdp),None");
//   auto placements = to_placements(spec, {"data", "tensor"});  // [S(0), S(1)]
//
// A spec has one entry per tensor dimension: the mesh axes that dimension is
// split over, empty for none. A dimension split over several axes is split
// row-major over them in the order listed (the first is the most
// significant), as in JAX. A mesh axis may appear at most once in a spec.
//
// Axis placements are the per-mesh-axis view (PyTorch DTensor's Placement;
// here AxisPlacement, since sharding::Placement (placement.h) is what one
// rank holds of a parameter): for every mesh axis, Shard(d), Replicate, or
// Partial(op) (each rank holds a partial value
// still to be reduced with op over that axis). A spec cannot say Partial; a
// Layout adds it. to_placements/from_placements convert between the two; when
// several axes shard one dimension, placements alone lose their order, so
// from_placements orders them as the mesh does (the order to_placements
// produces for specs that list them in mesh order).
//
// Thread-safety: immutable values.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::sharding {

class PartitionSpec {
 public:
  PartitionSpec() = default;
  // dims[d] = the mesh axes tensor dimension d is split over.
  explicit PartitionSpec(std::vector<std::vector<std::string>> dims);
  // All dimensions unsplit.
  static PartitionSpec replicated(int ndim);
  // "data,tensor", "None,tensor", "(data,fsdp),None", "data+fsdp,_": one
  // comma-separated entry per dimension; an entry is None, _ or empty (not
  // split), an axis name, or several joined by + or grouped in parentheses.
  // Throws InvalidArgument on a malformed spec or an axis used twice.
  static PartitionSpec parse(std::string_view text);

  int ndim() const { return static_cast<int>(dims_.size()); }
  const std::vector<std::string>& axes(int dim) const;
  const std::vector<std::vector<std::string>>& dims() const { return dims_; }
  // Every axis the spec uses, in dimension order.
  std::vector<std::string> used_axes() const;
  // The dimension split over `axis`, or -1.
  int dim_of(const std::string& axis) const;
  bool is_replicated() const { return used_axes().empty(); }

  // Throws InvalidArgument naming the problem: ndim differs from the tensor's,
  // an axis is not in the mesh (listing the mesh's axes).
  void validate(const std::vector<std::string>& mesh_axes, int tensor_ndim) const;

  // "P(data, None, (fsdp, tensor))"
  std::string to_string() const;
  bool operator==(const PartitionSpec&) const = default;

 private:
  std::vector<std::vector<std::string>> dims_;
};

struct AxisPlacement {
  enum class Kind : uint8_t { replicate, shard, partial };
  Kind kind = Kind::replicate;
  int dim = -1;                             // shard
  comm::ReduceOp reduce = comm::ReduceOp::sum;  // partial

  static AxisPlacement Replicate() { return {}; }
  static AxisPlacement Shard(int d) { return {Kind::shard, d, comm::ReduceOp::sum}; }
  static AxisPlacement Partial(comm::ReduceOp op = comm::ReduceOp::sum) { return {Kind::partial, -1, op}; }
  bool is_shard() const { return kind == Kind::shard; }
  bool is_replicate() const { return kind == Kind::replicate; }
  bool is_partial() const { return kind == Kind::partial; }
  // "S(0)", "R", "P(sum)"
  std::string to_string() const;
  bool operator==(const AxisPlacement&) const = default;
};

// One placement per mesh axis (Shard(d) where the spec splits d over the axis,
// else Replicate).
std::vector<AxisPlacement> to_placements(const PartitionSpec& spec, const std::vector<std::string>& mesh_axes);
// The spec of placements (Partial entries are dropped: see Layout); a
// dimension sharded by several axes lists them in mesh order.
PartitionSpec from_placements(const std::vector<AxisPlacement>& placements, const std::vector<std::string>& mesh_axes,
                              int tensor_ndim);

}  // namespace meshtrain::sharding
