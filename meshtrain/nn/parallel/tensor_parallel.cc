#include "meshtrain/nn/parallel/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <unordered_set>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/deterministic.h"
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
                          fmt::format("with c = ceil({} / k) features per rank, the k ranks need {} > (k - 1) c: use "
                                      "a tensor axis that divides {}, or fewer ranks",
                                      total, total, total));
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

// The ranks' time steps side by side, (B, T, ...) <-> (k, B, T/k, ...):
// block-major order, where block j holds rank j's time steps of every
// sample (the order all_gather fills and reduce_scatter reads). A copy
// (B = 1: the same memory, a view); callers profile it with their
// collective. to_blocks' copy is charged as its input is (a clone);
// from_blocks' to `tracker` as activations.
Tensor to_blocks(const Tensor& natural, int64_t k) {
  const int64_t b = natural.size(0), rest = natural.numel() / (b * k);
  std::vector<int64_t> shape = natural.shape();
  shape[1] /= k;
  shape.insert(shape.begin(), k);
  if (b == 1) return natural.view(shape);
  return natural.view({b, k, rest}).transpose(0, 1).contiguous().view(shape);
}
Tensor from_blocks(const Tensor& blocks, MemoryTracker* tracker) {
  const int64_t k = blocks.size(0), b = blocks.size(1), rest = blocks.numel() / (k * b);
  std::vector<int64_t> shape(blocks.shape().begin() + 1, blocks.shape().end());
  shape[1] *= k;
  if (b == 1) return blocks.view(shape);
  Tensor out = Tensor::empty(shape, DType::f32, Device{}, tracker, MemoryCategory::activations);
  out.view({b, k, rest}).copy_from(blocks.view({k, b, rest}).transpose(0, 1));
  return out;
}
// Block j of a block-major tensor, as (B, T/k, ...).
Tensor block_of(const Tensor& blocks, int64_t j) {
  return blocks.narrow(0, j, 1).view({blocks.shape().begin() + 1, blocks.shape().end()});
}

// The overlap rings' point-to-point tag ("tp"). One tag suffices: ring
// steps are waited in order, and nothing else sends point to point on the
// tensor communicator.
constexpr int kRingTag = 0x7470;

// All-gather around the ring, own block first, for a GEMM over the
// block-major buffer `blocks` (k, ...) whose block r (this rank's) is
// filled: step s multiplies block (r + s) mod k while that block goes to
// rank r - 1 and block (r + s + 1) mod k arrives from rank r + 1. Waits
// (the exposed communication) count as `scope` in the op profile.
class GatherRing {
 public:
  GatherRing(const TensorParallelGroup& g, const Tensor& blocks, const char* scope)
      : g_(g), blocks_(blocks.view({g.size(), -1})), scope_(scope) {}
  RowBlocks row_blocks() {
    RowBlocks b;
    for (int s = 0; s < g_.size(); ++s) b.order.push_back((g_.rank() + s) % g_.size());
    b.ready = [this](int64_t j) { step(j); };
    return b;
  }
  void finish() {
    const functional::ProfileScope profile(scope_);
    pending_.wait();
  }

 private:
  void step(int64_t j) {
    const functional::ProfileScope profile(scope_);
    const int k = g_.size(), r = g_.rank();
    pending_.wait();  // brought block j (none before the first step)
    const int64_t next = (j + 1) % k;
    if (next == r) return;  // the last step: every block is here
    const Tensor out = blocks_.select(0, j), in = blocks_.select(0, next);
    const auto n = static_cast<size_t>(out.numel());
    pending_ = g_.comm->batch_isend_irecv({comm::P2POp::isend(out.data_ptr(), n, DType::f32, (r + k - 1) % k, kRingTag),
                                           comm::P2POp::irecv(in.data_ptr(), n, DType::f32, (r + 1) % k, kRingTag)});
  }
  const TensorParallelGroup& g_;
  Tensor blocks_;  // (k, block elements)
  const char* scope_;
  comm::Work pending_;
};

// Reduce-scatter around the ring, fed block by block by a GEMM whose
// output is block-major (k, ...) partial sums: step s computes block
// (r - 1 - s) mod k, adds the running sum of that block received from rank
// r - 1 and sends it on to rank r + 1; the last step's block is this
// rank's, then the sum over every rank (for k = 2 the same sum, bit for
// bit, as the engine's reduce_scatter: a + b = b + a). defer_last: its
// final receive is waited and added by finish() instead, so that work
// between (a backward's weight gradient) hides it.
class ReduceScatterRing {
 public:
  ReduceScatterRing(const TensorParallelGroup& g, int64_t block_elements, MemoryTracker* tracker, const char* scope)
      : g_(g), scope_(scope) {
    if (g.size() > 1)
      acc_ = Tensor::empty({block_elements}, DType::f32, Device{}, tracker, MemoryCategory::activations);
  }
  RowBlocks row_blocks(bool defer_last) {
    defer_last_ = defer_last;
    RowBlocks b;
    const int k = g_.size();
    for (int s = 0; s < k; ++s) b.order.push_back(((g_.rank() - 1 - s) % k + k) % k);
    b.done = [this](int64_t, const Tensor& rows) { step(rows); };
    return b;
  }
  void finish() {
    if (!last_.defined()) return;
    const functional::ProfileScope profile(scope_);
    pending_.wait();
    accumulate(acc_, last_.view({-1}));
    last_ = Tensor();
  }

 private:
  void step(const Tensor& rows) {
    const int k = g_.size(), r = g_.rank();
    const int s = steps_++;
    if (s == k - 1 && defer_last_) {
      last_ = rows;
      return;
    }
    const functional::ProfileScope profile(scope_);
    if (s > 0) {
      pending_.wait();
      accumulate(acc_, rows.view({-1}));
    }
    if (s == k - 1) return;
    const auto n = static_cast<size_t>(rows.numel());
    pending_ = g_.comm->batch_isend_irecv({comm::P2POp::isend(rows.data_ptr(), n, DType::f32, (r + 1) % k, kRingTag),
                                           comm::P2POp::irecv(acc_.data_ptr(), n, DType::f32, (r + k - 1) % k, kRingTag)});
  }
  const TensorParallelGroup& g_;
  const char* scope_;
  Tensor acc_;   // the running sum from rank r - 1
  Tensor last_;  // defer_last: this rank's block, waiting for its last receive
  bool defer_last_ = false;
  int steps_ = 0;
  comm::Work pending_;
};

// Without sequence parallelism: all-reduces each block of rows (async) as
// soon as the GEMM finished it, so the next block's GEMM, or the weight
// gradient after a backward's dX, hides it.
class AllReduceBlocks {
 public:
  explicit AllReduceBlocks(const TensorParallelGroup& g) : g_(g) {}
  RowBlocks row_blocks(int64_t count) {
    RowBlocks b;
    for (int64_t j = 0; j < count; ++j) b.order.push_back(j);
    b.done = [this](int64_t, const Tensor& rows) {
      const functional::ProfileScope profile("tp all_reduce");
      pending_.push_back(g_.comm->all_reduce_async(rows.data_ptr(), rows.data_ptr(), static_cast<size_t>(rows.numel()),
                                                   DType::f32, comm::ReduceOp::sum));
    };
    return b;
  }
  void finish() {
    const functional::ProfileScope profile("tp all_reduce");
    for (comm::Work& w : pending_) w.wait();
    pending_.clear();
  }

 private:
  const TensorParallelGroup& g_;
  std::vector<comm::Work> pending_;
};

// Row blocks of an all-reduced GEMM: 2 when the rows split evenly.
int64_t all_reduce_blocks(const Tensor& x) { return x.numel() / x.size(-1) % 2 == 0 ? 2 : 1; }

}  // namespace

Tensor gather_sequence(const Tensor& local, const TensorParallelGroup& g, MemoryTracker* tracker) {
  if (g.size() == 1) return local;
  const char* op = "gather_sequence";
  const Tensor x = internal::f32_contiguous(local, op, "input");
  if (x.dim() < 2)
    throw InvalidArgument(op, fmt::format("input {} has no sequence dim", shape_to_string(x.shape())),
                          "pass (batch, time, ...)");
  // The ranks' blocks arrive one after another: (k, B, T/k, ...).
  std::vector<int64_t> blocks = x.shape();
  blocks.insert(blocks.begin(), g.size());
  Tensor buf = Tensor::empty(blocks, DType::f32, Device{}, tracker, MemoryCategory::activations);
  {
    const functional::ProfileScope scope("tp all_gather");
    g.comm->all_gather(x.data<float>(), buf.data<float>(), static_cast<size_t>(x.numel()), DType::f32);
  }
  const functional::ProfileScope scope("tp reorder");
  return from_blocks(buf, tracker);
}

Tensor reduce_scatter_sequence(const Tensor& full, const TensorParallelGroup& g, MemoryTracker* tracker) {
  if (g.size() == 1) return full;
  const char* op = "reduce_scatter_sequence";
  const Tensor x = internal::f32_contiguous(full, op, "input");
  std::vector<int64_t> local = x.shape();
  local[1] = local_steps(x, g, op);
  // Block r of the send buffer is rank r's time steps of every sample.
  Tensor send;
  {
    const functional::ProfileScope scope("tp reorder");
    send = to_blocks(x, g.size());
  }
  Tensor out = Tensor::empty(local, DType::f32, Device{}, tracker, MemoryCategory::activations);
  const functional::ProfileScope scope("tp reduce_scatter");
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

void sum_grads(const std::vector<Parameter*>& params, comm::Communicator& comm, const char* profile_name) {
  if (comm.size() == 1) return;
  size_t n = 0;
  for (const Parameter* p : params) n += static_cast<size_t>(p->grad.numel());
  if (n == 0) return;
  // Packed in f32 (a strategy may keep gradients in a half-precision
  // reduce dtype): one all-reduce for every such gradient.
  std::vector<float> buf(n);
  size_t at = 0;
  for (const Parameter* p : params) {
    const Tensor g_ = p->grad.to(DType::f32).contiguous();
    std::copy_n(g_.data<float>(), g_.numel(), buf.data() + at);
    at += static_cast<size_t>(g_.numel());
  }
  {
    const functional::ProfileScope scope(profile_name);  // once per step, not per layer
    comm.all_reduce(buf.data(), buf.data(), n, DType::f32, comm::ReduceOp::sum);
  }
  at = 0;
  for (Parameter* p : params) {
    p->grad.copy_from(Tensor::from_blob(buf.data() + at, p->grad.shape(), DType::f32));
    at += static_cast<size_t>(p->grad.numel());
  }
}

void reduce_sequence_parallel_grads(const std::vector<Parameter*>& params, const std::vector<std::string>& names,
                                    const TensorParallelGroup& g) {
  if (g.size() == 1) return;
  sum_grads(named(params, names), *g.comm, "tp grad all_reduce");
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
  if (group_.overlaps() && group_.splits_sequence()) return overlapped_forward(x, saved);
  return local_.forward(group_.splits_sequence() ? gather_sequence(x, group_, tracker_) : x, saved.child(0));
}

// The gathered input in block-major order, (k, B, T/k, in), filled by the
// ring while the GEMM multiplies block by block; the output reordered.
Tensor ColumnParallelLinear::overlapped_forward(const Tensor& x, Saved& saved) {
  const Tensor xl = internal::f32_contiguous(x, "ColumnParallelLinear::forward", "input");
  if (xl.dim() < 2)
    throw InvalidArgument("ColumnParallelLinear::forward",
                          fmt::format("'{}': input {} has no sequence dim", name_, shape_to_string(xl.shape())),
                          "pass (batch, time, ...)");
  std::vector<int64_t> shape = xl.shape();
  shape.insert(shape.begin(), group_.size());
  const Tensor xg = Tensor::empty(shape, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  block_of(xg, group_.rank()).copy_from(xl);
  GatherRing ring(group_, xg, "tp all_gather");
  local_.set_next_forward_blocks(ring.row_blocks());
  const Tensor y = local_.forward(xg, saved.child(0));
  ring.finish();
  const functional::ProfileScope profile("tp reorder");
  return from_blocks(y, tracker_);
}

// dY reordered to the forward's block-major rows; dX's blocks summed over
// the ring, this rank's last.
Tensor ColumnParallelLinear::overlapped_backward(const Tensor& grad_out, Saved& saved, bool split) {
  const Tensor dy = internal::f32_contiguous(grad_out, "ColumnParallelLinear::backward", "grad_out");
  if (!group_.splits_sequence()) {  // dX's all-reduce behind the weight gradient (split: its second block)
    AllReduceBlocks reduce(group_);
    local_.set_next_backward_blocks(reduce.row_blocks(split ? all_reduce_blocks(dy) : 1));
    const Tensor dx = split ? local_.backward_input(dy, saved.child(0)) : local_.backward(dy, saved.child(0));
    reduce.finish();
    return dx;
  }
  (void)local_steps(dy, group_, "ColumnParallelLinear::backward");  // T divisible by k
  Tensor dyb;
  {
    const functional::ProfileScope profile("tp reorder");
    dyb = to_blocks(dy, group_.size());
  }
  ReduceScatterRing ring(group_, dyb.numel() / dyb.size(-1) / group_.size() * local_.in_features(), tracker_,
                         "tp reduce_scatter");
  local_.set_next_backward_blocks(ring.row_blocks(/*defer_last=*/!split));
  const Tensor dx = split ? local_.backward_input(dyb, saved.child(0)) : local_.backward(dyb, saved.child(0));
  ring.finish();
  return block_of(dx, group_.rank());
}

Tensor ColumnParallelLinear::input_grad(const Tensor& dx) {
  if (group_.splits_sequence()) return reduce_scatter_sequence(dx, group_);
  all_reduce_sum(group_, dx);
  return dx;
}

Tensor ColumnParallelLinear::do_backward_input(const Tensor& grad_out, Saved& saved) {
  if (group_.overlaps() && local_.needs_input_grad()) return overlapped_backward(grad_out, saved, true);
  return input_grad(local_.backward_input(grad_out, saved.child(0)));
}

void ColumnParallelLinear::do_backward_weight(Saved& saved) { local_.backward_weight(saved.child(0)); }

Tensor ColumnParallelLinear::do_backward(const Tensor& grad_out, Saved& saved) {
  if (group_.overlaps() && local_.needs_input_grad()) return overlapped_backward(grad_out, saved, false);
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
  Tensor y;
  if (group_.overlaps()) {
    y = overlapped_forward(x, saved);
  } else {
    y = local_.forward(x, saved.child(0));  // this rank's partial product
    if (group_.splits_sequence())
      y = reduce_scatter_sequence(y, group_, tracker_);
    else
      all_reduce_sum(group_, y);
  }
  if (has_bias_) {
    functional::bias_add(internal::param_value(bias_.value, DType::f32, "RowParallelLinear::forward", bias_.name),
                         y.view({y.numel() / y.size(-1), y.size(-1)}));
    round_to(y, compute_dtype_);
  }
  return y;
}

void RowParallelLinear::bias_grad(const Tensor& dy, const BatchContext& batch) {
  if (!has_bias_) return;
  internal::check_param_grad(bias_.grad, "RowParallelLinear::backward", bias_.name);
  const Tensor rows = dy.contiguous().view({dy.numel() / dy.size(-1), dy.size(-1)});
  add_gradient(bias_, 0, call_node(batch, dy.dim() > 1 ? dy.size(0) : 1),
               [&](const Tensor& g) { functional::bias_backward(rows, g); });
  notify_grad_ready(bias_);
}

Tensor RowParallelLinear::full_grad(const Tensor& dy) {
  return group_.splits_sequence() ? gather_sequence(dy, group_) : dy;
}

// The input reordered to block-major rows; the partial products' blocks
// summed over the ring, this rank's last: its time steps of the sum.
Tensor RowParallelLinear::overlapped_forward(const Tensor& x, Saved& saved) {
  const Tensor xf = internal::f32_contiguous(x, "RowParallelLinear::forward", "input");
  if (!group_.splits_sequence()) {  // the first half's all-reduce behind the second half's GEMM
    AllReduceBlocks reduce(group_);
    local_.set_next_forward_blocks(reduce.row_blocks(all_reduce_blocks(xf)));
    const Tensor y = local_.forward(xf, saved.child(0));
    reduce.finish();
    return y;
  }
  (void)local_steps(xf, group_, "RowParallelLinear::forward");  // T divisible by k
  Tensor xb;
  {
    const functional::ProfileScope profile("tp reorder");
    xb = to_blocks(xf, group_.size());
  }
  ReduceScatterRing ring(group_, xb.numel() / xb.size(-1) / group_.size() * local_.out_features(), tracker_,
                         "tp reduce_scatter");
  local_.set_next_forward_blocks(ring.row_blocks(/*defer_last=*/false));
  const Tensor y = local_.forward(xb, saved.child(0));
  ring.finish();
  return block_of(y, group_.rank());
}

// dy gathered around the ring into the forward's block-major rows while dX
// multiplies block by block; dX reordered.
Tensor RowParallelLinear::overlapped_backward(const Tensor& grad_out, Saved& saved, bool split) {
  const Tensor dy = internal::f32_contiguous(grad_out, "RowParallelLinear::backward", "grad_out");
  std::vector<int64_t> shape = dy.shape();
  shape.insert(shape.begin(), group_.size());
  const Tensor dyg = Tensor::empty(shape, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  block_of(dyg, group_.rank()).copy_from(dy);
  GatherRing ring(group_, dyg, "tp all_gather");
  local_.set_next_backward_blocks(ring.row_blocks());
  const Tensor dx = split ? local_.backward_input(dyg, saved.child(0)) : local_.backward(dyg, saved.child(0));
  ring.finish();
  if (!dx.defined()) return dx;
  const functional::ProfileScope profile("tp reorder");
  return from_blocks(dx, tracker_);
}

Tensor RowParallelLinear::do_backward_input(const Tensor& grad_out, Saved& saved) {
  saved.state<State>().dy = grad_out;
  if (group_.overlaps() && group_.splits_sequence()) return overlapped_backward(grad_out, saved, true);
  return local_.backward_input(full_grad(grad_out), saved.child(0));
}

void RowParallelLinear::do_backward_weight(Saved& saved) {
  State& st = saved.state<State>();
  bias_grad(st.dy, saved.batch);
  st.dy = Tensor();
  local_.backward_weight(saved.child(0));
}

Tensor RowParallelLinear::do_backward(const Tensor& grad_out, Saved& saved) {
  bias_grad(grad_out, saved.batch);
  if (group_.overlaps() && group_.splits_sequence()) return overlapped_backward(grad_out, saved, false);
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
