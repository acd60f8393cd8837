// Activation memory of the GPT (nn/gpt.h), by formula: the bytes a rank's
// MemoryTracker charges to MemoryCategory::activations for one micro-batch's
// forward, loss and backward, derived from what nn's code allocates (not a
// generic transformer formula; megatron_layer_activation_bytes gives that
// one, for comparison). Pure arithmetic over the shape and the layout: plan
// sits left of nn and includes none of it.
//
//   plan::GptShape s{.vocab = 8192, .seq = 128, .layers = 4, .heads = 4, .width = 256};
//   plan::ActivationLayout l{.micro_batch = 8, .tensor = 2, .sequence_parallel = true};
//   plan::ActivationEstimate e = plan::estimate_activations(s, l);
//   e.saved_per_micro_batch;   // what stays from a micro-batch's forward until its backward
//   e.peak_one_micro_batch;    // the peak of its forward + loss + backward
//   for (auto& t : e.peak_terms) ...  // what is live at that peak, by tensor
//   for (auto& m : e.timeline) ...    // bytes at every FSDP hook of the micro-batch
//
// How it is computed. nn's allocations are few and regular, but their
// lifetimes are not (buffers reused across calls, split backward, recompute,
// handles that keep tensors alive), so the estimate walks the code's
// allocation order for one micro-batch with reference-counted handles, the
// way the Tensors themselves are counted, and takes the running sum and its
// maximum: exact, including every transient, for the tensors charged to the
// tracker. Closed forms for the common case are in docs/planner.md.
//
// Notation: B micro_batch; T seq; C width; H heads, D = C / H; V vocab;
// k tensor; n context. t = T / n (this rank's steps under context
// parallelism, else T); with sequence parallelism the blocks' tensor-parallel
// regions see t' = t rounded up to a multiple of k and everything outside
// them s = t' / k steps (t' = s = t otherwise). R = B t' rows in a region,
// Rs = B s rows outside; Cl = C / k, Fl = 4 C / k; Vl this rank's vocabulary
// shard (shard_range(V, tensor_rank, k)). f32 = 4 bytes, c = the compute
// dtype's size (4 for f32, 2 for bf16 / f16).
//
// Per block (GPTBlock), kept from forward to backward (no recompute):
//   ln_1, ln_2   xhat (Rs, C) f32, y (Rs, C) f32, rstd (Rs) f32: each
//                LayerNorm's normalized input, output buffer and 1/std
//   c_attn       y (R, 3 Cl) f32: the q|k|v projection's output buffer
//                (kept by the Linear for reuse, though backward reads the
//                q, k, v copies); input: ln_1's y (f32), or under sequence
//                parallelism the all-gathered (R, C) f32
//   q, k, v      (B H/k, t', D) f32 each: split_heads' copies (the blockwise
//                kernel's operands; context parallelism, ring: the
//                chunk-major copies of the t real steps instead;
//                all_to_all: nothing charged)
//   out, lse     (B H/k, t', D) f32 and (B H/k, t') f32: attention's output
//                and log-sum-exp (no T x T matrix: the kernel rebuilds its
//                64 x 64 probability tiles from lse); context parallelism:
//                not charged (context_parallel.cc allocates them untracked)
//   merged       (R, Cl) f32: the heads side by side, c_proj's input (none
//                when H/k = 1 or t' = 1: a view of out; context parallel:
//                not charged)
//   c_proj       y (R, C) f32 output buffer; under sequence parallelism the
//                reduce-scattered (Rs, C) is a new tensor (kept only as the
//                dropout's input: freed when dropout is on)
//   c_fc         y (R, Fl) f32 (GELU's input); input: ln_2's y or gathered
//   GELU         y (R, Fl) f32 (mlp.c_proj's input)
//   mlp.c_proj   y (R, C) f32 output buffer
//   dropouts     resid and mlp, when p > 0 in training: scale (Rs C) f32
//                (the mask as 0 or 1/(1-p)) and y (Rs, C) f32 each
//   half compute every Linear also keeps its input's copy (rows, in) in the
//                compute dtype (xr), and the f32 input it came from is then
//                not kept by the Linear (a gathered input or merged is freed)
// Not kept: the residual stream. Each block's output (Rs, C) f32 lives
// until the next block's forward returns; with recompute each block keeps
// its input instead of all of the above.
// Backward adds, per block, reusable gradient buffers that then stay in the
// Saved: ln dx (Rs, C) x2; Linear dx: c_attn (R, C), c_proj (R, Cl), c_fc
// (R, C), mlp.c_proj (R, Fl); GELU dx (R, Fl); dropout dx (Rs, C) x2 (p >
// 0); half compute: each Linear's dy copy (rows, out) in the compute dtype.
// Transients: attention's dout in the heads layout (R, Cl), sequence
// parallelism's gather buffers and reduce-scatter send copies (R, C).
//
// Embedding (first stage): wte y (B t', C) f32 and wpe y (s, C) f32 output
// buffers (kept for reuse; backward needs neither); their sum (Rs, C) f32
// (block 0's input, freed after the forward unless dropout copies it); the
// dropout's scale and y (Rs, C) f32 and dx (p > 0). Sequence parallelism:
// wte's output is reduce-scattered into a new (Rs, C) (freed after the sum).
// Head (last stage): ln_f as above (its dx (Rs, C) in backward); the head's
// input h: ln_f's y shared, or the gathered (B t', C) f32 (sequence
// parallel), or its compute-dtype copy (B t, C) c; logits (B t, Vl) f32,
// freed once the loss has read them. Loss: CrossEntropyLoss charges nothing
// (its probabilities and gradient are untracked); VocabParallelCrossEntropy
// (tensor > 1) keeps probs (B t, Vl) f32 and its gradient (B t, Vl) f32,
// and under half compute the head keeps dlogits' copy (B t, Vl) c until its
// weight pass.
//
// Lifetimes that set the peak (nn/module.cc, gpt.cc):
// - GPT::backward runs block by block, each block's input and weight passes
//   together (the MLP's Linears fused: weight gradient, then dx, dy not
//   kept; the attention's and the norms' input then weight passes). Without
//   recompute a block's buffers stay in its Saved (below); Linear inputs
//   (st.x) are released as each Linear finishes.
// - Recompute: a block keeps its input only; its backward rebuilds the
//   activations into a Saved that dies when the block's backward ends, so
//   the peak is every block's input plus one block rebuilt, with its
//   gradient buffers.
// - split_backward (backward_input, then backward_weight: a zero-bubble
//   pipeline's stage): the input pass runs through every block before any
//   weight pass; Linear inputs and every layer's dy are released only in the
//   weight pass, and with recompute every block's rebuilt activations are
//   live at the end of the input pass (recompute then cuts
//   saved_per_micro_batch, what a micro-batch holds from F to I, not the
//   peak). The GPT's own scope is then two: backward_input, backward_weight.
// - Buffers (outputs, dx, masks, half copies) stay in the Saved after the
//   backward and are reused by the next forward into it when nobody else
//   holds them (internal/buffers.h). A pipeline gives every micro-batch a
//   fresh Saved (the "cold" numbers); the trainer without a pipeline reuses
//   one Saved for every micro-batch and step (the "warm" numbers: the
//   buffers' bytes never go back to zero, resident_after_backward). In warm
//   steps GPT::State::h, kept after the backward, shares ln_f's y (f32,
//   no sequence parallelism): ln_f then allocates a new y next forward.
//
// Not charged to the tracker, so not counted (real memory all the same):
// attention's per-thread tiles (forward 64 x 64 + 64 x D + 128 floats,
// backward 2 x 64 x 64 + T floats per thread); the block's dh and dx
// (Rs, C), dq, dk, dv (R, Cl) x3 and dqkv (R, 3 Cl) in backward; the head's
// dh (B t', C); CrossEntropyLoss's probs and grad (B t, V) x2; sequence
// parallelism's backward gathers and reduce-scatter outputs; context
// parallelism's ring buffers (2 (R, Cl) x2 in flight), its out, lse and
// merged, and all_to_all's gathered q, k, v, out, lse; the pipeline's
// receive buffers; converted parameter copies.
//
// Thread-safety: pure functions. Errors: InvalidArgument naming the value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/plan/model_description.h"

namespace meshtrain::plan {

// How one rank runs the model.
struct ActivationLayout {
  int64_t micro_batch = 1;   // B: samples per micro-batch on this rank
  // Samples per loaded batch on this rank (micro_batch x micro-batches),
  // for batch_bytes; 0: micro_batch.
  int64_t batch_rows = 0;
  int tensor = 1;            // k: ranks of the tensor axis
  int tensor_rank = 0;       // which vocabulary shard (uneven V / k)
  bool sequence_parallel = false;
  int context = 1;           // n: ranks of the context axis
  int expert = 1;            // P: ranks of the expert axis (a MoE layer's all-to-all buffers)
  // Over an expert axis: the rows this rank's experts run over the even
  // share (n top_k; >= 1): the trainer's `imbalance` (max / mean tokens per
  // expert) bounds it. 1: routing even.
  double expert_imbalance = 1.0;
  layout::ContextComm cp_comm = layout::ContextComm::ring;
  bool cp_load_balance = true;   // no effect on bytes (chunks of equal length)
  bool recompute = false;    // every block in recompute mode
  // The backward as backward_input then backward_weight (a zero-bubble
  // pipeline's stage) instead of GPT::backward's block by block.
  bool split_backward = false;
  DType compute = DType::f32;    // f32, bf16 or f16 (Module::set_compute_dtype)
  double dropout = 0.0;      // GPTConfig::dropout
  bool training = true;      // dropout acts only in training
  // The part of the model (GPTConfig): blocks [first_block, last_block)
  // (last_block < 0: to the last), the embeddings and the head.
  int64_t first_block = 0, last_block = -1;
  bool embed = true, head = true;
  DType token_dtype = DType::i64;  // the batch's tokens and targets
};

// Bytes of one kind of tensor live at some moment: `count` tensors of
// `bytes` in all (summed over layers).
struct ActivationTerm {
  std::string name;  // "h.*.ln_1.xhat", "logits", ... (what it is: see above)
  int64_t count = 0;
  double bytes = 0;
};

// The module scopes that fully sharded data parallelism's hooks wrap
// (nn::ParamHook::before_use / after_use with nn::Pass; FSDP's units of the
// GPT: each block and the GPT itself, train/gpt_recipe.cc), in the order nn
// opens and closes them for one micro-batch: the GPT's forward around the
// embedding, every block's forward and the head; the loss outside it; the
// GPT's backward (GPT::backward, as the trainer and a pipeline's fused B
// run it) around the head's passes and every block's backward (recompute:
// a block's forward scope again just before it, rebuilding); split: the
// GPT's backward_input around every block's backward_input, then its
// backward_weight around every block's backward_weight.
enum class ScopePass : uint8_t { forward, backward, backward_input, backward_weight };
enum class ScopeEvent : uint8_t { start, before_use, after_use };

// One moment of a micro-batch's timeline: a hook call (or the start, before
// the forward) with the activation bytes in use then, and the most in use
// from then until the next moment. Bytes as ActivationEstimate's (from what
// was in use before the forward, without the batch).
struct ActivationMoment {
  ScopeEvent event = ScopeEvent::start;
  ScopePass pass = ScopePass::forward;
  int64_t block = -1;  // the block's global index, or -1: the GPT (the part) itself
  double at = 0;       // when the hook runs
  double peak = 0;     // the maximum until the next moment (>= at)
};

// Bytes charged to MemoryCategory::activations; "cold" means a Saved that
// no forward used before (a pipeline's micro-batch), "warm" the trainer's
// reused one (from its second micro-batch on). Measured from what was in use
// before the forward, without the batch's own tensors (batch_bytes).
struct ActivationEstimate {
  // In use after the forward and the loss's forward (logits freed; a part
  // without the head having handed its output on): what a micro-batch
  // holds until its backward (a pipeline's cost per micro-batch in flight).
  double saved_per_micro_batch = 0;
  // The peak over the forward, loss and backward of one micro-batch (cold).
  double peak_one_micro_batch = 0;
  // What a Saved keeps after the backward (buffers for the next forward).
  double resident_after_backward = 0;
  // The same two for a warm Saved (resident_after_backward included).
  double saved_warm = 0;
  double peak_warm = 0;
  // A part without the head: its output (Rs, C) f32, live at the end of
  // the forward (the pipeline holds it until its send completes).
  double stage_output = 0;
  // One loaded batch's tokens and targets (batch_rows, T) in token_dtype,
  // charged to activations by the data loader (data/text_data.cc); the
  // trainer holds two (the batch in use and the next, prefetched).
  double batch_bytes = 0;
  // The micro-batch moment by moment (cold, then warm): the maximum of
  // `peak` over a timeline is peak_one_micro_batch (peak_warm). The planner
  // adds fully sharded data parallelism's working memory at each moment
  // (plan/memory_model.h), which changes only at these hooks.
  std::vector<ActivationMoment> timeline, timeline_warm;
  std::vector<ActivationTerm> saved_terms;  // what saved_per_micro_batch is made of
  std::vector<ActivationTerm> peak_terms;   // what is live at the cold peak
  std::string peak_at;                      // where it happens ("backward_input h.0: h.*.ln_1.dx")
};

// Throws InvalidArgument for sizes nn would refuse (heads not dividing the
// width or over the tensor axis, a sequence the context axis's chunks do
// not divide, all_to_all with heads per tensor rank the context axis does
// not divide, ...).
ActivationEstimate estimate_activations(const GptShape& shape, const ActivationLayout& layout);

// A table of the terms ("name  count  bytes"), for explanations.
std::string to_string(const std::vector<ActivationTerm>& terms);

// Megatron-LM's published activation memory of one transformer layer in
// bytes (Korthikanti et al. 2022, "Reducing Activation Recomputation in
// Large Transformer Models", 16-bit activations, s = seq, b = micro_batch,
// h = width, a = heads, t = tensor):
//   none                        s b h (34 + 5 a s / h)
//   tensor parallel             s b h (10 + 24 / t + 5 a s / (h t))
//   tensor + sequence parallel  s b h (34 / t + 5 a s / (h t))
//   ... + selective recompute   s b h 34 / t (attention scores recomputed)
//   full recompute              2 s b h (the layer's input only)
enum class MegatronRecompute : uint8_t { none, selective, full };
double megatron_layer_activation_bytes(const GptShape& shape, int64_t micro_batch, int tensor = 1,
                                       bool sequence_parallel = false,
                                       MegatronRecompute recompute = MegatronRecompute::none);

}  // namespace meshtrain::plan
