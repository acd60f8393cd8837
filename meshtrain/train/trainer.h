// The training loop behind `meshtrain train`: an MLP classifier or a VAE on
// Fashion-MNIST, data parallel over the mesh's "data" axis, on any engine.
//
//   TrainConfig tc = TrainConfig::from_toml_file("examples/mlp_fashion.toml");
//   config::DistributedConfig dc = ...;   // mesh, engine, world size
//   TrainResult r = run_training(tc, dc, {.engine = Engine::threads, .ranks = 4});
//
// Every rank runs the same loop; rank 0 alone prints (config dump, progress
// bar, epoch summaries) and writes the run directory: config.toml,
// metrics.jsonl, model.safetensors, loss.svg and, for the VAE,
// reconstructions.png and samples.png.
//
// Exactness: each rank's loss is normalized by the GLOBAL batch size and the
// data-parallel gradients are summed, so any data-parallel degree computes
// the same gradient as one device (up to float summation order); dropout
// masks and VAE noise are keyed by the global sample index.
//
// BLAS threads: one process-wide setting, cores / ranks-in-this-process (at
// least 1) unless threads_per_rank is given, so ranks never oversubscribe
// the machine with BLAS pools.
// Thread-safety: call from one thread.
#pragma once

#include <string>

#include "meshtrain/comm/launch.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/train/train_config.h"

namespace meshtrain::train {

struct TrainResult {
  int64_t steps = 0;
  double seconds = 0;             // wall time of the training loop (rank 0)
  double samples_per_second = 0;  // training samples / seconds
  double final_train_loss = 0;    // mean loss of the last logged window
  double test_loss = 0;           // after the last epoch
  double test_accuracy = 0;       // MLP only
  double hidden_fraction = 0;     // data-parallel communication hidden behind backward (mean)
  std::vector<double> step_losses;  // every step's global loss
  std::string run_dir;
};

TrainResult run_training(const TrainConfig& tc, const config::DistributedConfig& dc,
                         const comm::LaunchOptions& launch);

}  // namespace meshtrain::train
