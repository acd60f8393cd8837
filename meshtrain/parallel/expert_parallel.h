// ExpertParallel: expert parallelism's part of the step protocol
// (parallelism.h), around the strategy over the ranks that hold the same
// parameters (DataParallel, FullyShardedDataParallel, a PipelineParallel of
// them, or a TensorParallel around one).
//
//   auto inner = std::make_unique<DataParallel>(model, replica_comm, options);   // data x fsdp x context
//   ExpertParallel par(std::move(inner), mesh.comm("expert"), model.parameters());
//   ... the step protocol, as with any Parallelism ...
//
// The expert axis splits the batch like a data axis and a mixture-of-experts
// model's routed experts over its ranks (nn/moe.h: each rank holds its
// experts, ParamInfo::expert; tokens travel to them by all_to_all_v inside
// forward and backward). Every other parameter is replicated over the axis
// and sees only this rank's samples, so once per step:
//   finish()        the inner strategy's, then the replicated parameters'
//                   gradients (their shards under fsdp) summed over the axis
//                   in one all-reduce (timed as "ep grad all_reduce");
//   grads_finite()  true only when it holds on every rank of the axis;
//   grad_norm()     the experts' squares summed over the axis, the
//                   replicated parameters' counted once;
//   grad_sq_split() the same per part, for an enclosing composition;
//   describe()      the inner strategy's, then "expert parallel k".
// Everything else is the inner strategy's.
//
// Thread-safety: one rank's thread, like the strategy it wraps.
#pragma once

#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/parallel/parallelism.h"

namespace meshtrain::parallel {

class ExpertParallel final : public WrappedParallelism {
 public:
  // expert: the expert axis (size > 1); model_parameters: the model's (or
  // every pipeline stage's) parameters, whose info.routed_expert() says
  // which are routed experts.
  ExpertParallel(std::unique_ptr<Parallelism> inner, comm::Communicator& expert,
                 const std::vector<nn::Parameter*>& model_parameters);

  std::string describe() const override;
  void finish() override;
  bool grads_finite() override { return grads_finite_over(*expert_); }
  double grad_norm() override;
  std::pair<double, double> grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) override;

 private:
  comm::Communicator* expert_;
  std::unordered_set<std::string> experts_;  // the routed experts' names
};

}  // namespace meshtrain::parallel
