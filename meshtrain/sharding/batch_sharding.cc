#include "meshtrain/sharding/batch_sharding.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "meshtrain/core/error.h"

namespace meshtrain::sharding {
namespace {

constexpr const char* kOp = "shard_batch_dim";

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("({})", fmt::join(shape, ", ")); }

}  // namespace

Layout batch_layout(mesh::DeviceMesh& mesh, const std::vector<int64_t>& global_shape, int batch_axis,
                    const std::string& mesh_axis, bool allow_uneven) {
  const auto& axes = mesh.axis_names();
  if (std::find(axes.begin(), axes.end(), mesh_axis) == axes.end())
    throw InvalidArgument(kOp, fmt::format("the mesh ({}) has no axis '{}'", fmt::join(axes, ", "), mesh_axis),
                          "pass mesh_axis naming one of the mesh's axes");
  const int ndim = static_cast<int>(global_shape.size());
  if (ndim == 0) return Layout(mesh, PartitionSpec::replicated(0), global_shape);  // a scalar: replicated
  if (batch_axis < 0 || batch_axis >= ndim)
    throw InvalidArgument(
        kOp,
        fmt::format("batch_axis {} is not a dimension of a tensor of shape {}", batch_axis, shape_string(global_shape)),
        fmt::format("pass 0 <= batch_axis < {} (replicating instead would give every rank the "
                    "whole batch)",
                    ndim));
  const int64_t rows = global_shape[batch_axis];
  const int shards = mesh.axis_size(mesh_axis);
  if (!allow_uneven && rows % shards != 0)
    throw InvalidArgument(kOp,
                          fmt::format("batch dimension {} of shape {} has {} rows, not divisible by mesh axis '{}' "
                                      "of size {}",
                                      batch_axis, shape_string(global_shape), rows, mesh_axis, shards),
                          fmt::format("use a batch that is a multiple of {} (e.g. {}), or allow_uneven to give the "
                                      "first ranks one row more",
                                      shards, (rows / shards + 1) * shards));
  std::vector<std::vector<std::string>> dims(ndim);
  dims[batch_axis] = {mesh_axis};
  return Layout(mesh, PartitionSpec(std::move(dims)), global_shape);
}

ShardedTensor shard_batch_dim(const Tensor& batch, mesh::DeviceMesh& mesh, int batch_axis, const std::string& mesh_axis,
                              bool allow_uneven) {
  if (!batch.defined())
    throw InvalidArgument(kOp, "the batch tensor is undefined", "pass the global batch, the same on every rank");
  return distribute_replicated(batch, batch_layout(mesh, batch.shape(), batch_axis, mesh_axis, allow_uneven));
}

std::map<std::string, ShardedTensor> shard_batch_dim(const std::map<std::string, Tensor>& batch, mesh::DeviceMesh& mesh,
                                                     int batch_axis, const std::string& mesh_axis, bool allow_uneven) {
  std::map<std::string, ShardedTensor> out;
  for (const auto& [name, tensor] : batch) {
    try {
      out.emplace(name, shard_batch_dim(tensor, mesh, batch_axis, mesh_axis, allow_uneven));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(kOp, fmt::format("entry '{}': {}", name, e.detail()), e.hint());
    }
  }
  return out;
}

}  // namespace meshtrain::sharding
