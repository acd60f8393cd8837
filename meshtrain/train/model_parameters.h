// The built-in recipes' models as parameter lists, built without values
// (deferred initialization: shapes only, nothing allocated), cut into the
// recipes' pipeline stages, each parameter with its fully sharded unit:
// what the placement rule (layout/placement_rule.h) places for the
// planner, `meshtrain shard --model` and the tests. They are the models
// the trainer builds (tests/placement_property_test.cc checks it rank by
// rank against real runs).
//
//   plan::GptShape g{.vocab = 50257, .seq = 1024, .layers = 12, .heads = 12, .width = 768};
//   plan::MemoryPrediction m = plan::predict_memory(train::with_gpt_model(g), layout);
//   // or: g.model = train::gpt_model_source(g);
//   std::vector<layout::ModelParameter> ps = train::mlp_parameters({784, 512, 10}, /*tensor=*/2, /*stages=*/2);
//
// Thread-safety: reentrant; a source may be called from any thread (it
// builds each stage count's description once and shares it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "meshtrain/layout/placement_rule.h"
#include "meshtrain/plan/model_description.h"

namespace meshtrain::train {

// The gpt recipe's model of `shape` in `stages` pipeline stages (block_size
// = shape.seq), with each stage's blocks and units for the planner.
// InvalidArgument for sizes nn::GPT refuses or more stages than blocks.
std::shared_ptr<const plan::ModelDescription> describe_gpt(const plan::GptShape& shape, int stages);

// describe_gpt of `shape`'s sizes, cached per stage count.
plan::ModelSource gpt_model_source(const plan::GptShape& shape);

// `shape` with model = gpt_model_source(shape).
plan::GptShape with_gpt_model(plan::GptShape shape);

// The mlp recipe's parameters for layer sizes `sizes` (input, hidden...,
// classes) in `stages` stages: with a tensor axis of `tensor` > 1 ranks
// its cut keeps a column/row pair of Linears on one stage, so the list
// depends on it. Units: one per Linear, as the recipe's.
std::vector<layout::ModelParameter> mlp_parameters(const std::vector<int64_t>& sizes, int tensor, int stages);

}  // namespace meshtrain::train
