#include "meshtrain/train/model_parameters.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/train/internal/builtin_recipes.h"

namespace meshtrain::train {

std::shared_ptr<const plan::ModelDescription> describe_gpt(const plan::GptShape& g, int stages) {
  const nn::GPTConfig whole{
      .vocab = g.vocab, .block_size = g.seq, .layers = g.layers, .heads = g.heads, .width = g.width,
      .defer_init = true};
  auto out = std::make_shared<plan::ModelDescription>();
  int s = 0;
  for (const nn::GPTConfig& part : internal::gpt_stage_configs(whole, stages)) {
    nn::GPT gpt(part);
    const std::vector<nn::Module*> units = gpt.fsdp_units();  // the recipe's (GptStage, GptModel)
    const std::vector<nn::Module*> blocks = gpt.blocks();
    plan::ModelDescription::Stage stage{.first_block = static_cast<int>(part.first_block),
                                        .last_block = static_cast<int>(part.last_block),
                                        .embed = part.embed,
                                        .head = part.head,
                                        .unit_block = {}};
    // model_parameters numbers the units in parallel::fsdp_units' order.
    for (const auto& [module, params] : parallel::fsdp_units(gpt, units)) {
      const auto b = std::find(blocks.begin(), blocks.end(), module);
      stage.unit_block.push_back(module == &gpt           ? plan::kRootUnit
                                 : b != blocks.end()       ? stage.first_block + static_cast<int>(b - blocks.begin())
                                                           : plan::kEmbeddingUnit);
    }
    out->stages.push_back(std::move(stage));
    for (layout::ModelParameter& p : parallel::model_parameters(gpt, units, s)) out->params.push_back(std::move(p));
    ++s;
  }
  return out;
}

plan::ModelSource gpt_model_source(const plan::GptShape& shape) {
  struct Cache {
    std::mutex mu;
    std::map<int, std::shared_ptr<const plan::ModelDescription>> by_stages;
  };
  auto cache = std::make_shared<Cache>();
  plan::GptShape sizes = shape;
  sizes.model = nullptr;
  return [cache, sizes](int stages) {
    std::lock_guard<std::mutex> lock(cache->mu);
    auto& d = cache->by_stages[stages];
    if (!d) d = describe_gpt(sizes, stages);
    return d;
  };
}

plan::GptShape with_gpt_model(plan::GptShape shape) {
  shape.model = gpt_model_source(shape);
  return shape;
}

std::vector<layout::ModelParameter> mlp_parameters(const std::vector<int64_t>& sizes, int tensor, int stages) {
  nn::MLPConfig whole;
  whole.sizes = sizes;
  whole.defer_init = true;
  const std::vector<nn::MLPConfig> parts =
      stages > 1 ? internal::mlp_stage_configs(whole, tensor, stages) : std::vector<nn::MLPConfig>{whole};
  std::vector<layout::ModelParameter> out;
  for (size_t s = 0; s < parts.size(); ++s) {
    nn::MLP mlp(parts[s]);
    for (layout::ModelParameter& p : parallel::model_parameters(mlp, {}, static_cast<int>(s)))
      out.push_back(std::move(p));
  }
  return out;
}

}  // namespace meshtrain::train
