#include "meshtrain/nn/gpt.h"

#include <fmt/format.h>

#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/deterministic.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/internal/pre_norm.h"
#include "meshtrain/nn/llama.h"

namespace meshtrain::nn {

namespace F = functional;
using internal::join_name;

namespace {

// One of q, k, v from the projection's (B, T, 3C) output, as (B H, T, D):
// the head dim leaves the channels and comes before time (a copy).
Tensor split_heads(const Tensor& qkv, int64_t which, int64_t heads) {
  const int64_t b = qkv.size(0), t = qkv.size(1), c = qkv.size(2) / 3, d = c / heads;
  return qkv.view({b, t, 3, heads, d}).select(2, which).transpose(1, 2).contiguous().view({b * heads, t, d});
}

// (B H, T, D) -> (B, T, H D): the heads back side by side (a copy).
Tensor merge_heads(const Tensor& x, int64_t b, int64_t heads) {
  const int64_t t = x.size(1), d = x.size(2);
  return x.view({b, heads, t, d}).transpose(1, 2).contiguous().view({b, t, heads * d});
}

}  // namespace

// ---- CausalSelfAttention ----

namespace {

// Heads per tensor-parallel rank; InvalidArgument unless they split evenly.
int64_t local_heads(int64_t width, int64_t heads, const TensorParallelGroup& tp, const std::string& prefix) {
  if (heads < 1 || width % heads != 0)
    throw InvalidArgument("CausalSelfAttention", fmt::format("'{}': width {} over {} heads", prefix, width, heads),
                          "pick a head count that divides the width");
  if (heads % tp.size() != 0)
    throw InvalidArgument("CausalSelfAttention",
                          fmt::format("'{}': {} heads over a tensor-parallel axis of {} ranks", prefix, heads,
                                      tp.size()),
                          "use a tensor axis size that divides the number of heads (each rank holds whole heads)");
  return heads / tp.size();
}

// Sequence (or context) parallelism: a dropout outside the tensor-parallel
// regions sees this rank's time steps of each sample.
DropoutShard sequence_shard(const TensorParallelGroup& tp, const ContextParallelGroup& cp) {
  DropoutShard s;
  if (tp.splits_sequence()) s.rank = tp.rank(), s.ranks = tp.size();
  if (cp.active()) s.pieces = cp.chunk_ids(cp.rank()), s.total_pieces = cp.chunks();
  return s;
}

// Sequence parallelism: a module replicated over the tensor axis that sees
// only this rank's tokens has partial gradients (tensor_parallel.h).
void mark_sequence_parallel(Module& m, const TensorParallelGroup& tp) {
  for (Parameter* p : m.parameters()) p->sequence_parallel = tp.splits_sequence();
}

}  // namespace

CausalSelfAttention::CausalSelfAttention(int64_t width, int64_t heads, const std::string& prefix, uint64_t seed,
                                         double proj_std, bool defer_init, double dropout, TensorParallelGroup tp,
                                         ContextParallelGroup cp)
    : name_(prefix),
      width_(width),
      heads_(local_heads(width, heads, tp, prefix)),
      head_dim_(width / heads),
      cp_(cp),
      c_attn_(width, 3 * width, join_name(prefix, "c_attn"), seed,
              LinearOptions{.role = sharding::LinearRole::column, .defer_init = defer_init, .init_std = 0.02}, tp,
              /*parts=*/3),
      c_proj_(width, width, join_name(prefix, "c_proj"), seed,
              LinearOptions{.role = sharding::LinearRole::row, .defer_init = defer_init, .init_std = proj_std}, tp),
      resid_dropout_(dropout, join_name(prefix, "resid_dropout"), seed, sequence_shard(tp, cp)) {
  // What the strategies see (sharding/strategy.h): the fused q|k|v of
  // `heads` heads, the output projection.
  for (Parameter* p : c_attn_.parameters()) p->info.num_heads = heads;
  for (Parameter* p : c_proj_.parameters()) {
    p->info.kind = p->info.shape.size() == 2 ? sharding::ParamKind::attention_out_weight
                                             : sharding::ParamKind::attention_out_bias;
    p->info.role = sharding::LinearRole::none;  // implied by the kind
  }
}

std::vector<Parameter*> CausalSelfAttention::parameters() {
  std::vector<Parameter*> ps = c_attn_.parameters();
  for (Parameter* p : c_proj_.parameters()) ps.push_back(p);
  return ps;
}

Tensor CausalSelfAttention::do_forward(const Tensor& x, Saved& saved) {
  if (x.dim() != 3 || x.size(2) != width_)
    throw InvalidArgument("CausalSelfAttention::forward",
                          fmt::format("'{}': input {} is not (B, T, {})", name_, shape_to_string(x.shape()), width_),
                          "pass (batch, time, width)");
  State& st = saved.state<State>();
  const Tensor qkv = c_attn_.forward(x, saved.child(0));  // (B, T, 3C) (x: (B, T/k, C) sequence parallel)
  st.b = qkv.size(0);
  st.t = qkv.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  if (splits()) {  // this rank's chunks; attention over the whole sequence
    // Sequence parallelism's padding is cut off: only the chunks' real steps attend.
    st.t_real = context_steps(saved.batch, st.t);
    const Tensor real = st.t_real == st.t ? qkv : qkv.narrow(1, 0, st.t_real).contiguous();
    const int64_t t = st.t_real;
    const Tensor out = context_attention_forward(cp_, to_chunks(real, 0, st.b, t), to_chunks(real, 1, st.b, t),
                                                 to_chunks(real, 2, st.b, t), /*causal=*/true, scale, st.cp);
    const std::vector<int64_t> shape{st.b, st.t, 1, heads_, head_dim_};
    Tensor merged = t == st.t ? Tensor::empty(shape, DType::f32) : Tensor::zeros(shape, DType::f32);  // padding: 0
    from_chunks(out, merged.narrow(1, 0, t), 0);
    return resid_dropout_.forward(c_proj_.forward(merged.view({st.b, st.t, heads_ * head_dim_}), saved.child(1)),
                                  saved.child(2));
  }
  st.q = split_heads(qkv, 0, heads_);
  st.k = split_heads(qkv, 1, heads_);
  st.v = split_heads(qkv, 2, heads_);
  st.out = Tensor::empty(st.q.shape(), DType::f32, Device{}, tracker_, MemoryCategory::activations);
  st.lse = Tensor::empty({st.q.size(0), st.t}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  F::attention_forward(st.q, st.k, st.v, /*causal=*/true, scale, st.out, st.lse);
  return resid_dropout_.forward(c_proj_.forward(merge_heads(st.out, st.b, heads_), saved.child(1)), saved.child(2));
}

Tensor CausalSelfAttention::do_backward_input(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  const Tensor dmerged =
      c_proj_.backward_input(resid_dropout_.backward_input(grad_out, saved.child(2)), saved.child(1));  // (B, T, C)
  if (splits()) {
    const int64_t t = st.t_real;
    const Tensor g = to_chunks(dmerged.narrow(1, 0, t).contiguous().view({st.b, t, 1, heads_ * head_dim_}), 0,
                               st.b, t);
    Tensor dq = Tensor::empty(g.shape(), DType::f32), dk = Tensor::empty(g.shape(), DType::f32),
           dv = Tensor::empty(g.shape(), DType::f32);
    context_attention_backward(cp_, g, true, 1.0 / std::sqrt(static_cast<double>(head_dim_)), st.cp, dq, dk, dv);
    st.cp = {};
    const std::vector<int64_t> shape{st.b, st.t, 3, heads_, head_dim_};
    Tensor dqkv = t == st.t ? Tensor::empty(shape, DType::f32) : Tensor::zeros(shape, DType::f32);
    int64_t which = 0;
    for (const Tensor* part : {&dq, &dk, &dv}) from_chunks(*part, dqkv.narrow(1, 0, t), which++);
    return c_attn_.backward_input(dqkv.view({st.b, st.t, 3 * heads_ * head_dim_}), saved.child(0));
  }
  Tensor dq = Tensor::empty(st.q.shape(), DType::f32), dk = Tensor::empty(st.q.shape(), DType::f32),
         dv = Tensor::empty(st.q.shape(), DType::f32);
  const int64_t d = head_dim_;
  const Tensor g =
      dmerged.contiguous().view({st.b, st.t, heads_, d}).transpose(1, 2).contiguous().view({st.b * heads_, st.t, d});
  F::attention_backward(st.q, st.k, st.v, st.out, st.lse, g, true, 1.0 / std::sqrt(static_cast<double>(d)), dq, dk,
                        dv);
  // dq, dk, dv back into the projection's (B, T, 3, H, D) layout.
  Tensor dqkv = Tensor::empty({st.b, st.t, 3, heads_, d}, DType::f32);
  int64_t which = 0;
  for (const Tensor* part : {&dq, &dk, &dv})
    dqkv.select(2, which++).copy_from(part->view({st.b, heads_, st.t, d}).transpose(1, 2));
  st.q = st.k = st.v = st.out = st.lse = Tensor();
  return c_attn_.backward_input(dqkv.view({st.b, st.t, 3 * heads_ * d}), saved.child(0));
}

// Part `which` of (B, T, parts, H, D) (T this rank's chunks in order) as
// (P, B, H, c, D).
Tensor CausalSelfAttention::to_chunks(const Tensor& qkv, int64_t which, int64_t b, int64_t t) const {
  const int64_t p = cp_.local_chunks(), c = t / p, parts = qkv.numel() / (b * t * heads_ * head_dim_);
  const Tensor src = qkv.contiguous().view({b, p, c, parts, heads_, head_dim_}).select(3, which);  // (B, P, c, H, D)
  Tensor out = Tensor::empty({p, b, heads_, c, head_dim_}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  for (int64_t i = 0; i < p; ++i) out.select(0, i).copy_from(src.select(1, i).transpose(1, 2));
  return out;
}

// The inverse into part `which` of dst (B, T, parts, H, D) (T steps of
// dst, which may be a narrowed view along them).
void CausalSelfAttention::from_chunks(const Tensor& x, const Tensor& dst, int64_t which) const {
  const int64_t p = x.size(0), c = x.size(3);
  for (int64_t i = 0; i < p; ++i)
    dst.narrow(1, i * c, c).select(2, which).copy_from(x.select(0, i).transpose(1, 2));  // (B, c, H, D)
}

// This rank's real steps of the t it holds: the whole length T (the batch
// context's sequence_length; 0: t, unpadded) over the context ranks; t is
// that rounded up to the sequence-parallel split.
int64_t CausalSelfAttention::context_steps(const BatchContext& batch, int64_t t) const {
  if (batch.sequence_length <= 0) return t;
  const int64_t real = batch.sequence_length / cp_.size();
  if (batch.sequence_length % cp_.size() != 0 || real > t || real % cp_.local_chunks() != 0)
    throw InvalidArgument("CausalSelfAttention::forward",
                          fmt::format("'{}': {} steps for a sequence of {} over {} context-parallel ranks", name_, t,
                                      batch.sequence_length, cp_.size()),
                          "pass this rank's chunks (padded to the sequence-parallel split)");
  return real;
}

void CausalSelfAttention::do_backward_weight(Saved& saved) {
  resid_dropout_.backward_weight(saved.child(2));
  c_proj_.backward_weight(saved.child(1));
  c_attn_.backward_weight(saved.child(0));
}

// ---- GPTBlock ----

GPTBlock::GPTBlock(int64_t width, int64_t heads, const std::string& prefix, uint64_t seed, double proj_std,
                   bool defer_init, double dropout, TensorParallelGroup tp, ContextParallelGroup cp)
    : name_(prefix),
      ln_1_(width, join_name(prefix, "ln_1"), 1e-5, true, defer_init),
      attn_(width, heads, join_name(prefix, "attn"), seed, proj_std, defer_init, dropout, tp, cp),
      ln_2_(width, join_name(prefix, "ln_2"), 1e-5, true, defer_init),
      mlp_(join_name(prefix, "mlp")) {
  mark_sequence_parallel(ln_1_, tp);
  mark_sequence_parallel(ln_2_, tp);
  // nanoGPT's names: mlp.c_fc, mlp.c_proj (the GELU takes no name).
  mlp_.add(std::make_unique<ColumnParallelLinear>(
      width, 4 * width, join_name(prefix, "mlp.c_fc"), seed,
      LinearOptions{.role = sharding::LinearRole::column, .defer_init = defer_init, .init_std = 0.02}, tp));
  mlp_.add(std::make_unique<GELU>(GeluApproximation::tanh));
  mlp_.add(std::make_unique<RowParallelLinear>(
      4 * width, width, join_name(prefix, "mlp.c_proj"), seed,
      LinearOptions{.role = sharding::LinearRole::row, .defer_init = defer_init, .init_std = proj_std}, tp));
  mlp_.add(std::make_unique<Dropout>(dropout, join_name(prefix, "mlp.dropout"), seed, sequence_shard(tp, cp)));
}

std::vector<Parameter*> GPTBlock::parameters() {
  std::vector<Parameter*> ps;
  for (Module* m : children())
    for (Parameter* p : m->parameters()) ps.push_back(p);
  return ps;
}

internal::PreNormBlock GPTBlock::block() { return {ln_1_, attn_, ln_2_, mlp_}; }

Tensor GPTBlock::do_forward(const Tensor& x, Saved& saved) { return block().forward(x, saved, tracker_); }
Tensor GPTBlock::do_backward(const Tensor& grad_out, Saved& saved) { return block().backward(grad_out, saved); }
Tensor GPTBlock::do_backward_input(const Tensor& grad_out, Saved& saved) {
  return block().backward_input(grad_out, saved);
}
void GPTBlock::do_backward_weight(Saved& saved) { block().backward_weight(saved); }

// ---- GPT ----

namespace {

const GPTConfig& checked(const GPTConfig& c) {
  if (c.arch == layout::DecoderArch::llama && c.dropout > 0.0)
    throw InvalidArgument("GPT", fmt::format("arch llama with dropout {}", c.dropout),
                          "Llama's blocks have no dropout: set dropout 0, or use arch gpt2");
  if (c.vocab < 1 || c.block_size < 1 || c.layers < 0 || c.heads < 1 || c.width < 1 || c.width % c.heads != 0 ||
      !(c.dropout >= 0.0 && c.dropout < 1.0))
    throw InvalidArgument("GPT",
                          fmt::format("vocab {}, block_size {}, layers {}, heads {}, width {}, dropout {}", c.vocab,
                                      c.block_size, c.layers, c.heads, c.width, c.dropout),
                          "need vocab, block_size, heads, width >= 1, layers >= 0, heads dividing width and dropout "
                          "in [0, 1)");
  if (c.moe.active() && c.arch != layout::DecoderArch::llama)
    throw InvalidArgument("GPT",
                          fmt::format("{} experts with arch {}", c.moe.experts, layout::decoder_arch_name(c.arch)),
                          "mixture-of-experts layers replace Llama's SwiGLU MLPs: use arch llama");
  const int64_t last = c.last_block < 0 ? c.layers : c.last_block;
  if (c.first_block < 0 || c.first_block > last || last > c.layers)
    throw InvalidArgument("GPT", fmt::format("blocks [{}, {}) of {}", c.first_block, c.last_block, c.layers),
                          "pick 0 <= first_block <= last_block <= layers (last_block < 0: all the rest)");
  return c;
}

}  // namespace

GPT::GPT(GPTConfig config) : config_(checked(config)), h_("h") {
  const GPTConfig& c = config_;
  const bool llama = c.arch == layout::DecoderArch::llama;
  if (c.embed || (c.head && c.tie_embeddings))
    wte_.emplace(c.vocab, c.width, "wte", c.seed,
                 EmbeddingOptions{.defer_init = c.defer_init, .tensor = c.tensor});  // vocabulary-parallel
  if (c.head && !c.tie_embeddings)
    lm_head_.emplace(c.vocab, c.width, "lm_head", c.seed,
                     EmbeddingOptions{.defer_init = c.defer_init, .tensor = c.tensor});
  if (c.embed) {
    if (!llama) {
      wpe_.emplace(c.block_size, c.width, "wpe", c.seed,
                   EmbeddingOptions{.defer_init = c.defer_init, .kind = sharding::ParamKind::other});
      mark_sequence_parallel(*wpe_, c.tensor);
    }
    drop_.emplace(c.dropout, "drop", c.seed, sequence_shard(c.tensor, c.context));
  }
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(c.layers, 1)));
  for (int64_t i = c.first_block; i < (c.last_block < 0 ? c.layers : c.last_block); ++i) {
    const std::string name = join_name("h", std::to_string(i));
    std::unique_ptr<Module> block;
    if (llama)
      block = std::make_unique<LlamaBlock>(LlamaBlockConfig{
          .width = c.width, .heads = c.heads, .kv_heads = c.kv_heads, .rope_base = c.rope_base,
          .ffn_hidden = layout::llama_ffn_hidden(c.width, c.ffn_hidden), .norm_eps = 1e-5, .prefix = name,
          .seed = c.seed, .init_std = 0.02, .out_std = proj_std, .defer_init = c.defer_init, .tensor = c.tensor,
          .context = c.context,
          .moe = i >= c.moe.first_dense ? c.moe : MoEOptions{}, .expert = c.expert});
    else
      block = std::make_unique<GPTBlock>(c.width, c.heads, name, c.seed, proj_std, c.defer_init, c.dropout, c.tensor,
                                         c.context);
    h_.add(std::move(block)).set_recompute(c.recompute);
  }
  if (c.head) {
    if (llama)
      ln_f_ = std::make_unique<RMSNorm>(c.width, "ln_f", 1e-5, c.defer_init);
    else
      ln_f_ = std::make_unique<LayerNorm>(c.width, "ln_f", 1e-5, true, c.defer_init);
    mark_sequence_parallel(*ln_f_, c.tensor);
  }
  if (c.embed && c.head && c.tie_embeddings) wte_->weight().users = 2;  // the embedding and the tied output head
}

std::vector<Parameter*> GPT::parameters() {
  std::vector<Parameter*> ps;
  for (Module* m : children())
    for (Parameter* p : m->parameters()) ps.push_back(p);
  return ps;
}

std::vector<Module*> GPT::children() {
  std::vector<Module*> out;
  if (wte_) out.push_back(&*wte_);
  if (wpe_) out.push_back(&*wpe_);
  if (drop_) out.push_back(&*drop_);
  out.push_back(&h_);
  if (ln_f_) out.push_back(ln_f_.get());
  if (lm_head_) out.push_back(&*lm_head_);
  return out;
}

std::vector<Module*> GPT::blocks() { return h_.children(); }

std::vector<Module*> GPT::fsdp_units() {
  std::vector<Module*> units = blocks();
  if (wte_ && config_.tie_embeddings && !(config_.embed && config_.head)) units.push_back(&*wte_);
  units.push_back(this);
  return units;
}

std::vector<std::pair<int64_t, MoE*>> GPT::moe_layers() {
  std::vector<std::pair<int64_t, MoE*>> out;
  if (config_.arch != layout::DecoderArch::llama) return out;
  int64_t block = config_.first_block;
  for (Module* b : h_.children()) {
    if (MoE* m = static_cast<LlamaBlock*>(b)->moe()) out.emplace_back(block, m);
    ++block;
  }
  return out;
}

void GPT::set_context_split(bool on) {
  split_context_ = on;
  for (Module* b : h_.children()) {
    if (config_.arch == layout::DecoderArch::llama)
      static_cast<LlamaBlock*>(b)->attention().set_context_split(on);
    else
      static_cast<GPTBlock*>(b)->attention().set_context_split(on);
  }
}

Tensor GPT::head_weight() {
  const Parameter& w = head_table().weight();
  return internal::param_value(w.value, compute_dtype_, "GPT::forward", w.name);
}

Tensor GPT::do_forward(const Tensor& input, Saved& saved) {
  const char* op = "GPT::forward";
  State& st = saved.state<State>();
  const TensorParallelGroup& tp = config_.tensor;
  const int64_t k = tp.splits_sequence() ? tp.size() : 1;
  Tensor x;
  if (config_.embed) {
    x = embed(input, saved);
  } else {  // a later pipeline stage: the residual stream (B, T / k, C)
    if (!input.defined() || input.dim() != 3 || input.size(2) != config_.width)
      throw InvalidArgument(op,
                            fmt::format("input {} of a part without the embeddings",
                                        input.defined() ? shape_to_string(input.shape()) : std::string("undefined")),
                            fmt::format("pass the previous stage's output (batch, T, {})", config_.width));
    x = input;
    st.b = input.size(0);
    // The real length, when sequence parallelism padded it or context
    // parallelism split it (the stage's caller knows T from the batch; 0:
    // unsplit, unpadded): this rank's t = T / n real steps of the t_pad.
    const ContextParallelGroup& cp = config_.context;
    const int64_t n = cp.active() && split_context_ ? cp.size() : 1;
    const int64_t given = saved.batch.sequence_length;
    st.t_pad = input.size(1) * k;
    st.t = given > 0 ? given / n : st.t_pad;
    if (given > 0 && (given % n != 0 || st.t > st.t_pad || st.t <= st.t_pad - k))
      throw InvalidArgument(op,
                            fmt::format("input {} for a sequence of {} steps over {} context x {} sequence-parallel "
                                        "ranks",
                                        shape_to_string(input.shape()), given, n, k),
                            "pass the previous stage's ceil(T / context / k) steps and the batch context's "
                            "sequence_length T");
  }
  Tensor h = h_.forward(x, saved.child(kBlocks));
  if (!config_.head) return h;
  h = ln_f_->forward(h, saved.child(kLnF));
  if (k > 1) h = gather_sequence(h, tp, tracker_).narrow(1, 0, st.t);  // the head sees every step
  st.h = h.contiguous().view({st.b * st.t, config_.width});
  if (compute_dtype_ != DType::f32) st.h = st.h.to(compute_dtype_);  // the head's GEMMs in half precision
  Tensor logits = Tensor::empty({st.b * st.t, head_table().shard().size()}, DType::f32, Device{}, tracker_,
                                MemoryCategory::activations);
  head_use(Pass::forward, [&] { F::unembed_forward(st.h, head_weight(), logits); });  // f32 logits for the loss
  return logits;
}

Tensor GPT::embed(const Tensor& ids, Saved& saved) {
  const char* op = "GPT::forward";
  if (!ids.defined() || ids.dim() != 2 || ids.size(1) < 1 || ids.size(1) > config_.block_size)
    throw InvalidArgument(op,
                          fmt::format("ids {} for block_size {}",
                                      ids.defined() ? shape_to_string(ids.shape()) : std::string("undefined"),
                                      config_.block_size),
                          "pass token ids (batch, T) with 1 <= T <= block_size");
  State& st = saved.state<State>();
  st.b = ids.size(0);
  const int64_t whole = ids.size(1);
  const ContextParallelGroup& cp = config_.context;
  if (cp.active() && !split_context_ && training_)
    throw InvalidArgument(op, "context split off while training", "call set_context_split(false) for evaluation only");
  // Context parallelism keeps this rank's chunks of every sample, at their
  // global positions; sequence parallelism then splits those t steps over
  // the k tensor ranks. A t that k does not divide is padded at the end:
  // causal attention (context parallel: attention on the real steps only)
  // keeps the padding from reaching the real steps, and the head drops it.
  const bool context = cp.active() && split_context_;
  Tensor in = ids;
  if (context) {
    cp.check_length(whole, op);
    in = shard_sequence(ids, cp, 1);
  }
  st.t = in.size(1);
  const TensorParallelGroup& tp = config_.tensor;
  const int64_t k = tp.splits_sequence() ? tp.size() : 1;
  st.t_pad = (st.t + k - 1) / k * k;
  // The children see the call's samples (the deterministic mode's node of
  // the position table's call) and, split over the sequence, the whole
  // length: the dropouts number their masks by it, so the padding changes
  // no real step's mask (one device's masks, cut by steps).
  BatchContext real = saved.batch;
  real.samples = st.b;
  if (k > 1) real.sequence_length = whole;
  for (Module* m : children()) m->set_batch_context(real);
  if (st.t_pad != st.t) {
    Tensor padded = Tensor::zeros({st.b, st.t_pad}, DType::i64);
    padded.narrow(1, 0, st.t).copy_from(in.to(DType::i64));
    in = padded;
  }
  const int64_t steps = st.t_pad / k, first = k > 1 ? tp.rank() * steps : 0;  // this rank's steps of the t_pad
  if (!st.positions.defined() || st.positions.size(0) != steps || st.first_step != first ||
      st.positions_of != (context ? whole : 0)) {
    const std::vector<int64_t> global = context ? sequence_positions(cp, whole) : std::vector<int64_t>{};
    std::vector<int64_t> pos(static_cast<size_t>(steps));
    for (int64_t i = 0; i < steps; ++i) {
      const int64_t l = first + i;  // padding: any valid position (it reaches no real step)
      pos[static_cast<size_t>(i)] = context && l < st.t ? global[static_cast<size_t>(l)]
                                                        : std::min(l, config_.block_size - 1);
    }
    st.positions = Tensor::from_vector(pos, {steps});
    st.first_step = first;
    st.positions_of = context ? whole : 0;
  }
  return embed_sum(in, saved);  // wte reduce-scatters the steps over the tensor axis (sequence parallel)
}

// wte(ids) + wpe(positions) -> dropout, with the State's positions.
Tensor GPT::embed_sum(const Tensor& in, Saved& saved) {
  State& st = saved.state<State>();
  const Tensor tok = wte_->forward(in, saved.child(kWte));            // (B, steps, C)
  if (!wpe_) return drop_->forward(tok, saved.child(kDrop));          // Llama: positions are rotary
  const Tensor pos = wpe_->forward(st.positions, saved.child(kWpe));  // (steps, C)
  Tensor x = Tensor::empty(tok.shape(), DType::f32, Device{}, tracker_, MemoryCategory::activations);
  for (int64_t b = 0; b < st.b; ++b) add(tok.select(0, b), pos, x.select(0, b));
  return drop_->forward(x, saved.child(kDrop));
}

// dlogits -> dh (B, t_pad, C) at ln_f's output, summed over the tensor axis.
Tensor GPT::head_backward_input(const Tensor& grad_out, State& st) {
  const char* op = "GPT::backward";
  st.dlogits = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(st.dlogits, {st.b * st.t, head_table().shard().size()}, op, "grad_out");
  if (compute_dtype_ != DType::f32) st.dlogits = st.dlogits.to(compute_dtype_);
  const TensorParallelGroup& tp = config_.tensor;
  Tensor dh = Tensor::zeros({st.b, st.t_pad, config_.width}, DType::f32);  // padded steps: no gradient
  Tensor dh_real = st.t_pad == st.t ? dh : Tensor::empty({st.b, st.t, config_.width}, DType::f32);
  head_use(Pass::backward_input, [&] {
    F::unembed_backward_input(st.dlogits, head_weight(), dh_real.view({st.b * st.t, config_.width}));
  });
  if (st.t_pad != st.t) dh.narrow(1, 0, st.t).copy_from(dh_real);
  // Each rank's vocabulary shard contributes to dh: summed over the group
  // (sequence parallel: this rank's time steps of the sum).
  if (tp.splits_sequence())
    dh = reduce_scatter_sequence(dh, tp);
  else if (tp.size() > 1) {
    const F::ProfileScope scope("tp all_reduce");
    tp.comm->all_reduce(dh.data<float>(), dh.data<float>(), static_cast<size_t>(dh.numel()), DType::f32,
                        comm::ReduceOp::sum);
  }
  round_to(dh, compute_dtype_);
  return dh;
}

// The head's share of the tied weight: its first report (wte's own, in the
// embeddings' backward, completes it); the untied lm_head's only one.
void GPT::head_backward_weight(State& st, const BatchContext& batch) {
  Parameter& w = head_table().weight();
  head_use(Pass::backward_weight, [&] {
    internal::check_param_grad(w.grad, "GPT::backward", w.name);
    // The deterministic mode: the tied table's head part is user 1, its
    // embedding part user 0 (each its own tree, added last).
    add_gradient(w, config_.tie_embeddings ? 1 : 0, call_node(batch, st.b),
                 [&](const Tensor& g) { F::unembed_backward_weight(st.h, st.dlogits, g); });
    notify_grad_ready(w);
  });
  st.dlogits = Tensor();
}

template <typename Step>
void GPT::embed_backward(const Tensor& dx, Saved& saved, Step step) {
  const State& st = saved.state<State>();
  const Tensor de = step(*drop_, dx, saved.child(kDrop));
  if (wpe_) {  // the position table is shared by the batch: the sum over samples
    Tensor dpos = Tensor::zeros({de.size(1), config_.width}, DType::f32);
    if (const int64_t block = deterministic_block(); block > 0) {
      // The deterministic mode: each block's samples in order, the blocks in the canonical tree.
      std::vector<Tensor> sums;
      std::vector<float*> parts;
      for (int64_t b0 = 0; b0 < st.b; b0 += block) {
        sums.push_back(Tensor::zeros({de.size(1), config_.width}, DType::f32));
        for (int64_t b = b0; b < b0 + block; ++b) add(sums.back(), de.select(0, b), sums.back());
        parts.push_back(sums.back().data<float>());
      }
      tree_sum(parts, dpos.numel());
      dpos = sums.front();
    } else {
      for (int64_t b = 0; b < st.b; ++b) add(dpos, de.select(0, b), dpos);
    }
    step(*wpe_, dpos, saved.child(kWpe));
  }
  step(*wte_, de, saved.child(kWte));
}

Tensor GPT::do_backward_input(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  Tensor dh = grad_out;  // without the head: the next stage's gradient of the residual stream
  if (config_.head) dh = ln_f_->backward_input(head_backward_input(grad_out, st), saved.child(kLnF));
  const Tensor dx = h_.backward_input(dh, saved.child(kBlocks));
  if (!config_.embed) return dx;
  embed_backward(dx, saved, [](Module& m, const Tensor& g, Saved& s) { return m.backward_input(g, s); });
  return Tensor();  // ids have no gradient
}

void GPT::do_backward_weight(Saved& saved) {
  // The head's share of the tied weight first (its first report), then the
  // layers in reverse; wte's own report comes last and completes it.
  if (config_.head) {
    head_backward_weight(saved.state<State>(), saved.batch);
    ln_f_->backward_weight(saved.child(kLnF));
  }
  h_.backward_weight(saved.child(kBlocks));
  if (!config_.embed) return;
  drop_->backward_weight(saved.child(kDrop));
  if (wpe_) wpe_->backward_weight(saved.child(kWpe));
  wte_->backward_weight(saved.child(kWte));
}

// Block by block, each module's passes together: the same numbers and the
// same order of gradient reports as the split passes.
Tensor GPT::do_backward(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  Tensor dh = grad_out;
  if (config_.head) {
    dh = head_backward_input(grad_out, st);
    head_backward_weight(st, saved.batch);
    dh = ln_f_->backward(dh, saved.child(kLnF));
  }
  const Tensor dx = h_.backward(dh, saved.child(kBlocks));
  if (!config_.embed) return dx;
  embed_backward(dx, saved, [](Module& m, const Tensor& g, Saved& s) { return m.backward(g, s); });
  return Tensor();
}

}  // namespace meshtrain::nn
