// FullyShardedDataParallel's memory formula of its header's table, and the
// checks and synchronization its constructor runs before building units
// (the runtime is fully_sharded.cc; the strategy names are
// layout/vocabulary.h's).
#include "meshtrain/parallel/fully_sharded.h"

#include <fmt/format.h>

#include <fmt/ranges.h>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"

namespace meshtrain::parallel {

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

void FullyShardedDataParallel::check_zeropp() const {
  const FullyShardedOptions& o = options_;
  if (!o.quantize_weights && !o.quantize_gradients && !o.hierarchical_partition) return;
  if (o.quantize_weights) o.weight_quant.check("FullyShardedDataParallel");
  if (o.quantize_gradients) o.grad_quant.check("FullyShardedDataParallel");
  if (o.hierarchical_partition && (o.stage != ZeroStage::zero3 || o.node_local == nullptr))
    throw InvalidArgument("FullyShardedDataParallel", "hierarchical_partition (hpZ) without stage zero3 and a node_local communicator",
                          "hpZ keeps a node-local copy of zero3's gathered parameters: use stage zero3 and pass "
                          "node_local (and cross_node)");
  if (o.quantize_weights && (o.stage != ZeroStage::zero3 || o.param_dtype != DType::f32))
    throw InvalidArgument("FullyShardedDataParallel", "quantize_weights (qwZ) without stage zero3 and f32 parameters",
                          "qwZ quantizes zero3's parameter all-gathers: use stage zero3 with param_dtype f32");
  if (o.quantize_gradients && (o.stage < ZeroStage::zero2 || reduce_dtype_ != DType::f32))
    throw InvalidArgument("FullyShardedDataParallel", "quantize_gradients (qgZ) without stage zero2/zero3 and f32 gradients",
                          "qgZ replaces the reduce-scatters of zero2 and zero3: use one, with reduce_dtype f32");
  if (o.cross_node != nullptr && o.node_local == nullptr)
    throw InvalidArgument("FullyShardedDataParallel", "cross_node without node_local", "pass both communicators, or neither (one node)");
  if (o.node_local != nullptr) {
    const int k = o.cross_node != nullptr ? o.cross_node->size() : 1, node = o.cross_node != nullptr ? o.cross_node->rank() : 0;
    if (o.node_local->size() * k != shard_->size() || node * o.node_local->size() + o.node_local->rank() != shard_->rank())
      throw InvalidArgument("FullyShardedDataParallel",
                            fmt::format("node_local (rank {} of {}) x cross_node (rank {} of {}) is not the shard "
                                        "communicator's rank {} of {} in node-major order",
                                        o.node_local->rank(), o.node_local->size(), node, k, shard_->rank(),
                                        shard_->size()),
                            "split the shard axis as node x local (a mesh node=K,fsdp=L: cross_node = its node "
                            "axis, node_local = its fsdp axis, shard = both)");
  }
}

void FullyShardedDataParallel::check_structure(const std::vector<nn::Parameter*>& params) {
  const FullyShardedOptions& o = options_;
  std::string desc = fmt::format("stage={};min={};p={};g={};qw={};qg={};hp={};q={}/{},{}/{};",
                                 static_cast<int>(o.stage), o.min_weight_size, dtype_name(o.param_dtype),
                                 dtype_name(reduce_dtype_), o.quantize_weights, o.quantize_gradients,
                                 o.hierarchical_partition, o.weight_quant.bits, o.weight_quant.block,
                                 o.grad_quant.bits, o.grad_quant.block);
  for (const nn::Parameter* p : params) desc += p->name + shape_to_string(p->info.shape) + ";";
  const int64_t mine[2] = {static_cast<int64_t>(params.size()), static_cast<int64_t>(key_from_name(desc))};
  for (comm::Communicator* c : {shard_, replicate_}) {
    if (!c) continue;
    const int n = c->size();
    std::vector<int64_t> all(2 * static_cast<size_t>(n));
    c->all_gather(mine, all.data(), 2, DType::i64);
    std::vector<int> differ;
    for (int r = 1; r < n; ++r)
      if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) differ.push_back(r);
    if (differ.empty()) continue;
    throw InvalidArgument("FullyShardedDataParallel",
                          fmt::format("rank(s) {} of the {} communicator have different parameters or options "
                                      "than its rank 0 (names, shapes, stage, min_weight_size and dtypes are "
                                      "compared)",
                                      fmt::join(differ, ", "), c == shard_ ? "shard" : "replicate"),
                          "build the same model with the same options on every rank");
  }
}

void FullyShardedDataParallel::sync_states() {
  for (nn::Parameter* p : model_->parameters()) {
    if (!p->value.defined()) continue;  // deferred: its init is the same function on every rank
    const size_t n = static_cast<size_t>(p->value.numel());
    shard_->broadcast(p->value.data<float>(), n, DType::f32, 0);
    if (replicate_) replicate_->broadcast(p->value.data<float>(), n, DType::f32, 0);
  }
}

}  // namespace meshtrain::parallel
