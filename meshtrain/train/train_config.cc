#include "meshtrain/train/train_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <toml++/toml.h>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/train/model_recipe.h"

namespace meshtrain::train {
namespace {

[[noreturn]] void bad(std::string_view source, std::string_view text, std::string_view want) {
  throw InvalidArgument("TrainConfig", fmt::format("{}: '{}' is not {}", source, text, want),
                        fmt::format("give {}", want));
}

constexpr const char* kOp = "TrainConfig";
constexpr int64_t kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// Largest layer width (hidden, latent): a 65536 x 65536 f32 weight is 16 GiB.
constexpr int64_t kMaxWidth = 65536;
constexpr int64_t kMaxHiddenLayers = 1024;

// Integers are range-checked before they are narrowed to the field's type,
// so 4294967552 is refused instead of becoming 256.
int64_t to_int(std::string_view t, std::string_view src, int64_t min, int64_t max) {
  return parse_int_in_range(t, src, min, max, kOp);
}
// Finite numbers only: "nan" and "inf" parse as doubles but are never a setting.
double to_double(std::string_view t, std::string_view src, const NumberRange& range) {
  return parse_double_in_range(t, src, range, kOp);
}
bool to_bool(std::string_view t, std::string_view src) {
  if (t == "true" || t == "1" || t == "on") return true;
  if (t == "false" || t == "0" || t == "off") return false;
  bad(src, t, "true or false");
}
std::vector<int> to_widths(std::string_view t, std::string_view src) {
  std::vector<int> out;
  const auto pieces = split(t);
  if (pieces.size() > kMaxHiddenLayers)
    throw InvalidArgument(kOp, fmt::format("{}: {} hidden layers, more than {}", src, pieces.size(), kMaxHiddenLayers),
                          "give at most 1024 hidden sizes");
  for (const std::string_view piece : pieces) out.push_back(static_cast<int>(to_int(piece, src, 1, kMaxWidth)));
  return out;
}
std::string num(double v) { return fmt::format("{}", v); }

// The choice-valued keys: parsed here, once, into what the trainer uses.
// Errors read "<source>: <key> '<text>'" and list the choices.
[[noreturn]] void bad_choice(std::string_view src, std::string_view key, std::string_view t, std::string_view hint) {
  throw InvalidArgument(kOp, fmt::format("{}: {} '{}' is not one of its choices", src, key, t), std::string(hint));
}
// `parse` (a layout vocabulary parser) on t, its refusal restated as
// bad_choice's, naming the source and the key.
template <typename Parse>
auto choice(Parse parse, std::string_view t, std::string_view src, std::string_view key, std::string_view hint) {
  try {
    return parse(t);
  } catch (const InvalidArgument&) {
    bad_choice(src, key, t, hint);
  }
}
FsdpSetting to_fsdp(std::string_view t, std::string_view src) {
  if (t.empty()) return {};
  return {std::string(t),
          choice(layout::parse_fsdp_mode, t, src, "fsdp",
                 "use full, shard_grad_op, no_shard, zero1, zero2, zero3, hybrid_full or hybrid_shard_grad_op, or "
                 "\"\" for plain data parallelism")};
}
NonFinitePolicy to_policy(std::string_view t, std::string_view src) {
  if (t == "error") return NonFinitePolicy::error;
  if (t == "skip") return NonFinitePolicy::skip;
  bad_choice(src, "on_nonfinite", t, "use error (stop the run) or skip (skip the step and count it)");
}
std::optional<DType> to_reduce_dtype(std::string_view t, std::string_view src) {
  if (t.empty()) return std::nullopt;
  if (std::find(layout::kPrecisionNames.begin(), layout::kPrecisionNames.end(), t) == layout::kPrecisionNames.end())
    bad_choice(src, "reduce_precision", t, "use \"\" (the compute precision), fp32, bf16 or fp16");
  return layout::parse_precision(t);
}
std::string reduce_dtype_name(std::optional<DType> d) { return d ? std::string(layout::precision_name(*d)) : ""; }
layout::ZeroPPParts to_zeropp(std::string_view t, std::string_view src) {
  try {
    return layout::parse_zeropp(t);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(kOp, fmt::format("{}: {}", src, e.detail()), e.hint());
  }
}

// A TOML basic string: "..." with \\, \" and control characters escaped.
std::string toml_basic_string(std::string_view v) {
  std::string out = "\"";
  for (const char ch : v) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f)
          out += fmt::format("\\u{:04X}", static_cast<unsigned char>(ch));
        else
          out += ch;
    }
  }
  return out + "\"";
}

// MT_INT(field, lo, hi): the range is checked in int64 before the value is
// narrowed to the field's type, and every range fits that type.
#define MT_INT(field, lo, hi)                                                                                     \
  [](TrainConfig& c, std::string_view t, std::string_view s) {                                                    \
    static_assert((hi) <= std::numeric_limits<decltype(c.field)>::max());                                         \
    c.field = static_cast<decltype(c.field)>(to_int(t, s, lo, hi));                                               \
  },                                                                                                              \
      [](const TrainConfig& c) { return fmt::format("{}", c.field); }, TrainFieldKind::integer
// MT_DBL(field, range): a finite number inside the NumberRange.
#define MT_DBL(field, ...)                                                                                        \
  [](TrainConfig& c, std::string_view t, std::string_view s) { c.field = to_double(t, s, NumberRange __VA_ARGS__); }, \
      [](const TrainConfig& c) { return num(c.field); }, TrainFieldKind::number
#define MT_BOOL(field) [](TrainConfig& c, std::string_view t, std::string_view s) { c.field = to_bool(t, s); }, \
                       [](const TrainConfig& c) { return std::string(c.field ? "true" : "false"); }, TrainFieldKind::boolean
#define MT_STR(field) [](TrainConfig& c, std::string_view t, std::string_view) { c.field = std::string(t); }, \
                      [](const TrainConfig& c) { return c.field; }, TrainFieldKind::string

const TrainField kFields[] = {
    {"model", "--model", "the model recipe: mlp | vae | gpt (built in)", MT_STR(model)},
    {"hidden", "--hidden", "hidden layer sizes, e.g. 512,512,256 (each 1 to 65536, at most 1024 layers)",
     [](TrainConfig& c, std::string_view t, std::string_view s) { c.hidden = to_widths(t, s); },
     [](const TrainConfig& c) { return fmt::format("{}", fmt::join(c.hidden, ",")); }, TrainFieldKind::integer_list},
    {"latent", "--latent", "VAE latent size (1 to 65536)", MT_INT(latent, 1, kMaxWidth)},
    {"vocab", "--vocab", "GPT: BPE vocabulary size (300 to 65536; the tokenizer is trained to it)",
     MT_INT(vocab, 300, 65536)},
    {"context", "--context", "GPT: tokens per sample, T (2 to 8192)", MT_INT(context, 2, 8192)},
    {"layers", "--layers", "GPT: transformer blocks (1 to 1024)", MT_INT(layers, 1, 1024)},
    {"heads", "--heads", "GPT: attention heads, dividing width (1 to 1024)", MT_INT(heads, 1, 1024)},
    {"width", "--width", "GPT: model width (1 to 65536)", MT_INT(width, 1, kMaxWidth)},
    {"arch", "--arch", "GPT: gpt2 (GPT-2's blocks) | llama (RMSNorm, rotary positions, grouped-query attention, "
     "SwiGLU MLP, no biases)",
     [](TrainConfig& c, std::string_view t, std::string_view s) {
       const auto parse = [](std::string_view x) { return layout::parse_decoder_arch(x); };
       c.arch = choice(parse, t, s, "arch", "use gpt2 or llama");
     },
     [](const TrainConfig& c) { return std::string(layout::decoder_arch_name(c.arch)); }, TrainFieldKind::string},
    {"kv_heads", "--kv-heads", "GPT llama: key/value heads, dividing heads (0: heads, multi-head attention)",
     MT_INT(kv_heads, 0, 1024)},
    {"rope_base", "--rope-base", "GPT llama: the rotary embedding's base (> 1; Llama 3: 500000)",
     MT_DBL(rope_base, {.min = 1, .min_open = true})},
    {"ffn_hidden", "--ffn-hidden", "GPT llama: the SwiGLU MLP's width (0: 8/3 width, rounded up to a multiple of 64)",
     MT_INT(ffn_hidden, 0, 4 * kMaxWidth)},
    {"tie_embeddings", "--tie-embeddings",
     "GPT: the output head multiplies the token embedding wte (false: a table of its own, lm_head, as Llama 2 and "
     "later)",
     MT_BOOL(tie_embeddings)},
    {"experts", "--experts",
     "GPT llama: routed experts of each mixture-of-experts layer (0: dense MLPs; the expert axis divides it)",
     MT_INT(moe.experts, 0, 4096)},
    {"top_k", "--top-k", "GPT llama with experts: experts per token (1 to experts)", MT_INT(moe.top_k, 1, 4096)},
    {"expert_hidden", "--expert-hidden", "GPT llama with experts: each expert's hidden width (0: ffn_hidden)",
     MT_INT(moe.expert_hidden, 0, 4 * kMaxWidth)},
    {"shared_experts", "--shared-experts",
     "GPT llama with experts: shared experts every token uses (one SwiGLU of shared_experts x expert_hidden)",
     MT_INT(moe.shared_experts, 0, 64)},
    {"router_score", "--router-score",
     "GPT llama with experts: softmax (Switch, Mixtral) | sigmoid (DeepSeek-V3) router scores",
     [](TrainConfig& c, std::string_view t, std::string_view s) {
       const auto parse = [](std::string_view x) { return layout::parse_router_score(x); };
       c.moe.score = choice(parse, t, s, "router_score", "use softmax or sigmoid");
     },
     [](const TrainConfig& c) { return std::string(layout::router_score_name(c.moe.score)); },
     TrainFieldKind::string},
    {"normalize_top_k", "--normalize-top-k", "GPT llama with experts: the k routing weights sum to 1",
     MT_BOOL(moe.normalize_top_k)},
    {"aux_loss_coef", "--aux-loss-coef",
     "GPT llama with experts: the load-balancing loss's coefficient (Switch/GShard form per sequence; 0: off)",
     MT_DBL(moe.aux_loss_coef, {.min = 0})},
    {"capacity_factor", "--capacity-factor",
     "GPT llama with experts: each expert takes at most ceil(factor x T x top_k / experts) tokens of a sequence, "
     "the rest dropped (0: no dropping)",
     MT_DBL(moe.capacity_factor, {.min = 0})},
    {"bias_update_rate", "--bias-update-rate",
     "GPT llama with experts: DeepSeek-V3's auxiliary-loss-free balancing step per optimizer step (0: off)",
     MT_DBL(moe.bias_update_rate, {.min = 0})},
    {"first_dense", "--first-dense", "GPT llama with experts: the first blocks that keep dense MLPs",
     MT_INT(moe.first_dense, 0, 1024)},
    {"recompute", "--recompute", "GPT: recompute each block's activations in backward", MT_BOOL(recompute)},
    {"device_memory", "--device-memory",
     "memory per device, e.g. 24GiB or 80GB (\"\": not checked): the GPT's predicted peak must fit (10% kept "
     "free); a resumed run on fewer devices is re-planned to fit (more micro-batches, ZeRO, recompute)",
     [](TrainConfig& c, std::string_view t, std::string_view s) {
       if (!t.empty()) (void)plan::parse_memory_size(t, s);
       c.device_memory = std::string(t);
     },
     [](const TrainConfig& c) { return c.device_memory; }, TrainFieldKind::string},
    {"sequence_parallel", "--sequence-parallel",
     "GPT with a tensor axis: split the activations outside the tensor-parallel regions along the sequence",
     MT_BOOL(sequence_parallel)},
    {"tp_overlap", "--tp-overlap",
     "with a tensor axis: hide the tensor-parallel collectives behind the GEMMs beside them, in blocks",
     MT_BOOL(tp_overlap)},
    {"corpus", "--corpus", "GPT: the text corpus, a file or directory", MT_STR(corpus)},
    {"text_cache", "--text-cache", "GPT: where the tokenizer and token file are cached", MT_STR(text_cache)},
    {"dropout", "--dropout",
     "dropout probability, in [0, 1) (MLP: after each hidden layer; GPT: embeddings and residual branches)",
     MT_DBL(dropout, {.min = 0, .max = 1, .max_open = true})},
    {"epochs", "--epochs", "passes over the training set (1 to 1000000)", MT_INT(epochs, 1, 1000000)},
    {"batch_size", "--batch-size", "global batch size (all data-parallel ranks), 1 to 16777216", MT_INT(batch_size, 1, 1 << 24)},
    {"micro_batches", "--micro-batches", "gradient accumulation steps per optimizer step (1 to 16777216)", MT_INT(micro_batches, 1, 1 << 24)},
    {"pipeline_schedule", "--pipeline-schedule",
     "with a pipeline axis: gpipe | 1f1b | interleaved | zb (zero-bubble ZB-H1)",
     [](TrainConfig& c, std::string_view t, std::string_view s) {
       c.pipeline_schedule =
           choice(layout::parse_schedule_kind, t, s, "pipeline_schedule", "use gpipe, 1f1b, interleaved or zb");
     },
     [](const TrainConfig& c) { return std::string(layout::to_string(c.pipeline_schedule)); },
     TrainFieldKind::string},
    {"virtual_stages", "--virtual-stages",
     "with a pipeline axis: model chunks per pipeline rank (interleaved: 2 or more), 1 to 1024",
     MT_INT(virtual_stages, 1, 1024)},
    {"cp_comm", "--cp-comm",
     "GPT with a context axis: ring (K/V blocks passed around the ring) | all_to_all (DeepSpeed Ulysses: heads "
     "scattered, the sequence gathered)",
     [](TrainConfig& c, std::string_view t, std::string_view s) {
       const auto parse = [](std::string_view x) { return layout::parse_context_comm(x); };  // default `what`
       c.cp_comm = choice(parse, t, s, "cp_comm", "use ring or all_to_all");
     },
     [](const TrainConfig& c) { return std::string(layout::context_comm_name(c.cp_comm)); }, TrainFieldKind::string},
    {"cp_load_balance", "--cp-load-balance",
     "GPT with a context axis: each rank holds sequence chunks i and 2n-1-i (zig-zag), evening out causal attention",
     MT_BOOL(cp_load_balance)},
    {"optimizer", "--optimizer", "adamw | sgd", MT_STR(optimizer)},
    {"lr", "--lr", "peak learning rate (> 0)", MT_DBL(lr, {.min = 0, .min_open = true})},
    {"momentum", "--momentum", "SGD momentum, in [0, 1)", MT_DBL(momentum, {.min = 0, .max = 1, .max_open = true})},
    {"weight_decay", "--weight-decay", "weight decay >= 0 (biases and norms never decay)", MT_DBL(weight_decay, {.min = 0})},
    {"schedule", "--schedule", "constant | cosine (after linear warmup)", MT_STR(schedule)},
    {"warmup_steps", "--warmup-steps", "linear warmup steps (>= 0)", MT_INT(warmup_steps, 0, kIntMax)},
    {"min_lr_ratio", "--min-lr-ratio", "cosine floor as a fraction of lr, in [0, 1]", MT_DBL(min_lr_ratio, {.min = 0, .max = 1})},
    {"lr_decay_steps", "--lr-decay-steps",
     "length of the cosine schedule in steps, >= 0 (0 = all epochs' steps; --max-steps does not shorten it)",
     MT_INT(lr_decay_steps, 0, kInt64Max)},
    {"clip_norm", "--clip-norm", "global gradient-norm clipping, >= 0 (0 = off)", MT_DBL(clip_norm, {.min = 0})},
    {"on_nonfinite", "--on-nonfinite",
     "error | skip: a non-finite loss or gradient stops the run, or skips that optimizer step (counted)",
     [](TrainConfig& c, std::string_view t, std::string_view s) { c.on_nonfinite = to_policy(t, s); },
     [](const TrainConfig& c) { return std::string(to_string(c.on_nonfinite)); }, TrainFieldKind::string},
    {"max_consecutive_skips", "--max-consecutive-skips",
     "stop after this many skipped steps in a row (non-finite steps with skip, fp16 loss-scale overflows), >= 1",
     MT_INT(max_consecutive_skips, 1, kIntMax)},
    {"loss_spike", "--loss-spike",
     "stop the run when a step's loss exceeds this multiple of the mean of the last --loss-spike-window steps' "
     "(0 = off, else > 1)",
     MT_DBL(loss_spike, {.min = 0})},
    {"loss_spike_window", "--loss-spike-window", "steps the loss-spike guard averages over (>= 1)",
     MT_INT(loss_spike_window, 1, kIntMax)},
    {"seed", "--seed", "seed of initialization, shuffling, dropout and noise (0 to 2^63-1)", MT_INT(seed, 0, kInt64Max)},
    {"max_steps", "--max-steps", "stop after this many optimizer steps, >= 0 (0 = all epochs)", MT_INT(max_steps, 0, kInt64Max)},
    {"log_every", "--log-every", "steps between metrics lines (>= 1)", MT_INT(log_every, 1, kIntMax)},
    {"bucket_mb", "--bucket-mb", "data-parallel gradient bucket size in MiB, in (0, 65536]", MT_DBL(bucket_mb, {.min = 0, .max = 65536, .min_open = true})},
    {"threads_per_rank", "--threads-per-rank", "BLAS threads per rank, 0 to 1024 (0 = cores / ranks)", MT_INT(threads_per_rank, 0, 1024)},
    {"drop_last", "--drop-last", "drop the last partial batch of each epoch", MT_BOOL(drop_last)},
    {"deterministic", "--deterministic",
     "the same parameter bits on any data, fsdp or pipeline layout, engine and thread count (docs/determinism.md)",
     MT_BOOL(deterministic)},
    {"deterministic_block", "--deterministic-block",
     "--deterministic: samples per block of the canonical reduction tree, 0 to 2^20 (0 = the fewest samples of at "
     "least 32 rows, a power of two)",
     MT_INT(deterministic_block, 0, 1 << 20)},
    {"checksum_every", "--checksum-every",
     "steps between checksums of the full model's parameters in metrics.jsonl, >= 0 (0 = none); the same on any "
     "layout",
     MT_INT(checksum_every, 0, kIntMax)},
    {"fsdp", "--fsdp",
     "fully sharded data parallelism: full | shard_grad_op | no_shard | zero1 | zero2 | zero3 | hybrid_full | "
     "hybrid_shard_grad_op (\"\" = plain data parallelism; an fsdp mesh axis > 1 defaults to full)",
     [](TrainConfig& c, std::string_view t, std::string_view s) { c.fsdp = to_fsdp(t, s); },
     [](const TrainConfig& c) { return c.fsdp.name; }, TrainFieldKind::string},
    {"fsdp_min_weight_size", "--fsdp-min-weight-size", "parameters with fewer elements stay replicated in f32 (>= 0)",
     MT_INT(fsdp_min_weight_size, 0, kInt64Max)},
    {"zeropp", "--zeropp",
     "fsdp zero2/zero3 with ZeRO++ over the mesh's node x fsdp axes: comma list of qwz (quantized weight "
     "all-gathers), qgz (hierarchical quantized gradient reduce-scatter), hpz (node-local secondary parameter "
     "shards: backward's gathers stay within the node); \"\" = off",
     [](TrainConfig& c, std::string_view t, std::string_view s) { c.zeropp = to_zeropp(t, s); },
     [](const TrainConfig& c) { return c.zeropp.to_string(); }, TrainFieldKind::string},
    {"zeropp_bits", "--zeropp-bits", "ZeRO++ code width: 8 or 4", MT_INT(zeropp_bits, 4, 8)},
    {"zeropp_grad_bits", "--zeropp-grad-bits", "qgz's code width when not --zeropp-bits: 8 or 4 (0 = the same)",
     MT_INT(zeropp_grad_bits, 0, 8)},
    {"zeropp_block", "--zeropp-block", "ZeRO++ values per f32 scale (even for 4 bits), 2 to 65536",
     MT_INT(zeropp_block, 2, 65536)},
    {"forward_prefetch", "--forward-prefetch", "fsdp: start the next unit's all-gather during forward",
     MT_BOOL(forward_prefetch)},
    {"backward_prefetch", "--backward-prefetch", "fsdp: none | pre | post (when backward gathers the next unit)",
     [](TrainConfig& c, std::string_view t, std::string_view s) {
       c.backward_prefetch =
           choice(layout::parse_backward_prefetch, t, s, "backward_prefetch", "use none, pre or post");
     },
     [](const TrainConfig& c) { return std::string(layout::to_string(c.backward_prefetch)); },
     TrainFieldKind::string},
    {"reshard_after_forward", "--reshard-after-forward",
     "fsdp: free gathered parameters after forward and gather again for backward", MT_BOOL(reshard_after_forward)},
    {"reduce_precision", "--reduce-precision",
     "fsdp: dtype of gradients and their reduction: \"\" = the compute precision, fp32, bf16 or fp16",
     [](TrainConfig& c, std::string_view t, std::string_view s) { c.reduce_precision = to_reduce_dtype(t, s); },
     [](const TrainConfig& c) { return reduce_dtype_name(c.reduce_precision); }, TrainFieldKind::string},
    {"data_dir", "--data-dir", "Fashion-MNIST directory (Debian: dataset-fashion-mnist)", MT_STR(data_dir)},
    {"run_dir", "--run-dir",
     "where config, metrics, model and pictures go (\"\" = the next runs/<model>/version_<N>)", MT_STR(run_dir)},
    {"overwrite", "--overwrite", "replace the run in run_dir (only once the new run succeeds)", MT_BOOL(overwrite)},
    {"checkpoint_every", "--checkpoint-every",
     "save a sharded checkpoint into <run_dir>/checkpoints every N steps and at the end (0 = none)",
     MT_INT(checkpoint_every, 0, kInt64Max)},
    {"keep_last", "--keep-last", "keep only the newest N checkpoints (0 = all)", MT_INT(keep_last, 0, 1000000)},
    {"async_checkpoint", "--async-checkpoint",
     "write checkpoints in the background while training goes on (a staging copy of this rank's state; the "
     "previous checkpoint finishes first)",
     MT_BOOL(async_checkpoint)},
    {"resume", "--resume",
     "continue the run in this directory from its newest checkpoint, on any mesh (its config.toml is the default "
     "configuration)",
     MT_STR(resume)},
    {"init_from", "--init-from",
     "start from the parameters in this safetensors file (meshtrain export's PyTorch layout) instead of the "
     "seed's",
     MT_STR(init_from)},
};

#undef MT_INT
#undef MT_DBL
#undef MT_STR
#undef MT_BOOL

const TrainField& field(std::string_view key, std::string_view source) {
  for (const auto& f : kFields)
    if (f.key == key) return f;
  std::vector<std::string_view> keys;
  for (const auto& f : kFields) keys.push_back(f.key);
  throw InvalidArgument("TrainConfig", fmt::format("{}: unknown key '{}'", source, key),
                        fmt::format("valid keys: {}", fmt::join(keys, ", ")));
}

}  // namespace

std::string_view to_string(NonFinitePolicy p) { return p == NonFinitePolicy::skip ? "skip" : "error"; }

std::span<const TrainField> train_config_fields() { return kFields; }

void TrainConfig::set(std::string_view key, std::string_view value, std::string_view source) {
  field(key, source).parse(*this, value, source);
}

TrainConfig TrainConfig::from_toml(std::string_view text, std::string_view source) {
  TrainConfig c;
  toml::table doc;
  try {
    doc = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw InvalidArgument(kOp,
                          fmt::format("{}:{}:{}: {}", source, e.source().begin.line, e.source().begin.column,
                                      e.description()),
                          "fix the TOML syntax at that position");
  }
  // Any subset of the project's sections (config::kTomlSections); the
  // top-level keys of a file without [distributed] are DistributedConfig's,
  // which rejects the unknown ones. A training key there was meant for [train].
  for (auto&& [k, v] : doc) {
    const std::string at = fmt::format("{}:{}:{}", source, k.source().begin.line, k.source().begin.column);
    const std::string_view key = k.str();
    if (v.is_table()) {
      if (std::find(std::begin(config::kTomlSections), std::end(config::kTomlSections), key) ==
          std::end(config::kTomlSections))
        throw InvalidArgument(kOp, fmt::format("{}: unknown section [{}]", at, key),
                              "a meshtrain TOML file holds the sections [distributed] and [train]");
      continue;
    }
    if (key == "train")
      throw InvalidArgument(kOp, fmt::format("{}: train must be a table", at), "write the keys under a [train] header");
    for (const auto& f : kFields)
      if (f.key == key)
        throw InvalidArgument(kOp, fmt::format("{}: training key '{}' is outside [train]", at, key),
                              "put it under a [train] header");
  }
  const toml::table* t = doc["train"].as_table();
  if (!t) return c;  // no [train] section: defaults
  for (const auto& [k, v] : *t) {
    const std::string where = fmt::format("{}: train.{}", source, k.str());
    std::string text_value;
    if (auto s = v.value<std::string>(); s && v.is_string()) text_value = *s;
    else if (v.is_integer()) text_value = fmt::format("{}", *v.value<int64_t>());
    else if (v.is_floating_point()) text_value = fmt::format("{}", *v.value<double>());
    else if (v.is_boolean()) text_value = *v.value<bool>() ? "true" : "false";
    else if (const toml::array* a = v.as_array()) {
      std::vector<std::string> parts;
      for (size_t i = 0; i < a->size(); ++i) {
        const auto e = (*a)[i].value<int64_t>();
        if (!(*a)[i].is_integer() || !e)
          throw InvalidArgument(kOp, fmt::format("{}[{}]: not an integer", where, i), "write e.g. [512, 256]");
        parts.push_back(fmt::format("{}", *e));
      }
      text_value = fmt::format("{}", fmt::join(parts, ","));
    } else {
      throw InvalidArgument(kOp, where + ": unsupported value type", "use a string, number or array");
    }
    c.set(k.str(), text_value, where);
  }
  return c;
}

TrainConfig TrainConfig::from_toml_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw IoError("TrainConfig", fmt::format("cannot open '{}'", path), "check the --config path");
  std::stringstream ss;
  ss << in.rdbuf();
  return from_toml(ss.str(), path);
}

void TrainConfig::continue_in_resumed_directory(bool run_dir_given, std::string_view flag) {
  if (resume.empty()) return;
  if (run_dir_given &&
      std::filesystem::path(run_dir).lexically_normal() != std::filesystem::path(resume).lexically_normal())
    throw InvalidArgument(std::string(flag), fmt::format("run_dir {} with resume {}", run_dir, resume),
                          "a resumed run continues in its own directory: drop run_dir");
  run_dir = resume;
}

void TrainConfig::validate() const {
  auto require = [](bool ok, const std::string& what, const std::string& hint) {
    if (!ok) throw InvalidArgument("TrainConfig::validate", what, hint);
  };
  (void)find_model_recipe(model);  // throws naming the registered recipes
  require(!hidden.empty(), "hidden is empty", "give at least one hidden size, e.g. 512,512");
  for (int h : hidden)
    require(h > 0 && h <= kMaxWidth, fmt::format("hidden size {}", h), "hidden sizes must be in [1, 65536]");
  require(latent > 0 && latent <= kMaxWidth, fmt::format("latent {}", latent), "latent must be in [1, 65536]");
  require(dropout >= 0 && dropout < 1, fmt::format("dropout {}", dropout), "dropout must be in [0, 1)");
  require(heads > 0 && width % heads == 0, fmt::format("width {} over heads {}", width, heads),
          "pick --heads dividing --width (e.g. width 256, heads 4)");
  require(epochs > 0, fmt::format("epochs {}", epochs), "epochs must be positive");
  require(batch_size > 0, fmt::format("batch_size {}", batch_size), "batch_size must be positive");
  require(micro_batches > 0 && batch_size % micro_batches == 0,
          fmt::format("batch_size {} with micro_batches {}", batch_size, micro_batches),
          "micro_batches must divide batch_size");
  require(optimizer == "adamw" || optimizer == "sgd", fmt::format("optimizer '{}'", optimizer),
          "use adamw or sgd");
  require(lr > 0, fmt::format("lr {}", lr), "lr must be positive");
  const bool pipeline_name =
      std::find(layout::kScheduleNames.begin(), layout::kScheduleNames.end(), schedule) != layout::kScheduleNames.end();
  require(schedule == "constant" || schedule == "cosine", fmt::format("schedule '{}'", schedule),
          pipeline_name ? fmt::format("schedule is the learning-rate schedule (constant or cosine); the pipeline "
                                      "schedule is pipeline_schedule (--pipeline-schedule {})",
                                      schedule)
                        : std::string("use constant or cosine"));
  require(zeropp_bits == 8 || zeropp_bits == 4, fmt::format("zeropp_bits {}", zeropp_bits), "use 8 or 4");
  require(zeropp_grad_bits == 0 || zeropp_grad_bits == 8 || zeropp_grad_bits == 4,
          fmt::format("zeropp_grad_bits {}", zeropp_grad_bits), "use 8 or 4 (or 0: zeropp_bits)");
  require((zeropp_bits == 8 && zeropp_grad_bits != 4) || zeropp_block % 2 == 0,
          fmt::format("zeropp_block {} with 4 bits", zeropp_block), "4-bit codes pack two per byte: use an even block");
  require(virtual_stages >= 1 && (virtual_stages == 1 || pipeline_schedule == layout::ScheduleKind::interleaved_1f1b),
          fmt::format("virtual_stages {} with pipeline_schedule '{}'", virtual_stages,
                      layout::to_string(pipeline_schedule)),
          "more than one model chunk per rank needs pipeline_schedule = \"interleaved\"");
  require(warmup_steps >= 0 && min_lr_ratio >= 0 && min_lr_ratio <= 1,
          fmt::format("warmup_steps {}, min_lr_ratio {}", warmup_steps, min_lr_ratio),
          "warmup_steps >= 0 and min_lr_ratio in [0, 1]");
  require(clip_norm >= 0 && std::isfinite(clip_norm), fmt::format("clip_norm {}", clip_norm), "0 turns clipping off");
  require(std::isfinite(lr) && momentum >= 0 && momentum < 1 && weight_decay >= 0 && std::isfinite(weight_decay),
          fmt::format("lr {}, momentum {}, weight_decay {}", lr, momentum, weight_decay),
          "lr finite, momentum in [0, 1), weight_decay finite and >= 0");
  require(lr_decay_steps >= 0, fmt::format("lr_decay_steps {}", lr_decay_steps),
          "0 decays over all epochs' steps, or give the schedule's length in steps");
  require(max_consecutive_skips >= 1, fmt::format("max_consecutive_skips {}", max_consecutive_skips),
          "give at least 1 (the default is 25)");
  require((loss_spike == 0 || loss_spike > 1) && std::isfinite(loss_spike) && loss_spike_window >= 1,
          fmt::format("loss_spike {}, loss_spike_window {}", loss_spike, loss_spike_window),
          "loss_spike 0 (off) or a factor above 1 (the default is 10), loss_spike_window >= 1");
  require(log_every > 0 && bucket_mb > 0 && threads_per_rank >= 0 && max_steps >= 0,
          fmt::format("log_every {}, bucket_mb {}, threads_per_rank {}, max_steps {}", log_every, bucket_mb,
                      threads_per_rank, max_steps),
          "log_every and bucket_mb positive; threads_per_rank and max_steps >= 0");
  require(fsdp_min_weight_size >= 0, fmt::format("fsdp_min_weight_size {}", fsdp_min_weight_size),
          "use 0 to shard every parameter");
}

std::string TrainConfig::to_toml() const {
  std::string s = "[train]\n";
  for (const auto& f : kFields) {
    const std::string v = f.format(*this);
    std::string literal;
    switch (f.kind) {
      case TrainFieldKind::string:
        literal = toml_basic_string(v);
        break;
      case TrainFieldKind::integer_list:
        literal = fmt::format("[{}]", fmt::join(split(v), ", "));
        break;
      case TrainFieldKind::number:  // "25" would read back as an integer
        literal = v.find_first_of(".eEni") == std::string::npos ? v + ".0" : v;
        break;
      case TrainFieldKind::integer:
      case TrainFieldKind::boolean:
        literal = v;
        break;
    }
    s += fmt::format("{} = {}\n", f.key, literal);
  }
  return s;
}

int64_t rows_per_sample(const TrainConfig& c) { return c.model == "gpt" ? c.context : 1; }

}  // namespace meshtrain::train
