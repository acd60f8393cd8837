// The built-in recipes' models as parameter lists, built without values
// (deferred initialization: shapes only, nothing allocated), cut into the
// recipes' pipeline stages, each parameter with its fully sharded unit:
// what the placement rule (layout/placement_rule.h) places for the
// planner, `meshtrain shard --model` and the tests. They are the models
// the trainer builds (tests/placement_property_test.cc checks it rank by
// rank against real runs).
//
//   plan::GptShape g{.vocab = 50257, .seq = 1024, .layers = 12, .heads = 12, .width = 768};
//   plan::MemoryPrediction m = plan::predict_memory(train::with_gpt_model(g), layout);
//   // or: g.model = train::gpt_model_source(g);
//   std::vector<layout::ModelParameter> ps = train::mlp_parameters({784, 512, 10}, /*tensor=*/2, /*stages=*/2);
//
// Thread-safety: reentrant; a source may be called from any thread (it
// builds each stage count's description once and shares it).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/layout/placement_rule.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/model_description.h"
#include "meshtrain/train/train_config.h"

namespace meshtrain::train {

// The gpt recipe's model of `shape` in `stages` pipeline stages (block_size
// = shape.seq), with each stage's blocks and units for the planner.
// InvalidArgument for sizes nn::GPT refuses or more stages than blocks.
std::shared_ptr<const plan::ModelDescription> describe_gpt(const plan::GptShape& shape, int stages);

// The nn::GPTConfig of `shape`'s sizes and blocks (block_size = seq),
// whole and without values (defer_init).
nn::GPTConfig planned_gpt_config(const plan::GptShape& shape);

// The GPT a TrainConfig trains (model "gpt"): its sizes (seq = context) and
// blocks (arch, kv_heads, ffn_hidden, moe); no model source.
plan::GptShape gpt_shape(const TrainConfig& tc);

// describe_gpt of `shape`'s sizes, cached per stage count.
plan::ModelSource gpt_model_source(const plan::GptShape& shape);

// `shape` with model = gpt_model_source(shape).
plan::GptShape with_gpt_model(plan::GptShape shape);

// The mlp recipe's parameters for layer sizes `sizes` (input, hidden...,
// classes) in `stages` stages: with a tensor axis of `tensor` > 1 ranks
// its cut keeps a column/row pair of Linears on one stage, so the list
// depends on it. Units: one per Linear, as the recipe's.
std::vector<layout::ModelParameter> mlp_parameters(const std::vector<int64_t>& sizes, int tensor, int stages);

// GPT sizes by name: GPT-2/3's (124M ... 175B, GPT-2's blocks), Llama 2's
// (llama2-7B, llama2-70B), Mixtral 8x7B's and DeepSeek-V3's (Llama's
// blocks, their heads untied; DeepSeek-V3's multi-head latent attention as
// plain multi-head attention: see docs/planner.md), for `meshtrain plan
// --size` and meshtrain.plan(size=...).
struct GptPreset {
  const char* name;
  int64_t layers, heads, width, vocab;
  layout::DecoderArch arch = layout::DecoderArch::gpt2;
  int64_t kv_heads = 0, ffn_hidden = 0;
  layout::MoEOptions moe = {};
  bool tie_embeddings = true;
};
std::span<const GptPreset> gpt_presets();
std::string gpt_preset_names();  // "124M, 350M, ..."

// The TrainConfig keys of the GPT's blocks besides its sizes (architecture,
// Llama's heads and MLP, the mixture-of-experts layers' shape): what `plan`
// and `shard --model` take under train's flags and meshtrain.plan as
// keywords.
inline constexpr std::string_view kGptBlockKeys[] = {"arch",          "kv_heads",       "ffn_hidden",
                                                     "tie_embeddings", "experts",       "top_k",
                                                     "expert_hidden", "shared_experts", "first_dense"};

// What the planner is asked about: a GPT (a preset, else the sizes) and
// how it is laid out, in the flags' words (`meshtrain plan`'s options,
// meshtrain.plan's keywords).
struct PlanRequest {
  std::string size;  // a preset name; "" = layers, heads, width, vocab
  int64_t layers = 4, heads = 4, width = 256, vocab = 8192, seq = 64, batch = 32;
  std::string mesh = "data=1";
  std::string fsdp;  // "": the trainer's default for the mesh (layout::resolve_fsdp_mode)
  std::string precision = "fp32";
  int micro_batches = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  bool sequence_parallel = false, recompute = false;
  std::string cp_comm = "ring";
  double expert_imbalance = 1.0;  // over an expert axis: the fullest rank's expert rows over the even share
  int64_t min_weight_size = 1024;
  // The blocks, as train's flags give them (--arch, --kv-heads,
  // --ffn-hidden, --experts, ...: set_blocks); a preset sets its own.
  layout::DecoderArch arch = layout::DecoderArch::gpt2;
  int64_t kv_heads = 0, ffn_hidden = 0;
  layout::MoEOptions moe = {};
  bool tie_embeddings = true;
  void set_blocks(const TrainConfig& tc);
};

// The request resolved as the trainer resolves a run: the model (with its
// parameters) and the layout. InvalidArgument naming the flag for an
// unknown preset, mesh, strategy, precision, schedule or exchange, and for
// what the gpt recipe's start-up checks refuse (heads or key/value heads
// over the tensor axis, experts over the expert axis, ...).
struct PlannedRun {
  plan::GptShape shape;
  plan::TrainingLayout layout;
  std::string fsdp;  // the resolved strategy's name ("" = plain data parallelism)
};
PlannedRun resolve_plan_request(const PlanRequest& request);

}  // namespace meshtrain::train
