// The recipes the registry (model_recipe.cc) starts with: "mlp" and "vae"
// on Fashion-MNIST (builtin_recipes.cc).
#pragma once

#include <vector>

#include "meshtrain/train/model_recipe.h"

namespace meshtrain::train::internal {

std::vector<RecipeRegistration> builtin_recipes();
// "gpt" (gpt_recipe.cc).
RecipeRegistration gpt_recipe();

}  // namespace meshtrain::train::internal
