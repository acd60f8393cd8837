// Checkpoints saved while training goes on (torch.distributed.checkpoint's
// async_save): the caller's pieces are copied into staging memory, and a
// thread of the saver's own runs save_checkpoint (checkpoint.h) on them over
// a communicator of its own, so the slow part of a save (writing, fsync,
// reading back, the commit) overlaps the next steps.
//
//   AsyncCheckpointSaver saver(world.split(0, world.rank()));  // collective, once
//   ...
//   saver.start("RUN/checkpoints", step, pieces, metadata, {.keep_last = 3});
//   // train on: the pieces' tensors may change now
//   if (std::optional<CheckpointSaveStats> done = saver.wait()) ...  // before the next start, at the end
//
// Semantics: a checkpoint is complete (and `latest` names it) only once its
// save has finished: a crash before that leaves the previous checkpoint as
// the newest (the save's temporary directory is removed by the next save,
// as after a crash in a synchronous one). start() waits for the previous
// save first, so at most one runs at a time and the checkpoints complete in
// order. A save that fails (on any rank) is rethrown by the next wait() or
// start() on every rank, as save_checkpoint throws it. The staging copy is as
// large as the pieces (the rank's masters and optimizer state) and lives
// until the save finishes; no MemoryTracker is charged for it.
//
// Thread-safety: one rank's thread calls it; the communicator must be used
// by nothing else (split one off the job's). The destructor waits for a save
// in flight and drops its error (a save waiting for a rank that failed ends
// when the job's engine aborts, or at the communicator's deadline).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/checkpoint/checkpoint.h"
#include "meshtrain/comm/communicator.h"

namespace meshtrain::checkpoint {

class AsyncCheckpointSaver {
 public:
  // `world`: the saves' communicator, the job's ranks in the same order.
  explicit AsyncCheckpointSaver(std::unique_ptr<comm::Communicator> world);
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Waits for the save in flight (rethrowing its error), copies `pieces`'
  // data and starts saving step `step` under `root`; returns the finished
  // save's stats, if there was one. Collective like save_checkpoint: every
  // rank calls it for the same step.
  std::optional<CheckpointSaveStats> start(const std::string& root, int64_t step,
                                           const std::vector<CheckpointPiece>& pieces, std::string metadata,
                                           CheckpointOptions options = {});
  // Waits for the save in flight and returns its stats (nullopt when none
  // was in flight); rethrows its error.
  std::optional<CheckpointSaveStats> wait();
  // The step of the save in flight, if any.
  std::optional<int64_t> in_flight() const { return step_; }

 private:
  std::unique_ptr<comm::Communicator> world_;
  std::thread thread_;
  std::optional<int64_t> step_;
  std::vector<CheckpointPiece> staged_;
  CheckpointSaveStats stats_;
  std::exception_ptr error_;
};

}  // namespace meshtrain::checkpoint
