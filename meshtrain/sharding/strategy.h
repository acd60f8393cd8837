// Sharding strategies: rules that map a named parameter, and the batch, to a
// PartitionSpec on a device mesh. This header holds the parameter description,
// the Strategy interface and the data-, fully-sharded- and tensor-parallel
// strategies; stage_assignment.h (PipelineParallelStrategy) and
// multi_dimensional.h hold the other two.
//
//   ParamInfo fc1{.name = "h.0.mlp.fc1.weight", .shape = {4096, 16384},
//                 .kind = ParamKind::linear_weight, .role = LinearRole::column};
//   TensorParallelStrategy("tensor", 4).param_spec(fc1);  // P(None, tensor)
//   FSDPStrategy("fsdp", 8).param_spec(fc1);              // P(None, fsdp)
//   DataParallelStrategy("data").batch_spec(3, 0);        // P(data, None, None)
//
// WEIGHT CONVENTION (stated here once; every strategy, test and doc follows
// it): a linear weight has shape (in_features, out_features) and the layer
// computes y = x W + b for row-major x (tokens, in_features), as Flax kernels
// do. PyTorch's nn.Linear stores (out, in): transpose when importing. So
//   column-parallel (split the output features)  -> weight P(None, axis),
//                                                   bias (out,) P(axis)
//   row-parallel    (split the input features)   -> weight P(axis, None),
//                                                   bias replicated
//   attention QKV = column-parallel, attention output = row-parallel,
//   token embedding (vocab, hidden)              -> P(axis, None) (vocab split).
//
// Roles come from ParamInfo metadata (kind and role), never from names or from
// a parameter's position in a list.
//
// Thread-safety: strategies are immutable after construction; all methods are
// const and may be called concurrently. Results are pure functions of the
// strategy's settings and the ParamInfo.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/sharding/partition_spec.h"
#include "meshtrain/sharding/layout.h"

namespace meshtrain::sharding {

// What a parameter is. Shapes follow the weight convention above.
enum class ParamKind : uint8_t {
  linear_weight,         // (in, out); split per `role`
  linear_bias,           // (out,); split for column-parallel, else replicated
  embedding,             // token embedding (vocab, hidden); position embeddings are `other`
  norm,                  // LayerNorm/RMSNorm scale or shift: always replicated by TP
  attention_qkv_weight,  // (hidden, 3 * hidden) fused or (hidden, hidden) each; column-parallel
  attention_qkv_bias,    // (3 * hidden,) or (hidden,); split like the weight's output
  attention_out_weight,  // (hidden, hidden); row-parallel
  attention_out_bias,    // (hidden,); replicated
  other,                 // anything else: replicated by TP
};

// How tensor parallelism splits a linear layer. Attention kinds imply their
// role (qkv: column, out: row); giving them the other role is an error.
enum class LinearRole : uint8_t { none, column, row };

std::string to_string(ParamKind kind);
std::string to_string(LinearRole role);

struct ParamInfo {
  std::string name;              // unique within a model, e.g. "h.0.attn.qkv.weight"
  std::vector<int64_t> shape;    // global shape, every dim >= 0
  ParamKind kind = ParamKind::other;
  LinearRole role = LinearRole::none;
  // Attention parameters only: the number of heads (0 = not given). When given,
  // tensor parallelism also checks that whole heads land on each rank. A fused
  // QKV weight must order its output features head by head ([q k v] of head 0,
  // then head 1, ...), as Megatron does, so that a contiguous split keeps each
  // head's q, k and v together.
  int64_t num_heads = 0;
  // A fused parameter that stacks `parts` equal blocks of output features
  // (GPT-2's c_attn stores [q | k | v]: 3): every strategy lays it out as
  // its view layout() (in, parts, out / parts), a bias as (parts, out /
  // parts), so tensor parallelism splits each block alike (each rank: q, k
  // and v of its own heads) and specs have the view's dims. 1: unfused.
  int64_t parts = 1;
  // A routed expert's parameter (a mixture-of-experts layer, nn/moe.h):
  // expert `expert` of its layer's `experts`. An expert axis of P ranks
  // (P dividing experts) holds it on the rank expert / (experts / P) alone;
  // -1: not an expert (every rank of an expert axis holds it).
  int expert = -1;
  int experts = 0;

  bool routed_expert() const { return expert >= 0; }
  int64_t numel() const;
  // This description with shape the view above and parts 1 (a copy of
  // itself when parts == 1). InvalidArgument when parts < 1 or does not
  // divide the last dimension.
  ParamInfo layout() const;
  // "'h.0.mlp.fc1.weight' (4096, 16384)"
  std::string to_string() const;
};

// "(4096, 16384)"
std::string shape_to_string(const std::vector<int64_t>& shape);

// The kind of a strategy: MultiDimensionalStrategy uses it to order axes that
// share a dimension (see multi_dimensional.h).
enum class StrategyKind : uint8_t { data_parallel, fully_sharded, tensor_parallel, pipeline_parallel, other };

// A rule from parameters (and the batch) to specs over the mesh axes it owns.
// Implementations must only use the axes listed by axes().
class Strategy {
 public:
  virtual ~Strategy() = default;

  // Names the strategy and its settings in error messages: "TensorParallel(tensor=4)".
  virtual std::string name() const = 0;
  virtual StrategyKind kind() const { return StrategyKind::other; }
  // The mesh axes this strategy owns.
  virtual std::vector<std::string> axes() const = 0;
  // The number of ranks on `axis` if the strategy knows it, else 0. Used to
  // compute the per-rank shape other strategies see when combined.
  virtual int64_t axis_size(const std::string& axis) const;

  // The spec of a parameter: one entry per dimension of p.shape. Throws
  // InvalidArgument naming the parameter when it cannot be split as asked.
  virtual PartitionSpec param_spec(const ParamInfo& p) const = 0;
  // The spec of a batch (input or activation) of `ndim` dims whose batch
  // dimension is `batch_dim` (0 <= batch_dim < ndim). Default: replicated.
  virtual PartitionSpec batch_spec(int ndim, int batch_dim) const;
  // Why param_spec decides what it does, in one line, e.g.
  // "FSDP(fsdp=8, min_weight_size=1024): 'b' (64,) has 64 elements < min_weight_size 1024: replicated".
  virtual std::string explain(const ParamInfo& p) const;
};

// Plain data parallelism: every parameter replicated, the batch dimension split
// over `axis`.
class DataParallelStrategy final : public Strategy {
 public:
  explicit DataParallelStrategy(std::string_view axis = mesh::kData);

  std::string name() const override;
  StrategyKind kind() const override { return StrategyKind::data_parallel; }
  std::vector<std::string> axes() const override { return {axis_}; }
  PartitionSpec param_spec(const ParamInfo& p) const override;
  PartitionSpec batch_spec(int ndim, int batch_dim) const override;
  std::string explain(const ParamInfo& p) const override;

  const std::string& axis() const { return axis_; }

 private:
  std::string axis_;
};

// Fully sharded data parallelism (ZeRO-3 layout): each large parameter split
// over `axis` along one dimension; the batch split over `axis` too, since FSDP
// is data parallelism whose replicas hold shards.
//
// Rule for a parameter (should_shard is THE decision the runtime,
// parallel::FullyShardedDataParallel, makes too):
//   numel < min_weight_size (elements), empty or scalar -> replicated
//   else the largest dimension whose size is divisible by axis_size is split
//        (ties: the first, outermost one); when none is, the largest
//        dimension is split unevenly (Layout's torch.chunk rule)
// The kind of parameter does not matter. The runtime stores a unit's sharded
// parameters as one flat, padded vector (FSDP1 / ZeRO style); each rank's
// Parameter::placement records the flat range it really holds, while
// param_spec is the per-dimension layout used when FSDP composes with other
// strategies (MultiDimensionalStrategy) and for pictures.
class FSDPStrategy final : public Strategy {
 public:
  // axis_size >= 1, min_weight_size >= 0.
  explicit FSDPStrategy(std::string_view axis = mesh::kFsdp, int64_t axis_size = 1, int64_t min_weight_size = 1024);

  std::string name() const override;
  StrategyKind kind() const override { return StrategyKind::fully_sharded; }
  std::vector<std::string> axes() const override { return {axis_}; }
  int64_t axis_size(const std::string& axis) const override;
  PartitionSpec param_spec(const ParamInfo& p) const override;
  PartitionSpec batch_spec(int ndim, int batch_dim) const override;
  std::string explain(const ParamInfo& p) const override;

  // The size half of the rule: a parameter of `numel` elements is large
  // enough to shard (numel >= min_weight_size, and not empty). The planner
  // (plan/memory_model, traffic_model, time_model) asks it with the
  // element counts it predicts.
  static bool large_enough(int64_t numel, int64_t min_weight_size) {
    return numel > 0 && numel >= min_weight_size;
  }
  // The dimension param_spec splits, or -1 when it replicates.
  int shard_dim(const ParamInfo& p) const;
  bool should_shard(const ParamInfo& p) const { return shard_dim(p) >= 0; }
  const std::string& axis() const { return axis_; }
  int64_t size() const { return axis_size_; }
  int64_t min_weight_size() const { return min_weight_size_; }

 private:
  std::string axis_;
  int64_t axis_size_;
  int64_t min_weight_size_;
};

// Megatron-style tensor parallelism over `axis` (axis_size ranks):
//   linear_weight column -> P(None, axis)   linear_weight row -> P(axis, None)
//   linear_bias   column -> P(axis)         linear_bias   row -> replicated
//   attention_qkv_weight -> P(None, axis)   attention_qkv_bias  -> P(axis)
//   attention_out_weight -> P(axis, None)   attention_out_bias  -> replicated
//   embedding            -> P(axis, None)   (vocab-parallel)
//   norm, other, linear with role none -> replicated
// A split dimension must be divisible by axis_size (and num_heads, when given,
// too); otherwise param_spec throws naming the parameter, the dimension, its
// size and the axis size. The batch is replicated over `axis`.
// A fused q|k|v weight described by its view (in, parts, C) (ParamInfo::
// parts) is split on C, the bias (parts, C) likewise. With uneven = true a
// dimension the axis does not divide is split by the torch.chunk rule
// (Layout's; heads must still divide): what the runtime modules build
// (nn/parallel/tensor_parallel.h), which take their blocks from block().
class TensorParallelStrategy final : public Strategy {
 public:
  // axis_size >= 1.
  explicit TensorParallelStrategy(std::string_view axis = mesh::kTensor, int64_t axis_size = 1, bool uneven = false);

  // The block of p.layout() that rank `rank` of the axis holds: the whole
  // view but for the split dimension, whose part follows the torch.chunk
  // rule (possibly empty). 0 <= rank < size().
  Box block(const ParamInfo& p, int64_t rank) const;

  std::string name() const override;
  StrategyKind kind() const override { return StrategyKind::tensor_parallel; }
  std::vector<std::string> axes() const override { return {axis_}; }
  int64_t axis_size(const std::string& axis) const override;
  PartitionSpec param_spec(const ParamInfo& p) const override;
  std::string explain(const ParamInfo& p) const override;

  // The specs of the weight convention, for 2-D weights and 1-D biases.
  PartitionSpec column_weight_spec() const;  // P(None, axis)
  PartitionSpec row_weight_spec() const;     // P(axis, None)
  PartitionSpec column_bias_spec() const;    // P(axis)
  PartitionSpec attention_qkv_spec() const { return column_weight_spec(); }
  PartitionSpec attention_output_spec() const { return row_weight_spec(); }
  PartitionSpec embedding_spec() const { return row_weight_spec(); }

  // The role param_spec applies to p: column, row or none (replicated).
  LinearRole effective_role(const ParamInfo& p) const;
  const std::string& axis() const { return axis_; }
  int64_t size() const { return axis_size_; }

 private:
  // The dimension p is split on, -1 for replicated; throws when not divisible.
  int split_dim(const ParamInfo& p) const;

  std::string axis_;
  int64_t axis_size_;
  bool uneven_;
};

namespace internal {
// Throws InvalidArgument(op, ...) naming p when a dim is negative.
void check_param(const char* op, const ParamInfo& p);
// Throws InvalidArgument(op, ...) unless 0 <= batch_dim < ndim.
void check_batch(const char* op, int ndim, int batch_dim);
// Throws InvalidArgument(op, ...) on an empty axis name.
void check_axis_name(const char* op, const std::string& axis);
}  // namespace internal

}  // namespace meshtrain::sharding
