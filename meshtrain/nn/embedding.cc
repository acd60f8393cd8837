#include "meshtrain/nn/embedding.h"

#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/deterministic.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

Embedding::Embedding(int64_t num, int64_t dim, const std::string& prefix, uint64_t seed, EmbeddingOptions options)
    : name_(prefix), num_(num), dim_(dim), tensor_(options.tensor) {
  if (num < 1 || dim < 1 || !(options.init_std >= 0.0))
    throw InvalidArgument("Embedding", fmt::format("'{}': num {}, dim {}, init_std {}", prefix, num, dim, options.init_std),
                          "need num >= 1, dim >= 1 and init_std >= 0");
  if (tensor_.size() > 1 && options.kind != sharding::ParamKind::embedding)
    throw InvalidArgument("Embedding", fmt::format("'{}': a tensor-parallel group for a table of kind {}", prefix,
                                                   sharding::to_string(options.kind)),
                          "only a token embedding (kind embedding) is vocabulary-parallel; build the table whole");
  const std::string name = internal::join_name(prefix, "weight");
  weight_.name = name;
  weight_.weight_decay = true;  // a matrix
  weight_.info = sharding::ParamInfo{.name = name, .shape = {num, dim}, .kind = options.kind};
  weight_.placement = Placement::whole({num, dim});
  const uint64_t key = key_from_name(name);
  const float std = static_cast<float>(options.init_std);
  weight_.init = [seed, key, std](int64_t start, int64_t count, float* out) {
    fill_normal(out, static_cast<size_t>(count), seed, key, static_cast<uint64_t>(start), 0.0f, std);
  };
  // This rank's rows of the table (all of them on one rank).
  sharding::Box rows = tensor_parallel_block(weight_.info, tensor_);
  shard_ = {rows.offsets[0], rows.offsets[0] + rows.sizes[0]};
  if (shard_.size() == 0)
    throw InvalidArgument("Embedding",
                          fmt::format("'{}': {} rows over {} tensor-parallel ranks leave rank {} none", prefix, num,
                                      tensor_.size(), tensor_.rank()),
                          fmt::format("use at most {} tensor-parallel ranks", num));
  if (tensor_.size() > 1) {
    weight_.info.shape = rows.sizes;
    weight_.init = box_init(weight_.init, {num, dim}, rows);
    weight_.placement = Placement::block(std::move(rows), {num, dim});
  }
  if (!options.defer_init) materialize(weight_);
}

Tensor Embedding::do_forward(const Tensor& ids, Saved& saved) {
  const char* op = "Embedding::forward";
  if (!ids.defined() || (ids.dtype() != DType::i64 && ids.dtype() != DType::i32))
    throw InvalidArgument(op, fmt::format("'{}': ids must be an i64 or i32 tensor", name_),
                          "pass token (or position) ids, e.g. (batch, T)");
  internal::param_value(weight_.value, weight_.value.dtype(), op, weight_.name);  // checks it
  State& st = saved.state<State>();
  st.shape = ids.shape();
  st.ids = ids.contiguous().view({ids.numel()});
  Tensor& y = internal::reuse_or_allocate(st.y, {ids.numel(), dim_}, tracker_);
  functional::embedding_forward(st.ids, weight_.value, y, shard_.begin, num_);
  std::vector<int64_t> out_shape = st.shape;
  out_shape.push_back(dim_);
  // Each id's row came from the one rank holding it: the sum over the group
  // (sequence parallel: only this rank's time steps of it).
  if (tensor_.splits_sequence()) return reduce_scatter_sequence(y.view(out_shape), tensor_, tracker_);
  if (tensor_.size() > 1) {
    const functional::ProfileScope scope("tp all_reduce");
    tensor_.comm->all_reduce(y.data<float>(), y.data<float>(), static_cast<size_t>(y.numel()), DType::f32,
                             comm::ReduceOp::sum);
  }
  return y.view(out_shape);
}

Tensor Embedding::do_backward_input(const Tensor& grad_out, Saved& saved) {
  const char* op = "Embedding::backward";
  State& st = saved.state<State>();
  std::vector<int64_t> want = st.shape;
  want.push_back(dim_);
  if (tensor_.splits_sequence()) want[1] /= tensor_.size();  // this rank's time steps
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(dy, want, op, "grad_out");
  if (tensor_.splits_sequence()) dy = gather_sequence(dy, tensor_);
  st.dy = dy.view({st.ids.numel(), dim_});
  return Tensor();  // ids have no gradient
}

void Embedding::do_backward_weight(Saved& saved) {
  State& st = saved.state<State>();
  internal::check_param_grad(weight_.grad, "Embedding::backward", weight_.name);
  add_gradient(weight_, 0, call_node(saved.batch, st.shape.size() > 1 ? st.shape[0] : 1), [&](const Tensor& g) {
    functional::embedding_backward(st.ids, st.dy, g, shard_.begin, num_);
  });
  notify_grad_ready(weight_);
  st.dy = Tensor();
  st.ids = Tensor();
}

}  // namespace meshtrain::nn
