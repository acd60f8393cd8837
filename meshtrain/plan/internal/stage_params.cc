#include "meshtrain/plan/internal/stage_params.h"

#include <fmt/format.h>

#include <deque>
#include <mutex>
#include <span>

#include "meshtrain/core/error.h"

namespace meshtrain::plan::internal {

std::shared_ptr<const ModelDescription> describe(const GptShape& g, int stages) {
  if (!g.model)
    throw InvalidArgument("plan", "a GptShape without a model source",
                          "set GptShape::model (train::gpt_model_source): the planner reads the parameters from the "
                          "model");
  std::shared_ptr<const ModelDescription> m = g.model(stages);
  if (!m || static_cast<int>(m->stages.size()) != stages)
    throw InvalidArgument("plan", fmt::format("a model source that did not cut the model into {} stages", stages),
                          "return one ModelDescription::Stage per pipeline stage");
  return m;
}

Holdings::Holdings(std::shared_ptr<const ModelDescription> model, int tensor, int expert)
    : model_(std::move(model)), tensor_(tensor), expert_(expert) {
  // The rule over the expert and tensor axes alone (expert rank 0: tensor
  // rank t is rank t), one stage's parameters at a time (they are
  // contiguous in the description).
  layout::TrainingLayout l;
  l.mesh = {.shape = {expert, tensor}, .axis_names = {std::string(mesh::kExpert), std::string(mesh::kTensor)}};
  const std::vector<layout::ModelParameter>& ps = model_->params;
  size_t begin = 0;
  for (size_t s = 0; s < model_->stages.size(); ++s) {
    size_t end = begin;
    while (end < ps.size() && ps[end].stage == static_cast<int>(s)) ++end;
    const std::span<const layout::ModelParameter> mine(ps.data() + begin, end - begin);
    const ModelDescription::Stage& stage = model_->stages[s];
    const int blocks = stage.last_block - stage.first_block;
    for (int t = 0; t < tensor; ++t) {
      const std::vector<layout::HeldParameter> held = layout::held_parameters(l, mine, t);
      std::vector<StageParam> out;
      size_t h = 0;  // held lists the parameters of `mine` rank t holds, in order
      for (const layout::ModelParameter& p : mine) {
        if (h == held.size() || held[h].name != p.info.name) continue;  // another expert rank's
        const int role = stage.unit_block.at(static_cast<size_t>(p.unit));
        const int unit = role == kEmbeddingUnit ? blocks : role == kRootUnit ? blocks + 1 : role - stage.first_block;
        out.push_back(
            {held[h].placement.block_numel(), unit, !held[h].placement.is_block(), p.info.routed_expert()});
        ++h;
      }
      held_.push_back(std::move(out));
    }
    begin = end;
  }
  if (begin != ps.size())
    throw InvalidArgument("plan", "a model description whose parameters are not listed stage by stage",
                          "list every stage's parameters after the previous stage's");
}

const std::vector<StageParam>& Holdings::at(int s, int t) const {
  return held_.at(static_cast<size_t>(s) * static_cast<size_t>(tensor_) + static_cast<size_t>(t));
}

bool Holdings::same_as_previous(const std::vector<int>& stages, int t) const {
  if (t == 0) return false;
  for (int s : stages)
    if (at(s, t) != at(s, t - 1)) return false;
  return true;
}

std::shared_ptr<const Holdings> holdings(const GptShape& shape, int stages, int tensor, int expert) {
  std::shared_ptr<const ModelDescription> model = describe(shape, stages);
  static std::mutex mu;
  static std::deque<std::shared_ptr<const Holdings>> recent;  // newest first
  constexpr size_t kKeep = 32;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& h : recent)
      if (&h->model() == model.get() && h->tensor() == tensor && h->expert() == expert) return h;
  }
  auto h = std::make_shared<const Holdings>(std::move(model), tensor, expert);  // outside the lock: the slow part
  std::lock_guard<std::mutex> lock(mu);
  recent.push_front(h);
  if (recent.size() > kKeep) recent.pop_back();
  return h;
}

}  // namespace meshtrain::plan::internal
