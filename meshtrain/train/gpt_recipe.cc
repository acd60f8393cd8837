// The "gpt" recipe (model_recipe.h): a GPT-2 decoder (nn/gpt.h) trained on a
// text corpus (text_data.h: SentencePiece BPE, token file, windows of
// context + 1 tokens, every val_every-th window held out).
//
// Loss: cross-entropy per token. The trainer passes norm = global batch /
// loss scale (samples); a sample has `context` tokens, so the recipe divides
// by norm * context and every rank's gradient sums to the mean over the
// global batch's tokens. Evaluation reports nats per token and perplexity
// beside the corpus's unigram entropy (the loss a model with no context
// would reach). At the end, sample.txt holds text the model writes after
// the prompt "The " (generate.h: temperature 0.8, top-k 40) and
// tokenizer.model the run's tokenizer.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/tensor_parallel.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/train/internal/builtin_recipes.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/train/text_data.h"
#include "meshtrain/train/tokenizer.h"

namespace meshtrain::train::internal {

namespace {

class GptModel final : public RecipeModel {
 public:
  GptModel(const nn::GPTConfig& c, double unigram, std::shared_ptr<const Tokenizer> tokenizer, uint64_t seed,
           MemoryTracker* tracker)
      : gpt_(c), unigram_(unigram), tokenizer_(std::move(tokenizer)), seed_(seed) {
    gpt_.set_memory_tracker(tracker);
    if (c.tensor.size() > 1) vocab_ce_.emplace(c.tensor, c.vocab, tracker);  // logits split by vocabulary
  }
  nn::Module& module() override { return gpt_; }
  // One FSDP unit per transformer block; the root's unit holds the rest
  // (embeddings, the final LayerNorm), as FSDP wraps GPT-2 in torchtitan.
  std::vector<nn::Module*> fsdp_units() override {
    std::vector<nn::Module*> units = gpt_.blocks();
    units.push_back(&gpt_);
    return units;
  }

  double loss_step(const Batch& micro, int64_t step, double norm) override {
    gpt_.set_batch_context(static_cast<uint64_t>(step), micro.first_global_sample);
    const Tensor& tokens = micro["tokens"];
    const Tensor& targets = micro["targets"];
    const double tokens_per_sample = static_cast<double>(tokens.size(1));
    const double loss = loss_of(gpt_.forward(tokens), targets, norm * tokens_per_sample);
    gpt_.backward(vocab_ce_ ? vocab_ce_->backward() : ce_.backward());
    return loss;
  }

  // {cross-entropy summed over the chunk's tokens / (n tokens per sample)},
  // kEvalRows samples at a time: the logits of a chunk (rows x T x vocab
  // floats) would otherwise dwarf the model.
  std::vector<double> evaluate(const Batch& chunk, int64_t n) override {
    constexpr int64_t kEvalRows = 16;
    const double per_token = static_cast<double>(n) * static_cast<double>(chunk["tokens"].size(1));
    double sum = 0;
    for (int64_t lo = 0; lo < chunk.size(); lo += kEvalRows) {
      const Batch part = chunk.rows(lo, std::min(chunk.size(), lo + kEvalRows));
      const Tensor& targets = part["targets"];
      sum += loss_of(gpt_.forward(part["tokens"]), targets, per_token);
    }
    return {sum};
  }

  // sample.txt: SampleOptions's defaults with the run's seed, printed by
  // rank 0 too; tokenizer.model: the run's tokenizer, so the run directory
  // alone generates (meshtrain generate). Every rank samples (collective
  // under fsdp: the forwards gather parameters).
  void write_artifacts(const RunDirectory* dir) override {
    const SampleOptions o{.seed = seed_};
    const std::string text = generate_text(gpt_, *tokenizer_, o);
    if (dir == nullptr) return;
    write_file_atomic(dir->file("sample.txt"), text + "\n");
    write_file_atomic(dir->file("tokenizer.model"), tokenizer_->serialized());
    fmt::print("sample (prompt \"{}\", temperature {}, top-k {}):\n{}\n", o.prompt, o.temperature, o.top_k, text);
  }

  Evaluation summarize(std::span<const double> s, int64_t) const override {
    const double loss = s[0], ppl = std::exp(loss);
    return {.loss = loss,
            .metrics = {{"loss", loss}, {"perplexity", ppl}, {"unigram_entropy", unigram_}},
            .epoch_line = fmt::format("validation loss {:.4f} nats/token (perplexity {:.1f}; unigram entropy {:.4f})",
                                      loss, ppl, unigram_),
            .final_line = fmt::format("validation loss {:.4f} nats/token, perplexity {:.1f} (unigram entropy {:.4f} "
                                      "nats/token)",
                                      loss, ppl, unigram_)};
  }

 private:
  // Cross-entropy of the logits (this rank's vocabulary shard under tensor
  // parallelism: the vocabulary-parallel loss) against targets, / norm.
  double loss_of(const Tensor& logits, const Tensor& targets, double norm) {
    const Tensor t = targets.contiguous().view({targets.numel()});
    return vocab_ce_ ? vocab_ce_->forward(logits, t, norm) : ce_.forward(logits, t, norm);
  }

  nn::GPT gpt_;
  nn::CrossEntropyLoss ce_;
  std::optional<nn::VocabParallelCrossEntropy> vocab_ce_;
  double unigram_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  uint64_t seed_;
};

class GptRecipe final : public ModelRecipe {
 public:
  explicit GptRecipe(const TrainConfig& tc) : tc_(tc) {
    TextDataOptions opt{.corpus = tc.corpus, .out_dir = tc.text_cache, .tokenizer = {}};
    opt.tokenizer.vocab_size = tc.vocab;
    const PreparedText p = prepare_text_data(opt);
    tokens_ = std::make_shared<const TokenFile>(TokenFile::open(p.tokens_path, tc.vocab));
    tokenizer_ = std::make_shared<const Tokenizer>(Tokenizer::load(p.tokenizer_path));
    unigram_ = unigram_entropy(*tokens_);
    train_ = std::make_unique<TokenDataSource>(tokens_, TextSplit::train, WindowOptions{.context = tc.context});
    valid_ = std::make_unique<TokenDataSource>(tokens_, TextSplit::validation, WindowOptions{.context = tc.context});
  }
  const DataSource& train_data() const override { return *train_; }
  const DataSource& test_data() const override { return *valid_; }
  std::vector<std::string> artifacts() const override { return {"sample.txt", "tokenizer.model"}; }
  MetricsDescription metrics() const override {
    return {.test_loss = "validation loss", .test_curve = "validation loss (nats/token)",
            .chart_title = fmt::format("GPT ({} x {}, {} heads) on {}", tc_.layers, tc_.width, tc_.heads, tc_.corpus),
            .rate_unit = "tokens",
            .units_per_sample = static_cast<double>(tc_.context)};
  }
  std::unique_ptr<RecipeModel> build(const ModelOptions& o) const override {
    nn::GPTConfig c{.vocab = tc_.vocab, .block_size = tc_.context, .layers = tc_.layers, .heads = tc_.heads,
                    .width = tc_.width, .seed = o.seed, .recompute = tc_.recompute, .dropout = tc_.dropout,
                    .defer_init = o.defer_init, .tensor = o.tensor};
    auto m = std::make_unique<GptModel>(c, unigram_, tokenizer_, o.seed, o.tracker);
    m->module().set_compute_dtype(o.compute_dtype);
    return m;
  }

 private:
  TrainConfig tc_;
  std::shared_ptr<const TokenFile> tokens_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  double unigram_ = 0;
  std::unique_ptr<TokenDataSource> train_, valid_;
};

}  // namespace

RecipeRegistration gpt_recipe() {
  return {"gpt", "GPT-2 decoder on a text corpus (vocab, context, layers, heads, width, corpus)",
          [](const TrainConfig& tc) { return std::make_unique<GptRecipe>(tc); },
          {"sample.txt", "tokenizer.model"}};
}

}  // namespace meshtrain::train::internal
