#include "meshtrain/nn/mlp.h"

#include <fmt/format.h>

#include <memory>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/dropout.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/tensor_parallel.h"

namespace meshtrain::nn {

namespace {

const MLPConfig& checked(const MLPConfig& c) {
  if (c.sizes.size() < 2)
    throw InvalidArgument("MLP", fmt::format("{} layer sizes", c.sizes.size()),
                          "give at least the input and output sizes, e.g. {784, 512, 10}");
  for (int64_t s : c.sizes) {
    if (s < 1) throw InvalidArgument("MLP", fmt::format("layer size {}", s), "every size must be >= 1");
  }
  if (!(c.dropout >= 0.0 && c.dropout <= 1.0))
    throw InvalidArgument("MLP", fmt::format("dropout {}", c.dropout), "use 0 <= dropout <= 1");
  return c;
}

}  // namespace

MLP::MLP(MLPConfig config) : Sequential(checked(config).prefix), config_(std::move(config)) {
  const std::vector<int64_t>& s = config_.sizes;
  const size_t layers = s.size() - 1;
  const std::vector<ChainRole> roles = chain_roles(s);
  for (size_t i = 0; i < layers; ++i) {
    LinearOptions options;
    options.needs_input_grad = i > 0 || config_.needs_input_grad;
    options.defer_init = config_.defer_init;
    const ChainRole role = roles[i];
    add(make_chain_linear(s[i], s[i + 1], next_name(), config_.seed, options, config_.tensor, role));
    if (i + 1 < layers) {  // hidden layer
      add(std::make_unique<ReLU>());
      if (config_.dropout > 0.0)
        add(std::make_unique<Dropout>(config_.dropout, next_name(), config_.seed,
                                      chain_dropout_shard(s[i + 1], config_.tensor, role)));
    }
  }
}

}  // namespace meshtrain::nn
