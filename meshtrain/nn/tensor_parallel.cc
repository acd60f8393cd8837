#include "meshtrain/nn/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/internal/loss_args.h"

namespace meshtrain::nn {

ShardRange shard_range(int64_t n, int rank, int ranks) {
  if (n < 0 || ranks < 1 || rank < 0 || rank >= ranks)
    throw InvalidArgument("shard_range", fmt::format("{} items, rank {} of {}", n, rank, ranks),
                          "pass n >= 0 and 0 <= rank < ranks");
  const int64_t c = (n + ranks - 1) / ranks;
  const int64_t begin = std::min(n, rank * c);
  return {begin, std::min(n, begin + c)};
}

VocabParallelCrossEntropy::VocabParallelCrossEntropy(TensorParallelGroup group, int64_t vocab, MemoryTracker* tracker)
    : group_(group), vocab_(vocab), shard_(shard_range(vocab, group.rank(), group.size())), tracker_(tracker) {
  if (vocab < 1)
    throw InvalidArgument("VocabParallelCrossEntropy", fmt::format("vocabulary {}", vocab), "pass vocab >= 1");
}

double VocabParallelCrossEntropy::forward(const Tensor& logits, const Tensor& labels, Saved& saved,
                                          std::optional<double> normalizer) {
  const char* op = "VocabParallelCrossEntropy::forward";
  const Tensor z = internal::f32_contiguous(logits, op, "logits");
  if (z.dim() != 2 || z.size(1) != shard_.size())
    throw InvalidArgument(op,
                          fmt::format("logits {} on tensor-parallel rank {} of {}, whose vocabulary shard is ids "
                                      "[{}, {}) of {}",
                                      shape_to_string(z.shape()), group_.rank(), group_.size(), shard_.begin,
                                      shard_.end, vocab_),
                          fmt::format("pass this rank's logits (N, {}): the head's output for its shard",
                                      shard_.size()));
  const int64_t n = z.size(0);
  State& st = saved.state<State>();
  internal::read_labels(labels, n, vocab_, op, st.labels);
  const int64_t* y = st.labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (y[i] < 0 || y[i] >= vocab_)
      throw InvalidArgument(op, fmt::format("label {} of row {} is outside [0, {})", y[i], i, vocab_),
                            "labels are vocabulary ids");
  const double norm = internal::resolve_normalizer(normalizer, static_cast<double>(n), op);
  Tensor& max = internal::reuse_or_allocate(st.max, {n});
  Tensor& probs = internal::reuse_or_allocate(st.probs, {n, shard_.size()}, tracker_);
  if (st.stats.numel() != 2 * n) st.stats = Tensor::empty({n, 2}, DType::f64);
  functional::row_max(z, max);
  if (group_.size() > 1) group_.comm->all_reduce(max.data<float>(), max.data<float>(), static_cast<size_t>(n),
                                                 DType::f32, comm::ReduceOp::max);
  functional::vocab_parallel_ce_partial(z, st.labels, shard_.begin, max, probs, st.stats);
  if (group_.size() > 1)
    group_.comm->all_reduce(st.stats.data<double>(), st.stats.data<double>(), static_cast<size_t>(2 * n), DType::f64,
                            comm::ReduceOp::sum);
  const double total = functional::vocab_parallel_ce_finish(st.stats, probs);
  st.normalizer = norm;
  return total / norm;
}

Tensor VocabParallelCrossEntropy::backward(Saved& saved, double grad_output) {
  State& st = saved.state<State>();
  internal::check_forward_done(st.normalizer, "VocabParallelCrossEntropy::backward");
  Tensor& g = internal::reuse_or_allocate(st.grad, st.probs.shape(), tracker_);
  functional::vocab_parallel_ce_backward(st.probs, st.labels, shard_.begin, grad_output / st.normalizer, g);
  return g;
}

}  // namespace meshtrain::nn
