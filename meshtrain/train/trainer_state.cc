#include "meshtrain/train/trainer_state.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "meshtrain/core/error.h"

namespace meshtrain::train {

namespace {

constexpr const char* kFormat = "meshtrain.trainer_state";
constexpr int kVersion = 1;

}  // namespace

std::string TrainerState::to_json() const {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["step"] = step;
  j["epoch"] = data.epoch;
  j["batch"] = data.batch;
  j["seed"] = seed;
  j["loss_scale"] = loss_scale;
  j["skipped_steps"] = skipped_steps;
  return j.dump(2) + "\n";
}

TrainerState TrainerState::from_json(std::string_view text, const std::string& source) {
  const auto bad = [&](const std::string& what) {
    return IoError("TrainerState::from_json", fmt::format("{}: {}", source, what),
                   "the file is not a meshtrain trainer state (trainer_state.json of a run directory)");
  };
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw bad("not a JSON object");
  if (j.value("format", "") != kFormat) throw bad(fmt::format("format is not \"{}\"", kFormat));
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() != kVersion)
    throw bad(fmt::format("version is not {}", kVersion));
  const auto count = [&](const char* key) {
    if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 0)
      throw bad(fmt::format("\"{}\" is missing or not a count", key));
    return j[key].get<int64_t>();
  };
  TrainerState s;
  s.step = count("step");
  s.data.epoch = count("epoch");
  s.data.batch = count("batch");
  if (!j.contains("seed") || !j["seed"].is_number_unsigned()) throw bad("\"seed\" is missing or not a count");
  s.seed = j["seed"].get<uint64_t>();
  if (!j.contains("loss_scale") || !j["loss_scale"].is_number() || j["loss_scale"].get<double>() < 0)
    throw bad("\"loss_scale\" is missing or negative");
  s.loss_scale = j["loss_scale"].get<double>();
  s.skipped_steps = count("skipped_steps");
  return s;
}

}  // namespace meshtrain::train
