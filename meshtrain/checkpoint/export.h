// Whole-model safetensors files in the layout a PyTorch user loads, and
// back: the mapping between meshtrain's names and layout and PyTorch's for
// the built-in models, and the files `meshtrain export` writes and
// --init-from reads (train/export.h finds a run's model to export).
//
//   write_model_file("gpt.safetensors", "gpt", tensors, "runs/gpt (step 40)");
//   NamedTensors back = load_model_file("gpt.safetensors", "gpt");  // meshtrain's names and layout, f32
//
// The mapping (docs/checkpoints.md):
// - gpt: GPT-2's names and layout, as in the Hugging Face hub's gpt2
//   model.safetensors (wte.weight, wpe.weight, h.<i>.ln_1.weight,
//   h.<i>.attn.c_attn.weight (in, 3 C), ..., ln_f.bias; Conv1D weights
//   are (in, out), as meshtrain keeps them); the head is tied to wte.
// - llama (the GPT recipe with arch llama): Hugging Face Llama's names and
//   layout (model.embed_tokens.weight, model.layers.<i>.self_attn.q_proj.weight
//   (out, in), ..., model.norm.weight); the head is tied to embed_tokens
//   (tie_word_embeddings), so no lm_head.weight is written.
// - mlp, vae: PyTorch's nn.Sequential / nn.Linear names (0.weight,
//   3.weight, ...; encoder.0.weight, fc_mu.weight, ...) with Linear weights
//   transposed to nn.Linear's (out, in).
// - any other model: meshtrain's names and layout unchanged (metadata
//   "layout": "meshtrain").
// Files read back may hold f32, bf16 or f16 (converted to f32).
//
// Thread-safety: reentrant.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/tensor.h"

namespace meshtrain::checkpoint {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// meshtrain's layout -> PyTorch's for `model` (see above), and back.
NamedTensors to_torch_layout(const std::string& model, NamedTensors tensors);
NamedTensors from_torch_layout(const std::string& model, NamedTensors tensors);

// Writes `tensors` (meshtrain's layout) to `out` in PyTorch's, with the
// model, the layout and `source` in the metadata; returns a line saying
// what was written. IoError naming the file when it cannot be written.
std::string write_model_file(const std::string& out, const std::string& model, NamedTensors tensors,
                             const std::string& source);

// A file written by write_model_file (or by PyTorch in the same layout), in
// meshtrain's names and layout, f32. IoError (op "--init-from") naming the
// file and tensor for another dtype or non-finite values.
NamedTensors load_model_file(const std::string& path, const std::string& model);

}  // namespace meshtrain::checkpoint
