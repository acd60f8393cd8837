// How the trainer reads the mesh and the configuration (train/trainer.cc,
// resolve_training.cc): which axes split the batch and which sum the
// gradients, the data-parallel strategy over them, and the start-up dump's
// tensor-parallel table. Not for use outside train.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/layout/training_layout.h"
#include "meshtrain/core/dtype.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/parallel/parallelism.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/train/train_config.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::train::internal {

// The axes the mesh has of `names`, in that order; Unsupported for an axis
// of size > 1 training has no use for (data, fsdp, context, tensor and
// pipeline are used).
std::vector<std::string> mesh_axes(const mesh::NamedShape& m, std::initializer_list<std::string_view> names);
// The batch is split over data, node, fsdp and expert; losses (and the
// replicated parameters' gradients) are summed over those and context
// (each context rank sees its own tokens of the same samples). The
// data-parallel strategy runs over the replica axes, the ranks that hold
// the same parameters: all of those but expert (an expert rank holds its
// own experts; parallel::ExpertParallel adds the rest over the expert axis).
std::vector<std::string> data_parallel_axes(const mesh::NamedShape& m);
std::vector<std::string> gradient_axes(const mesh::NamedShape& m);
std::vector<std::string> replica_axes(const mesh::NamedShape& m);
// The size of axis `name`; 0 when absent.
int axis_size(const mesh::NamedShape& m, std::string_view name);

// The strategy the layout asks for over the data-parallel ranks dp_comm:
// fully sharded (layout.fsdp, its precision and ZeRO++ parts; hybrid: shard
// over fsdp, replicate over data) or plain data parallelism; tc gives the
// scheduling options (prefetch, buckets, quantization codes). Collective
// (the wrappers broadcast and check the parameters).
std::unique_ptr<parallel::Parallelism> make_parallelism(const TrainConfig& tc, const layout::TrainingLayout& layout,
                                                       nn::Module& model, std::vector<nn::Module*> units,
                                                       mesh::DeviceMesh& mesh, comm::Communicator& dp_comm,
                                                       MemoryTracker* memory);

// The communicators training uses, named for TrainResult::traffic_by_rank:
// the mesh's (DeviceMesh::communicators), then the strategy's own
// (Parallelism::own_communicators: "tied" where a pipeline sums tied
// gradients; every rank lists it, null where it holds no tied stage).
using NamedComms = std::vector<std::pair<std::string, comm::Communicator*>>;
NamedComms training_communicators(const mesh::DeviceMesh& mesh, const parallel::Parallelism& strategy);
// Zeroes their traffic counters.
void reset_traffic(const NamedComms& comms);
// After the first epoch's training steps (collective over the world): every
// rank's memory peaks (MemoryTracker::at_total_peak) and traffic since
// reset_traffic into *result (rank 0's; null on the others):
// train_memory_by_rank, traffic_by_rank, traffic_steps.
void record_training_figures(const MemoryTracker& memory, const NamedComms& comms, comm::Communicator& world,
                             TrainResult* result);

// Collective over `world`: every rank's strategy->parameter_shards() into
// result->placements_by_rank (rank 0's; null on the others).
void gather_placements(const parallel::Parallelism& strategy, comm::Communicator& world, TrainResult* result);

// How a tensor axis splits the model, as rank 0 holds it: one line per
// parameter (layers placed alike folded: nn::fold_layer_rows), its block and
// the global shape it lies in, or "replicated" ("replicated,
// sequence-parallel gradient" for the partial ones).
std::string tensor_parallel_summary(const std::vector<nn::Parameter*>& params, const nn::TensorParallelGroup& tp);

}  // namespace meshtrain::train::internal
