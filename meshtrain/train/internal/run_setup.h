// The run directory's set-up at the start of run_training (trainer.cc).
// Not for use outside train.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::train::internal {

// World rank 0 creates (or resumes) the run directory into `dir` and writes
// config.toml into it (the resolved [train] table, its notes, and the
// [distributed] one); every rank learns whether that worked (under mpirun a
// refusal seen by rank 0 alone would leave the others waiting in their
// first collective) and where checkpoints go (`checkpoints`, one file
// system). `artifacts`: the recipe's own files, which create() may replace
// with --overwrite. Collective over `world`. Returns false on the ranks that
// must stop quietly because rank 0 failed; rank 0 rethrows its error.
bool prepare_run_directory(comm::Communicator& world, const ResolvedTraining& resolved,
                           const config::DistributedConfig& dc, const std::vector<std::string>& artifacts,
                           std::optional<RunDirectory>& dir, std::string& checkpoints);

}  // namespace meshtrain::train::internal
