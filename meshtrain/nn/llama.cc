#include "meshtrain/nn/llama.h"

#include <fmt/format.h>

#include <cmath>
#include <tuple>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/internal/pre_norm.h"

namespace meshtrain::nn {

namespace F = functional;

namespace {

const LlamaAttentionConfig& checked(const LlamaAttentionConfig& c) {
  const char* op = "LlamaAttention";
  const int64_t kv = c.kv_heads == 0 ? c.heads : c.kv_heads;
  if (c.heads < 1 || c.width % c.heads != 0 || (c.width / c.heads) % 2 != 0)
    throw InvalidArgument(op, fmt::format("'{}': width {} over {} heads", c.prefix, c.width, c.heads),
                          "pick a head count that divides the width into even head dims (rotary pairs)");
  if (kv < 1 || c.heads % kv != 0)
    throw InvalidArgument(op, fmt::format("'{}': {} key/value heads for {} query heads", c.prefix, kv, c.heads),
                          "use a kv_heads that divides heads");
  const int k = c.tensor.size();
  if (kv % k != 0 && k % kv != 0)
    throw InvalidArgument(op,
                          fmt::format("'{}': {} key/value heads over a tensor-parallel axis of {} ranks", c.prefix, kv,
                                      k),
                          "use a tensor axis size that divides kv_heads, or that kv_heads divides (each head then "
                          "replicated on tensor / kv_heads ranks)");
  return c;
}

std::unique_ptr<Module> projection(const LlamaAttentionConfig& c, int64_t in, int64_t out, const char* name,
                                   ChainRole role, double std) {
  const LinearOptions o{.bias = false, .defer_init = c.defer_init, .init_std = std};
  return make_chain_linear(in, out, internal::join_name(c.prefix, name), c.seed, o, c.tensor, role);
}

// (B, T, H D) -> (B H, T, D) (a copy).
Tensor to_heads(const Tensor& x, int64_t heads) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2) / heads;
  return x.contiguous().view({b, t, heads, d}).transpose(1, 2).contiguous().view({b * heads, t, d});
}
// (B H, T, D) -> (B, T, H D) (a copy).
Tensor from_heads(const Tensor& x, int64_t b, int64_t heads) {
  const int64_t t = x.size(1), d = x.size(2);
  return x.view({b, heads, t, d}).transpose(1, 2).contiguous().view({b, t, heads * d});
}
// (B K, T, D) -> (B K g, T, D): each key/value head once per query head of its group.
Tensor repeat_heads(const Tensor& x, int64_t group) {
  if (group == 1) return x;
  const int64_t n = x.size(0), t = x.size(1), d = x.size(2);
  Tensor out = Tensor::empty({n, group, t, d}, DType::f32);
  for (int64_t j = 0; j < group; ++j) out.select(1, j).copy_from(x);
  return out.view({n * group, t, d});
}
// The inverse's gradient: (B K g, T, D) summed over each group -> (B K, T, D).
Tensor sum_groups(const Tensor& x, int64_t group) {
  if (group == 1) return x;
  const int64_t n = x.size(0) / group, t = x.size(1), d = x.size(2);
  const Tensor v = x.view({n, group, t, d});
  Tensor out = v.select(1, 0).contiguous();
  for (int64_t j = 1; j < group; ++j) add(out, v.select(1, j).contiguous(), out);
  return out;
}

// (B H, T, D) with T = P chunks of c steps -> chunk-major (P, B, H, c, D) (a copy).
Tensor to_chunks(const Tensor& x, int64_t b, int64_t p) {
  const int64_t h = x.size(0) / b, t = x.size(1), d = x.size(2), c = t / p;
  const Tensor v = x.view({b, h, p, c, d});
  Tensor out = Tensor::empty({p, b, h, c, d}, DType::f32);
  for (int64_t i = 0; i < p; ++i) out.select(0, i).copy_from(v.select(2, i));
  return out;
}
// The inverse: (P, B, H, c, D) -> (B H, P c, D).
Tensor from_chunks(const Tensor& x) {
  const int64_t p = x.size(0), b = x.size(1), h = x.size(2), c = x.size(3), d = x.size(4);
  Tensor out = Tensor::empty({b * h, p * c, d}, DType::f32);
  const Tensor v = out.view({b, h, p, c, d});
  for (int64_t i = 0; i < p; ++i) v.select(2, i).copy_from(x.select(0, i));
  return out;
}

}  // namespace

LlamaAttention::LlamaAttention(const LlamaAttentionConfig& config)
    : config_(checked(config)),
      heads_(config_.heads / config_.tensor.size()),
      head_dim_(config_.width / config_.heads) {
  const int64_t c = config_.width, d = head_dim_, kv = config_.kv_heads == 0 ? config_.heads : config_.kv_heads;
  const int k = config_.tensor.size();
  kv_heads_ = k > kv ? 1 : kv / k;
  const double out_std = config_.out_std > 0.0 ? config_.out_std : config_.init_std;
  q_ = projection(config_, c, config_.heads * d, "q_proj", ChainRole::column, config_.init_std);
  LlamaAttentionConfig kv_config = config_;
  if (k > kv) {  // collective over the tensor axis
    const int rep = k / static_cast<int>(kv), r = config_.tensor.rank();
    kv_comm_ = config_.tensor.comm->split(r % rep, r);
    rep_comm_ = config_.tensor.comm->split(r / rep, r);
    kv_config.tensor = {.comm = kv_comm_.get()};
  }
  k_ = projection(kv_config, c, kv * d, "k_proj", ChainRole::column, config_.init_std);
  v_ = projection(kv_config, c, kv * d, "v_proj", ChainRole::column, config_.init_std);
  if (rep_comm_)
    for (Module* m : {k_.get(), v_.get()})
      for (Parameter* p : m->parameters()) p->partial_over = rep_comm_.get();
  o_ = projection(config_, config_.heads * d, c, "o_proj", ChainRole::row, out_std);
  // What the strategies see: q's heads, k's and v's key/value heads.
  for (Parameter* p : q_->parameters()) p->info.num_heads = config_.heads;
  for (Parameter* p : k_->parameters()) p->info.num_heads = kv;
  for (Parameter* p : v_->parameters()) p->info.num_heads = kv;
}

std::vector<Parameter*> LlamaAttention::parameters() {
  std::vector<Parameter*> ps;
  for (Module* m : children())
    for (Parameter* p : m->parameters()) ps.push_back(p);
  return ps;
}

Tensor LlamaAttention::do_forward(const Tensor& x, Saved& saved) {
  if (x.dim() != 3 || x.size(2) != config_.width)
    throw InvalidArgument("LlamaAttention::forward",
                          fmt::format("'{}': input {} is not (B, T, {})", config_.prefix, shape_to_string(x.shape()),
                                      config_.width),
                          "pass (batch, time, width)");
  State& st = saved.state<State>();
  const Tensor q = q_->forward(x, saved.child(0));  // (B, T, Hq D) (sequence parallel: gathered)
  // Replicated key/value heads run over kv_comm_ on the whole sequence:
  // under sequence parallelism their input is gathered over the tensor axis.
  const Tensor xkv = rep_comm_ && config_.tensor.splits_sequence() ? gather_sequence(x, config_.tensor, tracker_) : x;
  const Tensor k = k_->forward(xkv, saved.child(1));
  const Tensor v = v_->forward(xkv, saved.child(2));
  st.b = q.size(0);
  st.t = q.size(1);
  std::vector<int64_t> pos(static_cast<size_t>(st.t), 0);
  st.t_real = st.t;
  if (splits()) {  // this rank's chunks at their global positions (sequence parallelism's padding after them)
    const ContextParallelGroup& cp = config_.context;
    const int64_t whole = saved.batch.sequence_length > 0 ? saved.batch.sequence_length : st.t * cp.size();
    st.t_real = whole / cp.size();
    if (whole % cp.size() != 0 || st.t_real > st.t || st.t_real % cp.local_chunks() != 0)
      throw InvalidArgument("LlamaAttention::forward",
                            fmt::format("'{}': {} steps for a sequence of {} over {} context-parallel ranks",
                                        config_.prefix, st.t, whole, cp.size()),
                            "pass this rank's chunks (padded to the sequence-parallel split)");
    const std::vector<int64_t> mine = sequence_positions(cp, whole);
    std::copy(mine.begin(), mine.end(), pos.begin());
  } else {
    for (int64_t i = 0; i < st.t; ++i) pos[static_cast<size_t>(i)] = i;
  }
  st.positions = Tensor::from_vector(pos, {st.t});
  const double base = config_.rope_base;
  st.q = to_heads(q, heads_);
  F::rotary_embedding(st.q, st.positions, base, false, st.q);
  Tensor kh = to_heads(k, kv_heads_);
  F::rotary_embedding(kh, st.positions, base, false, kh);
  const int64_t group = heads_ / kv_heads_;
  st.k = repeat_heads(kh, group);
  st.v = repeat_heads(to_heads(v, kv_heads_), group);
  if (splits()) {  // attention over the whole sequence from this rank's chunks' real steps
    const int64_t p = config_.context.local_chunks(), t = st.t_real;
    const auto real = [&](const Tensor& x) { return t == st.t ? x : x.narrow(1, 0, t).contiguous(); };
    const Tensor out = context_attention_forward(config_.context, to_chunks(real(st.q), st.b, p),
                                                 to_chunks(real(st.k), st.b, p), to_chunks(real(st.v), st.b, p),
                                                 /*causal=*/true, 1.0 / std::sqrt(static_cast<double>(head_dim_)),
                                                 st.cp);
    st.q = st.k = st.v = Tensor();
    Tensor merged = from_heads(from_chunks(out), st.b, heads_);  // (B, t, Hq D)
    if (t != st.t) {  // the padded steps' outputs: 0
      Tensor padded = Tensor::zeros({st.b, st.t, merged.size(2)}, DType::f32);
      padded.narrow(1, 0, t).copy_from(merged);
      merged = padded;
    }
    return o_->forward(merged, saved.child(3));
  }
  st.out = Tensor::empty(st.q.shape(), DType::f32, Device{}, tracker_, MemoryCategory::activations);
  st.lse = Tensor::empty({st.q.size(0), st.t}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  F::attention_forward(st.q, st.k, st.v, /*causal=*/true, 1.0 / std::sqrt(static_cast<double>(head_dim_)), st.out,
                       st.lse);
  return o_->forward(from_heads(st.out, st.b, heads_), saved.child(3));
}

Tensor LlamaAttention::do_backward_input(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  const Tensor dmerged = o_->backward_input(grad_out, saved.child(3));  // (B, T, Hq D)
  const Tensor g = to_heads(dmerged, heads_);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  Tensor dq, dk, dv;
  if (splits()) {
    const int64_t t = st.t_real;
    const Tensor gc = to_chunks(t == st.t ? g : g.narrow(1, 0, t).contiguous(), st.b, config_.context.local_chunks());
    Tensor dqc = Tensor::empty(gc.shape(), DType::f32), dkc = Tensor::empty(gc.shape(), DType::f32),
           dvc = Tensor::empty(gc.shape(), DType::f32);
    context_attention_backward(config_.context, gc, true, scale, st.cp, dqc, dkc, dvc);
    st.cp = {};
    // Back to the t steps held (the padded ones' gradients: 0).
    const auto held = [&](const Tensor& chunks) {
      const Tensor real = from_chunks(chunks);
      if (t == st.t) return real;
      Tensor out = Tensor::zeros({real.size(0), st.t, real.size(2)}, DType::f32);
      out.narrow(1, 0, t).copy_from(real);
      return out;
    };
    dq = held(dqc);
    dk = held(dkc);
    dv = held(dvc);
  } else {
    dq = Tensor::empty(st.q.shape(), DType::f32);
    dk = Tensor::empty(st.q.shape(), DType::f32);
    dv = Tensor::empty(st.q.shape(), DType::f32);
    F::attention_backward(st.q, st.k, st.v, st.out, st.lse, g, true, scale, dq, dk, dv);
  }
  const int64_t group = heads_ / kv_heads_;
  Tensor dkh = sum_groups(dk, group), dvh = sum_groups(dv, group);
  F::rotary_embedding(dq, st.positions, config_.rope_base, true, dq);
  F::rotary_embedding(dkh, st.positions, config_.rope_base, true, dkh);
  st.q = st.k = st.v = st.out = st.lse = Tensor();
  Tensor dx = q_->backward_input(from_heads(dq, st.b, heads_), saved.child(0));
  Tensor dkv;  // replicated heads: k's and v's parts, summed over rep_comm_ below
  for (auto [m, d, i] : {std::tuple{k_.get(), &dkh, size_t{1}}, {v_.get(), &dvh, size_t{2}}}) {
    const Tensor part = m->backward_input(from_heads(*d, st.b, kv_heads_), saved.child(i)).contiguous();
    if (!rep_comm_) add(dx, part, dx);
    else if (!dkv.defined()) dkv = part.clone();
    else add(dkv, part, dkv);
  }
  if (rep_comm_) {  // the ranks holding one head saw different query heads' gradients
    {
      const F::ProfileScope scope("tp all_reduce");
      rep_comm_->all_reduce(dkv.data<float>(), dkv.data<float>(), static_cast<size_t>(dkv.numel()), DType::f32,
                            comm::ReduceOp::sum);
    }
    // dkv is the whole sequence's complete sum on every rank: under sequence
    // parallelism this rank's steps of it join q's reduce-scattered dx.
    if (config_.tensor.splits_sequence()) {
      const int64_t s = dx.size(1);
      dkv = dkv.narrow(1, config_.tensor.rank() * s, s).contiguous();
    }
    add(dx, dkv, dx);
  }
  return dx;
}

// Reverse definition order: o, v, k, q.
void LlamaAttention::do_backward_weight(Saved& saved) {
  o_->backward_weight(saved.child(3));
  v_->backward_weight(saved.child(2));
  k_->backward_weight(saved.child(1));
  q_->backward_weight(saved.child(0));
}

// ---- LlamaBlock ----

namespace {

LlamaAttentionConfig block_attention(const LlamaBlockConfig& c) {
  return {.width = c.width, .heads = c.heads, .kv_heads = c.kv_heads, .rope_base = c.rope_base,
          .prefix = internal::join_name(c.prefix, "self_attn"), .seed = c.seed, .init_std = c.init_std,
          .out_std = c.out_std, .defer_init = c.defer_init, .tensor = c.tensor, .context = c.context};
}

std::unique_ptr<Module> block_mlp(const LlamaBlockConfig& c) {
  if (c.ffn_hidden < 1)
    throw InvalidArgument("LlamaBlock", fmt::format("'{}': ffn_hidden {}", c.prefix, c.ffn_hidden),
                          "use an MLP width >= 1");
  const std::string prefix = internal::join_name(c.prefix, "mlp");
  if (c.moe.active()) {
    MoEOptions moe = c.moe;
    if (moe.expert_hidden == 0) moe.expert_hidden = c.ffn_hidden;
    return std::make_unique<MoE>(MoEConfig{.width = c.width, .moe = moe, .prefix = prefix, .seed = c.seed,
                                           .init_std = c.init_std, .out_std = c.out_std,
                                           .defer_init = c.defer_init, .tensor = c.tensor, .expert = c.expert});
  }
  return std::make_unique<SwiGLUMLP>(SwiGLUConfig{.width = c.width, .hidden = c.ffn_hidden, .prefix = prefix,
                                                  .seed = c.seed, .init_std = c.init_std, .out_std = c.out_std,
                                                  .defer_init = c.defer_init, .tensor = c.tensor});
}

}  // namespace

LlamaBlock::LlamaBlock(const LlamaBlockConfig& config)
    : prefix_(config.prefix),
      input_norm_(config.width, internal::join_name(config.prefix, "input_layernorm"), config.norm_eps,
                  config.defer_init),
      attn_(block_attention(config)),
      post_norm_(config.width, internal::join_name(config.prefix, "post_attention_layernorm"),
                 config.norm_eps, config.defer_init),
      mlp_(block_mlp(config)), moe_(dynamic_cast<MoE*>(mlp_.get())) {
  for (RMSNorm* n : {&input_norm_, &post_norm_})
    for (Parameter* p : n->parameters()) p->sequence_parallel = config.tensor.splits_sequence();
}

std::vector<Parameter*> LlamaBlock::parameters() {
  std::vector<Parameter*> ps;
  for (Module* m : children())
    for (Parameter* p : m->parameters()) ps.push_back(p);
  return ps;
}

internal::PreNormBlock LlamaBlock::block() { return {input_norm_, attn_, post_norm_, *mlp_}; }
Tensor LlamaBlock::do_forward(const Tensor& x, Saved& saved) { return block().forward(x, saved, tracker_); }
Tensor LlamaBlock::do_backward(const Tensor& grad_out, Saved& saved) { return block().backward(grad_out, saved); }
Tensor LlamaBlock::do_backward_input(const Tensor& grad_out, Saved& saved) {
  return block().backward_input(grad_out, saved);
}
void LlamaBlock::do_backward_weight(Saved& saved) { block().backward_weight(saved); }

}  // namespace meshtrain::nn
