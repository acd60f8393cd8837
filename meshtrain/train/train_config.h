// TrainConfig: what `meshtrain train` trains and how, from one table of
// fields (train_config_fields()) that drives the TOML [train] section, the
// CLI flags, --help and the start-up dump, so every key is defined once.
//
//   TrainConfig c = TrainConfig::from_toml_file("examples/mlp_fashion.toml");
//   c.set("lr", "3e-4", "--lr");       // a CLI override
//   c.validate();
//   fmt::print("{}", c.to_toml());     // the dump
//
// Where the device layout lives: [distributed] (config::DistributedConfig).
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::train {

struct TrainConfig {
  std::string model = "mlp";                 // mlp | vae
  std::vector<int> hidden = {512, 512, 256};  // MLP hidden sizes (VAE: encoder/decoder widths)
  int latent = 20;                           // VAE latent size
  double dropout = 0.0;                      // MLP dropout after each hidden layer
  int epochs = 10;
  int batch_size = 256;    // global batch (all data-parallel ranks together)
  int micro_batches = 1;   // gradient accumulation steps per optimizer step
  std::string optimizer = "adamw";  // adamw | sgd
  double lr = 1e-3;
  double momentum = 0.9;       // sgd
  double weight_decay = 0.0;   // decoupled (adamw) / L2 (sgd); biases and norms never decay
  std::string schedule = "cosine";  // constant | cosine (linear warmup, then cosine to min_lr_ratio)
  int warmup_steps = 0;        // clamped to the run's total steps (e.g. a short --max-steps)
  double min_lr_ratio = 0.0;
  double clip_norm = 0.0;      // global gradient-norm clipping; 0 = off
  uint64_t seed = 42;
  int64_t max_steps = 0;       // stop after this many optimizer steps; 0 = all epochs
  int log_every = 50;          // steps between metrics.jsonl lines
  double bucket_mb = 25.0;     // data-parallel gradient bucket size
  int threads_per_rank = 0;    // BLAS threads per rank; 0 = cores / ranks (at least 1)
  bool drop_last = true;       // drop the last partial batch of an epoch
  // Fully sharded data parallelism (parallel/fully_sharded.h): "" = plain
  // data parallelism (DataParallel, f32), else a strategy name of
  // parallel::parse_sharding_strategy: full | shard_grad_op | no_shard |
  // zero1 | zero2 | zero3 | hybrid_full | hybrid_shard_grad_op. Resolved by
  // resolve_training (trainer.h): an fsdp mesh axis > 1 defaults it to
  // "full", mixed precision without it to "no_shard".
  std::string fsdp;
  int64_t fsdp_min_weight_size = 1024;  // smaller parameters stay replicated (f32)
  bool forward_prefetch = false;        // gather the next unit during forward
  std::string backward_prefetch = "pre";  // none | pre | post
  bool reshard_after_forward = true;    // free gathered units after forward (zero3)
  // Dtype gradients are stored and reduced in under fsdp: "" = the compute
  // precision (mixed_precision), or fp32 | bf16 | fp16 (the seeds'
  // FSDP2Config reduce_dtype; fp32 keeps full-precision gradient sums).
  std::string reduce_precision;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string run_dir = "runs/latest";

  static TrainConfig from_toml(std::string_view text, std::string_view source = "<string>");
  static TrainConfig from_toml_file(const std::string& path);
  // Sets a field from text; errors name `source` (a flag or a TOML location).
  void set(std::string_view key, std::string_view value, std::string_view source);
  // Throws InvalidArgument saying what to change.
  void validate() const;
  std::string to_toml() const;  // a [train] section with every key
};

struct TrainField {
  std::string_view key;   // TOML key
  std::string_view flag;  // CLI flag
  std::string_view help;
  void (*parse)(TrainConfig& c, std::string_view text, std::string_view source);
  std::string (*format)(const TrainConfig& c);
};
std::span<const TrainField> train_config_fields();

}  // namespace meshtrain::train
