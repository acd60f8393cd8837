// Embedding: a lookup table (num, dim); forward maps integer ids to rows.
//
//   nn::Embedding wte(50257, 768, "wte", /*seed=*/42);   // "wte.weight" (50257, 768) ~ N(0, 0.02)
//   Tensor x = wte.forward(tokens);                      // (B, T) i64/i32 -> (B, T, 768)
//   wte.backward(dx);                                    // weight.grad rows += dx; returns undefined
//
// Ids have no gradient: backward returns an undefined Tensor (split:
// backward_input returns it and keeps dy; backward_weight scatter-adds into
// the rows the ids name, in order, so repeated ids accumulate
// deterministically). The weight is ParamKind::embedding (vocab-parallel
// under tensor parallelism) and is decayed (a matrix). Its initial value is
// N(0, init_std) from (seed, name, index): any shard can be built alone.
// A language model ties its output head to this weight (see gpt.h and the
// tied-parameter rule in module.h).
// Vocabulary-parallel (options.tensor of k > 1 ranks): rank r holds rows
// shard_range(num, r, k) of the table (its block of the unsharded
// initialization, Placement::box); forward looks up the ids in its rows,
// zeros elsewhere, and all-reduces over the group, so every rank returns
// the full lookup; backward accumulates into the rank's rows only. With
// sequence parallelism (options.tensor.sequence_parallel, ids (B, T), T
// divisible by k) the sum is a reduce-scatter: forward returns this rank's
// time steps (B, T/k, dim) and backward takes them (and all-gathers dy).
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/nn/module.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::nn {

struct EmbeddingOptions {
  double init_std = 0.02;
  bool defer_init = false;  // see LinearOptions::defer_init
  sharding::ParamKind kind = sharding::ParamKind::embedding;  // position tables: other
  TensorParallelGroup tensor = {};  // vocabulary-parallel over these ranks (see above)
};

class Embedding final : public Module {
 public:
  Embedding(int64_t num, int64_t dim, const std::string& prefix, uint64_t seed, EmbeddingOptions options = {});
  Embedding(const Embedding&) = delete;
  Embedding& operator=(const Embedding&) = delete;

  std::vector<Parameter*> parameters() override { return {&weight_}; }
  Parameter& weight() { return weight_; }
  int64_t num() const { return num_; }  // the whole table's rows
  int64_t dim() const { return dim_; }
  ShardRange shard() const { return shard_; }  // the rows this rank holds

 protected:
  Tensor do_forward(const Tensor& ids, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  std::string describe() const override { return "Embedding '" + name_ + "'"; }

 private:
  struct State {
    Tensor ids;                    // (N) as given (flattened)
    std::vector<int64_t> shape;    // ids' shape
    Tensor dy;                     // (N, dim) kept for the weight pass
    Tensor y;                      // output buffer
  };
  std::string name_;
  int64_t num_, dim_;
  TensorParallelGroup tensor_;
  ShardRange shard_;
  Parameter weight_;  // (shard rows, dim)
};

}  // namespace meshtrain::nn
