// The small GPT run that gpt_parity_test (threads) and
// gpt_parity_mpi_test (mpirun) train: 2 blocks of width 32 on the fortunes
// "computers" file (238 KB of English, BPE vocabulary 512), 16-token
// windows, batch 8, 30 steps.
#pragma once

#include <filesystem>
#include <string>

#include "meshtrain/train/train_config.h"

namespace meshtrain {

inline constexpr int64_t kGptParitySteps = 30;

// SGD with momentum unless told: the key projection's bias has an exactly
// zero gradient (softmax is invariant to it), so AdamW's g / sqrt(v) would
// turn last-bit summation-order noise into steps of size lr.
inline train::TrainConfig gpt_parity_config(const std::string& tag, const std::string& optimizer = "sgd") {
  train::TrainConfig tc;
  tc.model = "gpt";
  tc.corpus = "/usr/share/games/fortunes/computers";
  tc.text_cache = MESHTRAIN_TEXT_CACHE;  // the build tree's cache, shared by the tests
  tc.vocab = 512;
  tc.context = 16;
  tc.layers = 2;
  tc.heads = 4;
  tc.width = 32;
  tc.batch_size = 8;
  tc.optimizer = optimizer;
  tc.lr = optimizer == "sgd" ? 0.1 : 1e-3;
  tc.max_steps = kGptParitySteps;
  tc.lr_decay_steps = kGptParitySteps;
  tc.epochs = 1;
  tc.log_every = 10;
  tc.threads_per_rank = 1;
  tc.dropout = 0.1;              // masks keyed by the global sample: the same on any layout
  tc.fsdp_min_weight_size = 64;  // shard every matrix, replicate biases and norms
  tc.run_dir = (std::filesystem::temp_directory_path() / ("meshtrain_gpt_parity_" + tag)).string();
  tc.overwrite = true;  // the previous test run's directory
  return tc;
}

}  // namespace meshtrain
