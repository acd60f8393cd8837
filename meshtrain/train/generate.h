// Text from a GPT (nn/gpt.h): the prompt, then tokens drawn one at a time
// from softmax(logits / temperature) over the top_k most likely next tokens.
// What the "gpt" recipe writes to sample.txt at the end of a run and what
// `meshtrain generate --run-dir RUN --prompt "..."` prints from a saved run.
//
//   LoadedGpt run = load_gpt_run("runs/gpt/version_0", tc);  // tc: the run's config.toml
//   std::string text = generate_text(*run.model, run.tokenizer, {.prompt = "The ", .tokens = 50});
//
// Draws are counter-based (core/random.h): draw i is uniform_at(seed,
// key_from_name("gpt.sample"), i), so a given (model, options) always writes
// the same text and every rank of a sharded model draws alike.
// sample.txt is generate_text with the defaults below and the run's seed.
// Each new token runs the model on the last block_size tokens (no key/value
// cache: generation is for looking at a model, not for serving it).
//
// Errors: InvalidArgument for options out of range (naming the option);
// load_gpt_run throws IoError naming the file for a run directory without
// model.safetensors or tokenizer.model, and InvalidArgument naming the
// parameter for weights that do not fit the configuration, or a run whose
// model is not "gpt".
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/nn/gpt.h"
#include "meshtrain/data/tokenizer.h"
#include "meshtrain/train/train_config.h"

namespace meshtrain::train {

struct SampleOptions {
  std::string prompt = "The ";
  int tokens = 120;          // new tokens, 1 to 100000
  double temperature = 0.8;  // > 0; 0: always the most likely token
  int top_k = 40;            // 0: the whole vocabulary
  uint64_t seed = 0;         // of the draws
};

// prompt_ids followed by options.tokens drawn tokens (options.prompt is not
// read: the caller encoded it). The model runs in evaluation mode and is
// left in the mode it was in. Collective when the model is sharded.
std::vector<int32_t> sample_tokens(nn::GPT& gpt, std::vector<int32_t> prompt_ids, const SampleOptions& options);

// tokenizer.decode(sample_tokens(gpt, tokenizer.encode(options.prompt), options)).
std::string generate_text(nn::GPT& gpt, const data::Tokenizer& tokenizer, const SampleOptions& options);

// A trained GPT and its tokenizer from a run directory: the model built from
// tc (the run's config.toml) with model.safetensors's weights, and the
// run's tokenizer.model.
struct LoadedGpt {
  std::unique_ptr<nn::GPT> model;
  data::Tokenizer tokenizer;
};
LoadedGpt load_gpt_run(const std::string& run_dir, const TrainConfig& tc);

}  // namespace meshtrain::train
