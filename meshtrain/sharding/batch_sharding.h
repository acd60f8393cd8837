// shard_batch_dim: every rank's slice of a batch along one mesh axis (the
// seeds' DevicePlacement.shard_batch_dim on the library's tensors).
//
//   void step(mesh::DeviceMesh& mesh) {  // (data=2, tensor=2)
//     Tensor images = load_global_batch();                 // (8, 784), the same on every rank
//     ShardedTensor x = shard_batch_dim(images, mesh);      // (4, 784): rows 0..3 on data=0
//     x.layout().spec();                                    // P(data, None)
//     auto batch = shard_batch_dim(std::map<std::string, Tensor>{{"images", images},
//                                                                {"labels", labels}}, mesh);
//   }
//
// Rules (docs/device-placement.md):
// - Dimension `batch_axis` is split over the mesh axis `mesh_axis`
//   (DataParallelStrategy(mesh_axis).batch_spec); every other mesh axis
//   replicates, so ranks that differ only there hold the same rows.
// - A 0-D tensor (a scalar: a step count, a loss scale) is replicated.
// - batch_axis >= ndim (of a tensor of 1 or more dims) is an error, not a
//   silent replication: replicating would hand every rank the whole batch.
// - The batch dimension must divide evenly by the axis size (InvalidArgument
//   naming both), unless allow_uneven: then the sharding layer's uneven rule
//   applies (layout.h: the first shards get ceil(N / k) rows, trailing ones
//   fewer, possibly none).
// Local: no communication. Every rank passes the same global tensor (as after
// a seeded, rank-independent load) and keeps a copy of its rows.
//
// Thread-safety: like distribute_replicated; call it on the mesh's thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "meshtrain/core/tensor.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/sharding/layout.h"
#include "meshtrain/sharding/sharded_tensor.h"

namespace meshtrain::sharding {

// The layout shard_batch_dim gives a tensor of `global_shape` (same rules
// and errors).
Layout batch_layout(mesh::DeviceMesh& mesh, const std::vector<int64_t>& global_shape, int batch_axis = 0,
                    const std::string& mesh_axis = std::string(mesh::kData), bool allow_uneven = false);

// This rank's rows of `batch` (a defined cpu tensor), as a ShardedTensor of
// batch_layout(...). Throws InvalidArgument when batch_axis < 0 or >= ndim
// (ndim >= 1), the mesh has no axis `mesh_axis` (listing its axes), or the
// batch does not divide evenly and !allow_uneven.
ShardedTensor shard_batch_dim(const Tensor& batch, mesh::DeviceMesh& mesh, int batch_axis = 0,
                              const std::string& mesh_axis = std::string(mesh::kData), bool allow_uneven = false);

// Every named tensor of a batch, by the same rules (the seeds' pytree); an
// error names the entry.
std::map<std::string, ShardedTensor> shard_batch_dim(const std::map<std::string, Tensor>& batch, mesh::DeviceMesh& mesh,
                                                     int batch_axis = 0,
                                                     const std::string& mesh_axis = std::string(mesh::kData),
                                                     bool allow_uneven = false);

}  // namespace meshtrain::sharding
