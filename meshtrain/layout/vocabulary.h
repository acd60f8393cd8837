// The training layout's vocabulary: every strategy option a run names, one
// enum each and one parser each. Flags, TOML, the planner, the benchmarks
// and the runtime all parse through these functions, so a name means the
// same everywhere and an unknown one gets the same message.
//
//   layout::parse_precision("bf16", "--precision");          // DType::bf16
//   layout::parse_fsdp_mode("hybrid_full");                   // {zero3, hybrid}
//   layout::parse_schedule_kind("zb");                        // ScheduleKind::zero_bubble
//   layout::parse_context_comm("all_to_all");                 // ContextComm::all_to_all
//   layout::parse_decoder_arch("llama");                       // DecoderArch::llama
//   layout::parse_router_score("sigmoid");                     // RouterScore::sigmoid
//   layout::parse_zeropp("qwz,hpz", "--zeropp");              // {.qwz = true, .hpz = true}
//
// Thread-safety: constants and pure functions. Errors: InvalidArgument
// naming the text and listing the choices (op: the flag or key the text
// came from where a `what` is taken, else the parser).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "meshtrain/core/dtype.h"

namespace meshtrain::layout {

// --- precision -----------------------------------------------------------

// The precisions a run computes in: fp32, bf16, fp16 (mixed precision's
// "no", the seeds' spelling, is fp32).
inline constexpr std::array<std::string_view, 3> kPrecisionNames = {"fp32", "bf16", "fp16"};
// The same three as the seeds' DistributedConfig.mixed_precision spells them.
inline constexpr std::array<std::string_view, 3> kMixedPrecisionNames = {"no", "bf16", "fp16"};
// "fp32" or "no" -> f32, "bf16" -> bf16, "fp16" -> f16.
DType parse_precision(std::string_view name, std::string_view what = "precision");
// "fp32", "bf16", "fp16"; InvalidArgument for another dtype.
std::string_view precision_name(DType precision);

// --- fully sharded data parallelism ---------------------------------------

// What is sharded: optimizer state (zero1), plus gradients (zero2), plus
// parameters (zero3). no_shard replicates everything (data parallelism).
enum class ZeroStage : uint8_t { no_shard = 0, zero1 = 1, zero2 = 2, zero3 = 3 };
// "no_shard", "zero1", "zero2", "zero3".
std::string_view zero_stage_name(ZeroStage stage);

// The seeds' FSDP2Config strategy names (plus zero1..3 aliases), mapped to a
// stage and whether the mesh's replicate axis is kept separate (hybrid):
//   full / zero3                 -> zero3         shard over every DP rank
//   shard_grad_op / zero2        -> zero2
//   zero1                        -> zero1
//   no_shard                     -> no_shard
//   hybrid_full                  -> zero3, hybrid shard within the shard axis,
//   hybrid_shard_grad_op         -> zero2, hybrid  all-reduce across replicas
struct FsdpMode {
  ZeroStage stage = ZeroStage::zero3;
  bool hybrid = false;
  // "full", "shard_grad_op", "no_shard", "zero1", "hybrid_full",
  // "hybrid_shard_grad_op": the canonical name.
  std::string name() const;
  bool operator==(const FsdpMode&) const = default;
};
// Throws InvalidArgument "Unknown sharding strategy: X" listing the names.
FsdpMode parse_fsdp_mode(std::string_view name);

// When stage 3 starts gathering the next unit in backward.
enum class BackwardPrefetch : uint8_t { none, pre, post };
// "none", "pre" (backward_pre), "post" (backward_post).
// InvalidArgument "Unknown backward prefetch: X" otherwise.
BackwardPrefetch parse_backward_prefetch(std::string_view name);
std::string_view to_string(BackwardPrefetch p);

// --- pipeline parallelism -------------------------------------------------

enum class ScheduleKind : uint8_t { gpipe, one_f_one_b, interleaved_1f1b, zero_bubble /* ZB-H1 */ };
inline constexpr std::array<std::string_view, 4> kScheduleNames = {"gpipe", "1f1b", "interleaved", "zb"};
// "gpipe", "1f1b", "interleaved", "zb".
ScheduleKind parse_schedule_kind(std::string_view name);
// The name parse_schedule_kind takes.
std::string_view to_string(ScheduleKind kind);

// --- decoder architecture ------------------------------------------------

// The GPT recipe's blocks: GPT-2's or Llama's (nn/gpt.h, nn/llama.h).
enum class DecoderArch : uint8_t { gpt2, llama };
inline constexpr std::array<std::string_view, 2> kDecoderArchNames = {"gpt2", "llama"};
DecoderArch parse_decoder_arch(std::string_view text, std::string_view what = "--arch");
std::string_view decoder_arch_name(DecoderArch a);
// Llama's SwiGLU MLP width: `given`, or when 0 8/3 width rounded up to a
// multiple of 64.
constexpr int64_t llama_ffn_hidden(int64_t width, int64_t given) {
  return given > 0 ? given : (8 * width / 3 + 63) / 64 * 64;
}

// A mixture-of-experts router's scores (nn/moe.h): softmax over the
// experts (Switch, Mixtral) or an independent sigmoid each (DeepSeek-V3).
enum class RouterScore : uint8_t { softmax, sigmoid };
inline constexpr std::array<std::string_view, 2> kRouterScoreNames = {"softmax", "sigmoid"};
RouterScore parse_router_score(std::string_view text, std::string_view what = "--router-score");
std::string_view router_score_name(RouterScore s);

// What a decoder's mixture-of-experts layers share (nn::GPTConfig::moe, the
// trainer's --experts and friends, the planner's plan::GptShape::moe; the
// layer's semantics in nn/moe.h): experts = 0 means dense MLPs.
struct MoEOptions {
  int experts = 0;                 // routed experts (0: no MoE layers)
  int top_k = 2;                   // experts per token, 1..experts
  int64_t expert_hidden = 0;       // each expert's hidden features (a decoder's 0: its ffn_hidden)
  int shared_experts = 0;          // >= 0: one SwiGLU of shared_experts * expert_hidden hidden features
  RouterScore score = RouterScore::softmax;
  bool normalize_top_k = true;     // the k weights sum to 1
  double aux_loss_coef = 0.0;      // >= 0: the Switch/GShard load-balancing loss's coefficient
  double capacity_factor = 0.0;    // 0: no dropping; else > 0: each expert's share of a sequence's assignments
  double bias_update_rate = 0.0;   // DeepSeek-V3's balancing step per optimizer step, 0: off
  int first_dense = 0;             // a decoder's blocks [0, first_dense) keep dense MLPs (DeepSeek's first_k_dense)
  bool active() const { return experts > 0; }
  bool operator==(const MoEOptions&) const = default;
};

// --- context parallelism --------------------------------------------------

// How a context-parallel attention layer meets the other ranks' tokens:
// ring (K/V blocks passed around) or all_to_all (DeepSpeed Ulysses).
enum class ContextComm : uint8_t { ring, all_to_all };
inline constexpr std::array<std::string_view, 2> kContextCommNames = {"ring", "all_to_all"};
// "ring", "all_to_all" (also "all-to-all", "ulysses").
ContextComm parse_context_comm(std::string_view text, std::string_view what = "--cp-comm");
std::string_view context_comm_name(ContextComm c);

// --- ZeRO++ ---------------------------------------------------------------

// Which of ZeRO++'s three parts a run uses.
struct ZeroPPParts {
  bool qwz = false;  // quantized weight all-gathers
  bool qgz = false;  // hierarchical quantized gradient reduce-scatter
  bool hpz = false;  // node-local secondary parameter shards
  bool any() const { return qwz || qgz || hpz; }
  // "qwz,qgz,hpz" (those set, in that order); "" for none.
  std::string to_string() const;
  bool operator==(const ZeroPPParts&) const = default;
};
// A comma list of qwz, qgz and hpz ("" for none; repeats allowed).
ZeroPPParts parse_zeropp(std::string_view text, std::string_view what = "--zeropp");

}  // namespace meshtrain::layout
