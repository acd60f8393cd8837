#include "meshtrain/train/export.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/checkpoint/checkpoint.h"
#include "meshtrain/train/train_config.h"

namespace meshtrain::train {

using checkpoint::CheckpointIndex;
using checkpoint::CheckpointPiece;
using checkpoint::latest_checkpoint;
using checkpoint::load_checkpoint_pieces;
using checkpoint::read_checkpoint_index;

namespace {

namespace fs = std::filesystem;

// Models whose Linear weights PyTorch stores as (out, in): every 2-D
// "*.weight" of theirs is an nn.Linear's.
bool transposes_linears(const std::string& model) { return model == "mlp" || model == "vae"; }
bool known(const std::string& model) { return transposes_linears(model) || model == "gpt"; }

bool is_linear_weight(const std::string& name, const Tensor& t) {
  return t.dim() == 2 && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
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

// The run's newest (or `step`'s) checkpoint: the staging directory of an
// interrupted run first.
std::optional<std::string> checkpoint_of(const std::string& run, std::optional<int64_t> step) {
  for (const std::string& dir : {run + ".incomplete", run}) {
    const std::string root = (fs::path(dir) / "checkpoints").string();
    if (!step) {
      if (auto latest = latest_checkpoint(root)) return latest;
      continue;
    }
    const std::string at = (fs::path(root) / fmt::format("step_{:08d}", *step)).string();
    if (fs::exists(fs::path(at) / "index.json")) return at;
  }
  return std::nullopt;
}

}  // namespace

NamedTensors to_torch_layout(const std::string& model, NamedTensors tensors) {
  return transpose_linears(model, std::move(tensors));
}

NamedTensors from_torch_layout(const std::string& model, NamedTensors tensors) {
  return transpose_linears(model, std::move(tensors));  // a transpose is its own inverse
}

std::string export_model(const std::string& run_dir, const std::string& out, std::optional<int64_t> step) {
  const char* op = "meshtrain export";
  // The run's files are the run's: an export into them would replace its
  // model with another layout (and the next export would transpose that).
  {
    std::error_code ec;
    const fs::path run = fs::weakly_canonical(fs::absolute(run_dir), ec);
    const fs::path to = fs::weakly_canonical(fs::absolute(out), ec);
    for (const fs::path& owned : {run, fs::path(run.string() + ".incomplete")}) {
      const auto [end, _] = std::mismatch(owned.begin(), owned.end(), to.begin(), to.end());
      if (!owned.empty() && end == owned.end())
        throw InvalidArgument(op, fmt::format("--out '{}' is inside the run directory '{}'", out, owned.string()),
                              "write the export outside the run, e.g. --out model_torch.safetensors");
    }
  }
  NamedTensors tensors;
  std::string model, source;
  if (const auto dir = checkpoint_of(run_dir, step)) {
    const CheckpointIndex index = read_checkpoint_index(*dir);
    try {
      model = nlohmann::json::parse(index.metadata).at("model").get<std::string>();
    } catch (const nlohmann::json::exception&) {
      throw IoError(op, fmt::format("{}: the index names no model", *dir), "export a training run's checkpoint");
    }
    std::vector<CheckpointPiece> wanted;
    for (const CheckpointIndex::Entry& e : index.tensors)
      if (e.name.rfind("model/", 0) == 0) wanted.push_back({e.name, sharding::Placement::whole(e.shape), Tensor()});
    load_checkpoint_pieces(index, wanted);
    for (CheckpointPiece& p : wanted) tensors.emplace_back(p.name.substr(6), p.data.view(p.placement.shape));
    source = fmt::format("{} (step {})", *dir, index.step);
  } else if (step) {
    throw InvalidArgument(op, fmt::format("'{}' has no checkpoint of step {}", run_dir, *step),
                          "list <run>/checkpoints for the steps it holds, or leave --step out");
  } else {
    const std::string file = (fs::path(run_dir) / "model.safetensors").string();
    const std::string config = (fs::path(run_dir) / "config.toml").string();
    if (!fs::exists(file) || !fs::exists(config))
      throw IoError(op, fmt::format("'{}' holds neither checkpoints nor model.safetensors and config.toml", run_dir),
                    "give the directory of a training run (--run-dir)");
    model = TrainConfig::from_toml_file(config).model;
    tensors = load_safetensors(file);
    source = file;
  }
  if (tensors.empty()) throw IoError(op, fmt::format("{} holds no model tensors", source), "");
  int64_t elements = 0;
  for (const auto& [name, t] : tensors) elements += t.numel();
  const size_t count = tensors.size();
  save_safetensors(out, to_torch_layout(model, std::move(tensors)),
                   {{"format", "pt"},
                    {"model", model},
                    {"layout", known(model) ? "torch" : "meshtrain"},
                    {"source", source}});
  return fmt::format("{}: model {}, {} tensors, {} parameters, from {}{}", out, model, count, elements,
                     source, known(model) ? "" : " (meshtrain's layout: the recipe has no PyTorch mapping)");
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

}  // namespace meshtrain::train
