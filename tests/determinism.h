// The deterministic mode's test runs (tests/determinism_test.cc on the
// threads engine, tests/determinism_mpi_main.cc on mpi and gloo): one
// configuration each for the MLP and a small GPT, and a run's model file.
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "meshtrain/train/train_config.h"

namespace meshtrain::testing {

// The MLP on Fashion-MNIST: 20 steps of AdamW (which turns any last-bit
// difference into a visible one), dropout keyed by global sample, 128
// samples in 8 blocks of 16 (one per rank on data=8); 4 layers, so 4 stages
// for the interleaved schedule. `tag` names its run directory.
inline train::TrainConfig deterministic_mlp(const std::string& tag) {
  train::TrainConfig tc;
  tc.model = "mlp";
  tc.hidden = {128, 64, 32};
  tc.dropout = 0.1;
  tc.batch_size = 128;
  tc.deterministic = true;
  tc.deterministic_block = 16;
  tc.max_steps = 20;
  tc.epochs = 1;
  tc.log_every = 1000;
  tc.threads_per_rank = 1;
  tc.run_dir = (std::filesystem::temp_directory_path() / ("meshtrain_determinism_" + tag)).string();
  tc.overwrite = true;
  return tc;
}

// A small GPT-2 on the fortunes: 8 samples of 32 tokens, one sample per
// block (32 rows), the GPT tests' shared tokenizer cache.
inline train::TrainConfig deterministic_gpt(const std::string& tag) {
  train::TrainConfig tc = deterministic_mlp(tag);
  tc.model = "gpt";
  tc.corpus = "/usr/share/games/fortunes/computers";
  tc.text_cache = MESHTRAIN_TEXT_CACHE;
  tc.vocab = 512;
  tc.context = 32;
  tc.layers = 2;
  tc.heads = 2;
  tc.width = 64;
  tc.batch_size = 8;
  tc.deterministic_block = 0;  // resolved: 1 sample of 32 rows
  return tc;
}

// A file's bytes ("" when it cannot be read).
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace meshtrain::testing
