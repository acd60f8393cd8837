// Tensor parallelism's building blocks (Megatron-LM's split of a transformer
// across a `tensor` mesh axis). This file grows with the tensor-parallel
// issue; today it holds the group, the shard rule and the
// vocabulary-parallel cross-entropy.
//
//   nn::TensorParallelGroup tp{&mesh.comm("tensor")};
//   const nn::ShardRange cols = nn::shard_range(vocab, tp.rank(), tp.size());  // this rank's vocabulary ids
//   nn::VocabParallelCrossEntropy ce(tp, vocab);
//   double loss = ce.forward(local_logits, labels);   // local_logits (N, cols.size): never gathered
//   Tensor dlogits = ce.backward();                   // (N, cols.size), no communication
//
// Shard rule (torch.chunk, as sharding::Layout): n items over k ranks, c =
// ceil(n / k); rank j holds [j c, min(n, (j + 1) c)), possibly empty.
//
// VocabParallelCrossEntropy: each rank holds the logits of its vocabulary
// shard for every row. Forward all-reduces the row maxima (max, f32), then
// the per-row sums of exp(z - max) and the target logit (sum, f64: one
// all-reduce of 2N numbers); every rank returns the same loss, equal to
// CrossEntropyLoss on the gathered logits (the row max may sit on any rank).
// It keeps N x V / k probabilities, not N x V. Backward is local:
// (softmax - onehot) on the shard. Collective: every rank of the group calls
// forward with the same rows and labels.
// Errors: InvalidArgument for logits whose width is not this rank's shard
// (naming both) or labels outside [0, vocab).
// Thread-safety: one thread at a time per object (a rank's own).
#pragma once

#include <cstdint>
#include <optional>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/saved.h"

namespace meshtrain::nn {

// The ranks a module is split over (the mesh's tensor axis); null comm: one rank.
struct TensorParallelGroup {
  comm::Communicator* comm = nullptr;
  int size() const { return comm == nullptr ? 1 : comm->size(); }
  int rank() const { return comm == nullptr ? 0 : comm->rank(); }
};

struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
// Rank `rank` of `ranks`' part of n items (the rule above).
ShardRange shard_range(int64_t n, int rank, int ranks);

class VocabParallelCrossEntropy {
 public:
  // vocab: the full vocabulary V; tracker (optional) counts the kept
  // probabilities and gradient as activations.
  VocabParallelCrossEntropy(TensorParallelGroup group, int64_t vocab, MemoryTracker* tracker = nullptr);

  // logits (N, shard) f32, labels (N) i64 global ids; returns
  // sum_i (logsumexp(z_i) - z_i[label_i]) / normalizer (default N).
  double forward(const Tensor& logits, const Tensor& labels, Saved& saved,
                 std::optional<double> normalizer = std::nullopt);
  Tensor backward(Saved& saved, double grad_output = 1.0);
  double forward(const Tensor& logits, const Tensor& labels, std::optional<double> normalizer = std::nullopt) {
    return forward(logits, labels, own_, normalizer);
  }
  Tensor backward(double grad_output = 1.0) { return backward(own_, grad_output); }
  ShardRange shard() const { return shard_; }

 private:
  struct State {
    Tensor probs, labels, grad, max, stats;
    double normalizer = 0.0;
  };
  TensorParallelGroup group_;
  int64_t vocab_;
  ShardRange shard_;
  MemoryTracker* tracker_;
  Saved own_;
};

}  // namespace meshtrain::nn
