#include "meshtrain/parallel/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::parallel {

namespace {

bool is_block(const nn::Parameter& p) { return p.placement.is_block(); }

}  // namespace

TensorParallel::TensorParallel(std::unique_ptr<Parallelism> inner, nn::TensorParallelGroup group,
                               std::vector<std::string> sequence_parallel,
                               std::vector<std::pair<std::string, comm::Communicator*>> partial)
    : WrappedParallelism(std::move(inner)), group_(group), sequence_parallel_(std::move(sequence_parallel)),
      partial_(std::move(partial)) {
  if (!inner_ || group_.size() < 2)
    throw InvalidArgument("TensorParallel", "no inner strategy, or a tensor axis of one rank",
                          "wrap a strategy over the data-parallel ranks, on a tensor axis of 2 or more");
  if (sequence_parallel_.empty()) return;
  // Sequence-parallel gradients are summed element by element: every rank of
  // the axis must hold the same elements of them.
  const auto key =
      static_cast<int64_t>(nn::sequence_parallel_layout_key(inner_->optimizer_parameters(), sequence_parallel_));
  int64_t lo = key, hi = key;
  group_.comm->all_reduce(&lo, &lo, 1, DType::i64, comm::ReduceOp::min);
  group_.comm->all_reduce(&hi, &hi, 1, DType::i64, comm::ReduceOp::max);
  if (lo != hi)
    throw InvalidArgument("meshtrain train",
                          fmt::format("--sequence-parallel: the tensor-parallel ranks' shards of the replicated "
                                      "parameters differ (the tensor axis of {} splits some parameter unevenly, "
                                      "which moves fsdp's flat shards)",
                                      group_.size()),
                          "pick sizes the tensor axis divides (the vocabulary above all), or train without "
                          "--sequence-parallel");
}

std::string TensorParallel::describe() const {
  return fmt::format("{}, tensor parallel {}{}", inner_->describe(), group_.size(),
                     group_.splits_sequence() ? " (sequence parallel)" : "");
}

void TensorParallel::finish() {
  inner_->finish();
  // The replicated parameters' partial sums (each rank saw its tokens only), once per step.
  nn::reduce_sequence_parallel_grads(inner_->optimizer_parameters(), sequence_parallel_, group_);
  // Replicated key/value heads: each group of ranks holding a head, in one
  // all-reduce per group (every rank of the axis is in exactly one).
  if (partial_.empty()) return;
  std::vector<std::pair<comm::Communicator*, std::vector<nn::Parameter*>>> groups;
  for (nn::Parameter* p : inner_->optimizer_parameters())
    for (const auto& [name, comm] : partial_)
      if (name == p->name && p->grad.defined()) {
        auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == comm; });
        if (it == groups.end()) it = groups.insert(groups.end(), {comm, {}});
        it->second.push_back(p);
      }
  for (auto& [comm, ps] : groups) nn::sum_grads(ps, *comm, "tp grad all_reduce");
}

double TensorParallel::grad_norm() { return grad_norm_over(*group_.comm, is_block); }

std::pair<double, double> TensorParallel::grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) {
  return grad_sq_split_over(*group_.comm, first, is_block);  // blocks add over the axis
}

}  // namespace meshtrain::parallel
