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
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/nn/moe.h"

namespace meshtrain::train {

// What to do with a non-finite loss or gradient (see TrainConfig).
enum class NonFinitePolicy : uint8_t { error, skip };
std::string_view to_string(NonFinitePolicy p);

// The fsdp setting as set: the mode layout::parse_fsdp_mode made of the
// name (once, when the config is read) and the name as written, for the
// dump and TOML ("zero3" and "full" are one mode; the dump keeps the word
// the user chose). No mode: plain data parallelism, name "".
struct FsdpSetting {
  FsdpSetting() = default;
  FsdpSetting(std::string n, layout::FsdpMode m) : name(std::move(n)), mode(m) {}
  std::string name;
  std::optional<layout::FsdpMode> mode;
  bool enabled() const { return mode.has_value(); }
};

// Strategy-like keys are parsed when set (TrainConfig::set, from_toml) and
// held as enums; their text form exists only in the dump and TOML.
struct TrainConfig {
  // A registered model recipe (model_recipe.h): mlp | vae built in.
  std::string model = "mlp";
  std::vector<int> hidden = {512, 512, 256};  // MLP hidden sizes (VAE: encoder/decoder widths)
  int latent = 20;                           // VAE latent size
  // GPT (model = "gpt"): a GPT-2 (or Llama) decoder on a text corpus.
  layout::DecoderArch arch = layout::DecoderArch::gpt2;  // GPT-2's blocks or Llama's (nn/gpt.h)
  int kv_heads = 0;                          // Llama: key/value heads (0: heads), dividing heads
  double rope_base = 10000.0;                // Llama: RoPE's base
  int ffn_hidden = 0;                        // Llama: the SwiGLU MLP's width (0: 8/3 width, rounded up to 64)
  bool tie_embeddings = true;                // GPT: the head multiplies wte (false: its own lm_head)
  // Llama: mixture-of-experts layers (nn/moe.h; experts 0: dense), keys
  // experts, top_k, expert_hidden, shared_experts, router_score,
  // normalize_top_k, aux_loss_coef, capacity_factor, bias_update_rate,
  // first_dense; experts split over the mesh's expert axis.
  nn::MoEOptions moe = {};
  int vocab = 8192;                          // BPE vocabulary (the tokenizer is trained to it)
  int context = 64;                          // tokens per sample (T)
  int layers = 4;
  int heads = 4;
  int width = 256;                           // divisible by heads
  bool recompute = false;                    // recompute every block's activations in backward
  // Memory per device ("24GiB", plan::parse_memory_size; "": not checked):
  // the GPT's predicted peak must fit, and a resumed run that no longer
  // fits is re-planned (train/device_memory.h).
  std::string device_memory;
  // Tensor parallelism's sequence parallelism (Megatron): outside the
  // tensor-parallel regions the GPT's activations are split along the
  // sequence over the tensor axis. No effect without a tensor axis.
  bool sequence_parallel = false;
  // Tensor parallelism's communication overlap (nn::TensorParallelGroup::
  // overlap, Megatron's tp_comm_overlap): each region's collective hidden
  // behind its GEMM, in blocks. No effect without a tensor axis.
  bool tp_overlap = false;
  std::string corpus = "/usr/share/games/fortunes";  // a text file or directory
  std::string text_cache = "data/text";      // tokenizer and token-file cache
  double dropout = 0.0;                      // MLP: after each hidden layer; GPT: embeddings and residual branches
  int epochs = 10;
  int batch_size = 256;    // global batch (all data-parallel ranks together)
  int micro_batches = 1;   // gradient accumulation steps per optimizer step
  // With a pipeline axis: the schedule that runs the micro-batches through
  // the stages (gpipe | 1f1b | interleaved | zb, layout::parse_schedule_kind)
  // and the model chunks per pipeline rank (interleaved: >= 2).
  layout::ScheduleKind pipeline_schedule = layout::ScheduleKind::one_f_one_b;
  int virtual_stages = 1;
  // With a context axis (the GPT): how attention spans the split sequence
  // (ring | all_to_all, layout::parse_context_comm) and whether each rank
  // holds two zig-zag chunks so causal attention's work is even.
  layout::ContextComm cp_comm = layout::ContextComm::ring;
  bool cp_load_balance = true;
  std::string optimizer = "adamw";  // adamw | sgd
  double lr = 1e-3;
  double momentum = 0.9;       // sgd
  double weight_decay = 0.0;   // decoupled (adamw) / L2 (sgd); biases and norms never decay
  std::string schedule = "cosine";  // constant | cosine (linear warmup, then cosine to min_lr_ratio)
  int warmup_steps = 0;        // clamped to the schedule's length
  double min_lr_ratio = 0.0;
  // Length of the cosine schedule in optimizer steps; 0 = every step of
  // `epochs` epochs. max_steps never changes it: a shorter run is a prefix
  // of the full one (Megatron's --lr-decay-iters, torchtitan's decay steps).
  int64_t lr_decay_steps = 0;
  double clip_norm = 0.0;      // global gradient-norm clipping; 0 = off
  // A non-finite loss or gradient (outside the fp16 loss scaler's own
  // overflow handling): "error" stops the run (non-zero exit, nothing
  // saved), "skip" skips the optimizer step and counts it. Non-finite
  // parameters always stop the run.
  NonFinitePolicy on_nonfinite = NonFinitePolicy::error;
  // Skipped steps in a row (non-finite with "skip", or fp16 overflows) after
  // which the run stops with an error. 25: the loss scaler halves its scale
  // from its ceiling 2^24 to its floor 1 in 24 steps.
  int max_consecutive_skips = 25;
  // The loss-spike guard: a step whose (finite) loss is more than
  // `loss_spike` times the mean of the last `loss_spike_window` steps'
  // losses stops the run before its update, as a non-finite loss does
  // (non-zero exit, nothing committed, an earlier run and the checkpoints
  // kept for --resume). Checked once 10 steps (or the whole window, if
  // shorter) are known. 0 turns it off; else > 1. A loss that explodes
  // without reaching inf (SGD at a far too large lr) is caught too.
  double loss_spike = 10.0;
  int loss_spike_window = 50;
  uint64_t seed = 42;
  int64_t max_steps = 0;       // stop after this many optimizer steps; 0 = all epochs (the schedule keeps its length)
  int log_every = 50;          // steps between metrics.jsonl lines
  double bucket_mb = 25.0;     // data-parallel gradient bucket size
  int threads_per_rank = 0;    // BLAS threads per rank; 0 = cores / ranks (at least 1)
  bool drop_last = true;       // drop the last partial batch of an epoch
  // The deterministic mode (docs/determinism.md): the same parameter bits on
  // any data, fsdp or pipeline layout, engine and thread count. Sums over
  // samples run in the canonical tree over blocks of deterministic_block
  // samples (0: the fewest samples of at least 32 rows, a power of two).
  bool deterministic = false;
  int deterministic_block = 0;
  // Steps between checksums of the full model's parameters in
  // metrics.jsonl (0 = none): a hash that does not depend on the layout.
  int checksum_every = 0;
  // Fully sharded data parallelism (parallel/fully_sharded.h): "" = plain
  // data parallelism (DataParallel, f32), else a strategy name of
  // layout::parse_fsdp_mode: full | shard_grad_op | no_shard |
  // zero1 | zero2 | zero3 | hybrid_full | hybrid_shard_grad_op. Resolved by
  // resolve_training (trainer.h): an fsdp mesh axis > 1 defaults it to
  // "full", mixed precision without it to "no_shard".
  FsdpSetting fsdp;
  int64_t fsdp_min_weight_size = 1024;  // smaller parameters stay replicated (f32)
  bool forward_prefetch = false;        // gather the next unit during forward
  layout::BackwardPrefetch backward_prefetch = layout::BackwardPrefetch::pre;  // none | pre | post
  bool reshard_after_forward = true;    // free gathered units after forward (zero3)
  // Dtype gradients are stored and reduced in under fsdp: "" (nullopt) =
  // the compute precision (mixed_precision), or fp32 | bf16 | fp16 (the
  // seeds' FSDP2Config reduce_dtype; fp32 keeps full-precision gradient sums).
  std::optional<DType> reduce_precision;
  // ZeRO++ under fsdp zero2/zero3 (parallel/zeropp.h): a comma list of qwz
  // (quantized weight all-gathers, zero3), qgz (hierarchical quantized
  // gradient reduce-scatter) and hpz (node-local secondary parameter
  // shards, zero3); "" = off. Nodes are the mesh's `node` axis
  // (node=K,fsdp=L). Codes of zeropp_bits (8 or 4; qgz's
  // zeropp_grad_bits when not 0) with an f32 scale per zeropp_block values.
  layout::ZeroPPParts zeropp;
  int zeropp_bits = 8;
  int zeropp_grad_bits = 0;
  int zeropp_block = 256;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  // "" = the next free runs/<model>/version_<N> (a new one per run). A
  // directory that holds a run is refused unless overwrite (RunDirectory,
  // run_dir.h).
  std::string run_dir;
  bool overwrite = false;  // replace the run in run_dir (only once the new run succeeds)
  // Sharded checkpoints (checkpoint.h) into <run_dir>/checkpoints every
  // checkpoint_every steps and at the end (0 = none); keep_last > 0 keeps
  // only the newest ones. resume: continue the run in that directory from
  // its newest checkpoint (interrupted or committed), on any mesh; its
  // config.toml is the default configuration.
  int64_t checkpoint_every = 0;
  int keep_last = 0;
  // Checkpoints written in the background while training goes on (the
  // previous one finished first; the run's last one before it ends):
  // checkpoint/async_save.h.
  bool async_checkpoint = false;
  std::string resume;
  // A safetensors file of the whole model (meshtrain export's layout,
  // export.h) whose values replace the initial parameters ("" = none).
  std::string init_from;

  static TrainConfig from_toml(std::string_view text, std::string_view source = "<string>");
  static TrainConfig from_toml_file(const std::string& path);
  // Sets a field from text; errors name `source` (a flag or a TOML location)
  // and, for a name that is not one of a key's choices, list them.
  void set(std::string_view key, std::string_view value, std::string_view source);
  // Throws InvalidArgument saying what to change.
  void validate() const;
  // A resumed run (resume set) continues in its own directory: run_dir
  // becomes resume. `run_dir_given`: the user also gave run_dir, which must
  // then name the same directory (InvalidArgument naming `flag` otherwise).
  void continue_in_resumed_directory(bool run_dir_given, std::string_view flag);
  // A [train] section with every key, each value written as its TOML type
  // (strings quoted and escaped, numbers, booleans, hidden as an array);
  // from_toml(to_toml()) gives the same config.
  std::string to_toml() const;
};

// The TOML type of a field's value (format() gives it as flag text).
enum class TrainFieldKind : uint8_t { string, integer, number, boolean, integer_list };

struct TrainField {
  std::string_view key;   // TOML key
  std::string_view flag;  // CLI flag
  std::string_view help;
  void (*parse)(TrainConfig& c, std::string_view text, std::string_view source);
  std::string (*format)(const TrainConfig& c);  // flag text: "512,512,256", "true", "0.001", "runs/x"
  TrainFieldKind kind;
};
std::span<const TrainField> train_config_fields();

// The rows one sample puts through a layer's products: the GPT's context,
// else 1 (the deterministic mode's blocks are whole samples).
int64_t rows_per_sample(const TrainConfig& c);

}  // namespace meshtrain::train
