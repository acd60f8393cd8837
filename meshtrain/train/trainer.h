// The training loop behind `meshtrain train`: any registered model recipe
// (model_recipe.h; built in: an MLP classifier or a VAE on Fashion-MNIST),
// data parallel over the mesh's "data" and "fsdp" axes, on any engine,
// through one parallel::Parallelism (parallelism.h): plain data parallelism
// (parallel::DataParallel, f32) or fully sharded data parallelism
// (parallel::FullyShardedDataParallel: ZeRO-1/2/3, hybrid sharding,
// bf16/fp16 mixed precision with dynamic loss scaling).
//
//   TrainConfig tc = TrainConfig::from_toml_file("examples/mlp_fashion.toml");
//   config::DistributedConfig dc = ...;   // mesh, engine, world size
//   TrainResult r = run_training(tc, dc, {.engine = Engine::threads, .ranks = 4});
//
// Every rank runs the same loop; rank 0 alone prints (config dump, progress
// bar, epoch summaries) and writes the run directory: config.toml,
// metrics.jsonl, model.safetensors, trainer_state.json (trainer_state.h),
// loss.svg and the recipe's own files (the VAE: reconstructions.png and
// samples.png; the GPT: sample.txt and tokenizer.model). The run directory (run_dir.h) holds
// one complete run: a directory holding a run is refused unless
// tc.overwrite; files are staged in "<run_dir>.incomplete" and swapped in
// when the run succeeds, so a failed run leaves run_dir as it was.
//
// Training that goes wrong stops (TrainingDiverged, on every rank at the
// same step, since each decision is made from globally reduced values):
// - non-finite parameters (checked before every step and before saving);
// - a non-finite loss or gradients with on_nonfinite = "error" (the
//   default); with "skip" the optimizer step is skipped and counted;
// - fp16: gradients that overflow at the loss scale are the scaler's: the
//   step is skipped, the scale backs off, a line is printed;
// - max_consecutive_skips skipped steps in a row (either kind).
//
// Schedule: the cosine schedule spans lr_decay_steps, or every step of
// `epochs` epochs; max_steps stops the run early without changing it, so a
// short run's losses are a prefix of the full run's.
//
// Data-parallel ranks: the group mesh.comm({"data", "fsdp"}) (the axes the
// mesh has); a "tensor" axis splits the model inside each stage, a
// "pipeline" axis cuts it into stages (tc.pipeline_schedule, virtual_stages;
// one data-parallel strategy per stage, combined by
// parallel::PipelineParallel; internal/pipeline_run.h runs them); every
// other axis must have size 1. Non-hybrid strategies shard
// over that whole group; hybrid_* shard over "fsdp" and replicate over
// "data" (both axes required).
//
// Exactness: each rank's loss is normalized by the GLOBAL batch size and the
// data-parallel gradients are summed, so any data-parallel degree computes
// the same gradient as one device (up to float summation order); dropout
// masks and VAE noise are keyed by the global sample index (recipes get it
// as Batch::first_global_sample).
//
// BLAS threads: one process-wide setting, cores / ranks-in-this-process (at
// least 1) unless threads_per_rank is given, so ranks never oversubscribe
// the machine with BLAS pools.
// Thread-safety: call from one thread.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/layout/training_layout.h"
#include "meshtrain/parallel/parallelism.h"
#include "meshtrain/train/stop.h"
#include "meshtrain/train/train_config.h"
#include "meshtrain/train/trainer_state.h"

namespace meshtrain::train {

// One communicator's use of one operation (comm::Communicator::traffic).
struct TrafficRecord {
  std::string group;  // its mesh axes joined by '+' ("data+context"), or "world"
  comm::CollectiveOp op = comm::CollectiveOp::all_reduce;
  uint64_t calls = 0, bytes = 0;
};

// A run stopped because its numbers went wrong (see above); what() names
// the step, the value and what to try.
class TrainingDiverged : public Error {
 public:
  using Error::Error;
};

struct TrainResult {
  int64_t steps = 0;
  double seconds = 0;             // wall time of the training loop (rank 0)
  double samples_per_second = 0;  // training samples / seconds
  std::string rate_unit;          // the recipe's rate unit ("tokens"), "" = samples
  double units_per_second = 0;    // samples_per_second in that unit
  double final_train_loss = 0;    // mean loss of the last logged window
  double test_loss = 0;           // after the last epoch (VAE: the sampled negative ELBO, nats per image)
  // Every test metric of the last evaluation, as in metrics.jsonl; the
  // three below repeat the ones named "accuracy", "reconstruction" and
  // "kl" (0 when the recipe has none).
  std::vector<std::pair<std::string, double>> test_metrics;
  double test_accuracy = 0;       // MLP
  double test_reconstruction = 0; // VAE: the reconstruction term of test_loss
  double test_kl = 0;             // VAE: the KL term of test_loss
  std::string test_summary;       // the recipe's final line, e.g. "test accuracy 89.35% (test loss 0.3046)"
  std::vector<std::string> artifacts;  // the recipe's own files in run_dir (the VAE's pictures), and expert_load.svg
  int64_t schedule_steps = 0;     // the learning-rate schedule's length
  double hidden_fraction = 0;     // data-parallel communication hidden behind backward (mean)
  std::vector<double> step_losses;  // every step's global loss
  TrainerState state;               // where the run stands after its last step (trainer_state.json)
  std::string run_dir;
  std::string fsdp;               // the resolved strategy as named ("" = DataParallel)
  std::string parallelism;        // Parallelism::describe(), e.g. "data parallel 2, fsdp full (... 3 units)"
  double loss_scale = 0;          // fp16: the loss scale at the end; 0 without a scaler
  int64_t skipped_steps = 0;      // optimizer steps skipped (fp16 overflows, non-finite with on_nonfinite = skip)
  // Rank 0's MemoryTracker peaks over the run, per category (indexed by
  // MemoryCategory) and of the total.
  std::array<uint64_t, kNumMemoryCategories> memory_peak{};
  uint64_t memory_total_peak = 0;
  // Every rank's peak through the training steps before the first
  // evaluation (what the planner's predictions are checked against), by
  // world rank: what each category held at that peak, then the total.
  std::vector<std::array<uint64_t, kNumMemoryCategories + 1>> train_memory_by_rank;
  // Rank 0's wall time of each training step (a step ends with the global
  // loss, which every rank waits for), in order.
  std::vector<double> step_seconds;
  // Every rank's communication through the same steps (traffic_steps of
  // them), by world rank: the (communicator, operation) pairs it used
  // (mesh::DeviceMesh::communicators names them), what the planner's
  // traffic model is checked against.
  std::vector<std::vector<TrafficRecord>> traffic_by_rank;
  int64_t traffic_steps = 0;
  // Every rank's holdings at the start of training, by world rank:
  // Parallelism::parameter_shards() (the placement rule,
  // layout/placement_rule.h, must give the same).
  std::vector<std::vector<parallel::ParamShard>> placements_by_rank;
  // A pipeline axis: the schedule's name, the idle share of the last step
  // measured from every pipeline rank's timeline (pipeline.svg) beside the
  // schedule's theory, and the most micro-batches whose activations rank 0
  // held at once in that step.
  std::string pipeline_schedule;
  double pipeline_bubble = 0;
  double pipeline_bubble_theory = 0;
  int pipeline_peak_in_flight = 0;
  // Rank 0: every parameter's final f32 value (full, unsharded), in the
  // model's parameter order; what model.safetensors holds.
  std::vector<std::pair<std::string, Tensor>> final_parameters;
};

// What run_training really runs, for the start-up dump: `config` is tc with
// fsdp resolved (an fsdp mesh axis > 1 without a strategy -> "full"; mixed
// precision without one -> "no_shard", since the DataParallel path is f32
// only), and `notes` says which defaults were applied and why. Throws
// Unsupported for a mesh axis other than data/fsdp/tensor/pipeline of
// size > 1 or zero3 with a pipeline axis (an interleaved schedule without
// virtual_stages gets 2, noted), and
// InvalidArgument for a hybrid strategy without both axes, or a config
// that does not validate (an unknown model lists the registered recipes).
struct ResolvedTraining {
  TrainConfig config;
  std::vector<std::string> notes;
  // The training layout the run uses (the mesh and each axis's strategy),
  // built here once from config and dc; the trainer, the placement rule
  // and the planner read it.
  layout::TrainingLayout layout;
};
ResolvedTraining resolve_training(const TrainConfig& tc, const config::DistributedConfig& dc);

// Resolves tc (resolve_training), prepares the run directory (world rank 0;
// tc.run_dir, or the next runs/<model>/version_<N> when empty), writes
// config.toml and trains. Collective: every process of the job calls it.
// The result is filled by world rank 0 (under mpirun the other processes
// get an empty one). Throws TrainingDiverged (see above), InvalidArgument
// for a run directory that holds a run, or what the run threw; then
// run_dir is left as it was. `stop` (stop.h), when given and requested,
// ends the run after the step every rank agrees on, with a checkpoint
// when checkpoint_every is set, and TrainingInterrupted.
TrainResult run_training(const TrainConfig& tc, const config::DistributedConfig& dc,
                         const comm::LaunchOptions& launch, const StopRequest* stop = nullptr);
// The same for a configuration resolve_training already resolved (as
// `meshtrain train` does, to print it before the run): it is not resolved
// again.
TrainResult run_training(const ResolvedTraining& resolved, const config::DistributedConfig& dc,
                         const comm::LaunchOptions& launch, const StopRequest* stop = nullptr);

}  // namespace meshtrain::train
