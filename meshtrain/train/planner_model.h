// The planner's model source for the gpt recipe (plan/model_description.h):
// the model the trainer would build, cut into the recipe's pipeline stages,
// built without values (nn::GPT with defer_init: shapes only, nothing
// allocated), with each stage's fully sharded units. The planner places
// these parameters with the placement rule, so what it prices is what the
// runtime allocates (tests/placement_property_test.cc checks it).
//
//   plan::GptShape g{.vocab = 50257, .seq = 1024, .layers = 12, .heads = 12, .width = 768};
//   plan::MemoryPrediction m = plan::predict_memory(train::with_gpt_model(g), layout);
//   // or: g.model = train::gpt_model_source(g);
//   plan::MemoryPrediction m = plan::predict_memory(g, layout);
//
// Thread-safety: the source may be called from any thread; it builds each
// stage count's description once and shares it.
#pragma once

#include <memory>

#include "meshtrain/plan/model_description.h"

namespace meshtrain::train {

// The gpt recipe's model of `shape` in `stages` pipeline stages (block_size
// = shape.seq). InvalidArgument for sizes nn::GPT refuses or more stages
// than blocks.
std::shared_ptr<const plan::ModelDescription> describe_gpt(const plan::GptShape& shape, int stages);

// describe_gpt of `shape`'s sizes, cached per stage count.
plan::ModelSource gpt_model_source(const plan::GptShape& shape);

// `shape` with model = gpt_model_source(shape).
plan::GptShape with_gpt_model(plan::GptShape shape);

}  // namespace meshtrain::train
