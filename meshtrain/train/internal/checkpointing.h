// The trainer's side of checkpoints (checkpoint.h): what a rank holds as
// pieces of global tensors, the trainer's own state beside them, and
// putting a loaded checkpoint back into a wrapped model and its optimizer.
//
// The tensors: for every parameter the optimizer updates on this rank (a
// whole parameter, a tensor-parallel block, a fully sharded flat shard, or
// a flat shard of a block), "model/<name>" (its f32 master) and
// "optim/<name>/<field>" (AdamW's exp_avg and exp_avg_sq, SGD's
// momentum_buffer), each piece placed where the optimizer's parameter's
// Placement says (under fsdp: the model parameter's, narrowed to the flat
// range this rank owns). Optimizer
// step counts are one number (every parameter is updated on every applied
// step), kept in the metadata. Gradients are not saved: a checkpoint is
// taken between steps, when they are zero.
//
// Thread-safety: one rank's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/nn/module.h"
#include "meshtrain/optim/loss_scaler.h"
#include "meshtrain/optim/optimizer.h"
#include "meshtrain/checkpoint/async_save.h"
#include "meshtrain/checkpoint/checkpoint.h"

namespace meshtrain::train::internal {

// The checkpoint layer's format and files (checkpoint/checkpoint.h).
using checkpoint::CheckpointIndex;
using checkpoint::CheckpointPiece;
using checkpoint::CheckpointSaveStats;
using checkpoint::copy_region;
using checkpoint::latest_checkpoint;
using checkpoint::load_checkpoint_pieces;
using checkpoint::read_checkpoint_index;
using checkpoint::save_checkpoint;

// What the trainer keeps beside the tensors.
struct ResumePoint {
  int64_t step = 0;               // optimizer steps taken, skipped ones included
  int64_t skipped_steps = 0;
  int64_t consecutive_skips = 0;
  int64_t optimizer_steps = 0;    // updates applied (each parameter's step count)
  std::optional<optim::DynamicLossScaler::State> scaler;
  std::string model;              // the recipe's name ("mlp", "gpt")
  std::string saved_from;         // the mesh and strategy, for messages
  std::string dir;                // where it was loaded from (not saved)
  std::string to_json() const;
  static ResumePoint from_json(const std::string& text, const std::string& source);
};

class TrainingCheckpoint {
 public:
  // `params`: what the optimizer updates (Parallelism::optimizer_parameters());
  // `buffers`: state outside the optimizer that a resumed run needs (a MoE
  // layer's selection bias), whole f32 tensors by name, loaded in place
  // ("buffer/<name>" pieces; ranks that hold the same one write it once).
  TrainingCheckpoint(std::vector<nn::Parameter*> params, optim::Optimizer& opt,
                     std::vector<std::pair<std::string, Tensor>> buffers = {});

  // This rank's pieces, their data viewing the live tensors (valid until the
  // next optimizer step). Throws InvalidArgument when the parameters' step
  // counts differ or differ from `point.optimizer_steps`.
  std::vector<CheckpointPiece> pieces(const ResumePoint& point) const;
  // Overwrites the masters and the optimizer state from the checkpoint
  // (every piece this rank needs); call Parallelism::after_step() next to
  // publish the masters. IoError as load_checkpoint_pieces.
  void load(const CheckpointIndex& index, const ResumePoint& point);
  // Collective over `world`: this rank's pieces and `point` as the
  // checkpoint of point.step under `root` (checkpoint.h's save_checkpoint);
  // returns what it did.
  CheckpointSaveStats save(comm::Communicator& world, const std::string& root, const ResumePoint& point, int keep_last) const;
  // Loads the newest checkpoint under `root` (see load) and returns its
  // point (dir set). IoError when there is none; InvalidArgument when it is
  // of a model other than `model`.
  ResumePoint resume(const std::string& root, const std::string& model);
  // Overwrites the masters from whole tensors by name (--init-from: a file
  // in meshtrain's names and layout, export.h's load_model_file); the
  // optimizer state stays fresh. IoError naming `source` and the tensor for
  // one the model has that `tensors` lacks or holds with another shape;
  // returns, per tensor, 1 when this rank took a part of it, else 0.
  std::vector<int32_t> load_model(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                  const std::string& source);

 private:
  std::vector<nn::Parameter*> params_;
  std::vector<std::pair<std::string, Tensor>> buffers_;
  optim::Optimizer* opt_;
};

// The run's saves: synchronous, or with --async-checkpoint written in the
// background (checkpoint/async_save.h) once the previous one has finished.
// Each call returns the progress lines of the saves it saw finish
// ("checkpoint of step 20: 117.52 MiB written in 0.31 s ...").
class CheckpointWriter {
 public:
  // Collective when `async` (it splits a communicator off `world` for the
  // background saves).
  CheckpointWriter(comm::Communicator& world, std::string root, int keep_last, bool async);
  // Collective: saves `point` of `ckpt`, or starts saving it in the
  // background; `last` (the run's final or interrupted save) finishes it
  // before returning.
  std::vector<std::string> save(const TrainingCheckpoint& ckpt, const ResumePoint& point, bool last);
  // Waits for the background save in flight, if any (rethrowing its error).
  std::vector<std::string> finish();

 private:
  comm::Communicator* world_;
  std::string root_;
  int keep_last_;
  std::unique_ptr<checkpoint::AsyncCheckpointSaver> saver_;  // async only
  double blocked_s_ = 0;  // how long starting the save in flight held the step
};

// Collective over `world`: runs `load` on every rank; when it fails
// anywhere, every rank throws before any other collective, so no rank is
// left waiting: a failing one prints its error to stderr first ("meshtrain:
// rank 1: <the file, the tensor>", on every engine, whichever error the job
// then ends with) and throws it, the others throw IoError naming `what` and
// the lowest failing rank. `flags` comes back max-reduced over the ranks.
void on_every_rank(comm::Communicator& world, const std::string& what, std::vector<int32_t>& flags,
                   const std::function<void()>& load);

}  // namespace meshtrain::train::internal
