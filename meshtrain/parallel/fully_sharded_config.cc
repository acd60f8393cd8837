// FullyShardedDataParallel's strategy names and the memory formula of its
// header's table (the runtime is fully_sharded.cc).
#include "meshtrain/parallel/fully_sharded.h"

#include <fmt/format.h>

#include "meshtrain/core/error.h"

namespace meshtrain::parallel {

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

ModelStateBytes predicted_model_state(ZeroStage stage, int64_t elements, int d, DType param_dtype,
                                      DType reduce_dtype, double state_bytes_per_element) {
  const double P = static_cast<double>(elements);
  const double p = static_cast<double>(dtype_size(param_dtype));
  const double g = static_cast<double>(dtype_size(reduce_dtype));
  const double master = param_dtype == DType::f32 ? 0.0 : 4.0;
  const double dd = stage == ZeroStage::no_shard ? 1.0 : static_cast<double>(d);
  ModelStateBytes b;
  b.parameters = stage == ZeroStage::zero3 ? p * P / dd : p * P;
  b.gradients = stage >= ZeroStage::zero2 ? g * P / dd : g * P;
  b.optimizer = (master + state_bytes_per_element) * P / dd;
  return b;
}

}  // namespace meshtrain::parallel
