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
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/train/internal/builtin_recipes.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/data/text_data.h"
#include "meshtrain/data/tokenizer.h"

namespace meshtrain::train::internal {

using data::PreparedText;
using data::TextDataOptions;
using data::TextSplit;
using data::TokenDataSource;
using data::TokenFile;
using data::Tokenizer;
using data::WindowOptions;
using data::prepare_text_data;
using data::unigram_entropy;

namespace {

// Cross-entropy of the logits (this rank's vocabulary shard under tensor
// parallelism: the vocabulary-parallel loss) against targets, / norm.
class GptLoss {
 public:
  GptLoss(const nn::GPTConfig& c, MemoryTracker* tracker) : context_(c.context) {
    if (c.tensor.size() > 1) vocab_ce_.emplace(c.tensor, c.vocab, tracker);  // logits split by vocabulary
  }
  // targets (B, T): under context parallelism the logits are this rank's
  // chunks of each sample, and so are the targets scored.
  double forward(const Tensor& logits, const Tensor& targets, double norm, nn::Saved& saved) {
    const Tensor mine = context_.active() ? nn::shard_sequence(targets, context_, 1) : targets.contiguous();
    const Tensor t = mine.view({mine.numel()});
    return vocab_ce_ ? vocab_ce_->forward(logits, t, saved, norm) : ce_.forward(logits, t, saved, norm);
  }
  Tensor backward(nn::Saved& saved) { return vocab_ce_ ? vocab_ce_->backward(saved) : ce_.backward(saved); }

 private:
  nn::ContextParallelGroup context_;
  nn::CrossEntropyLoss ce_;
  std::optional<nn::VocabParallelCrossEntropy> vocab_ce_;
};

Evaluation summary(double loss, double unigram) {
  const double ppl = std::exp(loss);
  return {.loss = loss,
          .metrics = {{"loss", loss}, {"perplexity", ppl}, {"unigram_entropy", unigram}},
          .epoch_line = fmt::format("validation loss {:.4f} nats/token (perplexity {:.1f}; unigram entropy {:.4f})",
                                    loss, ppl, unigram),
          .final_line = fmt::format("validation loss {:.4f} nats/token, perplexity {:.1f} (unigram entropy {:.4f} "
                                    "nats/token)",
                                    loss, ppl, unigram)};
}

// The model's sizes and options as the config gives them (one rank, unsplit).
nn::GPTConfig gpt_config(const TrainConfig& tc) {
  return {.arch = tc.arch, .kv_heads = tc.kv_heads, .rope_base = tc.rope_base, .ffn_hidden = tc.ffn_hidden,
          .vocab = tc.vocab, .block_size = tc.context, .layers = tc.layers, .heads = tc.heads, .width = tc.width,
          .recompute = tc.recompute, .dropout = tc.dropout, .tie_embeddings = tc.tie_embeddings, .moe = tc.moe};
}

// The start-up check (RecipeRegistration::check): what the model's blocks,
// heads and sequence must divide.
void check_gpt_layout(const TrainConfig& tc, const layout::TrainingLayout& l) {
  const int tensor = l.size(mesh::kTensor), context = l.size(mesh::kContext), expert = l.size(mesh::kExpert);
  if (expert > 1 && !tc.moe.active())
    throw InvalidArgument("--mesh", fmt::format("an expert axis of {} for a model without experts", expert),
                          "add --arch llama --experts N (N divisible by the expert axis), or use a data axis");
  if (tc.moe.active() && tc.moe.experts % expert != 0)
    throw InvalidArgument("--experts", fmt::format("{} experts over an expert axis of {}", tc.moe.experts, expert),
                          "use a number of experts the expert axis divides");
  if (tc.heads % tensor != 0)
    throw InvalidArgument("--heads", fmt::format("{} heads over a tensor axis of {}", tc.heads, tensor),
                          "use a tensor axis size that divides the number of heads (each rank holds whole heads)");
  if (tc.arch == layout::DecoderArch::llama) {
    const int kv = tc.kv_heads == 0 ? tc.heads : tc.kv_heads;
    if (tc.heads % kv != 0)
      throw InvalidArgument("--kv-heads", fmt::format("{} key/value heads for {} heads", kv, tc.heads),
                            "use a kv_heads that divides heads");
    if (kv % tensor != 0 && tensor % kv != 0)
      throw InvalidArgument("--kv-heads", fmt::format("{} key/value heads over a tensor axis of {}", kv, tensor),
                            "use a tensor axis size that divides kv_heads, or one kv_heads divides (each head "
                            "then replicated on tensor / kv_heads ranks, as Megatron does)");
    // The column-parallel MLPs' features by torch.chunk's rule: every rank
    // needs some (20 over 6 ranks: 4 each leaves rank 5 none).
    const int64_t ffn = layout::llama_ffn_hidden(tc.width, tc.ffn_hidden);
    const int64_t expert_ffn = tc.moe.expert_hidden > 0 ? tc.moe.expert_hidden : ffn;
    const bool dense = !tc.moe.active() || tc.moe.first_dense > 0, moe = tc.moe.active();
    for (auto [features, flag] : {std::pair{dense ? ffn : 0, "--ffn-hidden"}, {moe ? expert_ffn : 0, "--expert-hidden"},
                                  {moe ? expert_ffn * tc.moe.shared_experts : 0, "--shared-experts"}})
      if (tensor > 1 && features > 0 && nn::shard_range(features, tensor - 1, tensor).size() == 0)
        throw InvalidArgument(flag, fmt::format("{} MLP features over a tensor axis of {} leave its last rank none",
                                                features, tensor),
                              fmt::format("use features that the tensor axis divides (or a tensor axis that divides "
                                          "{})", features));
    if (tc.dropout > 0.0)
      throw InvalidArgument("--arch llama", fmt::format("dropout {}", tc.dropout),
                            "Llama's blocks have no dropout: set --dropout 0, or use --arch gpt2");
  }
  if (tc.moe.active()) {
    if (tc.arch != layout::DecoderArch::llama)
      throw InvalidArgument("--experts", fmt::format("{} experts with --arch {}", tc.moe.experts,
                                                     layout::decoder_arch_name(tc.arch)),
                            "mixture-of-experts layers replace Llama's MLPs: add --arch llama");
    if (tc.moe.top_k > tc.moe.experts)
      throw InvalidArgument("--top-k", fmt::format("top_k {} of {} experts", tc.moe.top_k, tc.moe.experts),
                            "pick at most --experts experts per token");
    if (tc.moe.first_dense >= tc.layers)
      throw InvalidArgument("--first-dense", fmt::format("{} dense blocks of {}", tc.moe.first_dense, tc.layers),
                            "leave at least one block with experts");
    if (tc.sequence_parallel && tensor > 1)
      throw InvalidArgument("--sequence-parallel", "mixture-of-experts layers with sequence parallelism",
                            "drop --sequence-parallel: the tensor axis splits the experts without it");
    if (context > 1)
      throw InvalidArgument("--mesh", fmt::format("mixture-of-experts layers with a context axis of {}", context),
                            "capacity and the auxiliary loss count whole sequences: drop the context axis (not yet "
                            "supported with --experts)");
  }
  if (context > 1) {
    nn::check_context_length(tc.context, context, tc.cp_load_balance, "--seq-len (context)");
    const int64_t local_heads = tc.heads / tensor;
    if (l.cp_comm == nn::ContextComm::all_to_all && local_heads % context != 0)
      throw InvalidArgument("--cp-comm all_to_all",
                            fmt::format("{} heads over tensor {} x context {}: {} heads per tensor rank do not "
                                        "split over the context axis",
                                        tc.heads, tensor, context, local_heads),
                            "use --cp-comm ring, or heads divisible by tensor x context");
  }
  if (const int stages = l.size(mesh::kPipeline) * l.virtual_stages; stages > 1)
    (void)gpt_stage_configs(gpt_config(tc), stages);  // InvalidArgument when a stage would be empty
}

// One pipeline stage: blocks [first_block, last_block) with the embeddings
// on the first stage and ln_f, the tied head and the loss on the last. A
// micro-batch's Saved holds the part's state in child 0, the loss's in
// child 1.
class GptStage final : public RecipeStage {
 public:
  GptStage(const nn::GPTConfig& c, MemoryTracker* tracker) : gpt_(c), loss_(c, tracker) {
    gpt_.set_memory_tracker(tracker);
  }
  nn::Module& module() override { return gpt_; }
  std::vector<nn::Module*> fsdp_units() override { return gpt_.fsdp_units(); }
  MoELayers moe_layers() override { return gpt_.moe_layers(); }
  Tensor forward(const Batch& micro, int64_t step, double norm, const Tensor& input, nn::Saved& saved,
                 double* loss) override {
    const Tensor& tokens = micro["tokens"];
    // The real length too: a later stage's input may be padded for sequence parallelism.
    gpt_.set_batch_context(nn::BatchContext{.step = static_cast<uint64_t>(step),
                                            .first_global_sample = micro.first_global_sample,
                                            .sequence_length = tokens.size(1),
                                            .global_samples = norm});
    const Tensor out = gpt_.forward(gpt_.config().embed ? tokens : input, saved.child(0));
    if (!gpt_.config().head) return out;
    *loss = loss_.forward(out, micro["targets"], norm * static_cast<double>(tokens.size(1)), saved.child(1));
    return Tensor();
  }
  Tensor backward_input(const Tensor& grad, nn::Saved& saved) override {
    return gpt_.backward_input(gpt_.config().head ? loss_.backward(saved.child(1)) : grad, saved.child(0));
  }
  void backward_weight(nn::Saved& saved) override { gpt_.backward_weight(saved.child(0)); }
  Tensor backward(const Tensor& grad, nn::Saved& saved) override {
    return gpt_.backward(gpt_.config().head ? loss_.backward(saved.child(1)) : grad, saved.child(0));
  }
  // The residual stream (B, T, C); with context parallelism this rank's
  // chunks (T / n steps), with sequence parallelism its steps of those
  // padded to the split.
  std::vector<int64_t> input_shape(const Batch& micro) const override {
    const nn::GPTConfig& c = gpt_.config();
    const int64_t t = micro["tokens"].size(1) / c.context.size(), k = c.tensor.splits_sequence() ? c.tensor.size() : 1;
    return {micro.size(), (t + k - 1) / k, c.width};
  }
  Tensor evaluate(const Batch& chunk, int64_t n, const Tensor& input, std::vector<double>* sums) override {
    const Tensor& tokens = chunk["tokens"];
    nn::BatchContext context = gpt_.batch_context();
    context.sequence_length = tokens.size(1);
    gpt_.set_batch_context(context);
    const Tensor out = gpt_.forward(gpt_.config().embed ? tokens : input, eval_saved_);
    if (!gpt_.config().head) return out;
    sums->resize(1);
    (*sums)[0] += loss_.forward(out, chunk["targets"], static_cast<double>(n) * static_cast<double>(tokens.size(1)),
                                eval_loss_saved_);
    return Tensor();
  }
  std::vector<std::string> tied_parameters() const override {
    if (gpt_.config().tie_embeddings && gpt_.config().head != gpt_.config().embed)
      return {"wte.weight"};  // the embedding's, the head's copy
    return {};
  }

 private:
  nn::GPT gpt_;
  GptLoss loss_;
  nn::Saved eval_saved_, eval_loss_saved_;
};

class GptModel final : public RecipeModel {
 public:
  GptModel(const nn::GPTConfig& c, double unigram, std::shared_ptr<const Tokenizer> tokenizer, uint64_t seed,
           MemoryTracker* tracker)
      : gpt_(c), loss_(c, tracker), unigram_(unigram), tokenizer_(std::move(tokenizer)), seed_(seed) {
    gpt_.set_memory_tracker(tracker);
  }
  nn::Module& module() override { return gpt_; }
  std::vector<nn::Module*> fsdp_units() override { return gpt_.fsdp_units(); }
  MoELayers moe_layers() override { return gpt_.moe_layers(); }

  double loss_step(const Batch& micro, int64_t step, double norm) override {
    gpt_.set_batch_context(nn::BatchContext{.step = static_cast<uint64_t>(step),
                                            .first_global_sample = micro.first_global_sample,
                                            .global_samples = norm});
    const Tensor& tokens = micro["tokens"];
    const Tensor& targets = micro["targets"];
    const double tokens_per_sample = static_cast<double>(tokens.size(1));
    const double loss = loss_.forward(gpt_.forward(tokens), targets, norm * tokens_per_sample, loss_saved_);
    gpt_.backward(loss_.backward(loss_saved_));
    return loss;
  }

  // {cross-entropy summed over the chunk's tokens / (n tokens per sample)}.
  std::vector<double> evaluate(const Batch& chunk, int64_t n) override {
    const double per_token = static_cast<double>(n) * static_cast<double>(chunk["tokens"].size(1));
    return {loss_.forward(gpt_.forward(chunk["tokens"]), chunk["targets"], per_token, loss_saved_)};
  }
  // The logits of a chunk (rows x T x vocab floats) would otherwise dwarf the model.
  int64_t evaluation_rows() const override { return 16; }

  // sample.txt: SampleOptions's defaults with the run's seed, printed by
  // rank 0 too; tokenizer.model: the run's tokenizer, so the run directory
  // alone generates (meshtrain generate). Every rank samples (collective
  // under fsdp: the forwards gather parameters).
  void write_artifacts(const RunDirectory* dir) override {
    const SampleOptions o{.seed = seed_};
    gpt_.set_context_split(false);  // prompts of any length: each context rank runs them whole
    const std::string text = generate_text(gpt_, *tokenizer_, o);
    gpt_.set_context_split(true);
    if (dir == nullptr) return;
    write_file_atomic(dir->file("sample.txt"), text + "\n");
    write_file_atomic(dir->file("tokenizer.model"), tokenizer_->serialized());
    fmt::print("sample (prompt \"{}\", temperature {}, top-k {}):\n{}\n", o.prompt, o.temperature, o.top_k, text);
  }

  Evaluation summarize(std::span<const double> s, int64_t) const override { return summary(s[0], unigram_); }

 private:
  nn::GPT gpt_;
  GptLoss loss_;
  nn::Saved loss_saved_;
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
  // check_gpt_layout passed (the start-up checks).
  std::unique_ptr<RecipeModel> build(const ModelOptions& o) const override {
    nn::GPTConfig c = gpt_config(tc_);
    c.seed = o.seed;
    c.defer_init = o.defer_init;
    c.tensor = o.tensor;
    c.context = o.context;
    c.expert = o.expert;
    if (o.pipeline_stages > 1) return build_stages(c, o);
    auto m = std::make_unique<GptModel>(c, unigram_, tokenizer_, o.seed, o.tracker);
    m->module().set_compute_dtype(o.compute_dtype);
    return m;
  }

 private:
  std::unique_ptr<RecipeModel> build_stages(const nn::GPTConfig& whole, const ModelOptions& o) const {
    const std::vector<nn::GPTConfig> parts = gpt_stage_configs(whole, o.pipeline_stages);
    std::vector<std::unique_ptr<RecipeStage>> stages;
    for (int s : o.stages) {
      stages.push_back(std::make_unique<GptStage>(parts.at(static_cast<size_t>(s)), o.tracker));
      stages.back()->module().set_compute_dtype(o.compute_dtype);
    }
    const double unigram = unigram_;
    return std::make_unique<StagedModel>(
        std::move(stages), [unigram](std::span<const double> s, int64_t) { return summary(s[0], unigram); },
        /*evaluation_rows=*/16);
  }

  TrainConfig tc_;
  std::shared_ptr<const TokenFile> tokens_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  double unigram_ = 0;
  std::unique_ptr<TokenDataSource> train_, valid_;
};

}  // namespace

// The blocks cut by forward FLOPs per token (GPT-2's 24 C^2 per block plus
// causal attention's 2 T C; the tied head's 2 C V on the last block).
std::vector<nn::GPTConfig> gpt_stage_configs(const nn::GPTConfig& whole, int stages) {
  const double c = static_cast<double>(whole.width), t = static_cast<double>(whole.block_size);
  std::vector<double> costs(static_cast<size_t>(whole.layers), 24 * c * c + 2 * t * c);
  if (!costs.empty()) costs.back() += 2 * c * static_cast<double>(whole.vocab);
  const auto cut = pipeline_cut(costs, stages, "gpt");
  std::vector<nn::GPTConfig> out;
  for (int s = 0; s < stages; ++s) {
    nn::GPTConfig part = whole;
    part.first_block = cut[static_cast<size_t>(s)].first;
    part.last_block = cut[static_cast<size_t>(s)].second;
    part.embed = s == 0;
    part.head = s == stages - 1;
    out.push_back(part);
  }
  return out;
}

RecipeRegistration gpt_recipe() {
  return {"gpt", "GPT-2 decoder on a text corpus (vocab, context, layers, heads, width, corpus)",
          [](const TrainConfig& tc) { return std::make_unique<GptRecipe>(tc); },
          {"sample.txt", "tokenizer.model"}, check_gpt_layout};
}

}  // namespace meshtrain::train::internal
