#include "meshtrain/train/export.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "meshtrain/core/error.h"
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

std::string torch_layout_model(const TrainConfig& tc) {
  return tc.model == "gpt" && tc.arch == layout::DecoderArch::llama ? "llama" : tc.model;
}

RunModel read_run_model(const std::string& run_dir, std::optional<int64_t> step, const char* op) {
  RunModel r;
  if (const auto dir = checkpoint_of(run_dir, step)) {
    const CheckpointIndex index = read_checkpoint_index(*dir);
    try {
      r.model = nlohmann::json::parse(index.metadata).at("model").get<std::string>();
    } catch (const nlohmann::json::exception&) {
      throw IoError(op, fmt::format("{}: the index names no model", *dir), "give a training run's checkpoint");
    }
    std::vector<CheckpointPiece> wanted;
    for (const CheckpointIndex::Entry& e : index.tensors)
      if (e.name.rfind("model/", 0) == 0) wanted.push_back({e.name, sharding::Placement::whole(e.shape), Tensor()});
    load_checkpoint_pieces(index, wanted);
    for (CheckpointPiece& p : wanted) r.tensors.emplace_back(p.name.substr(6), p.data.view(p.placement.shape));
    r.source = fmt::format("{} (step {})", *dir, index.step);
  } else if (step) {
    throw InvalidArgument(op, fmt::format("'{}' has no checkpoint of step {}", run_dir, *step),
                          "list <run>/checkpoints for the steps it holds, or leave the step out");
  } else {
    const std::string file = (fs::path(run_dir) / "model.safetensors").string();
    const std::string config = (fs::path(run_dir) / "config.toml").string();
    if (!fs::exists(file) || !fs::exists(config))
      throw IoError(op, fmt::format("'{}' holds neither checkpoints nor model.safetensors and config.toml", run_dir),
                    "give the directory of a training run (--run-dir)");
    r.model = TrainConfig::from_toml_file(config).model;
    r.tensors = load_safetensors(file);
    r.source = file;
  }
  if (r.tensors.empty()) throw IoError(op, fmt::format("{} holds no model tensors", r.source), "");
  // The GPT recipe's architecture is the run's config's (checkpoints name the recipe).
  if (const fs::path config = fs::path(run_dir) / "config.toml"; r.model == "gpt" && fs::exists(config))
    r.model = torch_layout_model(TrainConfig::from_toml_file(config.string()));
  return r;
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
  RunModel r = read_run_model(run_dir, step, op);
  return checkpoint::write_model_file(out, r.model, std::move(r.tensors), r.source);
}

}  // namespace meshtrain::train
