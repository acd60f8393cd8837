// Llama's decoder pieces: the attention (grouped-query causal
// self-attention with rotary position embeddings, no biases) and the block
// (pre-RMSNorm residuals around it and a SwiGLU MLP), under Hugging Face
// Llama's names.
//
//   nn::LlamaAttention attn({.width = 512, .heads = 8, .kv_heads = 2, .prefix = "model.layers.0.self_attn"});
//   // q_proj (512, 512), k_proj (512, 128), v_proj (512, 128), o_proj (512, 512)
//   Tensor y = attn.forward(x);    // (B, T, 512) -> (B, T, 512); token t at position t
//
// q = q_proj(x) split into `heads` heads of width / heads; k and v into
// `kv_heads` heads (dividing heads: query head h reads key/value head
// h / (heads / kv_heads), grouped-query attention; kv_heads = heads is
// multi-head attention); q and k rotated by functional::rotary_embedding
// (rope_base) at positions 0..T-1; causal attention by the blockwise kernel
// (nn::functional::attention_*), scale 1/sqrt(head dim); o_proj back to
// width. Tensor parallelism (config.tensor of k ranks): q, k and v
// column-parallel by whole heads (each rank holds heads / k query heads and
// the kv_heads / k key/value heads they read; kv_heads must divide by k,
// InvalidArgument otherwise), o_proj row-parallel; with sequence
// parallelism the input and output hold the rank's T / k steps (the
// projections gather and reduce-scatter; communication overlap as the group
// says). Context parallelism (config.context): the input holds this rank's
// chunks of the sequence (context_parallel.h), rotated at their global
// positions (the batch context's sequence_length is the whole length; 0:
// the local steps times the axis size), and attention spans the whole
// sequence by the group's ring or all_to_all; set_context_split(false)
// runs the whole sequence locally (evaluation). Backward sums the repeated
// key/value heads' gradients back per group and rotates dq, dk back (the
// rotation's inverse).
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/nn/layer_norm.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/nn/parallel/context_parallel.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/nn/moe.h"
#include "meshtrain/nn/swiglu.h"

namespace meshtrain::nn {

namespace internal {
struct PreNormBlock;  // internal/pre_norm.h
}  // namespace internal

struct LlamaAttentionConfig {
  int64_t width = 0;        // model width, divisible by heads
  int64_t heads = 0;        // query heads
  int64_t kv_heads = 0;     // key/value heads, dividing heads (0: heads)
  double rope_base = 10000.0;  // RoPE's theta (Llama 3: 500000)
  std::string prefix = "";  // module path
  uint64_t seed = 0;
  double init_std = 0.02;   // projections ~ N(0, init_std); o_proj's: out_std when > 0
  double out_std = 0.0;
  bool defer_init = false;
  TensorParallelGroup tensor = {};
  ContextParallelGroup context = {};
};

class LlamaAttention final : public Module {
 public:
  explicit LlamaAttention(const LlamaAttentionConfig& config);
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override { return {q_.get(), k_.get(), v_.get(), o_.get()}; }
  const LlamaAttentionConfig& config() const { return config_; }
  // Context parallelism on (default) or off (GPT::set_context_split).
  void set_context_split(bool on) { split_ = on; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  std::string describe() const override { return "LlamaAttention '" + config_.prefix + "'"; }

 private:
  struct State {
    int64_t b = 0, t = 0;
    int64_t t_real = 0;             // context parallel: this rank's real steps of t (sp padding after them)
    Tensor positions;               // (T) i64: global positions
    Tensor q, k, v, out, lse;       // q, out (B Hq, T, D) rotated; k, v (B Hq, T, D) repeated per query head
    ContextAttentionSaved cp;       // context parallel: instead of q, k, v, out, lse
  };
  bool splits() const { return split_ && config_.context.active(); }
  bool split_ = true;
  LlamaAttentionConfig config_;
  int64_t heads_, kv_heads_, head_dim_;  // this rank's heads
  // Key/value heads replicated (a tensor axis of k > kv_heads ranks, rep =
  // k / kv_heads): k and v column-parallel over kv_comm_ (the kv_heads
  // ranks r with one r % rep: rank r holds head r / rep), their input
  // gradients then summed over rep_comm_ (the rep ranks holding that head),
  // which also sums their weights' gradients (Parameter::partial_over).
  // Under sequence parallelism k and v take the input gathered over the
  // tensor axis, and this rank's steps of their summed input gradient join
  // q's reduce-scattered one.
  std::unique_ptr<comm::Communicator> kv_comm_, rep_comm_;
  std::unique_ptr<Module> q_, k_, v_, o_;
};

// One Llama decoder block: h = x + self_attn(input_layernorm(x)), y = h +
// mlp(post_attention_layernorm(h)), RMSNorms (eps norm_eps) and a SwiGLU
// MLP of ffn_hidden features (swiglu.h), or with moe.active() a mixture of
// experts (moe.h; expert_hidden 0: ffn_hidden) split over `expert`.
// Tensor and context parallelism as its parts;
// with sequence parallelism the norms see the rank's T / k steps (their
// weights' gradients are partial sums: Parameter::sequence_parallel).
//
//   nn::LlamaBlock block({.width = 512, .heads = 8, .kv_heads = 2, .ffn_hidden = 1376, .prefix = "model.layers.0"});
struct LlamaBlockConfig {
  int64_t width = 0, heads = 0, kv_heads = 0;  // the attention's (LlamaAttentionConfig)
  double rope_base = 10000.0;
  int64_t ffn_hidden = 0;          // >= 1
  double norm_eps = 1e-6;
  std::string prefix = "";
  uint64_t seed = 0;
  double init_std = 0.02;  // every projection ~ N(0, init_std); the residual ones (o_proj, down_proj): out_std
  double out_std = 0.0;    // > 0: the residual projections' std (GPT-2's 0.02 / sqrt(2 layers))
  bool defer_init = false;
  TensorParallelGroup tensor = {};
  ContextParallelGroup context = {};
  MoEOptions moe = {};               // experts 0: the dense SwiGLU MLP
  ExpertParallelGroup expert = {};
};

class LlamaBlock final : public Module {
 public:
  explicit LlamaBlock(const LlamaBlockConfig& config);
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override { return {&input_norm_, &attn_, &post_norm_, mlp_.get()}; }
  LlamaAttention& attention() { return attn_; }
  MoE* moe() { return moe_; }  // the MoE layer, or null for a dense MLP

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override { return "LlamaBlock '" + prefix_ + "'"; }

 private:
  internal::PreNormBlock block();
  std::string prefix_;
  RMSNorm input_norm_;
  LlamaAttention attn_;
  RMSNorm post_norm_;
  std::unique_ptr<Module> mlp_;  // SwiGLUMLP or MoE
  MoE* moe_ = nullptr;
};

}  // namespace meshtrain::nn
