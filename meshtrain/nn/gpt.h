// GPT-2: a decoder-only transformer language model with explicit forward
// and backward, built from nn's modules and nn::functional's kernels.
//
//   nn::GPT gpt(nn::GPTConfig{.vocab = 8192, .block_size = 128, .layers = 4, .heads = 4, .width = 256});
//   Tensor logits = gpt.forward(tokens);          // (B, T) i64 -> (B * T, vocab) (tensor parallel: the rank's shard)
//   nn::CrossEntropyLoss ce;
//   double loss = ce.forward(logits, targets.view({B * T}));
//   gpt.backward(ce.backward());                  // grads += ...; returns undefined (ids)
//
// Llama (config.arch = llama): the same container (wte, blocks "h.<i>",
// ln_f, the tied head) with llama.h's LlamaBlock ("h.0.self_attn.q_proj",
// "h.0.mlp.gate_proj", ...), an RMSNorm ln_f and no wpe (positions are
// rotary, inside attention); weights ~ N(0, 0.02), the residual
// projections as GPT-2's. Tensor, sequence, context and pipeline
// parallelism and fully sharded data parallelism work as for GPT-2
// (sequence-parallel padding beside a context axis too); dropout is
// refused (InvalidArgument).
//
// Architecture (GPT-2): token embedding "wte" (vocab, width) plus learned
// position embedding "wpe" (block_size, width); `layers` pre-LayerNorm
// blocks "h.<i>": x + attn(ln_1(x)), then x + mlp(ln_2(x)), where attn is
// causal multi-head self-attention (c_attn: width -> 3 width for q, k, v;
// heads of width / heads; c_proj back to width) computed by the blockwise
// kernel (nn::functional::attention_*), and mlp is c_fc (width -> 4 width),
// GELU (tanh approximation), c_proj; a final LayerNorm "ln_f"; the output
// head is tied to wte (logits = h wte^T; wte.weight has users = 2, so hooks
// see its gradient once, after both uses: module.h's tied rule), or with
// tie_embeddings off its own table "lm_head" (vocab, width) ~ N(0, 0.02)
// (Hugging Face Llama's lm_head.weight; vocabulary-parallel as wte).
// Parameter names follow GPT-2's checkpoints ("h.0.attn.c_attn.weight"),
// with Linear weights stored (in, out) as everywhere in meshtrain.
//
// Initialization (GPT-2): Linear weights and both embeddings ~ N(0, 0.02),
// the residual projections (attn.c_proj, mlp.c_proj) ~ N(0, 0.02 /
// sqrt(2 layers)), biases 0, LayerNorms 1 and 0; every value a function of
// (seed, name, index). Weight decay: matrices (weights, embeddings) only.
//
// Recompute: config.recompute sets every block's recompute mode (its
// activations are rebuilt in backward; numbers identical).
// Backward: backward() runs block by block, each block's input and weight
// passes together (its rebuilt activations and gradient buffers are freed
// before the next block's backward starts); backward_input then
// backward_weight (a zero-bubble pipeline's split) runs every block's input
// pass first and keeps what the weight passes need until then. Both compute
// the same numbers, and report gradients (grad_ready) in the same order.
// Half precision (set_compute_dtype(bf16 / f16)): every Linear's GEMMs and
// the tied head's run on half-precision operands with f32 accumulation; the
// logits stay f32 for the loss; attention's tiles stay f32.
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/nn/parallel/context_parallel.h"
#include "meshtrain/nn/dropout.h"
#include "meshtrain/nn/embedding.h"
#include "meshtrain/nn/layer_norm.h"
#include "meshtrain/nn/moe.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/nn/sequential.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::nn {

namespace internal {
struct PreNormBlock;  // internal/pre_norm.h
}  // namespace internal

struct GPTConfig {
  // The blocks: GPT-2's (LayerNorm, learned positions "wpe", GELU MLP,
  // biases) or Llama's (llama.h: RMSNorm, rotary positions, grouped-query
  // attention, SwiGLU MLP, no biases; no wpe). layout/vocabulary.h names them.
  layout::DecoderArch arch = layout::DecoderArch::gpt2;
  // Llama's: key/value heads (0: heads; dividing heads), RoPE's base, and
  // the SwiGLU MLP's features (0: 8/3 width rounded up to a multiple of 64).
  int64_t kv_heads = 0;
  double rope_base = 10000.0;
  int64_t ffn_hidden = 0;
  int64_t vocab = 8192;
  int64_t block_size = 128;  // longest sequence (rows of wpe)
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 256;       // divisible by heads
  uint64_t seed = 0;
  bool recompute = false;    // every block in recompute mode
  // GPT-2's embd_pdrop and resid_pdrop: dropout after the embeddings' sum
  // and after each block's attention and MLP projections (0: off). The
  // attention probabilities get none (the blockwise kernel has no dropout).
  double dropout = 0.0;
  bool defer_init = false;   // see LinearOptions::defer_init
  // Tensor parallelism (Megatron): over these ranks each block's attention
  // holds heads / k whole heads (q|k|v column-parallel, c_proj row-parallel),
  // its MLP c_fc column- and c_proj row-parallel, and wte (with the tied
  // head) is vocabulary-parallel: forward returns this rank's vocabulary
  // columns of the logits (vocab_shard()), for VocabParallelCrossEntropy.
  // tensor.sequence_parallel: the embeddings' sum, dropouts, LayerNorms and
  // residual sums hold T/k time steps per rank (tensor_parallel.h); the head
  // gathers the steps back. A T that k does not divide is padded at the end
  // to ceil(T / k) k steps (the dropouts number their masks by the real T,
  // so every layout draws one device's masks); a pipeline part without the
  // embeddings learns T from the batch context's sequence_length (its
  // input holds ceil(T / k) steps per rank).
  TensorParallelGroup tensor = {};
  // Pipeline parallelism: a part of the model. Only blocks [first_block,
  // last_block) (last_block < 0: to the last) are built, with the
  // embeddings when `embed` (the first stage: forward takes ids) and ln_f
  // with the tied head when `head` (the last stage: forward returns
  // logits); otherwise forward takes, and returns, the residual stream
  // (B, T, C) ((B, T/k, C) with sequence parallelism, (B, T/n, C), this
  // rank's chunks, with context parallelism) and backward returns
  // its gradient. Names are the whole model's ("h.5.attn..."), so a part
  // holds the same values as those blocks of the whole model. A part with
  // the head but not the embeddings still holds wte (users 1): the pipeline
  // adds its gradient to the first stage's. Default: the whole model.
  int64_t first_block = 0, last_block = -1;
  bool embed = true, head = true;
  // The output head multiplies wte (true: GPT-2's, Llama 2 ... 70B's
  // configs set false) or its own "lm_head" table, which a pipeline's last
  // stage then holds alone (no tied gradient between stages).
  bool tie_embeddings = true;
  // Context parallelism (context_parallel.h): forward still takes the whole
  // (B, T) ids; each rank keeps its chunks of the sequence (zig-zag: two),
  // with their global positions, and returns their logits (B * T / n, V)
  // in its local order (shard targets with shard_sequence). Attention spans
  // the whole sequence (ring or all_to_all); dropout masks are the
  // one-device masks' pieces. T must divide into context.chunks(). Not with
  // sequence parallelism (InvalidArgument). A pipeline part without the
  // embeddings takes this rank's chunks (B, T/n, C) and checks them against
  // the batch context's sequence_length T when it is set.
  ContextParallelGroup context = {};
  // Mixture of experts (moe.h; Llama's blocks only): with moe.active() the
  // blocks from moe.first_dense on replace their SwiGLU MLP by a MoE layer
  // (expert_hidden 0: ffn_hidden), its experts split over `expert`.
  MoEOptions moe = {};
  ExpertParallelGroup expert = {};
};

// Causal multi-head self-attention: (B, T, C) -> (B, T, C).
class CausalSelfAttention final : public Module {
 public:
  CausalSelfAttention(int64_t width, int64_t heads, const std::string& prefix, uint64_t seed, double proj_std,
                      bool defer_init, double dropout = 0.0, TensorParallelGroup tp = {},
                      ContextParallelGroup cp = {});
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override { return {&c_attn_, &c_proj_, &resid_dropout_}; }
  // Context parallelism on (default) or off (GPT::set_context_split).
  void set_context_split(bool on) { split_ = on; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  std::string describe() const override { return "CausalSelfAttention '" + name_ + "'"; }

 private:
  struct State {
    int64_t b = 0, t = 0;
    int64_t t_real = 0;        // context parallel: the real steps of t (the rest pads the sequence-parallel split)
    Tensor q, k, v, out, lse;  // (B H, T, D), lse (B H, T)
    ContextAttentionSaved cp;  // context parallel: instead of the above
  };
  // Context parallelism: (B, T, 3, H, D) q|k|v <-> chunk-major (P, B, H, c, D).
  Tensor to_chunks(const Tensor& qkv, int64_t which, int64_t b, int64_t t) const;
  void from_chunks(const Tensor& x, const Tensor& dst, int64_t which) const;
  int64_t context_steps(const BatchContext& batch, int64_t t) const;
  std::string name_;
  int64_t width_, heads_, head_dim_;  // heads_: this rank's (all without tensor parallelism)
  ContextParallelGroup cp_;
  bool split_ = true;
  bool splits() const { return split_ && cp_.active(); }
  ColumnParallelLinear c_attn_;  // width -> 3 width (this rank's heads of q, k, v)
  RowParallelLinear c_proj_;     // width -> width
  Dropout resid_dropout_;
};

// One pre-LayerNorm transformer block: (B, T, C) -> (B, T, C).
class GPTBlock final : public Module {
 public:
  GPTBlock(int64_t width, int64_t heads, const std::string& prefix, uint64_t seed, double proj_std, bool defer_init,
           double dropout = 0.0, TensorParallelGroup tp = {}, ContextParallelGroup cp = {});
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override { return {&ln_1_, &attn_, &ln_2_, &mlp_}; }
  CausalSelfAttention& attention() { return attn_; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override { return "GPTBlock '" + name_ + "'"; }

 private:
  internal::PreNormBlock block();  // ln_1, attn, ln_2, mlp: the shared pre-norm residual
  std::string name_;
  LayerNorm ln_1_;
  CausalSelfAttention attn_;
  LayerNorm ln_2_;
  Sequential mlp_;  // c_fc, GELU(tanh), c_proj, dropout
};

class GPT final : public Module {
 public:
  explicit GPT(GPTConfig config = {});
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  // forward: ids (B, T) i64/i32 with T <= block_size -> logits (B * T, vocab)
  // (a pipeline part: see GPTConfig::embed, head).
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override;  // wte, wpe, drop, h, ln_f, lm_head
  const GPTConfig& config() const { return config_; }
  // The transformer blocks (for FSDP's unit_modules, recompute, pipelines).
  std::vector<Module*> blocks();
  // Fully sharded data parallelism's units (FullyShardedOptions::
  // unit_modules): one per block, then the root for the rest (embeddings,
  // the final LayerNorm), as torchtitan wraps GPT-2. A pipeline stage
  // holding wte without the whole model (the first stage, or the last one's
  // tied head) makes wte a unit of its own before the root, so both stages
  // shard their copies alike.
  std::vector<Module*> fsdp_units();
  // This part's MoE layers with their block index, in block order (empty
  // for a dense model).
  std::vector<std::pair<int64_t, MoE*>> moe_layers();
  // The vocabulary ids whose logits forward returns (all of them without
  // tensor parallelism); empty for a part without the head.
  ShardRange vocab_shard() const {
    return lm_head_ ? lm_head_->shard() : wte_ ? wte_->shard() : ShardRange{};
  }
  // Context parallelism off: every rank of the context axis runs the whole
  // sequence itself (the parameters are the same on each) and returns all
  // its logits, for sequences the axis does not divide (generation's
  // growing prompts). Evaluation mode only (InvalidArgument when training).
  void set_context_split(bool on);

 protected:
  Tensor do_forward(const Tensor& ids, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override { return "GPT"; }

 private:
  // The head's table (lm_head, or the tied wte) and its value as the head
  // multiplies it: in the compute dtype.
  Embedding& head_table() { return lm_head_ ? *lm_head_ : *wte_; }
  Tensor head_weight();
  // ids -> the embeddings' sum after dropout (B, T / k, C); sets the State's sizes.
  Tensor embed(const Tensor& ids, Saved& saved);
  Tensor embed_sum(const Tensor& in, Saved& saved);
  enum Slot : size_t { kWte = 0, kWpe, kBlocks, kLnF, kDrop };
  struct State {
    int64_t b = 0, t = 0;
    int64_t t_pad = 0;       // t rounded up to the sequence-parallel split (t without it)
    int64_t first_step = 0;    // this rank's first step of the t_pad (sequence parallel)
    int64_t positions_of = 0;  // context parallel: the whole T the positions are global in (0: not split)
    Tensor positions;  // (steps) i64: this rank's position ids
    Tensor h;          // (B T, C) ln_f output: the head's input (in the compute dtype)
    Tensor dlogits;    // (B T, V) kept for the head's weight pass (in the compute dtype)
  };
  // The head's input pass: dlogits -> dh (B, t_pad, C), before ln_f; its
  // weight pass: the tied weight's share (its first report).
  Tensor head_backward_input(const Tensor& grad_out, State& st);
  void head_backward_weight(State& st, const BatchContext& batch);
  // The embeddings' backward from the blocks' dx, `step` running each
  // module's backward (fused) or backward_input.
  template <typename Step>
  void embed_backward(const Tensor& dx, Saved& saved, Step step);
  GPTConfig config_;
  bool split_context_ = true;
  std::optional<Embedding> wte_;      // with the embeddings, or the tied head
  std::optional<Embedding> lm_head_;  // the untied head
  // The head's use of its table. Where the table's module never runs (the
  // untied lm_head, or wte in a part without the embeddings) its hooks'
  // use-scope opens here (fully sharded data parallelism gathers the table
  // and provides its gradient there).
  template <typename Fn>
  void head_use(Pass pass, Fn&& fn) {
    if (config_.embed && !lm_head_) return fn();
    head_table().use_parameters(pass, fn);
  }
  std::optional<Embedding> wpe_;  // with the embeddings (GPT-2)
  std::optional<Dropout> drop_;   // on the embeddings' sum
  Sequential h_;
  std::unique_ptr<Module> ln_f_;  // with the head: LayerNorm (GPT-2) or RMSNorm (Llama)
};

}  // namespace meshtrain::nn
