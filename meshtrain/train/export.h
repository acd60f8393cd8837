// Whole-model safetensors files in the layout a PyTorch user loads, from a
// run's checkpoint (or its final model.safetensors), and back for
// --init-from.
//
//   export_model("runs/gpt/version_3", "gpt.safetensors");   // meshtrain export
//   auto tensors = load_model_file("gpt.safetensors", "gpt");  // meshtrain's names and layout
//
// The mapping (docs/checkpoints.md):
// - gpt: GPT-2's names and layout, as in the Hugging Face hub's gpt2
//   model.safetensors (wte.weight, wpe.weight, h.<i>.ln_1.weight,
//   h.<i>.attn.c_attn.weight (in, 3 C), ..., ln_f.bias; Conv1D weights
//   are (in, out), as meshtrain keeps them); the head is tied to wte.
// - mlp, vae: PyTorch's nn.Sequential / nn.Linear names (0.weight,
//   3.weight, ...; encoder.0.weight, fc_mu.weight, ...) with Linear weights
//   transposed to nn.Linear's (out, in).
// - any other recipe: meshtrain's names and layout unchanged (metadata
//   "layout": "meshtrain").
// Files read back may hold f32, bf16 or f16 (converted to f32).
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/tensor.h"

namespace meshtrain::train {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// meshtrain's layout -> PyTorch's for `model` (see above), and back.
NamedTensors to_torch_layout(const std::string& model, NamedTensors tensors);
NamedTensors from_torch_layout(const std::string& model, NamedTensors tensors);

// The whole model of the run in `run_dir` (its interrupted staging
// directory first): its newest checkpoint, or `step`'s, else its
// model.safetensors; written to `out` in PyTorch's layout. Returns a line
// saying what was written. Throws IoError/InvalidArgument naming the path.
std::string export_model(const std::string& run_dir, const std::string& out, std::optional<int64_t> step = {});

// A file written by export_model (or by PyTorch in the same layout), in
// meshtrain's names and layout, f32.
NamedTensors load_model_file(const std::string& path, const std::string& model);

}  // namespace meshtrain::train
