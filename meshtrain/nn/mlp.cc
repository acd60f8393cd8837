#include "meshtrain/nn/mlp.h"

#include <fmt/format.h>

#include <memory>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/dropout.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

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
  const int64_t layers = static_cast<int64_t>(s.size()) - 1;
  const int64_t first = config_.first_layer, last = config_.last_layer < 0 ? layers : config_.last_layer;
  const std::vector<ChainRole> roles = chain_roles(s);
  const auto row_at = [&](int64_t i) { return i < layers && roles[static_cast<size_t>(i)] == ChainRole::row; };
  if (first < 0 || first > last || last > layers || (config_.tensor.size() > 1 && (row_at(first) || row_at(last))))
    throw InvalidArgument("MLP",
                          fmt::format("Linear layers [{}, {}) of {}{}", first, config_.last_layer, layers,
                                      config_.tensor.size() > 1 ? " with tensor parallelism" : ""),
                          "pick 0 <= first_layer <= last_layer <= layers (last_layer < 0: the rest); under tensor "
                          "parallelism a part may not cut a column/row pair");
  // Children are numbered as in the whole MLP: Linear i is child i * per.
  const int64_t per = config_.dropout > 0.0 ? 3 : 2;
  const auto name = [&](int64_t child) { return internal::join_name(config_.prefix, std::to_string(child)); };
  for (int64_t i = first; i < last; ++i) {
    const auto u = static_cast<size_t>(i);
    LinearOptions options;
    options.needs_input_grad = i > 0 || config_.needs_input_grad;
    options.defer_init = config_.defer_init;
    add(make_chain_linear(s[u], s[u + 1], name(i * per), config_.seed, options, config_.tensor, roles[u]));
    if (i + 1 < layers) {  // hidden layer
      add(std::make_unique<ReLU>());
      if (config_.dropout > 0.0)
        add(std::make_unique<Dropout>(config_.dropout, name(i * per + 2), config_.seed,
                                      chain_dropout_shard(s[u + 1], config_.tensor, roles[u])));
    }
  }
}

}  // namespace meshtrain::nn
