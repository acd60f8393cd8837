// A run against the memory of its devices (TrainConfig::device_memory,
// `--device-memory 24GiB`): the GPT's predicted peak per device
// (plan::predict_memory of the resolved layout, docs/planner.md) must fit
// the usable part, the device less plan's reserve (10%, as `meshtrain plan
// --devices` counts it). A resumed run (a launcher's restart on fewer
// devices) that no longer fits is re-planned with the planner's memory
// model, keeping what the user fixed: the model, the global batch, the
// tensor, pipeline, context and expert sizes; what may change, tried in
// this order (cheapest first on a CPU, where the planner's time model has
// no figures for the machine), the first that fits winning:
//   1. more micro-batches (2x, 4x, ... up to one sample each);
//   2. the data ranks shard the model: zero1, zero2, zero3 (the data axis
//      becomes an fsdp axis), each with 1. again; a run already sharded
//      tries the stages above its own;
//   3. recompute (each block's activations again in backward), with 1.-2.
// When nothing fits (or the run is not resumed) it stops with
// InvalidArgument naming --device-memory, the memory needed per device and
// the least the re-plan found.
//
//   std::vector<std::string> notes;
//   train::ResolvedTraining r = train::resolve_training(tc, dc);
//   r = train::fit_device_memory(r, dc, /*may_replan=*/!tc.resume.empty(), &notes);  // dc's mesh may change
//
// Models without a memory model (the mlp, the vae) are not checked (a note
// says so). Thread-safety: pure function of its arguments.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::train {

// A resumed run on another number of data-parallel ranks (mesh `before`,
// its last part's, -> `after`: data, node, fsdp and expert axes): each
// rank's share of the (unchanged) global batch changes, and the
// micro-batches follow so that each keeps its size (and memory), as a note
// says: on fewer ranks they multiply, on more (a node back) they divide
// back. Nothing when the count would not be whole.
void keep_micro_batch_size(TrainConfig& tc, const mesh::NamedShape& before, const mesh::NamedShape& after,
                           std::vector<std::string>* notes);

// The predicted peak per device of the resolved run, in bytes: the device
// that needs the most (0 for a model the planner does not describe).
double predicted_peak_bytes(const ResolvedTraining& resolved);

ResolvedTraining fit_device_memory(const ResolvedTraining& resolved, config::DistributedConfig& dc, bool may_replan,
                                   std::vector<std::string>* notes);

}  // namespace meshtrain::train
