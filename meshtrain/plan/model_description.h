// The model the planner prices: the GPT's sizes, and its parameters as the
// model itself lists them. plan sits left of nn, so it cannot build a
// model; the caller hands it a ModelSource that can (train/model_parameters.h:
// the GPT recipe's stages built without values, nothing allocated), and the
// memory, traffic and time models place those parameters with the one
// placement rule (layout/placement_rule.h) instead of a list of their own.
//
//   plan::GptShape g{.vocab = 8192, .seq = 64, .layers = 4, .heads = 4, .width = 256};
//   g.model = train::gpt_model_source(g);
//   plan::predict_memory(g, layout);
//
// Thread-safety: plain values; a ModelSource may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "meshtrain/layout/placement_rule.h"
#include "meshtrain/layout/vocabulary.h"

namespace meshtrain::plan {

// ModelDescription::StageDescription::unit_block's roles besides a block.
inline constexpr int kEmbeddingUnit = -1;  // the tied embedding, a unit of its own (two stages hold it)
inline constexpr int kRootUnit = -2;       // the rest of the stage (norms, position embedding, ...)

// The model cut into pipeline stages as the trainer cuts it.
struct ModelDescription {
  struct Stage {
    int first_block = 0, last_block = 0;  // the transformer blocks [first, last)
    bool embed = false, head = false;     // holds the embeddings / the final norm and the head
    // Per fully sharded unit (layout::ModelParameter::unit): the block it
    // gathers, or kEmbeddingUnit, or kRootUnit.
    std::vector<int> unit_block;
  };
  std::vector<Stage> stages;
  // Every stage's parameters in module order, stage by stage
  // (ModelParameter::stage); a tied parameter once per stage holding it.
  std::vector<layout::ModelParameter> params;
};

// The description for a given number of pipeline stages (1: the whole
// model). InvalidArgument when the model has fewer blocks than stages.
using ModelSource = std::function<std::shared_ptr<const ModelDescription>(int stages)>;

// The GPT's sizes (nn::GPTConfig): vocab V, the sequence length T the run
// trains on (≤ block_size), layers, heads H, width C; Llama's blocks (arch
// llama) with kv_heads (0: heads) and their SwiGLU MLP's ffn_hidden (0:
// layout::llama_ffn_hidden's default), and mixture-of-experts layers
// (moe.active(); Llama's blocks only) in the blocks from moe.first_dense
// on; the head tied to wte or not; and `model`, where its parameters come from (predict_memory,
// predict_traffic, predict_time and the layout search need it; the
// activation estimate does not).
struct GptShape {
  int64_t vocab = 0, seq = 0, layers = 0, heads = 0, width = 0;
  layout::DecoderArch arch = layout::DecoderArch::gpt2;
  int64_t kv_heads = 0, ffn_hidden = 0;
  layout::MoEOptions moe = {};
  bool tie_embeddings = true;  // false: the head's own table, lm_head
  ModelSource model = nullptr;

  bool llama() const { return arch == layout::DecoderArch::llama; }
  int64_t key_value_heads() const { return llama() && kv_heads > 0 ? kv_heads : heads; }
  // The dense MLP's hidden features: 4C (GPT-2), ffn_hidden (Llama).
  int64_t mlp_hidden() const { return llama() ? layout::llama_ffn_hidden(width, ffn_hidden) : 4 * width; }
  // A routed expert's hidden features (moe.expert_hidden, 0: mlp_hidden()).
  int64_t expert_hidden() const { return moe.expert_hidden > 0 ? moe.expert_hidden : mlp_hidden(); }
  // Whether block `b` has a MoE layer.
  bool moe_block(int64_t b) const { return moe.active() && b >= moe.first_dense; }
};

}  // namespace meshtrain::plan
