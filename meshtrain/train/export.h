// `meshtrain export`: a run's whole model as a safetensors file in the
// layout a PyTorch user loads (the mapping and the file format are
// checkpoint/export.h's).
//
//   export_model("runs/gpt/version_3", "gpt.safetensors");   // meshtrain export
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "meshtrain/checkpoint/export.h"
#include "meshtrain/train/train_config.h"

namespace meshtrain::train {

using checkpoint::load_model_file;
using checkpoint::NamedTensors;

// The whole model of the run in `run_dir` (its interrupted staging
// directory first): its newest checkpoint, or `step`'s, else its
// model.safetensors (the model named by its config.toml); written to `out`
// in PyTorch's layout (checkpoint::write_model_file). Returns a line saying
// what was written. Throws IoError/InvalidArgument naming the path, and
// refuses an `out` inside the run directory.
std::string export_model(const std::string& run_dir, const std::string& out, std::optional<int64_t> step = {});

// The name of the PyTorch layout a run's model is exported in
// (checkpoint/export.h): the recipe's, but "llama" for the GPT recipe with
// arch llama.
std::string torch_layout_model(const TrainConfig& tc);

// The whole model of a run, in meshtrain's names and layout (what
// export_model writes, before PyTorch's layout): from the same place.
struct RunModel {
  std::string model;     // the recipe's layout name: "gpt", "llama", "mlp", ... (torch_layout_model)
  NamedTensors tensors;  // every parameter, whole
  std::string source;    // "<run>/checkpoints/step_00000020 (step 20)" or the model file
};
RunModel read_run_model(const std::string& run_dir, std::optional<int64_t> step = {},
                        const char* op = "meshtrain export");

}  // namespace meshtrain::train
