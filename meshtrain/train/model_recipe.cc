#include "meshtrain/train/model_recipe.h"

#include <fmt/format.h>

#include <deque>
#include <mutex>

#include "meshtrain/core/error.h"
#include "meshtrain/sharding/stage_assignment.h"
#include "meshtrain/train/internal/builtin_recipes.h"

namespace meshtrain::train {
namespace {

struct Registry {
  std::mutex mu;
  std::deque<RecipeRegistration> entries;  // a deque: references stay valid as it grows
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: recipes may be looked up during static destruction
    for (RecipeRegistration& e : internal::builtin_recipes()) reg->entries.push_back(std::move(e));
    return reg;
  }();
  return *r;
}

// `"mlp" or "vae"`, `"a", "b" or "c"`.
std::string quoted_choices(const std::deque<RecipeRegistration>& entries) {
  std::string out;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i > 0) out += i + 1 == entries.size() ? " or " : ", ";
    out += fmt::format("\"{}\"", entries[i].name);
  }
  return out;
}

}  // namespace

StagedModel::StagedModel(std::vector<std::unique_ptr<RecipeStage>> stages, Summarize summarize,
                         int64_t evaluation_rows)
    : stages_(std::move(stages)), summarize_(std::move(summarize)), evaluation_rows_(evaluation_rows) {
  if (stages_.empty() || !summarize_)
    throw InvalidArgument("StagedModel", "no stages or no summarize function", "give this rank's stages");
}

std::vector<RecipeStage*> StagedModel::stages() {
  std::vector<RecipeStage*> out;
  for (auto& s : stages_) out.push_back(s.get());
  return out;
}

double StagedModel::loss_step(const Batch&, int64_t, double) {
  throw InvalidArgument("StagedModel::loss_step", "the whole-model step of a model built in pipeline stages",
                        "drive stages() (the trainer's pipeline executor does)");
}

std::vector<double> StagedModel::evaluate(const Batch&, int64_t) {
  throw InvalidArgument("StagedModel::evaluate", "the whole-model evaluation of a model built in pipeline stages",
                        "drive stages() (the trainer's pipeline executor does)");
}

std::vector<std::pair<int, int>> pipeline_cut(const std::vector<double>& costs, int stages, std::string_view model) {
  if (static_cast<int64_t>(costs.size()) < stages)
    throw InvalidArgument("meshtrain train",
                          fmt::format("model {} has {} layers to cut into {} pipeline stages: a stage would be empty",
                                      model, costs.size(), stages),
                          "use a pipeline axis of at most that many stages (with --virtual-stages: ranks x chunks), "
                          "or a deeper model");
  const sharding::PipelineParallelStrategy pp(mesh::kPipeline, stages);
  const std::vector<int> counts = pp.assign_layers_to_stages(costs);
  std::vector<std::pair<int, int>> out;
  for (int s = 0; s < stages; ++s) out.push_back(pp.layer_range(s, counts));
  return out;
}

void register_model_recipe(RecipeRegistration registration) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (registration.name.empty() || !registration.make)
    throw InvalidArgument("register_model_recipe",
                          fmt::format("recipe '{}' has {}", registration.name,
                                      registration.name.empty() ? "no name" : "no make function"),
                          "give a name and a function that makes the recipe");
  for (const RecipeRegistration& e : r.entries)
    if (e.name == registration.name)
      throw InvalidArgument("register_model_recipe", fmt::format("a model recipe '{}' is registered already", e.name),
                            "register each name once, or pick another name");
  r.entries.push_back(std::move(registration));
}

std::vector<std::string> model_recipe_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (const RecipeRegistration& e : r.entries) out.push_back(e.name);
  return out;
}

const RecipeRegistration& find_model_recipe(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const RecipeRegistration& e : r.entries)
    if (e.name == name) return e;
  throw InvalidArgument("TrainConfig::validate", fmt::format("model '{}' is not a registered model recipe", name),
                        fmt::format("use model = {}", quoted_choices(r.entries)));
}

std::unique_ptr<ModelRecipe> make_model_recipe(const TrainConfig& tc) { return find_model_recipe(tc.model).make(tc); }

}  // namespace meshtrain::train
