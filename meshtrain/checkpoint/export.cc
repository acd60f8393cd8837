#include "meshtrain/checkpoint/export.h"

#include <fmt/format.h>

#include <string_view>
#include <utility>

#include "meshtrain/checkpoint/safetensors.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"

namespace meshtrain::checkpoint {
namespace {

// Models whose Linear weights PyTorch stores as (out, in): every 2-D
// "*.weight" of theirs is an nn.Linear's.
bool transposes_linears(const std::string& model) { return model == "mlp" || model == "vae" || model == "llama"; }
bool known(const std::string& model) { return transposes_linears(model) || model == "gpt"; }

// The GPT container's Llama names <-> Hugging Face Llama's (the blocks'
// inner names are already theirs).
const std::pair<std::string_view, std::string_view> kLlamaPrefixes[] = {
    {"wte.", "model.embed_tokens."}, {"h.", "model.layers."}, {"ln_f.", "model.norm."}};

NamedTensors rename_llama(NamedTensors tensors, bool to_torch) {
  for (auto& [name, t] : tensors)
    for (const auto& [ours, theirs] : kLlamaPrefixes) {
      const std::string_view from = to_torch ? ours : theirs, to = to_torch ? theirs : ours;
      if (name.rfind(from, 0) == 0) {
        name = std::string(to) + name.substr(from.size());
        break;
      }
    }
  return tensors;
}

bool is_linear_weight(const std::string& name, const Tensor& t) {
  // Tables stored (rows, width) by both: the embeddings and the untied head.
  const bool embedding = name.find("embed_tokens") != std::string::npos || name.rfind("wte.", 0) == 0 ||
                         name.rfind("lm_head.", 0) == 0;
  return t.dim() == 2 && !embedding && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
}

Tensor transposed(const Tensor& t) {
  const Tensor c = t.contiguous();
  const int64_t rows = c.shape()[0], cols = c.shape()[1];
  Tensor out = Tensor::empty({cols, rows}, DType::f32);
  const float* in = c.data<float>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) o[j * rows + i] = in[i * cols + j];
  return out;
}

NamedTensors transpose_linears(const std::string& model, NamedTensors tensors) {
  if (!transposes_linears(model)) return tensors;
  for (auto& [name, t] : tensors)
    if (is_linear_weight(name, t)) t = transposed(t);
  return tensors;
}

}  // namespace

NamedTensors to_torch_layout(const std::string& model, NamedTensors tensors) {
  tensors = transpose_linears(model, std::move(tensors));
  return model == "llama" ? rename_llama(std::move(tensors), true) : tensors;
}

NamedTensors from_torch_layout(const std::string& model, NamedTensors tensors) {
  if (model == "llama") tensors = rename_llama(std::move(tensors), false);
  return transpose_linears(model, std::move(tensors));  // a transpose is its own inverse
}

std::string write_model_file(const std::string& out, const std::string& model, NamedTensors tensors,
                             const std::string& source) {
  int64_t elements = 0;
  for (const auto& [name, t] : tensors) elements += t.numel();
  const size_t count = tensors.size();
  save_safetensors(out, to_torch_layout(model, std::move(tensors)),
                   {{"format", "pt"},
                    {"model", model},
                    {"layout", known(model) ? "torch" : "meshtrain"},
                    {"source", source}});
  return fmt::format("{}: model {}, {} tensors, {} parameters, from {}{}", out, model, count, elements, source,
                     known(model) ? "" : " (meshtrain's layout: the recipe has no PyTorch mapping)");
}

NamedTensors load_model_file(const std::string& path, const std::string& model) {
  NamedTensors tensors;
  try {
    tensors = load_safetensors(path);
  } catch (const IoError& e) {  // the reader's words, under the flag's name
    throw IoError("--init-from", e.detail(), e.hint());
  }
  for (auto& [name, t] : tensors) {
    if (t.dtype() == DType::f32) continue;
    if (t.dtype() != DType::bf16 && t.dtype() != DType::f16)
      throw IoError("--init-from", fmt::format("{}: tensor '{}' is {}", path, name, dtype_name(t.dtype())),
                    "give a model file of f32, bf16 or f16 tensors");
    Tensor f = Tensor::empty(t.shape(), DType::f32);
    f.copy_from(t);
    t = f;
  }
  // A model with NaN or inf values is no model to start from: refused here,
  // naming the tensor, not found at step 0 as an overflowing update.
  for (const auto& [name, t] : tensors)
    if (!all_finite(t))
      throw IoError("--init-from", fmt::format("{}: tensor '{}' holds NaN or infinite values", path, name),
                    "give a model file of finite values (an earlier checkpoint's export, say)");
  return from_torch_layout(model, std::move(tensors));
}

}  // namespace meshtrain::checkpoint
