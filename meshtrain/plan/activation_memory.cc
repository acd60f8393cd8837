#include "meshtrain/plan/activation_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/internal/ledger.h"

namespace meshtrain::plan {

namespace {

using internal::Ledger;

constexpr const char* kOp = "estimate_activations";

// The sizes every walker needs (see the header's notation).
struct Dims {
  int64_t b;       // B
  int64_t t;       // this rank's real steps (T, or T / n)
  int64_t tb;      // t': the steps inside tensor-parallel regions (t padded to k under sp)
  int64_t s;       // steps outside them (t' / k under sp)
  int64_t c;       // C
  int64_t hl, d;   // heads on this rank, head dim
  int64_t cl, fl;  // C / k, 4 C / k
  int64_t vl;      // this rank's vocabulary shard
  int k;
  bool sp, cp, ring, half, drop, recompute, split;
  int64_t cd;                               // compute dtype bytes
  // Llama's blocks: key/value features of this rank's heads, the SwiGLU's
  // hidden features on this rank; MoE layers: experts E, top_k, this rank's
  // experts, an expert's and the shared experts' hidden features on this
  // rank (0: none), the expert axis P.
  bool llama = false;
  bool kv_rep = false;  // key/value heads replicated over the tensor axis (fewer than its ranks)
  int64_t kvl = 0, gl = 0;
  int64_t experts = 0, top_k = 0, local_experts = 0, el = 0, sl = 0, first_dense = 0;
  int expert_ranks = 1;
  double expert_imbalance = 1.0;  // the fullest rank's experts' rows over the even share (expert axis > 1)
  // Rows this rank's experts run: n top_k, times the imbalance over an expert axis.
  int64_t received_rows() const {
    const int64_t nk = rows() * top_k;
    return expert_ranks > 1 ? static_cast<int64_t>(static_cast<double>(nk) * expert_imbalance + 0.5) : nk;
  }
  bool moe_block(int64_t index) const { return experts > 0 && index >= first_dense; }
  int64_t rows() const { return b * tb; }   // R
  int64_t rows_s() const { return b * s; }  // Rs
};

// What a module's call keeps in its Saved (handles: ids of the ledger).
struct LinearS { int x = -1, dy = -1, y = -1, dx = -1, xr = -1, dyr = -1; };
struct NormS { int dy = -1, xhat = -1, y = -1, rstd = -1, dx = -1; };
struct ActS { int x = -1, y = -1, dx = -1; };
struct DropS { int scale = -1, y = -1, dx = -1; };
struct RowS { int dy = -1; LinearS lin; };
// A SwiGLU MLP's call (swiglu.cc): its three Linears, the silu(g) and
// s * u buffers, the handles it keeps on g and u until its backward.
struct SwiS {
  LinearS gate, up;
  RowS down;
  int s = -1, h = -1, g = -1, u = -1;
};
// MoE::State and its router, experts and shared experts (moe.cc).
struct MoES {
  LinearS router;
  int x = -1, scores = -1, out = -1;
  std::vector<SwiS> experts;
  SwiS shared;
};
struct BlockS {
  NormS ln1, ln2;
  // Llama's: q, k, v and o projections; the MLP (SwiGLU or MoE).
  LinearS q_proj, k_proj, v_proj;
  RowS o;
  SwiS mlp;
  std::unique_ptr<MoES> moe;
  LinearS c_attn, c_fc;
  RowS c_proj, fc_proj;
  ActS gelu;
  DropS rd, md;
  int q = -1, k = -1, v = -1, out = -1, lse = -1;
  int q_heads = -1, k_heads = -1, v_heads = -1;  // Llama: the heads' layout when it is a view of q, k, v
  int input = -1;                   // recompute: the forward's input
  std::unique_ptr<BlockS> rebuilt;  // recompute: the activations rebuilt in backward
};

void release(Ledger& l, LinearS& s) {
  for (int* id : {&s.x, &s.dy, &s.y, &s.dx, &s.xr, &s.dyr}) l.unref(*id);
}
void release(Ledger& l, NormS& s) {
  for (int* id : {&s.dy, &s.xhat, &s.y, &s.rstd, &s.dx}) l.unref(*id);
}
void release(Ledger& l, SwiS& s) {
  release(l, s.gate);
  release(l, s.up);
  release(l, s.down.lin);
  for (int* id : {&s.down.dy, &s.s, &s.h, &s.g, &s.u}) l.unref(*id);
}
// Saved::clear / destruction of a block's Saved.
void release(Ledger& l, BlockS& s) {
  release(l, s.ln1);
  release(l, s.ln2);
  release(l, s.c_attn);
  release(l, s.c_fc);
  release(l, s.c_proj.lin);
  release(l, s.fc_proj.lin);
  release(l, s.q_proj);
  release(l, s.k_proj);
  release(l, s.v_proj);
  release(l, s.o.lin);
  l.unref(s.o.dy);
  release(l, s.mlp);
  if (s.moe) {
    release(l, s.moe->router);
    for (int* id : {&s.moe->x, &s.moe->scores, &s.moe->out}) l.unref(*id);
    for (SwiS& e : s.moe->experts) release(l, e);
    release(l, s.moe->shared);
  }
  for (int* id : {&s.c_proj.dy, &s.fc_proj.dy, &s.gelu.x, &s.gelu.y, &s.gelu.dx, &s.rd.scale, &s.rd.y, &s.rd.dx,
                  &s.md.scale, &s.md.y, &s.md.dx, &s.q, &s.k, &s.v, &s.out, &s.lse, &s.input, &s.q_heads,
                  &s.k_heads, &s.v_heads})
    l.unref(*id);
  if (s.rebuilt) release(l, *s.rebuilt);
  s.rebuilt.reset();
}

// One micro-batch through nn's GPT, in nn's order (gpt.cc, module.cc,
// linear.cc, layer_norm.cc, activations.cc, dropout.cc, tensor_parallel.cc).
class Walk {
 public:
  Walk(const Dims& d, int64_t blocks, int64_t first, bool embed, bool head, int64_t seq_t)
      : d_(d), blocks_(static_cast<size_t>(blocks)), first_(first), embed_(embed), head_(head), t_(seq_t) {}

  Ledger& ledger() { return l_; }

  // Forward and the loss's forward; returns the stage output (a part
  // without the head) or -1 (logits freed after the loss).
  int forward() {
    l_.mark(ScopeEvent::before_use, ScopePass::forward, -1);  // the GPT's forward
    l_.set_phase("forward embed");
    int x = embed_ ? embed_forward() : -1;  // a later stage's input is the receive buffer (untracked)
    int h = l_.ref(x);                      // Sequential::do_forward's h
    for (size_t i = 0; i < blocks_.size(); ++i) {
      l_.set_phase(fmt::format("forward h.{}", first_ + static_cast<int64_t>(i)));
      int y = block_module_forward(blocks_[i], h, first_ + static_cast<int64_t>(i));
      l_.unref(h);
      h = y;
    }
    if (!head_) {
      l_.unref(x);
      l_.mark(ScopeEvent::after_use, ScopePass::forward, -1);
      return h;
    }
    l_.set_phase("forward head");
    const int64_t bt = d_.b * t_;
    int n = norm_forward(gpt_.lnf, h, "ln_f");
    l_.unref(h);
    h = n;
    if (d_.sp) {  // the head sees every step: gathered, then narrowed to the real ones
      int g = gather(h, "head input (gathered)");
      l_.unref(h);
      h = g;
      l_.assign(gpt_.h, d_.tb != t_ && d_.b > 1 ? l_.alloc("head input (contiguous)", 4 * bt * d_.c) : l_.ref(h));
    } else {
      l_.assign(gpt_.h, l_.ref(h));
    }
    if (d_.half) l_.assign(gpt_.h, l_.alloc("head input (compute dtype)", d_.cd * bt * d_.c));
    int logits = l_.alloc("logits", 4 * bt * d_.vl);
    l_.unref(h);
    l_.unref(x);
    l_.mark(ScopeEvent::after_use, ScopePass::forward, -1);
    l_.set_phase("forward loss");
    if (d_.k > 1) l_.buffer(gpt_.probs, "loss probs (vocabulary-parallel)", 4 * bt * d_.vl);
    l_.unref(logits);  // the loss has read them
    return -1;
  }

  // GPT::backward: the head's two passes, ln_f, every block's backward
  // (input and weight passes together), the embeddings'. Split
  // (backward_input, then backward_weight: a zero-bubble pipeline's stage):
  // every input pass, then every weight pass.
  void backward() {
    const bool split = d_.split;
    const ScopePass pass = split ? ScopePass::backward_input : ScopePass::backward;
    const char* in = split ? "backward_input" : "backward";
    const int64_t bt = d_.b * t_;
    l_.set_phase("backward loss");
    int dl = -1;  // CrossEntropyLoss's gradient is untracked
    if (head_ && d_.k > 1) {
      l_.buffer(gpt_.grad, "loss grad (vocabulary-parallel)", 4 * bt * d_.vl);
      dl = l_.ref(gpt_.grad);
    }
    l_.mark(ScopeEvent::before_use, pass, -1);  // the GPT's scope
    int dh = -1;  // the head's dh is untracked
    if (head_) {
      l_.set_phase(fmt::format("{} head", in));
      l_.assign(gpt_.dlogits, l_.ref(dl));
      // A copy charged to the gradient's tracker: untracked for CrossEntropyLoss.
      if (d_.half) l_.assign(gpt_.dlogits, dl >= 0 ? l_.alloc("dlogits (compute dtype)", d_.cd * bt * d_.vl) : -1);
      if (!split) l_.unref(gpt_.dlogits);  // the head's weight pass follows at once
      dh = split ? norm_backward_input(gpt_.lnf, -1, "ln_f") : norm_backward(gpt_.lnf, -1, "ln_f");
    }
    int g = l_.ref(dh);  // Sequential's reverse chain
    for (size_t i = blocks_.size(); i-- > 0;) {
      const int64_t index = first_ + static_cast<int64_t>(i);
      l_.set_phase(fmt::format("{} h.{}", in, index));
      int gi = split ? block_module_backward_input(blocks_[i], g, index) : block_module_backward(blocks_[i], g, index);
      l_.unref(g);
      g = gi;
    }
    if (embed_) {
      l_.set_phase(fmt::format("{} embed", in));
      int de = dropout_backward(gpt_.drop, g, "drop");
      if (split && !d_.sp) l_.assign(gpt_.wte_dy, l_.ref(de));  // wte keeps dy for its weight pass
      l_.unref(de);
    }
    l_.unref(g);
    l_.unref(dh);
    l_.unref(dl);
    l_.mark(ScopeEvent::after_use, pass, -1);
    if (!split) return;
    l_.mark(ScopeEvent::before_use, ScopePass::backward_weight, -1);  // GPT::backward_weight
    l_.set_phase("backward_weight");
    l_.unref(gpt_.dlogits);
    l_.unref(gpt_.lnf.dy);
    for (size_t i = blocks_.size(); i-- > 0;)
      block_module_backward_weight(blocks_[i], first_ + static_cast<int64_t>(i));
    l_.unref(gpt_.wte_dy);
    l_.mark(ScopeEvent::after_use, ScopePass::backward_weight, -1);
  }

 private:
  struct GptS {
    int wte_y = -1, wpe_y = -1, wte_dy = -1;
    DropS drop;
    NormS lnf;
    int h = -1, dlogits = -1, probs = -1, grad = -1;
  };

  // ---- layers ----

  int linear_forward(LinearS& s, int x, int64_t rows, int64_t in, int64_t out, const std::string& name) {
    l_.assign(s.x, l_.ref(x));
    if (d_.half) {
      l_.buffer(s.xr, name + ".x (compute dtype)", d_.cd * rows * in);
      l_.assign(s.x, l_.ref(s.xr));
    }
    l_.buffer(s.y, name + ".y", 4 * rows * out);
    return l_.ref(s.y);
  }
  int linear_backward_input(LinearS& s, int dy, int64_t rows, int64_t in, int64_t out, const std::string& name) {
    int g = l_.ref(dy);
    if (d_.half) {
      l_.buffer(s.dyr, name + ".dy (compute dtype)", d_.cd * rows * out);
      l_.assign(g, l_.ref(s.dyr));
    }
    l_.buffer(s.dx, name + ".dx", 4 * rows * in);
    l_.assign(s.dy, g);
    return l_.ref(s.dx);
  }
  void linear_backward_weight(LinearS& s) {
    l_.unref(s.x);
    l_.unref(s.dy);
  }
  // Linear::do_backward: both passes, dy not kept.
  int linear_backward(LinearS& s, int dy, int64_t rows, int64_t in, int64_t out, const std::string& name) {
    int dx = linear_backward_input(s, dy, rows, in, out, name);
    linear_backward_weight(s);
    return dx;
  }
  int norm_forward(NormS& s, int /*x*/, const std::string& name) {
    const int64_t r = d_.rows_s();
    l_.buffer(s.xhat, name + ".xhat", 4 * r * d_.c);
    l_.buffer(s.y, name + ".y", 4 * r * d_.c);
    l_.buffer(s.rstd, name + ".rstd", 4 * r);
    return l_.ref(s.y);
  }
  int norm_backward_input(NormS& s, int dy, const std::string& name) {
    l_.assign(s.dy, l_.ref(dy));
    l_.buffer(s.dx, name + ".dx", 4 * d_.rows_s() * d_.c);
    return l_.ref(s.dx);
  }
  int norm_backward(NormS& s, int dy, const std::string& name) {
    int dx = norm_backward_input(s, dy, name);
    l_.unref(s.dy);  // the weight pass
    return dx;
  }
  int dropout_forward(DropS& s, int x, const std::string& name) {
    if (!d_.drop) return l_.ref(x);
    l_.buffer(s.scale, name + ".mask", 4 * d_.rows_s() * d_.c);
    l_.buffer(s.y, name + ".y", 4 * d_.rows_s() * d_.c);
    return l_.ref(s.y);
  }
  int dropout_backward(DropS& s, int dy, const std::string& name) {
    if (!d_.drop) return l_.ref(dy);
    l_.buffer(s.dx, name + ".dx", 4 * d_.rows_s() * d_.c);
    return l_.ref(s.dx);
  }
  // gather_sequence with a tracker: (k, B, s, C) buffer, then (B, t', C)
  // in sequence order unless B = 1.
  int gather(int /*x*/, const std::string& name) {
    const int64_t bytes = 4 * d_.rows() * d_.c;
    int buf = l_.alloc(name + " (all_gather buffer)", bytes);
    if (d_.b == 1) return buf;
    int out = l_.alloc(name, bytes);
    l_.unref(buf);
    return out;
  }
  // reduce_scatter_sequence of a tracked (B, t', C): the send copy (B > 1)
  // is charged to the input's tracker; the output only when given one.
  int reduce_scatter(bool tracked_out, const std::string& name) {
    int send = d_.b > 1 ? l_.alloc("reduce_scatter send copy", 4 * d_.rows() * d_.c) : -1;
    int out = tracked_out ? l_.alloc(name, 4 * d_.rows_s() * d_.c) : -1;
    l_.unref(send);
    return out;
  }
  int column_forward(LinearS& s, int x, int64_t out, const std::string& name) {
    int in = d_.sp ? gather(x, name + ".x (gathered)") : l_.ref(x);
    int y = linear_forward(s, in, d_.rows(), d_.c, out, name);
    l_.unref(in);
    return y;
  }
  int column_backward_input(LinearS& s, int dy, int64_t out, const std::string& name, bool fused = false) {
    int dx = fused ? linear_backward(s, dy, d_.rows(), d_.c, out, name)
                   : linear_backward_input(s, dy, d_.rows(), d_.c, out, name);
    if (!d_.sp) return dx;  // all-reduced in place
    reduce_scatter(false, "");
    l_.unref(dx);
    return -1;
  }
  int row_forward(RowS& s, int x, int64_t in, const std::string& name) {
    int y = linear_forward(s.lin, x, d_.rows(), in, d_.c, name);
    if (!d_.sp) return y;
    int out = reduce_scatter(true, name + ".y (reduce-scattered)");
    l_.unref(y);
    return out;
  }
  int row_backward_input(RowS& s, int dy, int64_t in, const std::string& name) {
    l_.assign(s.dy, l_.ref(dy));
    return linear_backward_input(s.lin, d_.sp ? -1 : dy, d_.rows(), in, d_.c, name);  // gathered: untracked
  }
  void row_backward_weight(RowS& s) {
    l_.unref(s.dy);
    linear_backward_weight(s.lin);
  }
  // RowParallelLinear::do_backward: dy not kept.
  int row_backward(RowS& s, int dy, int64_t in, const std::string& name) {
    return linear_backward(s.lin, d_.sp ? -1 : dy, d_.rows(), in, d_.c, name);  // gathered: untracked
  }

  // ---- attention and blocks ----

  // Heads of a transpose of (B, t', H/k, D) are contiguous already (no copy)
  // when one of the two swapped dims has size 1.
  bool transpose_is_view() const { return d_.hl == 1 || d_.tb == 1; }

  int attention_forward(BlockS& s, int x) {
    int qkv = column_forward(s.c_attn, x, 3 * d_.cl, "h.*.attn.c_attn");
    const int64_t part = 4 * d_.rows() * d_.cl;
    int y = -1, merged = -1;
    if (!d_.cp) {
      l_.assign(s.q, l_.alloc("h.*.attn.q", part));
      l_.assign(s.k, l_.alloc("h.*.attn.k", part));
      l_.assign(s.v, l_.alloc("h.*.attn.v", part));
      l_.assign(s.out, l_.alloc("h.*.attn.out", part));
      l_.assign(s.lse, l_.alloc("h.*.attn.lse", 4 * d_.b * d_.hl * d_.tb));
      merged = transpose_is_view() ? l_.ref(s.out) : l_.alloc("h.*.attn.merged", part);
    } else {  // to_chunks: q, k, v chunk-major (the real steps); kept by the ring, not by all_to_all
      int ch[3];
      for (int i = 0; i < 3; ++i) ch[i] = l_.alloc("h.*.attn.q|k|v (context chunks)", 4 * d_.b * d_.t * d_.cl);
      if (d_.ring) {
        l_.assign(s.q, l_.ref(ch[0]));
        l_.assign(s.k, l_.ref(ch[1]));
        l_.assign(s.v, l_.ref(ch[2]));
      }
      for (int& c : ch) l_.unref(c);
      // merged, out, lse: untracked
    }
    y = row_forward(s.c_proj, merged, d_.cl, "h.*.attn.c_proj");
    int a = dropout_forward(s.rd, y, "h.*.attn.resid_dropout");
    l_.unref(y);
    l_.unref(merged);
    l_.unref(qkv);
    return a;
  }

  int attention_backward_input(BlockS& s, int dy) {
    int d1 = dropout_backward(s.rd, dy, "h.*.attn.resid_dropout");
    int dmerged = row_backward_input(s.c_proj, d1, d_.cl, "h.*.attn.c_proj");
    l_.unref(d1);
    int g = -1;
    if (!d_.cp)
      g = transpose_is_view() ? l_.ref(dmerged) : l_.alloc("h.*.attn dout (heads layout)", 4 * d_.rows() * d_.cl);
    else
      g = l_.alloc("h.*.attn dout (context chunks)", 4 * d_.b * d_.t * d_.cl);
    for (int* id : {&s.q, &s.k, &s.v, &s.out, &s.lse}) l_.unref(*id);
    int dx = column_backward_input(s.c_attn, -1, 3 * d_.cl, "h.*.attn.c_attn");  // dqkv untracked
    l_.unref(g);
    l_.unref(dmerged);
    return dx;
  }

  // internal::PreNormBlock::forward, the frame both blocks share: h = x +
  // attention(n1(x)) and y = h + mlp(n2(h)), each sum a new (Rs, C); the
  // branches keep what they need themselves.
  template <typename Attention, typename Mlp>
  int pre_norm_forward(BlockS& s, int x, const std::string& n1_name, const std::string& n2_name,
                       Attention attention, Mlp mlp) {
    int n1 = norm_forward(s.ln1, x, n1_name);
    int a = attention(n1);
    l_.unref(n1);
    int h = l_.alloc("h.*.residual h", 4 * d_.rows_s() * d_.c);
    int n2 = norm_forward(s.ln2, h, n2_name);
    int m = mlp(n2);
    l_.unref(n2);
    int y = l_.alloc("h.*.output", 4 * d_.rows_s() * d_.c);
    l_.unref(m);
    l_.unref(h);
    l_.unref(a);
    return y;
  }

  int block_forward(BlockS& s, int x, int64_t index) {
    if (d_.llama) return llama_block_forward(s, x, index);
    return pre_norm_forward(s, x, "h.*.ln_1", "h.*.ln_2", [&](int n1) { return attention_forward(s, n1); },
                            [&](int n2) {  // mlp (Sequential): c_fc, GELU, c_proj, dropout
                              int m = l_.ref(n2);
                              l_.assign(m, column_forward(s.c_fc, m, d_.fl, "h.*.mlp.c_fc"));
                              l_.assign(s.gelu.x, l_.ref(m));
                              l_.buffer(s.gelu.y, "h.*.mlp.gelu.y", 4 * d_.rows() * d_.fl);
                              l_.assign(m, l_.ref(s.gelu.y));
                              l_.assign(m, row_forward(s.fc_proj, m, d_.fl, "h.*.mlp.c_proj"));
                              l_.assign(m, dropout_forward(s.md, m, "h.*.mlp.dropout"));
                              return m;
                            });
  }

  // GPTBlock::residual_backward with every module's backward_input, or
  // (fused) its backward: the MLP's layers fused, the attention's and the
  // norms' input then weight passes (they have no fused one).
  int block_backward(BlockS& s, int dy, bool fused) {
    if (d_.llama) return llama_block_backward(s, dy, fused);
    int g = l_.ref(dy);
    int m = dropout_backward(s.md, g, "h.*.mlp.dropout");
    l_.assign(m, fused ? row_backward(s.fc_proj, m, d_.fl, "h.*.mlp.c_proj")
                       : row_backward_input(s.fc_proj, m, d_.fl, "h.*.mlp.c_proj"));
    l_.buffer(s.gelu.dx, "h.*.mlp.gelu.dx", 4 * d_.rows() * d_.fl);
    l_.unref(s.gelu.x);
    l_.assign(m, l_.ref(s.gelu.dx));
    l_.assign(m, column_backward_input(s.c_fc, m, d_.fl, "h.*.mlp.c_fc", fused));
    int dm = fused ? norm_backward(s.ln2, m, "h.*.ln_2") : norm_backward_input(s.ln2, m, "h.*.ln_2");
    l_.unref(m);
    int da0 = attention_backward_input(s, -1);  // dh: untracked
    if (fused) {  // CausalSelfAttention's weight pass
      row_backward_weight(s.c_proj);
      linear_backward_weight(s.c_attn);
    }
    int da = fused ? norm_backward(s.ln1, da0, "h.*.ln_1") : norm_backward_input(s.ln1, da0, "h.*.ln_1");
    l_.unref(da0);
    l_.unref(da);
    l_.unref(dm);
    l_.unref(g);
    return -1;  // dx: untracked
  }

  void block_backward_weight(BlockS& s) {
    if (d_.llama) return llama_block_backward_weight(s);
    row_backward_weight(s.fc_proj);
    linear_backward_weight(s.c_fc);
    l_.unref(s.ln2.dy);
    row_backward_weight(s.c_proj);
    linear_backward_weight(s.c_attn);
    l_.unref(s.ln1.dy);
  }

  // ---- Llama's blocks (llama.cc, swiglu.cc, moe.cc) ----

  // A heads-layout copy of tracked `x` (to_heads, from_heads: contiguous()
  // charges the copy to x's tracker), or x itself when the transpose is a view.
  int heads_copy(int x, int64_t bytes, const std::string& name) {
    return transpose_is_view() ? l_.ref(x) : l_.alloc(name, bytes);
  }

  // LlamaAttention::do_forward: q, k, v projections (each column-parallel
  // Linear gathers its own input under sequence parallelism); q's and the
  // key/value heads' copies in the heads layout (tracked, as copies of
  // tracked outputs), the key/value heads repeated over their query group
  // (untracked; the same tensor when the group is one head); out and lse;
  // the merged heads (a tracked copy of out), o's input. Context
  // parallelism: its chunks, out and merged untracked.
  int llama_attention_forward(BlockS& s, int x) {
    int q = column_forward(s.q_proj, x, d_.cl, "h.*.self_attn.q_proj");
    int k = -1, v = -1;
    if (d_.kv_rep) {  // plain Linears of the key/value head on the whole sequence (gathered once under sp)
      int xkv = d_.sp ? gather(x, "h.*.self_attn k/v input (gathered)") : l_.ref(x);
      k = linear_forward(s.k_proj, xkv, d_.rows(), d_.c, d_.kvl, "h.*.self_attn.k_proj");
      v = linear_forward(s.v_proj, xkv, d_.rows(), d_.c, d_.kvl, "h.*.self_attn.v_proj");
      l_.unref(xkv);
    } else {
      k = column_forward(s.k_proj, x, d_.kvl, "h.*.self_attn.k_proj");
      v = column_forward(s.v_proj, x, d_.kvl, "h.*.self_attn.v_proj");
    }
    const bool grouped = d_.cl != d_.kvl;  // repeat_heads copies (untracked)
    l_.assign(s.q_heads, heads_copy(q, 4 * d_.rows() * d_.cl, "h.*.self_attn.q (heads)"));
    int kh = heads_copy(k, 4 * d_.rows() * d_.kvl, "h.*.self_attn.k (heads)");
    if (!grouped) l_.assign(s.k_heads, l_.ref(kh));
    l_.unref(kh);
    int vh = heads_copy(v, 4 * d_.rows() * d_.kvl, "h.*.self_attn.v (heads)");
    if (!grouped) l_.assign(s.v_heads, l_.ref(vh));
    l_.unref(vh);
    int merged = -1;
    if (d_.cp) {
      for (int* id : {&s.q_heads, &s.k_heads, &s.v_heads}) l_.unref(*id);
    } else {
      l_.assign(s.out, l_.alloc("h.*.self_attn.out", 4 * d_.rows() * d_.cl));
      l_.assign(s.lse, l_.alloc("h.*.self_attn.lse", 4 * d_.b * d_.hl * d_.tb));
      merged = heads_copy(s.out, 4 * d_.rows() * d_.cl, "h.*.self_attn.merged");
    }
    int y = row_forward(s.o, merged, d_.cl, "h.*.self_attn.o_proj");
    l_.unref(merged);
    for (int* id : {&q, &k, &v}) l_.unref(*id);
    return y;
  }
  // LlamaAttention::do_backward_input: o's dx; dq, dk, dv and the heads'
  // gradients untracked; q's dx, into which k's and v's are added.
  int llama_attention_backward_input(BlockS& s, int dy) {
    int dmerged = row_backward_input(s.o, dy, d_.cl, "h.*.self_attn.o_proj");
    if (!d_.cp) {
      int g = heads_copy(dmerged, 4 * d_.rows() * d_.cl, "h.*.self_attn dout (heads)");
      l_.unref(g);
    }
    for (int* id : {&s.q_heads, &s.k_heads, &s.v_heads, &s.out, &s.lse}) l_.unref(*id);
    int dx = column_backward_input(s.q_proj, -1, d_.cl, "h.*.self_attn.q_proj");
    if (!d_.kv_rep) {
      int dk = column_backward_input(s.k_proj, -1, d_.kvl, "h.*.self_attn.k_proj");
      int dv = column_backward_input(s.v_proj, -1, d_.kvl, "h.*.self_attn.v_proj");
      l_.unref(dk);
      l_.unref(dv);
    } else {  // k's and v's dx summed into a copy (whole sequence), under sp narrowed to this rank's steps
      int dk = linear_backward_input(s.k_proj, -1, d_.rows(), d_.c, d_.kvl, "h.*.self_attn.k_proj");
      int dkv = l_.alloc("h.*.self_attn dkv", 4 * d_.rows() * d_.c);
      int dv = linear_backward_input(s.v_proj, -1, d_.rows(), d_.c, d_.kvl, "h.*.self_attn.v_proj");
      l_.unref(dk);
      l_.unref(dv);
      if (d_.sp && d_.b > 1) l_.assign(dkv, l_.alloc("h.*.self_attn dkv (this rank's steps)", 4 * d_.rows_s() * d_.c));
      l_.unref(dkv);
    }
    l_.unref(dmerged);
    return dx;
  }
  void llama_attention_backward_weight(BlockS& s) {
    row_backward_weight(s.o);
    linear_backward_weight(s.v_proj);
    linear_backward_weight(s.k_proj);
    linear_backward_weight(s.q_proj);
  }

  // SwiGLUMLP::do_forward over `rows` rows (x: R rows of a dense MLP, or
  // an expert's dispatched rows) into f hidden features. `dense`: the
  // block's MLP (its Linears column- and row-parallel over the tensor
  // axis, gathering under sequence parallelism), else plain Linears of
  // those rows.
  int swiglu_forward(SwiS& s, int x, int64_t rows, int64_t f, bool dense, const std::string& name) {
    int g = dense ? column_forward(s.gate, x, f, name + ".gate_proj")
                  : linear_forward(s.gate, x, rows, d_.c, f, name + ".gate_proj");
    l_.assign(s.g, l_.ref(g));
    int u = dense ? column_forward(s.up, x, f, name + ".up_proj")
                  : linear_forward(s.up, x, rows, d_.c, f, name + ".up_proj");
    l_.assign(s.u, l_.ref(u));
    l_.buffer(s.s, name + ".silu", 4 * rows * f);
    l_.buffer(s.h, name + ".h", 4 * rows * f);
    int y = dense ? row_forward(s.down, s.h, f, name + ".down_proj")
                  : linear_forward(s.down.lin, s.h, rows, f, d_.c, name + ".down_proj");
    l_.unref(g);
    l_.unref(u);
    return y;
  }
  // SwiGLUMLP::do_backward_input: down's dx, d gate and d up (new), the
  // projections' dx and their sum (new, the rows of the input: Rs under
  // sequence parallelism).
  int swiglu_backward_input(SwiS& s, int dy, int64_t rows, int64_t f, bool dense, const std::string& name) {
    int dh = dense ? row_backward_input(s.down, dy, f, name + ".down_proj")
                   : linear_backward_input(s.down.lin, dy, rows, f, d_.c, name + ".down_proj");
    int dg = l_.alloc(name + ".dg", 4 * rows * f);
    int du = l_.alloc(name + ".du", 4 * rows * f);
    l_.unref(s.g);
    l_.unref(s.u);
    int dx = dense ? column_backward_input(s.gate, dg, f, name + ".gate_proj")
                   : linear_backward_input(s.gate, dg, rows, d_.c, f, name + ".gate_proj");
    int dxu = dense ? column_backward_input(s.up, du, f, name + ".up_proj")
                    : linear_backward_input(s.up, du, rows, d_.c, f, name + ".up_proj");
    const int64_t out_rows = dense && d_.sp ? d_.rows_s() : rows;
    int sum = l_.alloc(name + ".dx", 4 * out_rows * d_.c);
    for (int* id : {&dg, &du, &dx, &dxu, &dh}) l_.unref(*id);
    return sum;
  }
  void swiglu_backward_weight(SwiS& s) {
    row_backward_weight(s.down);
    linear_backward_weight(s.up);
    linear_backward_weight(s.gate);
  }

  // MoE::do_forward on n = B t rows (no sequence parallelism), routing
  // assumed even: every expert gets n top_k / E of the rows (no token
  // dropped), so each of this rank's experts n top_k / (E / P) after the
  // all-to-all.
  int moe_forward(MoES& s, int x) {
    const int64_t n = d_.rows(), nk = n * d_.top_k, recv = d_.received_rows(), per = recv / d_.local_experts;
    const int p = d_.expert_ranks;
    l_.assign(s.x, l_.ref(x));
    int logits = linear_forward(s.router, x, n, d_.c, d_.experts, "h.*.mlp.gate");
    l_.assign(s.scores, l_.alloc("h.*.mlp scores", 4 * n * d_.experts));
    l_.unref(logits);
    int rows = l_.alloc("h.*.mlp rows (dispatch order)", 4 * nk * d_.c);
    int received = p > 1 ? l_.alloc("h.*.mlp rows received (all_to_all)", 4 * recv * d_.c) : -1;
    std::vector<int> outs;
    for (int64_t e = 0; e < d_.local_experts; ++e) outs.push_back(l_.alloc("h.*.mlp expert input", 4 * per * d_.c));
    l_.unref(received);
    s.experts.resize(static_cast<size_t>(d_.local_experts));
    for (int64_t e = 0; e < d_.local_experts; ++e) {
      int y = swiglu_forward(s.experts[static_cast<size_t>(e)], outs[static_cast<size_t>(e)], per, d_.el, false,
                             "h.*.mlp.experts.*");
      l_.assign(outs[static_cast<size_t>(e)], y);
    }
    int back = l_.alloc("h.*.mlp expert outputs (combine)", 4 * recv * d_.c);
    if (p > 1) {
      int mine = l_.alloc("h.*.mlp expert outputs (all_to_all)", 4 * nk * d_.c);
      l_.unref(back);
      back = mine;
    }
    l_.assign(s.out, back);
    for (int& o : outs) l_.unref(o);
    int y = l_.alloc("h.*.mlp.y", 4 * n * d_.c);
    if (d_.sl > 0) {
      int sh = swiglu_forward(s.shared, x, n, d_.sl, false, "h.*.mlp.shared_experts");
      l_.unref(sh);
    }
    l_.unref(rows);
    return y;
  }
  int moe_backward_input(MoES& s, int dy) {
    const int64_t n = d_.rows(), nk = n * d_.top_k, recv = d_.received_rows(), per = recv / d_.local_experts;
    const int p = d_.expert_ranks;
    int drows = l_.alloc("h.*.mlp drows", 4 * nk * d_.c);
    int received = p > 1 ? l_.alloc("h.*.mlp drows received (all_to_all)", 4 * recv * d_.c) : -1;
    std::vector<int> grads;
    for (int64_t e = 0; e < d_.local_experts; ++e) grads.push_back(l_.alloc("h.*.mlp expert dy", 4 * per * d_.c));
    l_.unref(received);
    for (int64_t e = 0; e < d_.local_experts; ++e) {
      int g = swiglu_backward_input(s.experts[static_cast<size_t>(e)], grads[static_cast<size_t>(e)], per, d_.el,
                                    false, "h.*.mlp.experts.*");
      l_.assign(grads[static_cast<size_t>(e)], g);
    }
    int back = l_.alloc("h.*.mlp expert dx (combine)", 4 * recv * d_.c);
    if (p > 1) {
      int mine = l_.alloc("h.*.mlp expert dx (all_to_all)", 4 * nk * d_.c);
      l_.unref(back);
      back = mine;
    }
    int dlogits = l_.alloc("h.*.mlp dlogits", 4 * n * d_.experts);
    int dx_router = linear_backward_input(s.router, dlogits, n, d_.c, d_.experts, "h.*.mlp.gate");
    l_.unref(dlogits);
    int dx = l_.alloc("h.*.mlp.dx", 4 * n * d_.c);
    if (d_.sl > 0) {
      int sh = swiglu_backward_input(s.shared, dy, n, d_.sl, false, "h.*.mlp.shared_experts");
      l_.unref(sh);
    }
    l_.unref(s.out);
    l_.unref(s.scores);
    for (int* id : {&drows, &back, &dx_router}) l_.unref(*id);
    for (int& g : grads) l_.unref(g);  // the experts' dx, alive until the call returns
    return dx;
  }
  void moe_backward_weight(MoES& s) {
    if (d_.sl > 0) swiglu_backward_weight(s.shared);
    for (size_t e = s.experts.size(); e-- > 0;) swiglu_backward_weight(s.experts[e]);
    linear_backward_weight(s.router);
    l_.unref(s.x);
  }

  // LlamaBlock: internal::PreNormBlock over RMSNorms, the attention and the
  // MLP (SwiGLU, or MoE in a block from first_dense on).
  int llama_block_forward(BlockS& s, int x, int64_t index) {
    return pre_norm_forward(s, x, "h.*.input_layernorm", "h.*.post_attention_layernorm",
                            [&](int n1) { return llama_attention_forward(s, n1); },
                            [&](int n2) {
                              if (!d_.moe_block(index)) return swiglu_forward(s.mlp, n2, d_.rows(), d_.gl, true,
                                                                              "h.*.mlp");
                              if (!s.moe) s.moe = std::make_unique<MoES>();
                              return moe_forward(*s.moe, n2);
                            });
  }
  // PreNormBlock::backward: each branch's backward (fused: input then weight
  // pass) or backward_input; dh and dx untracked.
  int llama_block_backward(BlockS& s, int dy, bool fused) {
    int g = l_.ref(dy);
    int dm = -1;
    if (s.moe) {
      dm = moe_backward_input(*s.moe, g);
      if (fused) moe_backward_weight(*s.moe);
    } else {
      dm = swiglu_backward_input(s.mlp, g, d_.rows(), d_.gl, true, "h.*.mlp");
      if (fused) swiglu_backward_weight(s.mlp);
    }
    int dn = fused ? norm_backward(s.ln2, dm, "h.*.post_attention_layernorm")
                   : norm_backward_input(s.ln2, dm, "h.*.post_attention_layernorm");
    l_.unref(dm);
    int da = llama_attention_backward_input(s, -1);  // dh: untracked
    if (fused) llama_attention_backward_weight(s);
    int d1 = fused ? norm_backward(s.ln1, da, "h.*.input_layernorm")
                   : norm_backward_input(s.ln1, da, "h.*.input_layernorm");
    for (int* id : {&da, &d1, &dn, &g}) l_.unref(*id);
    return -1;  // dx: untracked
  }
  void llama_block_backward_weight(BlockS& s) {
    if (s.moe) moe_backward_weight(*s.moe);
    else swiglu_backward_weight(s.mlp);
    l_.unref(s.ln2.dy);
    llama_attention_backward_weight(s);
    l_.unref(s.ln1.dy);
  }

  // Module::forward / backward_input / backward_weight of block `index`,
  // with recompute's rules and the hooks' scopes (module.cc).
  int block_module_forward(BlockS& s, int x, int64_t index) {
    l_.mark(ScopeEvent::before_use, ScopePass::forward, index);
    int y = -1;
    if (!d_.recompute) {
      y = block_forward(s, x, index);
    } else {
      l_.assign(s.input, l_.ref(x));
      BlockS scratch;
      y = block_forward(scratch, x, index);
      release(l_, scratch);
    }
    l_.mark(ScopeEvent::after_use, ScopePass::forward, index);
    return y;
  }
  // Module::backward_target: in recompute mode the forward again, in a
  // forward scope, into the Saved the backward passes use.
  BlockS& block_target(BlockS& s, int64_t index) {
    if (!d_.recompute) return s;
    l_.mark(ScopeEvent::before_use, ScopePass::forward, index);
    s.rebuilt = std::make_unique<BlockS>();
    int y = block_forward(*s.rebuilt, s.input, index);
    l_.unref(y);
    l_.mark(ScopeEvent::after_use, ScopePass::forward, index);
    return *s.rebuilt;
  }
  // Module::end_call: recompute drops what it rebuilt, and the input.
  void block_end_call(BlockS& s) {
    if (!d_.recompute) return;
    release(l_, *s.rebuilt);
    s.rebuilt.reset();
    l_.unref(s.input);
  }
  int block_module_backward(BlockS& s, int dy, int64_t index) {
    BlockS& target = block_target(s, index);
    l_.mark(ScopeEvent::before_use, ScopePass::backward, index);
    int dx = block_backward(target, dy, /*fused=*/true);
    l_.mark(ScopeEvent::after_use, ScopePass::backward, index);
    block_end_call(s);
    return dx;
  }
  int block_module_backward_input(BlockS& s, int dy, int64_t index) {
    BlockS& target = block_target(s, index);
    l_.mark(ScopeEvent::before_use, ScopePass::backward_input, index);
    int dx = block_backward(target, dy, /*fused=*/false);
    l_.mark(ScopeEvent::after_use, ScopePass::backward_input, index);
    return dx;
  }
  void block_module_backward_weight(BlockS& s, int64_t index) {
    l_.mark(ScopeEvent::before_use, ScopePass::backward_weight, index);
    block_backward_weight(d_.recompute ? *s.rebuilt : s);
    l_.mark(ScopeEvent::after_use, ScopePass::backward_weight, index);
    block_end_call(s);
  }

  // GPT::embed / embed_sum: wte, wpe, their sum, dropout.
  int embed_forward() {
    l_.buffer(gpt_.wte_y, "wte.y", 4 * d_.rows() * d_.c);
    int tok = l_.ref(gpt_.wte_y);
    if (d_.sp) {
      int out = reduce_scatter(true, "wte.y (reduce-scattered)");
      l_.unref(tok);
      tok = out;
    }
    if (d_.llama) {  // rotary positions: no wpe, no sum
      int out = dropout_forward(gpt_.drop, tok, "drop");
      l_.unref(tok);
      return out;
    }
    l_.buffer(gpt_.wpe_y, "wpe.y", 4 * d_.s * d_.c);
    int pos = l_.ref(gpt_.wpe_y);
    int x = l_.alloc("embedding sum", 4 * d_.rows_s() * d_.c);
    int out = dropout_forward(gpt_.drop, x, "drop");
    l_.unref(x);
    l_.unref(pos);
    l_.unref(tok);
    return out;
  }

  Ledger l_;
  Dims d_;
  GptS gpt_;
  std::vector<BlockS> blocks_;
  int64_t first_;
  bool embed_, head_;
  int64_t t_;  // the real steps (the head's rows: B t)
};

void check(bool ok, const std::string& what, const std::string& fix) {
  if (!ok) throw InvalidArgument(kOp, what, fix);
}

// Rank r's share of n features split over k ranks (torch.chunk's rule, nn::shard_range).
int64_t shard_size(int64_t n, int k, int r) {
  const int64_t chunk = (n + k - 1) / k;
  return std::max<int64_t>(0, std::min(n, (r + 1) * chunk) - r * chunk);
}

}  // namespace

ActivationEstimate estimate_activations(const GptShape& g, const ActivationLayout& l) {
  check(g.vocab >= 1 && g.seq >= 1 && g.layers >= 0 && g.heads >= 1 && g.width >= 1 && g.width % g.heads == 0,
        fmt::format("vocab {}, seq {}, layers {}, heads {}, width {}", g.vocab, g.seq, g.layers, g.heads, g.width),
        "need vocab, seq, heads, width >= 1, layers >= 0 and heads dividing width");
  check(l.micro_batch >= 1 && l.batch_rows >= 0, fmt::format("micro_batch {}, batch_rows {}", l.micro_batch, l.batch_rows),
        "need micro_batch >= 1 and batch_rows >= 0");
  check(l.tensor >= 1 && l.tensor_rank >= 0 && l.tensor_rank < l.tensor && g.heads % l.tensor == 0,
        fmt::format("{} heads over tensor {} (rank {})", g.heads, l.tensor, l.tensor_rank),
        "use a tensor axis that divides the heads, and 0 <= tensor_rank < tensor");
  check(l.context >= 1, fmt::format("context {}", l.context), "need context >= 1");
  check(l.compute == DType::f32 || l.compute == DType::bf16 || l.compute == DType::f16,
        fmt::format("compute dtype {}", dtype_name(l.compute)), "use f32, bf16 or f16");
  check(l.dropout >= 0.0 && l.dropout < 1.0, fmt::format("dropout {}", l.dropout), "use 0 <= dropout < 1");
  check(l.token_dtype == DType::i64 || l.token_dtype == DType::i32,
        fmt::format("token dtype {}", dtype_name(l.token_dtype)), "use i64 or i32");
  const int64_t last = l.last_block < 0 ? g.layers : l.last_block;
  check(l.first_block >= 0 && l.first_block <= last && last <= g.layers,
        fmt::format("blocks [{}, {}) of {}", l.first_block, l.last_block, g.layers),
        "pick 0 <= first_block <= last_block <= layers");
  const bool sp = l.sequence_parallel && l.tensor > 1, cp = l.context > 1;
  const int64_t chunks = l.cp_load_balance ? 2 * int64_t{l.context} : l.context;
  check(!cp || g.seq % chunks == 0, fmt::format("context {} with seq {}", l.context, g.seq),
        fmt::format("context parallelism needs seq divisible by {}", chunks));
  check(!cp || l.cp_comm == layout::ContextComm::ring || (g.heads / l.tensor) % l.context == 0,
        fmt::format("all_to_all over {} context ranks with {} heads per tensor rank", l.context, g.heads / l.tensor),
        "use ring, or heads divisible by tensor x context");
  // Sequence parallelism pads this rank's t steps (T, or T / n with a
  // context axis) that the tensor axis does not divide (GPT::embed).

  Dims d{};
  d.b = l.micro_batch;
  d.k = l.tensor;
  d.t = cp ? g.seq / l.context : g.seq;
  d.tb = sp ? (d.t + d.k - 1) / d.k * d.k : d.t;
  d.s = sp ? d.tb / d.k : d.t;
  d.c = g.width;
  d.hl = g.heads / d.k;
  d.d = g.width / g.heads;
  d.cl = d.hl * d.d;
  d.fl = 4 * g.width / d.k;
  d.vl = shard_size(g.vocab, d.k, l.tensor_rank);
  if (g.llama()) {
    const int64_t kv = g.key_value_heads();
    check(g.heads % kv == 0 && (kv % d.k == 0 || d.k % kv == 0),
          fmt::format("{} key/value heads for {} heads over tensor {}", kv, g.heads, d.k),
          "use kv_heads dividing heads, and a tensor axis that divides kv_heads or that kv_heads divides");
    d.llama = true;
    d.kv_rep = d.k > kv;
    d.kvl = (d.k > kv ? 1 : kv / d.k) * d.d;
    d.gl = shard_size(g.mlp_hidden(), d.k, l.tensor_rank);
    if (g.moe.active()) {
      check(g.moe.top_k >= 1 && g.moe.top_k <= g.moe.experts && l.expert >= 1 && g.moe.experts % l.expert == 0,
            fmt::format("{} experts, top_k {}, over an expert axis of {}", g.moe.experts, g.moe.top_k, l.expert),
            "use 1 <= top_k <= experts and an expert axis that divides the experts");
      check(!sp && !cp, "mixture-of-experts layers with sequence or context parallelism",
            "run them with tensor parallelism alone (as the trainer does)");
      d.experts = g.moe.experts;
      d.top_k = g.moe.top_k;
      d.expert_ranks = l.expert;
      check(l.expert_imbalance >= 1.0, fmt::format("expert imbalance {}", l.expert_imbalance),
            "give the fullest expert's load over the mean, at least 1");
      d.expert_imbalance = l.expert_imbalance;
      d.local_experts = g.moe.experts / l.expert;
      d.el = shard_size(g.expert_hidden(), d.k, l.tensor_rank);
      d.sl = g.moe.shared_experts > 0 ? shard_size(g.moe.shared_experts * g.expert_hidden(), d.k, l.tensor_rank) : 0;
      d.first_dense = g.moe.first_dense;
    }
  } else {
    check(!g.moe.active(), fmt::format("{} experts with GPT-2's blocks", g.moe.experts),
          "mixture-of-experts layers replace Llama's MLPs: set arch llama");
  }
  d.sp = sp;
  d.cp = cp;
  d.ring = l.cp_comm == layout::ContextComm::ring;
  d.half = l.compute != DType::f32;
  d.cd = static_cast<int64_t>(dtype_size(l.compute));
  d.drop = l.training && l.dropout > 0.0;
  d.recompute = l.recompute;
  d.split = l.split_backward;

  Walk w(d, last - l.first_block, l.first_block, l.embed, l.head, d.t);
  Ledger& led = w.ledger();
  ActivationEstimate e;
  // Cold: a fresh Saved.
  led.reset_peak(true);
  led.begin_timeline();
  int out = w.forward();
  if (out >= 0) {
    e.stage_output = static_cast<double>(4 * d.rows_s() * d.c);
    led.unref(out);  // handed on (sent)
  }
  e.saved_per_micro_batch = static_cast<double>(led.now());
  e.saved_terms = led.live_terms();
  w.backward();
  e.peak_one_micro_batch = static_cast<double>(led.peak());
  e.peak_terms = led.peak_terms();
  e.peak_at = led.peak_at();
  e.resident_after_backward = static_cast<double>(led.now());
  e.timeline = led.take_timeline();
  // Warm: the same Saved again.
  led.reset_peak(false);
  led.begin_timeline();
  out = w.forward();
  led.unref(out);
  e.saved_warm = static_cast<double>(led.now());
  w.backward();
  e.peak_warm = static_cast<double>(led.peak());
  e.timeline_warm = led.take_timeline();
  const int64_t rows = l.batch_rows > 0 ? l.batch_rows : l.micro_batch;
  e.batch_bytes = static_cast<double>(2 * rows * g.seq * static_cast<int64_t>(dtype_size(l.token_dtype)));
  return e;
}

std::string to_string(const std::vector<ActivationTerm>& terms) {
  std::string out;
  for (const ActivationTerm& t : terms)
    out += fmt::format("  {:<44} {:>5} x  {:>14.0f} B\n", t.name, t.count, t.bytes);
  return out;
}

double megatron_layer_activation_bytes(const GptShape& g, int64_t micro_batch, int tensor, bool sequence_parallel,
                                       MegatronRecompute recompute) {
  check(g.seq >= 1 && g.width >= 1 && g.heads >= 1 && micro_batch >= 1 && tensor >= 1,
        fmt::format("seq {}, width {}, heads {}, micro_batch {}, tensor {}", g.seq, g.width, g.heads, micro_batch,
                    tensor),
        "need positive sizes");
  const double s = static_cast<double>(g.seq), b = static_cast<double>(micro_batch), h = static_cast<double>(g.width),
               a = static_cast<double>(g.heads), t = tensor;
  const double sbh = s * b * h;
  const bool sp = sequence_parallel && tensor > 1;
  switch (recompute) {
    case MegatronRecompute::full: return 2.0 * sbh / (sp ? t : 1.0);
    case MegatronRecompute::selective: return sbh * (sp ? 34.0 / t : 10.0 + 24.0 / t);
    case MegatronRecompute::none: break;
  }
  const double scores = 5.0 * a * s / (h * t);
  return sbh * ((sp ? 34.0 / t : 10.0 + 24.0 / t) + scores);
}

}  // namespace meshtrain::plan
