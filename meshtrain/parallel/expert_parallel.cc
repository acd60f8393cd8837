#include "meshtrain/parallel/expert_parallel.h"

#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::parallel {

namespace {

bool is_expert(const nn::Parameter& p) { return p.info.routed_expert(); }

}  // namespace

ExpertParallel::ExpertParallel(std::unique_ptr<Parallelism> inner, comm::Communicator& expert,
                               const std::vector<nn::Parameter*>& model_parameters)
    : WrappedParallelism(std::move(inner)), expert_(&expert) {
  if (!inner_ || expert.size() < 2)
    throw InvalidArgument("ExpertParallel", "no inner strategy, or an expert axis of one rank",
                          "wrap a strategy over the replica ranks, on an expert axis of 2 or more");
  for (const nn::Parameter* p : model_parameters)
    if (is_expert(*p)) experts_.insert(p->name);
}

std::string ExpertParallel::describe() const {
  return fmt::format("{}, expert parallel {}", inner_->describe(), expert_->size());
}

void ExpertParallel::finish() {
  inner_->finish();
  // The replicated parameters saw this rank's samples only: their (shards')
  // gradients add over the axis, once per step.
  std::vector<nn::Parameter*> replicated;
  for (nn::Parameter* p : inner_->optimizer_parameters())
    if (!experts_.contains(p->name) && p->grad.defined()) replicated.push_back(p);
  nn::sum_grads(replicated, *expert_, "ep grad all_reduce");
}

double ExpertParallel::grad_norm() { return grad_norm_over(*expert_, is_expert); }

std::pair<double, double> ExpertParallel::grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) {
  return grad_sq_split_over(*expert_, first, is_expert);  // experts add over the axis
}

}  // namespace meshtrain::parallel
