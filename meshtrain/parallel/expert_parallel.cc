#include "meshtrain/parallel/expert_parallel.h"

#include <fmt/format.h>

#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::parallel {

namespace {

bool is_expert(const nn::Parameter& p) { return p.expert; }

}  // namespace

ExpertParallel::ExpertParallel(std::unique_ptr<Parallelism> inner, comm::Communicator& expert,
                               const std::vector<nn::Parameter*>& model_parameters)
    : inner_(std::move(inner)), expert_(&expert) {
  if (!inner_ || expert.size() < 2)
    throw InvalidArgument("ExpertParallel", "no inner strategy, or an expert axis of one rank",
                          "wrap a strategy over the replica ranks, on an expert axis of 2 or more");
  for (const nn::Parameter* p : model_parameters)
    if (p->expert) experts_.insert(p->name);
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

bool ExpertParallel::grads_finite() {
  double bad = inner_->grads_finite() ? 0.0 : 1.0;
  expert_->all_reduce(&bad, &bad, 1, DType::f64, comm::ReduceOp::sum);  // every rank decides alike
  return bad == 0;
}

double ExpertParallel::grad_norm() {
  auto [experts, replicated] = inner_->grad_sq_split(is_expert);
  expert_->all_reduce(&experts, &experts, 1, DType::f64, comm::ReduceOp::sum);
  return std::sqrt(experts + replicated);
}

std::pair<double, double> ExpertParallel::grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) {
  // Experts add over the axis, replicated parameters count once: the
  // experts of each part, then each part whole.
  double experts[2] = {inner_->grad_sq_split([&](const nn::Parameter& p) { return first(p) && p.expert; }).first,
                       inner_->grad_sq_split([&](const nn::Parameter& p) { return !first(p) && p.expert; }).first};
  const auto [in_first, in_second] = inner_->grad_sq_split(first);
  const double local[2] = {experts[0], experts[1]};
  expert_->all_reduce(experts, experts, 2, DType::f64, comm::ReduceOp::sum);
  return {experts[0] + (in_first - local[0]), experts[1] + (in_second - local[1])};
}

}  // namespace meshtrain::parallel
