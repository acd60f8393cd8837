// Flags of other commands that mean what `meshtrain train`'s do: a subset
// of the TrainConfig fields (train/train_config.h's table: the same flag
// names, help and parsing), registered on a command and applied to a
// TrainConfig. `meshtrain plan` and `shard --model` take the GPT's blocks
// this way (--arch, --kv-heads, --experts, ...), so a model is described
// with one set of words everywhere.
//
//   TrainFieldFlags decoder(app, train::kGptBlockKeys);
//   ...                                     // after parsing
//   train::TrainConfig tc;
//   decoder.apply(tc);                      // the given flags only
#pragma once

#include <CLI/CLI.hpp>

#include <map>
#include <span>
#include <string>
#include <string_view>

#include "meshtrain/train/train_config.h"

namespace meshtrain::cli {

class TrainFieldFlags {
 public:
  // Registers the fields `keys` (TOML keys of train_config_fields()) on
  // `app` under their train flags, with their help and defaults.
  TrainFieldFlags(CLI::App* app, std::span<const std::string_view> keys);
  // Sets the fields whose flags were given on `tc` (InvalidArgument naming
  // the flag for a bad value, as train).
  void apply(train::TrainConfig& tc) const;

 private:
  CLI::App* app_;
  std::map<std::string, std::string, std::less<>> values_;  // by key
};

}  // namespace meshtrain::cli
