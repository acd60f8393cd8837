// MultiDimensionalStrategy: several strategies, each on its own mesh axes,
// combined into one PartitionSpec per named parameter and one for the batch.
//
//   auto fsdp = std::make_shared<FSDPStrategy>("fsdp", 8);
//   auto tp = std::make_shared<TensorParallelStrategy>("tensor", 4);
//   MultiDimensionalStrategy md({fsdp, tp}, {"fsdp", "tensor"});
//   ParamInfo fc2{.name = "h.0.mlp.fc2.weight", .shape = {16384, 4096},
//                 .kind = ParamKind::linear_weight, .role = LinearRole::row};
//   md.combined_spec(fc2);           // P((tensor, fsdp), None): TP leaves each rank
//                                    // (4096, 4096); FSDP splits its first largest dim
//   md.combined_batch_spec(2, 0);    // P(fsdp, None)
//
// Rules:
//  * Every mesh axis belongs to at most one strategy; construction throws
//    naming both strategies otherwise. (DataParallel and FSDP on one axis is
//    rejected too: FSDP already splits the batch over its axis; HSDP is
//    DataParallel("data") + FSDP("fsdp"), two axes.) With mesh_axes given,
//    every strategy's axes must be mesh axes.
//  * Parameters: strategies apply in the order pipeline, tensor, other, FSDP,
//    data parallel (list order within a kind). Each strategy sees the per-rank
//    shape left by those before it (a dimension split over axes of known size
//    n is divided by n, rounded up), so FSDP shards what a tensor-parallel rank
//    holds and its divisibility and min_weight_size tests apply to that shard.
//  * A dimension split by several strategies lists their axes in that order,
//    e.g. (tensor, fsdp): the outer axis is the most significant (see
//    partition_spec.h), so an all-gather over fsdp rebuilds exactly the
//    contiguous block the tensor-parallel rank computes with.
//  * The batch: strategies apply in the order data parallel, FSDP, others, so
//    HSDP splits the batch over (data, fsdp).
//  * A mesh axis used twice in one combined spec (on two dimensions, or by two
//    strategies), or used by a strategy that does not own it, is an error
//    naming the parameter (or "batch"), the axis, the dimensions and the
//    strategies. The built-in strategies cannot cause it; custom ones can.
//
// Nesting a MultiDimensionalStrategy inside another works, but it is ordered as
// one strategy of kind other.
//
// Thread-safety: immutable after construction; the strategies are shared
// const objects and must themselves be thread-safe (the built-in ones are).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/sharding/strategy.h"

namespace meshtrain::sharding {

class MultiDimensionalStrategy final : public Strategy {
 public:
  // strategies: non-null, owning disjoint mesh axes. mesh_axes: the mesh's axis
  // names, or empty to skip the mesh checks.
  explicit MultiDimensionalStrategy(std::vector<std::shared_ptr<const Strategy>> strategies,
                                    std::vector<std::string> mesh_axes = {});

  // "MultiDimensional[FSDP(fsdp=8, min_weight_size=1024), TensorParallel(tensor=4)]"
  std::string name() const override;
  // Every strategy's axes, in strategy order.
  std::vector<std::string> axes() const override;
  int64_t axis_size(const std::string& axis) const override;
  PartitionSpec param_spec(const ParamInfo& p) const override { return combined_spec(p); }
  PartitionSpec batch_spec(int ndim, int batch_dim) const override { return combined_batch_spec(ndim, batch_dim); }
  // The combined spec, then one line per strategy with the shape it saw.
  std::string explain(const ParamInfo& p) const override;

  // One spec for p combining every strategy (rules above).
  PartitionSpec combined_spec(const ParamInfo& p) const;
  // The spec of a batch of `ndim` dims with batch dimension `batch_dim`.
  PartitionSpec combined_batch_spec(int ndim, int batch_dim) const;
  // combined_spec of every parameter, by name. Names must be non-empty and
  // unique.
  std::map<std::string, PartitionSpec> specs(const std::vector<ParamInfo>& params) const;

  // The strategy owning `axis`, or nullptr.
  const Strategy* owner(const std::string& axis) const;
  const std::vector<std::shared_ptr<const Strategy>>& strategies() const { return strategies_; }
  const std::vector<std::string>& mesh_axes() const { return mesh_axes_; }

 private:
  struct Step {
    const Strategy* strategy;
    ParamInfo seen;      // the (per-rank) shape this strategy was given
    PartitionSpec spec;  // its answer
  };
  std::vector<Step> apply(const ParamInfo& p) const;
  PartitionSpec merge(const std::string& what, int ndim, const std::vector<Step>& steps) const;

  std::vector<std::shared_ptr<const Strategy>> strategies_;
  std::vector<std::string> mesh_axes_;
  std::vector<const Strategy*> param_order_;
  std::vector<const Strategy*> batch_order_;
};

}  // namespace meshtrain::sharding
