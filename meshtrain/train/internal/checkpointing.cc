#include "meshtrain/train/internal/checkpointing.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"

namespace meshtrain::train::internal {

namespace {

using nlohmann::json;
constexpr const char* kOp = "checkpoint";

Tensor flat(const Tensor& t) {
  if (!t.defined() || t.dtype() != DType::f32 || !t.is_contiguous())
    throw InvalidArgument(kOp, "a parameter or state tensor is not contiguous f32", "");
  return t.view({t.numel()});
}

}  // namespace

std::string ResumePoint::to_json() const {
  json j{{"step", step},
         {"skipped_steps", skipped_steps},
         {"consecutive_skips", consecutive_skips},
         {"optimizer_steps", optimizer_steps},
         {"model", model},
         {"saved_from", saved_from},
         {"scaler", nullptr}};
  if (scaler)
    j["scaler"] = json{{"scale", scaler->scale}, {"good_steps", scaler->good_steps},
                       {"skipped_steps", scaler->skipped_steps}};
  return j.dump();
}

ResumePoint ResumePoint::from_json(const std::string& text, const std::string& source) {
  ResumePoint p;
  try {
    const json j = json::parse(text);
    p.step = j.at("step").get<int64_t>();
    p.skipped_steps = j.at("skipped_steps").get<int64_t>();
    p.consecutive_skips = j.at("consecutive_skips").get<int64_t>();
    p.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
    p.model = j.at("model").get<std::string>();
    p.saved_from = j.at("saved_from").get<std::string>();
    if (!j.at("scaler").is_null())
      p.scaler = optim::DynamicLossScaler::State{j["scaler"].at("scale").get<double>(),
                                                 j["scaler"].at("good_steps").get<int64_t>(),
                                                 j["scaler"].at("skipped_steps").get<int64_t>()};
  } catch (const json::exception& e) {
    throw IoError(kOp, fmt::format("{}: the trainer's state in the index is malformed: {}", source, e.what()),
                  "the checkpoint is damaged or not a training run's: load an older one");
  }
  if (p.step < 0 || p.skipped_steps < 0 || p.optimizer_steps < 0 || p.optimizer_steps > p.step)
    throw IoError(kOp, fmt::format("{}: step {}, {} skipped, {} optimizer steps do not add up", source, p.step,
                                   p.skipped_steps, p.optimizer_steps),
                  "the checkpoint is damaged: load an older one");
  return p;
}

TrainingCheckpoint::TrainingCheckpoint(std::vector<nn::Parameter*> params, optim::Optimizer& opt,
                                       std::vector<std::pair<std::string, Tensor>> buffers)
    : params_(std::move(params)), buffers_(std::move(buffers)), opt_(&opt) {}

std::vector<CheckpointPiece> TrainingCheckpoint::pieces(const ResumePoint& point) const {
  const optim::OptimizerState state = opt_->export_state();  // params() order = params_
  std::vector<CheckpointPiece> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const nn::Parameter& p = *params_[i];
    if (state[i].step != point.optimizer_steps)
      throw InvalidArgument(kOp,
                            fmt::format("parameter '{}' was updated {} times, the run {} times", p.name,
                                        state[i].step, point.optimizer_steps),
                            "every parameter must take part in every step");
    out.push_back({"model/" + p.name, p.placement, flat(p.value)});
    for (const auto& [field, t] : state[i].tensors)
      out.push_back({fmt::format("optim/{}/{}", p.name, field), p.placement, flat(t)});
  }
  for (const auto& [name, t] : buffers_)
    out.push_back({"buffer/" + name, sharding::Placement::whole(t.shape()), flat(t)});
  return out;
}

void TrainingCheckpoint::load(const CheckpointIndex& index, const ResumePoint& point) {
  optim::OptimizerState state = opt_->export_state();  // the fields this optimizer keeps, and their shapes
  std::vector<CheckpointPiece> wanted;
  for (size_t i = 0; i < params_.size(); ++i) {
    const nn::Parameter& p = *params_[i];
    wanted.push_back({"model/" + p.name, p.placement, flat(p.value)});  // the master itself: loaded in place
    for (auto& [field, t] : state[i].tensors)  // the exported copy: filled, then imported
      wanted.push_back({fmt::format("optim/{}/{}", p.name, field), p.placement, flat(t)});
    state[i].step = point.optimizer_steps;
  }
  for (const auto& [name, t] : buffers_)  // in place
    wanted.push_back({"buffer/" + name, sharding::Placement::whole(t.shape()), flat(t)});
  load_checkpoint_pieces(index, wanted);
  opt_->import_state(state);
}

std::vector<int32_t> TrainingCheckpoint::load_model(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                                    const std::string& source) {
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < tensors.size(); ++i) by_name[tensors[i].first] = i;
  std::vector<int32_t> used(tensors.size(), 0);
  for (nn::Parameter* p : params_) {
    auto it = by_name.find(p->name);
    CheckpointPiece piece{p->name, p->placement, flat(p->value)};
    if (it == by_name.end())
      throw IoError("--init-from", fmt::format("{} has no tensor '{}' ({} tensors)", source, p->name, tensors.size()),
                    "give a model file of the same model (meshtrain export writes one)");
    const Tensor& whole = tensors[it->second].second;
    if (whole.shape() != piece.placement.shape)
      throw IoError("--init-from",
                    fmt::format("{} holds '{}' as [{}], this model needs [{}]", source, p->name,
                                fmt::join(whole.shape(), ", "), fmt::join(piece.placement.shape, ", ")),
                    "give a model file of the same model and sizes");
    copy_region(whole.contiguous(), piece);
    used[it->second] = 1;
  }
  // Buffers (the MoE layers' selection biases) when the file has them: one
  // exported before they were written keeps the model's own.
  for (const auto& [name, t] : buffers_) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) continue;
    const Tensor& whole = tensors[it->second].second;
    if (whole.shape() != t.shape())
      throw IoError("--init-from",
                    fmt::format("{} holds '{}' as [{}], this model needs [{}]", source, name,
                                fmt::join(whole.shape(), ", "), fmt::join(t.shape(), ", ")),
                    "give a model file of the same model and sizes");
    Tensor into = t;  // the live buffer, in place
    into.copy_from(whole.to(DType::f32));
    used[it->second] = 1;
  }
  return used;
}

CheckpointSaveStats TrainingCheckpoint::save(comm::Communicator& world, const std::string& root, const ResumePoint& point,
                                  int keep_last) const {
  return save_checkpoint(world, root, point.step, pieces(point), point.to_json(), {.keep_last = keep_last});
}

CheckpointWriter::CheckpointWriter(comm::Communicator& world, std::string root, int keep_last, bool async)
    : world_(&world), root_(std::move(root)), keep_last_(keep_last) {
  if (async) saver_ = std::make_unique<checkpoint::AsyncCheckpointSaver>(world.split(0, world.rank()));
}

std::vector<std::string> CheckpointWriter::save(const TrainingCheckpoint& ckpt, const ResumePoint& point, bool last) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  if (!saver_) {
    const uint64_t bytes = ckpt.save(*world_, root_, point, keep_last_).bytes;
    return {fmt::format("checkpoint of step {}: {} written in {:.2f} s", point.step, format_bytes(bytes),
                        std::chrono::duration<double>(Clock::now() - t0).count())};
  }
  std::vector<std::string> lines = finish();
  saver_->start(root_, point.step, ckpt.pieces(point), point.to_json(), {.keep_last = keep_last_});
  blocked_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
  if (last)
    for (std::string& line : finish()) lines.push_back(std::move(line));
  return lines;
}

std::vector<std::string> CheckpointWriter::finish() {
  if (!saver_ || !saver_->in_flight()) return {};
  const int64_t step = *saver_->in_flight();
  const auto t0 = std::chrono::steady_clock::now();
  const CheckpointSaveStats stats = *saver_->wait();
  const double saving = stats.exchange_s + stats.write_s + stats.sync_s + stats.verify_s + stats.commit_s;
  const double waited = blocked_s_ + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {fmt::format("checkpoint of step {}: {} written in {:.2f} s in the background (training waited {:.2f} s "
                      "for it)",
                      step, format_bytes(stats.bytes), saving, waited)};
}

ResumePoint TrainingCheckpoint::resume(const std::string& root, const std::string& model) {
  const std::optional<std::string> dir = latest_checkpoint(root);
  if (!dir)
    throw IoError("--resume", fmt::format("no checkpoint under '{}'", root),
                  "runs write checkpoints with --checkpoint-every N");
  const CheckpointIndex index = read_checkpoint_index(*dir);
  ResumePoint point = ResumePoint::from_json(index.metadata, *dir + "/index.json");
  if (point.model != model)
    throw InvalidArgument("--resume",
                          fmt::format("{} is a checkpoint of model '{}', this run trains '{}'", *dir, point.model,
                                      model),
                          "resume with the model the checkpoint was saved from");
  load(index, point);
  point.dir = *dir;
  return point;
}

void on_every_rank(comm::Communicator& world, const std::string& what, std::vector<int32_t>& flags,
                   const std::function<void()>& load) {
  std::exception_ptr error;
  try {
    load();
  } catch (const std::exception& e) {
    error = std::current_exception();
    // Printed here, before the verdict: whichever rank's error the job
    // ends with, the cause (the file, the tensor) is on stderr.
    fmt::print(stderr, "meshtrain: rank {}: {}\n", world.rank(), e.what());
    std::fflush(stderr);
  }
  // flags (max) and, last, the lowest rank that failed (min).
  flags.push_back(error ? 1 : 0);
  world.all_reduce(flags.data(), flags.data(), flags.size(), DType::i32, comm::ReduceOp::max);
  int32_t first_failed = error ? world.rank() : std::numeric_limits<int32_t>::max();
  world.all_reduce(&first_failed, &first_failed, 1, DType::i32, comm::ReduceOp::min);
  if (error) std::rethrow_exception(error);
  if (flags.back() != 0)
    throw IoError(what, fmt::format("rank {} could not load its part", first_failed),
                  fmt::format("see rank {}'s error above (\"meshtrain: rank {}: ...\")", first_failed, first_failed));
  flags.pop_back();
}

}  // namespace meshtrain::train::internal
