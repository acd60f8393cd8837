#include "meshtrain/nn/parallel/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <unordered_set>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/internal/loss_args.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::nn {

ShardRange shard_range(int64_t n, int rank, int ranks) {
  if (n < 0 || ranks < 1 || rank < 0 || rank >= ranks)
    throw InvalidArgument("shard_range", fmt::format("{} items, rank {} of {}", n, rank, ranks),
                          "pass n >= 0 and 0 <= rank < ranks");
  const auto [begin, end] = sharding::chunk_range(n, rank, ranks);
  return {begin, end};
}

sharding::Box tensor_parallel_block(const sharding::ParamInfo& info, const TensorParallelGroup& g) {
  return sharding::TensorParallelStrategy(mesh::kTensor, g.size(), /*uneven=*/true).block(info, g.rank());
}

namespace {

// Sets a deferred parameter (built at the block's shape) to this rank's
// block of the unsharded parameter `whole`, with whole's metadata (kind,
// role, parts), and builds its value unless `defer`. On a group of one rank
// the block is the whole parameter.
void take_block(Parameter& p, const Parameter& whole, bool defer, const TensorParallelGroup& g) {
  p.info.kind = whole.info.kind;
  p.info.role = whole.info.role;
  p.info.parts = whole.info.parts;
  if (g.size() == 1) {
    p.init = whole.init;
  } else {
    std::vector<int64_t> view = whole.info.layout().shape;
    sharding::Box box = tensor_parallel_block(whole.info, g);
    p.init = box_init(whole.init, view, box);
    p.placement = Placement::block(std::move(box), std::move(view), whole.info.shape);
  }
  if (!defer) materialize(p);
}

void all_reduce_sum(const TensorParallelGroup& g, const Tensor& t) {
  if (g.size() == 1 || !t.defined()) return;
  const functional::ProfileScope scope("tp all_reduce");
  g.comm->all_reduce(t.data<float>(), t.data<float>(), static_cast<size_t>(t.numel()), DType::f32,
                     comm::ReduceOp::sum);
}

int64_t checked_parts(int64_t out, int64_t parts, const std::string& prefix) {
  if (parts < 1 || out % parts != 0)
    throw InvalidArgument("ColumnParallelLinear",
                          fmt::format("'{}': {} output features in {} parts", prefix, out, parts),
                          "use a part count that divides the output features (3 for a fused q|k|v projection)");
  return parts;
}

LinearOptions deferred(LinearOptions o, bool bias) {
  o.defer_init = true;
  o.bias = bias;
  return o;
}

// The weight of a column- (fused q|k|v when parts > 1) or row-parallel
// layer as the strategies see it.
sharding::ParamInfo weight_info(int64_t in, int64_t out, sharding::LinearRole role, int64_t parts) {
  if (parts > 1)
    return {.name = "", .shape = {in, out}, .kind = sharding::ParamKind::attention_qkv_weight, .parts = parts};
  return {.name = "", .shape = {in, out}, .kind = sharding::ParamKind::linear_weight, .role = role};
}

// The features (columns, or rows for a row-parallel layer) of the weight
// `info` this rank holds; InvalidArgument when there are none.
int64_t local_features(const sharding::ParamInfo& info, const TensorParallelGroup& g, const char* op,
                       const std::string& prefix, const char* what) {
  const sharding::Box b = tensor_parallel_block(info, g);
  const bool rows = info.role == sharding::LinearRole::row;
  const int64_t n = rows ? b.sizes.front() : b.sizes.back() * info.parts;
  if (n == 0) {
    const int64_t total = rows ? info.shape.front() : info.shape.back() / info.parts;
    throw InvalidArgument(op,
                          fmt::format("'{}': {} {} features over {} tensor-parallel ranks leave rank {} none", prefix,
                                      total, what, g.size(), g.rank()),
                          fmt::format("use at most {} tensor-parallel ranks for this layer", total));
  }
  return n;
}

// Marks a fused q|k|v layer's parameters for the strategies (kind, parts).
void describe_fused(Linear& whole, int64_t parts) {
  if (parts == 1) return;
  for (Parameter* p : whole.parameters()) {
    p->info.kind = p == &whole.weight() ? sharding::ParamKind::attention_qkv_weight
                                         : sharding::ParamKind::attention_qkv_bias;
    p->info.role = sharding::LinearRole::none;  // implied by the kind
    p->info.parts = parts;
  }
}

// T / k for a (B, T, ...) activation split along T; InvalidArgument unless k divides T.
int64_t local_steps(const Tensor& x, const TensorParallelGroup& g, const char* op) {
  if (x.dim() < 2 || x.size(1) % g.size() != 0)
    throw InvalidArgument(op,
                          fmt::format("activation {} over a tensor axis of {} ranks with sequence parallelism",
                                      shape_to_string(x.shape()), g.size()),
                          "use a sequence length (dim 1) divisible by the tensor axis size, or turn sequence "
                          "parallelism off");
  return x.size(1) / g.size();
}

}  // namespace

Tensor gather_sequence(const Tensor& local, const TensorParallelGroup& g, MemoryTracker* tracker) {
  if (g.size() == 1) return local;
  const functional::ProfileScope scope("tp all_gather");  // with the reordering copy it needs
  const char* op = "gather_sequence";
  const Tensor x = internal::f32_contiguous(local, op, "input");
  if (x.dim() < 2)
    throw InvalidArgument(op, fmt::format("input {} has no sequence dim", shape_to_string(x.shape())),
                          "pass (batch, time, ...)");
  const int64_t k = g.size(), b = x.size(0);
  std::vector<int64_t> full = x.shape();
  full[1] *= k;
  // The ranks' blocks arrive one after another: (k, B, T/k, ...).
  std::vector<int64_t> blocks = x.shape();
  blocks.insert(blocks.begin(), k);
  Tensor buf = Tensor::empty(blocks, DType::f32, Device{}, tracker, MemoryCategory::activations);
  g.comm->all_gather(x.data<float>(), buf.data<float>(), static_cast<size_t>(x.numel()), DType::f32);
  if (b == 1) return buf.view(full);  // (k, 1, T/k, ...) is (1, T, ...) already
  Tensor out = Tensor::empty(full, DType::f32, Device{}, tracker, MemoryCategory::activations);
  const int64_t rest = x.numel() / b;  // elements per sample of one block
  out.view({b, k, rest}).copy_from(buf.view({k, b, rest}).transpose(0, 1));
  return out;
}

Tensor reduce_scatter_sequence(const Tensor& full, const TensorParallelGroup& g, MemoryTracker* tracker) {
  if (g.size() == 1) return full;
  const functional::ProfileScope scope("tp reduce_scatter");  // with the reordering copy it needs
  const char* op = "reduce_scatter_sequence";
  const Tensor x = internal::f32_contiguous(full, op, "input");
  const int64_t k = g.size(), b = x.size(0), steps = local_steps(x, g, op);
  std::vector<int64_t> local = x.shape();
  local[1] = steps;
  const int64_t rest = x.numel() / (b * k);  // elements per sample of one rank's block
  // Block r of the send buffer is rank r's time steps of every sample.
  const Tensor send = b == 1 ? x : x.view({b, k, rest}).transpose(0, 1).contiguous();
  Tensor out = Tensor::empty(local, DType::f32, Device{}, tracker, MemoryCategory::activations);
  g.comm->reduce_scatter(send.data<float>(), out.data<float>(), static_cast<size_t>(out.numel()), DType::f32,
                         comm::ReduceOp::sum);
  return out;
}

namespace {

// The parameters of `params` whose names are in `names`, in order.
std::vector<Parameter*> named(const std::vector<Parameter*>& params, const std::vector<std::string>& names) {
  const std::unordered_set<std::string> want(names.begin(), names.end());
  std::vector<Parameter*> out;
  for (Parameter* p : params)
    if (want.count(p->name) != 0) out.push_back(p);
  return out;
}

}  // namespace

void reduce_sequence_parallel_grads(const std::vector<Parameter*>& params, const std::vector<std::string>& names,
                                    const TensorParallelGroup& g) {
  if (g.size() == 1) return;
  const std::vector<Parameter*> ps = named(params, names);
  size_t n = 0;
  for (const Parameter* p : ps) n += static_cast<size_t>(p->grad.numel());
  if (n == 0) return;
  // Packed in f32 (a strategy may keep gradients in a half-precision
  // reduce dtype): one all-reduce for every such gradient.
  std::vector<float> buf(n);
  size_t at = 0;
  for (const Parameter* p : ps) {
    const Tensor g_ = p->grad.to(DType::f32).contiguous();
    std::copy_n(g_.data<float>(), g_.numel(), buf.data() + at);
    at += static_cast<size_t>(g_.numel());
  }
  {
    const functional::ProfileScope scope("tp grad all_reduce");  // once per step, not per layer
    g.comm->all_reduce(buf.data(), buf.data(), n, DType::f32, comm::ReduceOp::sum);
  }
  at = 0;
  for (Parameter* p : ps) {
    p->grad.copy_from(Tensor::from_blob(buf.data() + at, p->grad.shape(), DType::f32));
    at += static_cast<size_t>(p->grad.numel());
  }
}

uint64_t sequence_parallel_layout_key(const std::vector<Parameter*>& params, const std::vector<std::string>& names) {
  std::string text;
  for (const Parameter* p : named(params, names))
    text += fmt::format("{}:{}:{};", p->name, p->placement.to_string(), shape_to_string(p->grad.shape()));
  return std::hash<std::string_view>{}(text);
}

Tensor gather_parameter(const Parameter& p, const TensorParallelGroup& g) {
  if (!p.placement.is_block() || g.size() == 1) return p.value;
  const Placement& pl = p.placement;
  const size_t nd = pl.view_shape().size();
  // Each rank sends [offsets..., sizes..., block values padded to the largest block].
  int64_t largest = p.value.numel();
  g.comm->all_reduce(&largest, &largest, 1, DType::i64, comm::ReduceOp::max);
  const size_t record = 2 * nd + static_cast<size_t>(largest);
  std::vector<double> send(record, 0.0), all(record * static_cast<size_t>(g.size()));
  for (size_t d = 0; d < nd; ++d) {
    send[d] = static_cast<double>(pl.box.offsets[d]);
    send[nd + d] = static_cast<double>(pl.box.sizes[d]);
  }
  const std::vector<double> values = p.value.to_vector();
  std::copy(values.begin(), values.end(), send.begin() + static_cast<std::ptrdiff_t>(2 * nd));
  g.comm->all_gather(send.data(), all.data(), record, DType::f64);
  Tensor whole = Tensor::zeros(pl.view_shape(), DType::f32);
  for (int r = 0; r < g.size(); ++r) {
    const double* rec = all.data() + static_cast<size_t>(r) * record;
    Tensor view = whole;
    int64_t n = 1;
    for (size_t d = 0; d < nd; ++d) {
      const auto off = static_cast<int64_t>(rec[d]), size = static_cast<int64_t>(rec[nd + d]);
      view = view.narrow(static_cast<int64_t>(d), off, size);
      n *= size;
    }
    std::vector<double> block(rec + 2 * nd, rec + 2 * nd + n);
    view.copy_from(Tensor::from_vector(block, view.shape()));
  }
  return whole.view(pl.shape);
}

// ---- ColumnParallelLinear ----

ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed,
                                           const LinearOptions& options, TensorParallelGroup group, int64_t parts)
    : name_(prefix),
      group_(group),
      local_(in,
             local_features(weight_info(in, out, sharding::LinearRole::column, checked_parts(out, parts, prefix)),
                            group, "ColumnParallelLinear", prefix, "output"),
             prefix, seed, deferred(options, options.bias)) {
  Linear whole(in, out, prefix, seed, deferred(options, options.bias));  // metadata and init only: nothing allocated
  describe_fused(whole, parts);
  for (Parameter* p : local_.parameters())
    take_block(*p, p == &local_.weight() ? whole.weight() : whole.bias(), options.defer_init, group);
}

// Sequence parallelism: the region starts by gathering the sequence, and
// backward reduce-scatters dX instead of all-reducing it.
Tensor ColumnParallelLinear::do_forward(const Tensor& x, Saved& saved) {
  return local_.forward(group_.splits_sequence() ? gather_sequence(x, group_, tracker_) : x, saved.child(0));
}

Tensor ColumnParallelLinear::input_grad(const Tensor& dx) {
  if (group_.splits_sequence()) return reduce_scatter_sequence(dx, group_);
  all_reduce_sum(group_, dx);
  return dx;
}

Tensor ColumnParallelLinear::do_backward_input(const Tensor& grad_out, Saved& saved) {
  return input_grad(local_.backward_input(grad_out, saved.child(0)));
}

void ColumnParallelLinear::do_backward_weight(Saved& saved) { local_.backward_weight(saved.child(0)); }

Tensor ColumnParallelLinear::do_backward(const Tensor& grad_out, Saved& saved) {
  return input_grad(local_.backward(grad_out, saved.child(0)));
}

// ---- RowParallelLinear ----

RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed,
                                     const LinearOptions& options, TensorParallelGroup group)
    : name_(prefix),
      group_(group),
      has_bias_(options.bias),
      local_(local_features(weight_info(in, out, sharding::LinearRole::row, 1), group, "RowParallelLinear", prefix,
                            "input"),
             out, prefix, seed, deferred(options, /*bias=*/false)) {
  Linear whole(in, out, prefix, seed, deferred(options, options.bias));  // metadata and init only
  take_block(local_.weight(), whole.weight(), options.defer_init, group);
  if (has_bias_) {
    bias_ = whole.bias();  // replicated: the whole bias on every rank
    bias_.sequence_parallel = group.splits_sequence();  // added to this rank's tokens only
    if (!options.defer_init) materialize(bias_);
  }
}

std::vector<Parameter*> RowParallelLinear::parameters() {
  std::vector<Parameter*> ps = local_.parameters();
  if (has_bias_) ps.push_back(&bias_);
  return ps;
}

// Sequence parallelism: the region ends with a reduce-scatter of the
// partial products (each rank keeps its time steps) instead of an
// all-reduce, and backward gathers dy back first.
Tensor RowParallelLinear::do_forward(const Tensor& x, Saved& saved) {
  Tensor y = local_.forward(x, saved.child(0));  // this rank's partial product
  if (group_.splits_sequence())
    y = reduce_scatter_sequence(y, group_, tracker_);
  else
    all_reduce_sum(group_, y);
  if (has_bias_) {
    functional::bias_add(internal::param_value(bias_.value, DType::f32, "RowParallelLinear::forward", bias_.name),
                         y.view({y.numel() / y.size(-1), y.size(-1)}));
    round_to(y, compute_dtype_);
  }
  return y;
}

void RowParallelLinear::bias_grad(const Tensor& dy) {
  if (!has_bias_) return;
  internal::check_param_grad(bias_.grad, "RowParallelLinear::backward", bias_.name);
  functional::bias_backward(dy.contiguous().view({dy.numel() / dy.size(-1), dy.size(-1)}), bias_.grad);
  notify_grad_ready(bias_);
}

Tensor RowParallelLinear::full_grad(const Tensor& dy) {
  return group_.splits_sequence() ? gather_sequence(dy, group_) : dy;
}

Tensor RowParallelLinear::do_backward_input(const Tensor& grad_out, Saved& saved) {
  saved.state<State>().dy = grad_out;
  return local_.backward_input(full_grad(grad_out), saved.child(0));
}

void RowParallelLinear::do_backward_weight(Saved& saved) {
  State& st = saved.state<State>();
  bias_grad(st.dy);
  st.dy = Tensor();
  local_.backward_weight(saved.child(0));
}

Tensor RowParallelLinear::do_backward(const Tensor& grad_out, Saved& saved) {
  bias_grad(grad_out);
  return local_.backward(full_grad(grad_out), saved.child(0));
}

// ---- Linear chains ----

std::vector<ChainRole> chain_roles(const std::vector<int64_t>& sizes) {
  const size_t n = sizes.size() < 2 ? 0 : sizes.size() - 1;
  std::vector<ChainRole> roles(n, ChainRole::whole);
  size_t first = 0;  // the first layer of the first pair
  if (n % 2 == 1 && sizes[0] * sizes[1] < sizes[n - 1] * sizes[n]) first = 1;  // the first layer stays whole
  for (size_t i = first; i + 1 < n; i += 2) {
    roles[i] = ChainRole::column;
    roles[i + 1] = ChainRole::row;
  }
  return roles;
}

std::unique_ptr<Module> make_chain_linear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed,
                                          LinearOptions options, const TensorParallelGroup& g, ChainRole role) {
  if (role != ChainRole::whole)
    options.role = role == ChainRole::column ? sharding::LinearRole::column : sharding::LinearRole::row;
  if (g.size() == 1 || role == ChainRole::whole) return std::make_unique<Linear>(in, out, prefix, seed, options);
  if (role == ChainRole::column) return std::make_unique<ColumnParallelLinear>(in, out, prefix, seed, options, g);
  return std::make_unique<RowParallelLinear>(in, out, prefix, seed, options, g);
}

DropoutShard chain_dropout_shard(int64_t out, const TensorParallelGroup& g, ChainRole role) {
  if (role != ChainRole::column || g.size() == 1) return {};
  return DropoutShard{.rank = g.rank(), .ranks = g.size(), .features = out};
}

// ---- VocabParallelCrossEntropy ----

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
  if (group_.size() > 1) {
    const functional::ProfileScope scope("tp all_reduce");
    group_.comm->all_reduce(max.data<float>(), max.data<float>(), static_cast<size_t>(n), DType::f32,
                            comm::ReduceOp::max);
  }
  functional::vocab_parallel_ce_partial(z, st.labels, shard_.begin, max, probs, st.stats);
  if (group_.size() > 1) {
    const functional::ProfileScope scope("tp all_reduce");
    group_.comm->all_reduce(st.stats.data<double>(), st.stats.data<double>(), static_cast<size_t>(2 * n), DType::f64,
                            comm::ReduceOp::sum);
  }
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
