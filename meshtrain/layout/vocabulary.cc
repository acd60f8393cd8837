// The training layout's vocabulary (vocabulary.h).
#include "meshtrain/layout/vocabulary.h"

#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::layout {

DType parse_precision(std::string_view name, std::string_view what) {
  if (name == "fp32" || name == "no") return DType::f32;
  if (name == "bf16") return DType::bf16;
  if (name == "fp16") return DType::f16;
  throw InvalidArgument(std::string(what), fmt::format("precision '{}'", name), "use fp32 (or no), bf16 or fp16");
}

std::string_view precision_name(DType precision) {
  switch (precision) {
    case DType::f32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::f16: return "fp16";
    default: break;
  }
  throw InvalidArgument("precision_name", fmt::format("{} is not a training precision", dtype_name(precision)),
                        "use f32, bf16 or f16");
}

std::string_view zero_stage_name(ZeroStage stage) {
  constexpr std::string_view kNames[] = {"no_shard", "zero1", "zero2", "zero3"};
  return kNames[static_cast<size_t>(stage)];
}

std::string FsdpMode::name() const {
  switch (stage) {
    case ZeroStage::no_shard: return "no_shard";
    case ZeroStage::zero1: return "zero1";
    case ZeroStage::zero2: return hybrid ? "hybrid_shard_grad_op" : "shard_grad_op";
    case ZeroStage::zero3: return hybrid ? "hybrid_full" : "full";
  }
  return "?";
}

FsdpMode parse_fsdp_mode(std::string_view name) {
  if (name == "full" || name == "zero3") return {ZeroStage::zero3, false};
  if (name == "shard_grad_op" || name == "zero2") return {ZeroStage::zero2, false};
  if (name == "zero1") return {ZeroStage::zero1, false};
  if (name == "no_shard") return {ZeroStage::no_shard, false};
  if (name == "hybrid_full") return {ZeroStage::zero3, true};
  if (name == "hybrid_shard_grad_op") return {ZeroStage::zero2, true};
  throw InvalidArgument("parse_fsdp_mode", fmt::format("Unknown sharding strategy: {}", name),
                        "use full (zero3), shard_grad_op (zero2), zero1, no_shard, hybrid_full or "
                        "hybrid_shard_grad_op");
}

BackwardPrefetch parse_backward_prefetch(std::string_view name) {
  if (name == "none") return BackwardPrefetch::none;
  if (name == "pre" || name == "backward_pre") return BackwardPrefetch::pre;
  if (name == "post" || name == "backward_post") return BackwardPrefetch::post;
  throw InvalidArgument("parse_backward_prefetch", fmt::format("Unknown backward prefetch: {}", name),
                        "use none, pre or post");
}

std::string_view to_string(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::none: return "none";
    case BackwardPrefetch::pre: return "pre";
    case BackwardPrefetch::post: return "post";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(std::string_view name) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved_1f1b,
                         ScheduleKind::zero_bubble})
    if (name == to_string(k)) return k;
  throw InvalidArgument("parse_schedule_kind", fmt::format("unknown pipeline schedule '{}'", name),
                        "use gpipe, 1f1b, interleaved or zb");
}

std::string_view to_string(ScheduleKind kind) { return kScheduleNames[static_cast<size_t>(kind)]; }

DecoderArch parse_decoder_arch(std::string_view text, std::string_view what) {
  for (size_t i = 0; i < kDecoderArchNames.size(); ++i)
    if (text == kDecoderArchNames[i]) return static_cast<DecoderArch>(i);
  throw InvalidArgument(std::string(what), fmt::format("architecture '{}'", text), "use gpt2 or llama");
}

std::string_view decoder_arch_name(DecoderArch a) { return kDecoderArchNames[static_cast<size_t>(a)]; }

RouterScore parse_router_score(std::string_view text, std::string_view what) {
  for (size_t i = 0; i < kRouterScoreNames.size(); ++i)
    if (text == kRouterScoreNames[i]) return static_cast<RouterScore>(i);
  throw InvalidArgument(std::string(what), fmt::format("router score '{}'", text), "use softmax or sigmoid");
}

std::string_view router_score_name(RouterScore s) { return kRouterScoreNames[static_cast<size_t>(s)]; }

ContextComm parse_context_comm(std::string_view text, std::string_view what) {
  if (text == "ring") return ContextComm::ring;
  if (text == "all_to_all" || text == "all-to-all" || text == "ulysses") return ContextComm::all_to_all;
  throw InvalidArgument(std::string(what), fmt::format("'{}'", text), "use ring or all_to_all");
}

std::string_view context_comm_name(ContextComm c) { return kContextCommNames[static_cast<size_t>(c)]; }

std::string ZeroPPParts::to_string() const {
  std::string out;
  for (auto [on, name] : {std::pair{qwz, "qwz"}, {qgz, "qgz"}, {hpz, "hpz"}})
    if (on) out += fmt::format("{}{}", out.empty() ? "" : ",", name);
  return out;
}

ZeroPPParts parse_zeropp(std::string_view text, std::string_view what) {
  ZeroPPParts out;
  if (trim(text).empty()) return out;
  for (const std::string_view piece : split(text)) {
    const std::string_view part = trim(piece);
    if (part == "qwz") out.qwz = true;
    else if (part == "qgz") out.qgz = true;
    else if (part == "hpz") out.hpz = true;
    else
      throw InvalidArgument(std::string(what), fmt::format("zeropp '{}': unknown part '{}'", text, part),
                            "list qwz, qgz and/or hpz, e.g. --zeropp qwz,qgz,hpz");
  }
  return out;
}

}  // namespace meshtrain::layout
