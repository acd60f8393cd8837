#include "meshtrain/train/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/train/artifacts.h"

namespace meshtrain::train {

using data::Tokenizer;

namespace {

void check(const SampleOptions& o) {
  if (o.tokens < 1 || o.tokens > 100000)
    throw InvalidArgument("tokens", fmt::format("{} new tokens", o.tokens), "ask for 1 to 100000 tokens");
  if (!(o.temperature >= 0 && o.temperature <= 100))
    throw InvalidArgument("temperature", fmt::format("temperature {}", o.temperature),
                          "use a temperature from 0 (always the most likely token) to 100");
  if (o.top_k < 0) throw InvalidArgument("top_k", fmt::format("top-k {}", o.top_k), "use 0 (all tokens) or more");
}

// The next token after `ids` (at most the model's context) for the draw
// u in [0, 1). Collective over a tensor-parallel model's group (the row's
// vocabulary shards are gathered).
int32_t sample_next(nn::GPT& gpt, const std::vector<int32_t>& ids, const SampleOptions& o, double u) {
  const int64_t t = std::min<int64_t>(static_cast<int64_t>(ids.size()), gpt.config().block_size);
  std::vector<int64_t> window(ids.end() - t, ids.end());
  const Tensor logits = gpt.forward(Tensor::from_vector(window, {1, t}));
  std::vector<double> all = logits.narrow(0, t - 1, 1).to_vector();  // the last position's row
  const nn::TensorParallelGroup& tp = gpt.config().tensor;
  if (tp.size() > 1) {  // each rank has its vocabulary shard of the row: gather them (shards are ceil(V/k) apart)
    const int64_t vocab = gpt.config().vocab, c = (vocab + tp.size() - 1) / tp.size();
    std::vector<double> mine(static_cast<size_t>(c), 0.0), row(static_cast<size_t>(c * tp.size()));
    std::copy(all.begin(), all.end(), mine.begin());
    tp.comm->all_gather(mine.data(), row.data(), static_cast<size_t>(c), DType::f64);
    all.assign(row.begin(), row.begin() + vocab);
  }
  std::vector<int32_t> order(all.size());
  std::iota(order.begin(), order.end(), 0);
  const auto more_likely = [&](int32_t a, int32_t b) {
    return all[static_cast<size_t>(a)] > all[static_cast<size_t>(b)];
  };
  if (o.temperature == 0) return *std::min_element(order.begin(), order.end(), more_likely);
  const size_t k = o.top_k == 0 ? order.size() : std::min<size_t>(static_cast<size_t>(o.top_k), order.size());
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(), more_likely);
  std::vector<double> p(k);
  const double top = all[static_cast<size_t>(order[0])];
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += p[i] = std::exp((all[static_cast<size_t>(order[i])] - top) / o.temperature);
  double acc = 0;
  for (size_t i = 0; i < k; ++i) {
    acc += p[i] / sum;
    if (u < acc) return order[i];
  }
  return order[k - 1];
}

}  // namespace

std::vector<int32_t> sample_tokens(nn::GPT& gpt, std::vector<int32_t> ids, const SampleOptions& options) {
  check(options);
  if (ids.empty())
    throw InvalidArgument("prompt", "an empty prompt", "give at least one character to continue from");
  const bool training = gpt.training();
  gpt.set_training(false);
  const uint64_t key = key_from_name("gpt.sample");
  for (int i = 0; i < options.tokens; ++i)
    ids.push_back(sample_next(gpt, ids, options, uniform_at(options.seed, key, static_cast<uint64_t>(i), 0.0, 1.0)));
  gpt.set_training(training);
  return ids;
}

std::string generate_text(nn::GPT& gpt, const Tokenizer& tokenizer, const SampleOptions& options) {
  return tokenizer.decode(sample_tokens(gpt, tokenizer.encode(options.prompt), options));
}

LoadedGpt load_gpt_run(const std::string& run_dir, const TrainConfig& tc) {
  if (tc.model != "gpt")
    throw InvalidArgument("load_gpt_run", fmt::format("{} trained model \"{}\", not a GPT", run_dir, tc.model),
                          "give the run directory of a run with model = \"gpt\"");
  const std::string weights = (std::filesystem::path(run_dir) / "model.safetensors").string();
  const std::string tokenizer = (std::filesystem::path(run_dir) / "tokenizer.model").string();
  for (const std::string& f : {weights, tokenizer})
    if (!std::filesystem::exists(f))
      throw IoError("load_gpt_run", fmt::format("{} does not exist", f),
                    "give the directory of a finished GPT run (it holds model.safetensors and tokenizer.model)");
  auto model = std::make_unique<nn::GPT>(nn::GPTConfig{.vocab = tc.vocab,
                                                       .block_size = tc.context,
                                                       .layers = tc.layers,
                                                       .heads = tc.heads,
                                                       .width = tc.width,
                                                       .seed = tc.seed,
                                                       .recompute = false,
                                                       .defer_init = false});
  const auto tensors = load_safetensors(weights);
  std::vector<nn::Parameter*> params = model->parameters();
  for (nn::Parameter* p : params) {
    const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == p->name; });
    if (it == tensors.end())
      throw InvalidArgument("load_gpt_run", fmt::format("{} has no tensor {}", weights, p->name),
                            "the weights come from another model; give the run directory they were trained in");
    if (it->second.shape() != p->value.shape())
      throw InvalidArgument("load_gpt_run",
                            fmt::format("{}: {} has shape {}, the configuration's model {}", weights, p->name,
                                        fmt::join(it->second.shape(), "x"), fmt::join(p->value.shape(), "x")),
                            "config.toml and model.safetensors come from different runs");
    p->value.copy_from(it->second.to(p->value.dtype()));
  }
  if (tensors.size() != params.size())
    throw InvalidArgument("load_gpt_run",
                          fmt::format("{} holds {} tensors, the configuration's model {}", weights, tensors.size(),
                                      params.size()),
                          "config.toml and model.safetensors come from different runs");
  return {std::move(model), Tokenizer::load(tokenizer)};
}

}  // namespace meshtrain::train
