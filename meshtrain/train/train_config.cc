#include "meshtrain/train/train_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <fstream>
#include <sstream>
#include <toml++/toml.h>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/parallel/fully_sharded.h"

namespace meshtrain::train {
namespace {

[[noreturn]] void bad(std::string_view source, std::string_view text, std::string_view want) {
  throw InvalidArgument("TrainConfig", fmt::format("{}: '{}' is not {}", source, text, want),
                        fmt::format("give {}", want));
}

int64_t to_int(std::string_view t, std::string_view src) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc() || p != t.data() + t.size()) bad(src, t, "an integer");
  return v;
}
double to_double(std::string_view t, std::string_view src) {
  try {
    size_t used = 0;
    const double v = std::stod(std::string(t), &used);
    if (used == t.size()) return v;
  } catch (const std::exception&) {
  }
  bad(src, t, "a number");
}
bool to_bool(std::string_view t, std::string_view src) {
  if (t == "true" || t == "1" || t == "on") return true;
  if (t == "false" || t == "0" || t == "off") return false;
  bad(src, t, "true or false");
}
std::vector<int> to_ints(std::string_view t, std::string_view src) {
  std::vector<int> out;
  for (const std::string_view piece : split(t)) out.push_back(static_cast<int>(to_int(piece, src)));
  return out;
}
std::string num(double v) { return fmt::format("{}", v); }

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

#define MT_INT(field) [](TrainConfig& c, std::string_view t, std::string_view s) { c.field = static_cast<decltype(c.field)>(to_int(t, s)); }, \
                      [](const TrainConfig& c) { return fmt::format("{}", c.field); }, TrainFieldKind::integer
#define MT_DBL(field) [](TrainConfig& c, std::string_view t, std::string_view s) { c.field = to_double(t, s); }, \
                      [](const TrainConfig& c) { return num(c.field); }, TrainFieldKind::number
#define MT_BOOL(field) [](TrainConfig& c, std::string_view t, std::string_view s) { c.field = to_bool(t, s); }, \
                       [](const TrainConfig& c) { return std::string(c.field ? "true" : "false"); }, TrainFieldKind::boolean
#define MT_STR(field) [](TrainConfig& c, std::string_view t, std::string_view) { c.field = std::string(t); }, \
                      [](const TrainConfig& c) { return c.field; }, TrainFieldKind::string

const TrainField kFields[] = {
    {"model", "--model", "mlp | vae", MT_STR(model)},
    {"hidden", "--hidden", "hidden layer sizes, e.g. 512,512,256",
     [](TrainConfig& c, std::string_view t, std::string_view s) { c.hidden = to_ints(t, s); },
     [](const TrainConfig& c) { return fmt::format("{}", fmt::join(c.hidden, ",")); }, TrainFieldKind::integer_list},
    {"latent", "--latent", "VAE latent size", MT_INT(latent)},
    {"dropout", "--dropout", "MLP dropout probability", MT_DBL(dropout)},
    {"epochs", "--epochs", "passes over the training set", MT_INT(epochs)},
    {"batch_size", "--batch-size", "global batch size (all data-parallel ranks)", MT_INT(batch_size)},
    {"micro_batches", "--micro-batches", "gradient accumulation steps per optimizer step", MT_INT(micro_batches)},
    {"optimizer", "--optimizer", "adamw | sgd", MT_STR(optimizer)},
    {"lr", "--lr", "peak learning rate", MT_DBL(lr)},
    {"momentum", "--momentum", "SGD momentum", MT_DBL(momentum)},
    {"weight_decay", "--weight-decay", "weight decay (biases and norms never decay)", MT_DBL(weight_decay)},
    {"schedule", "--schedule", "constant | cosine (after linear warmup)", MT_STR(schedule)},
    {"warmup_steps", "--warmup-steps", "linear warmup steps", MT_INT(warmup_steps)},
    {"min_lr_ratio", "--min-lr-ratio", "cosine floor as a fraction of lr", MT_DBL(min_lr_ratio)},
    {"lr_decay_steps", "--lr-decay-steps",
     "length of the cosine schedule in steps (0 = all epochs' steps; --max-steps does not shorten it)",
     MT_INT(lr_decay_steps)},
    {"clip_norm", "--clip-norm", "global gradient-norm clipping (0 = off)", MT_DBL(clip_norm)},
    {"on_nonfinite", "--on-nonfinite",
     "error | skip: a non-finite loss or gradient stops the run, or skips that optimizer step (counted)",
     MT_STR(on_nonfinite)},
    {"max_consecutive_skips", "--max-consecutive-skips",
     "stop after this many skipped steps in a row (non-finite steps with skip, fp16 loss-scale overflows)",
     MT_INT(max_consecutive_skips)},
    {"seed", "--seed", "seed of initialization, shuffling, dropout and noise", MT_INT(seed)},
    {"max_steps", "--max-steps", "stop after this many optimizer steps (0 = all epochs)", MT_INT(max_steps)},
    {"log_every", "--log-every", "steps between metrics lines", MT_INT(log_every)},
    {"bucket_mb", "--bucket-mb", "data-parallel gradient bucket size in MiB", MT_DBL(bucket_mb)},
    {"threads_per_rank", "--threads-per-rank", "BLAS threads per rank (0 = cores / ranks)", MT_INT(threads_per_rank)},
    {"drop_last", "--drop-last", "drop the last partial batch of each epoch", MT_BOOL(drop_last)},
    {"fsdp", "--fsdp",
     "fully sharded data parallelism: full | shard_grad_op | no_shard | zero1 | zero2 | zero3 | hybrid_full | "
     "hybrid_shard_grad_op (\"\" = plain data parallelism; an fsdp mesh axis > 1 defaults to full)",
     MT_STR(fsdp)},
    {"fsdp_min_weight_size", "--fsdp-min-weight-size", "parameters with fewer elements stay replicated in f32",
     MT_INT(fsdp_min_weight_size)},
    {"forward_prefetch", "--forward-prefetch", "fsdp: start the next unit's all-gather during forward",
     MT_BOOL(forward_prefetch)},
    {"backward_prefetch", "--backward-prefetch", "fsdp: none | pre | post (when backward gathers the next unit)",
     MT_STR(backward_prefetch)},
    {"reshard_after_forward", "--reshard-after-forward",
     "fsdp: free gathered parameters after forward and gather again for backward", MT_BOOL(reshard_after_forward)},
    {"reduce_precision", "--reduce-precision",
     "fsdp: dtype of gradients and their reduction: \"\" = the compute precision, fp32, bf16 or fp16",
     MT_STR(reduce_precision)},
    {"data_dir", "--data-dir", "Fashion-MNIST directory (Debian: dataset-fashion-mnist)", MT_STR(data_dir)},
    {"run_dir", "--run-dir",
     "where config, metrics, model and pictures go (\"\" = the next runs/<model>/version_<N>)", MT_STR(run_dir)},
    {"overwrite", "--overwrite", "replace the run in run_dir (only once the new run succeeds)", MT_BOOL(overwrite)},
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
    throw InvalidArgument("TrainConfig", fmt::format("{}: {}", source, e.description()), "fix the TOML syntax");
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
      for (const auto& e : *a) parts.push_back(fmt::format("{}", e.value<int64_t>().value_or(-1)));
      text_value = fmt::format("{}", fmt::join(parts, ","));
    } else {
      throw InvalidArgument("TrainConfig", where + ": unsupported value type", "use a string, number or array");
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

void TrainConfig::validate() const {
  auto require = [](bool ok, const std::string& what, const std::string& hint) {
    if (!ok) throw InvalidArgument("TrainConfig::validate", what, hint);
  };
  require(model == "mlp" || model == "vae", fmt::format("model '{}'", model), "use model = \"mlp\" or \"vae\"");
  require(!hidden.empty(), "hidden is empty", "give at least one hidden size, e.g. 512,512");
  for (int h : hidden) require(h > 0, fmt::format("hidden size {}", h), "hidden sizes must be positive");
  require(latent > 0, fmt::format("latent {}", latent), "latent must be positive");
  require(dropout >= 0 && dropout < 1, fmt::format("dropout {}", dropout), "dropout must be in [0, 1)");
  require(epochs > 0, fmt::format("epochs {}", epochs), "epochs must be positive");
  require(batch_size > 0, fmt::format("batch_size {}", batch_size), "batch_size must be positive");
  require(micro_batches > 0 && batch_size % micro_batches == 0,
          fmt::format("batch_size {} with micro_batches {}", batch_size, micro_batches),
          "micro_batches must divide batch_size");
  require(optimizer == "adamw" || optimizer == "sgd", fmt::format("optimizer '{}'", optimizer),
          "use adamw or sgd");
  require(lr > 0, fmt::format("lr {}", lr), "lr must be positive");
  require(schedule == "constant" || schedule == "cosine", fmt::format("schedule '{}'", schedule),
          "use constant or cosine");
  require(warmup_steps >= 0 && min_lr_ratio >= 0 && min_lr_ratio <= 1,
          fmt::format("warmup_steps {}, min_lr_ratio {}", warmup_steps, min_lr_ratio),
          "warmup_steps >= 0 and min_lr_ratio in [0, 1]");
  require(clip_norm >= 0, fmt::format("clip_norm {}", clip_norm), "0 turns clipping off");
  require(lr_decay_steps >= 0, fmt::format("lr_decay_steps {}", lr_decay_steps),
          "0 decays over all epochs' steps, or give the schedule's length in steps");
  require(on_nonfinite == "error" || on_nonfinite == "skip", fmt::format("on_nonfinite '{}'", on_nonfinite),
          "use error (stop the run) or skip (skip the step and count it)");
  require(max_consecutive_skips >= 1, fmt::format("max_consecutive_skips {}", max_consecutive_skips),
          "give at least 1 (the default is 25)");
  require(log_every > 0 && bucket_mb > 0 && threads_per_rank >= 0 && max_steps >= 0,
          fmt::format("log_every {}, bucket_mb {}, threads_per_rank {}, max_steps {}", log_every, bucket_mb,
                      threads_per_rank, max_steps),
          "log_every and bucket_mb positive; threads_per_rank and max_steps >= 0");
  if (!fsdp.empty()) {
    try {
      (void)parallel::parse_sharding_strategy(fsdp);
    } catch (const InvalidArgument&) {
      require(false, fmt::format("fsdp '{}'", fsdp),
              "use full, shard_grad_op, no_shard, zero1, zero2, zero3, hybrid_full or hybrid_shard_grad_op, "
              "or \"\" for plain data parallelism");
    }
  }
  require(fsdp_min_weight_size >= 0, fmt::format("fsdp_min_weight_size {}", fsdp_min_weight_size),
          "use 0 to shard every parameter");
  try {
    (void)parallel::parse_backward_prefetch(backward_prefetch);
  } catch (const InvalidArgument&) {
    require(false, fmt::format("backward_prefetch '{}'", backward_prefetch), "use none, pre or post");
  }
  require(reduce_precision.empty() || reduce_precision == "fp32" || reduce_precision == "bf16" ||
              reduce_precision == "fp16",
          fmt::format("reduce_precision '{}'", reduce_precision), "use \"\" (the compute precision), fp32, bf16 or fp16");
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

}  // namespace meshtrain::train
