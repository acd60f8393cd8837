// The recipes the registry (model_recipe.cc) starts with: "mlp" and "vae"
// on Fashion-MNIST (builtin_recipes.cc).
#pragma once

#include <vector>

#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/train/model_recipe.h"

namespace meshtrain::train::internal {

std::vector<RecipeRegistration> builtin_recipes();
// "gpt" (gpt_recipe.cc).
RecipeRegistration gpt_recipe();
// The gpt recipe's pipeline stages of `whole` (stages > 1: the blocks cut
// by forward FLOPs; each part with its embed and head flags), for the
// recipe and the planner's model source (model_parameters.h).
std::vector<nn::GPTConfig> gpt_stage_configs(const nn::GPTConfig& whole, int stages);
// The mlp recipe's pipeline stages of `whole` (builtin_recipes.cc): the
// Linears cut by their weights; over a tensor axis of `tensor` > 1 ranks a
// column/row pair stays on one stage.
std::vector<nn::MLPConfig> mlp_stage_configs(const nn::MLPConfig& whole, int tensor, int stages);

}  // namespace meshtrain::train::internal
