// Tensor parallelism's building blocks (Megatron-LM's split of a transformer
// across a `tensor` mesh axis): the group, the shard rule, column- and
// row-parallel linear layers and the vocabulary-parallel cross-entropy.
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
// ColumnParallelLinear (Megatron's split of the first MLP matrix and the
// q|k|v projection): rank r holds the columns (output features) of its shard
// of each of `parts` equal column blocks (parts = 3 for a fused q|k|v
// weight, so each rank holds q, k and v of its own heads), and the bias
// entries of those columns. Forward takes the whole input and returns this
// rank's output columns (no communication); backward all-reduces dX over the
// group (the "f" operator). RowParallelLinear (the second MLP matrix, the
// attention output projection): rank r holds the rows (input features) of
// its shard; forward takes this rank's input columns, all-reduces the
// partial products (the "g" operator) and adds the bias, which every rank
// holds whole; backward needs no communication (dy is the same on every
// rank, so is the bias gradient). A group of one rank computes what a plain
// Linear computes (the bias added after the product instead of before the
// GEMM's accumulation: the same up to one rounding). Parameters keep the unsharded names; info.shape is the rank's
// block, placement says where it lies (Placement::box) and its initial
// value is that block of the unsharded layer's (box_init): the model is the
// same whatever the split.
//
// Sequence parallelism (Megatron-LM's, group.sequence_parallel): outside
// the tensor-parallel regions (LayerNorms, dropout, residual sums, the
// embeddings' sum) activations (B, T, C) are split along T: rank r holds
// time steps [r T/k, (r + 1) T/k) of every sample, (B, T/k, C), so those
// layers' activations and work are 1/k. Each region begins with an
// all-gather of the sequence (ColumnParallelLinear's forward; its backward
// reduce-scatters dX) and ends with a reduce-scatter (RowParallelLinear's
// forward, in place of the all-reduce; its backward all-gathers dy): the
// same bytes on the wire as the all-reduces they replace (an all-reduce is
// a reduce-scatter and an all-gather). Parameters replicated over the
// tensor axis that see only this rank's tokens (LayerNorms, row-parallel
// biases, position embeddings) get Parameter::sequence_parallel; their
// gradients are partial sums, added over the axis once per optimizer step
// by reduce_sequence_parallel_grads (after gradient accumulation and the
// data-parallel reduction: the sums commute). T must be divisible by k
// (InvalidArgument naming both otherwise). The column-parallel layer keeps
// its gathered input for the weight gradient (Megatron re-gathers it in
// backward instead, trading an all-gather for (B, T, C) of memory).
//
// Communication overlap (group.overlap; with sequence parallelism the
// collective matmuls of Wang et al. 2023, as Megatron-LM's tp_comm_overlap
// and torchtitan's async tensor parallelism do): each boundary's collective
// becomes k - 1 point-to-point ring steps, each hidden behind the GEMM of one
// block of time steps (Linear's row blocks). The column-parallel forward
// multiplies its own time steps while the next rank's arrive (all-gather
// ring, own block first); the row-parallel forward computes the partial
// product of rank r - 1's time steps first and sends it on while it
// computes the next (reduce-scatter ring, this rank's block last); backward
// runs the same rings the other way (the column-parallel one keeps its last
// receive for after the weight gradient). Between a region's GEMM and the
// ring, activations are in block-major order (rank j's time steps of every
// sample together), one reordering copy per boundary as without overlap
// (none when B = 1). The ring adds the same partial products as the
// collective (for k = 2 in the same order); a block's GEMM may round
// differently from the whole one (the library's blocking depends on the
// row count), so results match the plain path's within the dtype's
// tolerance, not bit for bit. Without sequence
// parallelism the row-parallel forward all-reduces the first half of its
// rows (asynchronously) while it multiplies the second, and the
// column-parallel backward all-reduces dX while it computes the weight
// gradient (the split backward: by halves, as the forward). A group of one
// rank has nothing to overlap.
//
// VocabParallelCrossEntropy: each rank holds the logits of its vocabulary
// shard for every row. Forward all-reduces the row maxima (max, f32), then
// the per-row sums of exp(z - max) and the target logit (sum, f64: one
// all-reduce of 2N numbers); every rank returns the same loss, equal to
// CrossEntropyLoss on the gathered logits (the row max may sit on any rank).
// It keeps N x V / k probabilities, not N x V. Backward is local:
// (softmax - onehot) on the shard. Collective: every rank of the group calls
// forward with the same rows and labels.
// Profiling: every collective of these layers, the vocabulary-parallel
// Embedding and the GPT's head times itself in nn::functional's op profile
// (functional::ProfileScope, while the calling thread profiles) as "tp
// all_reduce", "tp all_gather" or "tp reduce_scatter" (gather_sequence and
// reduce_scatter_sequence with their reordering copies), and
// reduce_sequence_parallel_grads as "tp grad all_reduce"; `meshtrain bench
// gpt --mesh tensor=2` sums them.
// Errors: InvalidArgument for logits whose width is not this rank's shard
// (naming both) or labels outside [0, vocab).
// Thread-safety: one thread at a time per object (a rank's own).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/dropout.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/nn/saved.h"

namespace meshtrain::nn {

// The ranks a module is split over (the mesh's tensor axis); null comm: one rank.
struct TensorParallelGroup {
  comm::Communicator* comm = nullptr;
  bool sequence_parallel = false;  // see above; a group of one rank has no effect
  bool overlap = false;            // "Communication overlap" above
  int size() const { return comm == nullptr ? 1 : comm->size(); }
  int rank() const { return comm == nullptr ? 0 : comm->rank(); }
  // Activations outside the tensor-parallel regions are split along T.
  bool splits_sequence() const { return sequence_parallel && size() > 1; }
  // The region boundaries' collectives run beside their GEMMs.
  bool overlaps() const { return overlap && size() > 1; }
};

struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
// Rank `rank` of `ranks`' part of n items (the rule above).
ShardRange shard_range(int64_t n, int rank, int ranks);

// The block of a parameter (described by its unsharded ParamInfo: kind,
// role, fused parts, heads) that rank group.rank() holds: the seeds'
// TensorParallelStrategy's rule (sharding/strategy.h) with uneven shards
// allowed (torch.chunk), over info.layout(). Every module here, and the
// vocabulary-parallel Embedding, takes its blocks from it, so the layouts
// the strategies print are the ones the runtime holds.
sharding::Box tensor_parallel_block(const sharding::ParamInfo& info, const TensorParallelGroup& group);

// The whole value of p on every rank of the group: p.value itself for a
// whole placement, else every rank's block (Placement::box) all-gathered and
// put in place (blocks may differ in size). Collective over the group.
Tensor gather_parameter(const Parameter& p, const TensorParallelGroup& group);

// Sequence-parallel region boundaries (collective over the group; a group
// of one rank returns its input). gather_sequence: every rank's (B, T/k, ...)
// -> (B, T, ...), rank r's block at time steps [r T/k, (r + 1) T/k).
// reduce_scatter_sequence: (B, T, ...) partial sums on every rank -> this
// rank's time steps of their sum, (B, T/k, ...); T divisible by k.
// Buffers are charged to `tracker` (may be null) as activations.
Tensor gather_sequence(const Tensor& local, const TensorParallelGroup& group, MemoryTracker* tracker = nullptr);
Tensor reduce_scatter_sequence(const Tensor& full, const TensorParallelGroup& group,
                               MemoryTracker* tracker = nullptr);

// Collective over `comm`: every rank's grads of `params` (the same shapes
// on every rank, in the same order) summed in one f32 all-reduce, timed as
// `profile_name` in the op profile. reduce_sequence_parallel_grads and
// parallel::ExpertParallel's replicated gradients use it.
void sum_grads(const std::vector<Parameter*>& params, comm::Communicator& comm, const char* profile_name);

// Collective over the group, once per optimizer step after the data-parallel
// strategy's finish(): adds over the tensor axis, in one all-reduce, the
// grads of those of `params` (the strategy's optimizer_parameters(), named
// like the model's) whose name is in `names` (the model's parameters with
// Parameter::sequence_parallel). Every rank of the group must hold the same
// elements of them (equal tensor-parallel blocks: check with
// sequence_parallel_layout_key).
void reduce_sequence_parallel_grads(const std::vector<Parameter*>& params, const std::vector<std::string>& names,
                                    const TensorParallelGroup& group);
// A hash of which elements of the named parameters `params` hold (names,
// placements, shapes): equal on every rank of a group exactly when
// reduce_sequence_parallel_grads adds like elements.
uint64_t sequence_parallel_layout_key(const std::vector<Parameter*>& params, const std::vector<std::string>& names);

class ColumnParallelLinear final : public Module {
 public:
  // in, out: the unsharded layer's; out divisible by parts. options as for
  // Linear (defer_init, init_std, bias, needs_input_grad).
  ColumnParallelLinear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed, const LinearOptions& options,
                       TensorParallelGroup group, int64_t parts = 1);
  std::vector<Parameter*> parameters() override { return local_.parameters(); }
  std::vector<Module*> children() override { return {&local_}; }
  int64_t local_out_features() const { return local_.out_features(); }
  Linear& local() { return local_; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override { return "ColumnParallelLinear '" + name_ + "'"; }

 private:
  Tensor input_grad(const Tensor& dx);  // the "f" operator's backward
  // Communication overlap (see above): the all-gather ring of forward; the
  // reduce-scatter ring (or all-reduce) of backward (split: backward_input's part).
  Tensor overlapped_forward(const Tensor& x, Saved& saved);
  Tensor overlapped_backward(const Tensor& grad_out, Saved& saved, bool split);
  std::string name_;
  TensorParallelGroup group_;
  Linear local_;
};

class RowParallelLinear final : public Module {
 public:
  // in, out: the unsharded layer's.
  RowParallelLinear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed, const LinearOptions& options,
                    TensorParallelGroup group);
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override { return {&local_}; }
  int64_t local_in_features() const { return local_.in_features(); }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override { return "RowParallelLinear '" + name_ + "'"; }

 private:
  struct State {
    Tensor dy;  // (R, out) (sequence parallel: this rank's rows) kept for the bias gradient of a split backward
  };
  void bias_grad(const Tensor& dy, const BatchContext& batch);
  Tensor full_grad(const Tensor& dy);  // the "g" operator's backward
  Tensor overlapped_forward(const Tensor& x, Saved& saved);
  Tensor overlapped_backward(const Tensor& grad_out, Saved& saved, bool split);
  std::string name_;
  TensorParallelGroup group_;
  bool has_bias_;
  Linear local_;  // (in shard, out), no bias
  Parameter bias_;
};

// Megatron's pairing for a chain of Linear layers sizes[0] -> sizes[1] ->
// ... (an MLP, a VAE's encoder or decoder): consecutive layers pair up, the
// first of a pair column-parallel and the second row-parallel, so the
// activation between them (after its ReLU and dropout) holds this rank's
// columns and each pair ends with one all-reduce. With an odd number of
// layers, the end layer with fewer weights (the first or the last) stays
// whole (replicated: every rank computes it on the same input): a
// classifier's last layer, a decoder's first. On a group of one rank
// make_chain_linear builds plain Linears (the role kept as metadata for the
// strategies: LinearOptions::role).
enum class ChainRole : uint8_t { column, row, whole };
std::vector<ChainRole> chain_roles(const std::vector<int64_t>& sizes);
// The layer of that role (options.role set to match), named `prefix`.
std::unique_ptr<Module> make_chain_linear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed,
                                          LinearOptions options, const TensorParallelGroup& group, ChainRole role);
// This rank's features of the output of a layer of that role (all of them
// but for column-parallel), for the dropout after it.
DropoutShard chain_dropout_shard(int64_t out, const TensorParallelGroup& group, ChainRole role);

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
