#include "meshtrain/sharding/strategy.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::sharding {

std::string to_string(ParamKind kind) {
  switch (kind) {
    case ParamKind::linear_weight: return "linear_weight";
    case ParamKind::linear_bias: return "linear_bias";
    case ParamKind::embedding: return "embedding";
    case ParamKind::norm: return "norm";
    case ParamKind::attention_qkv_weight: return "attention_qkv_weight";
    case ParamKind::attention_qkv_bias: return "attention_qkv_bias";
    case ParamKind::attention_out_weight: return "attention_out_weight";
    case ParamKind::attention_out_bias: return "attention_out_bias";
    case ParamKind::other: return "other";
  }
  return "unknown";
}

std::string to_string(LinearRole role) {
  switch (role) {
    case LinearRole::none: return "none";
    case LinearRole::column: return "column";
    case LinearRole::row: return "row";
  }
  return "unknown";
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) s += ",";
  return s + ")";
}

int64_t ParamInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ParamInfo::to_string() const { return fmt::format("'{}' {}", name, shape_to_string(shape)); }

ParamInfo ParamInfo::layout() const {
  if (parts == 1) return *this;
  if (parts < 1 || shape.empty() || shape.size() > 2 || shape.back() % parts != 0)
    throw InvalidArgument("ParamInfo::layout",
                          fmt::format("parameter {}: {} fused parts", to_string(), parts),
                          "parts (>= 1) must divide the last dimension of a 1-D or 2-D parameter");
  ParamInfo v = *this;
  v.shape.back() /= parts;
  v.shape.insert(v.shape.end() - 1, parts);
  v.parts = 1;
  return v;
}

namespace internal {

void check_param(const char* op, const ParamInfo& p) {
  for (size_t d = 0; d < p.shape.size(); ++d)
    if (p.shape[d] < 0)
      throw InvalidArgument(op, fmt::format("parameter {}: dimension {} has negative size", p.to_string(), d),
                            "sizes must be >= 0");
  if (p.num_heads < 0)
    throw InvalidArgument(op, fmt::format("parameter {}: num_heads {} < 0", p.to_string(), p.num_heads),
                          "give the number of heads, or 0 when unknown");
}

void check_batch(const char* op, int ndim, int batch_dim) {
  if (ndim < 1 || batch_dim < 0 || batch_dim >= ndim)
    throw InvalidArgument(op, fmt::format("batch_dim {} is not a dimension of a {}-D tensor", batch_dim, ndim),
                          "pass 0 <= batch_dim < ndim");
}

void check_axis_name(const char* op, const std::string& axis) {
  if (axis.empty()) throw InvalidArgument(op, "the mesh axis name is empty", "name a mesh axis, e.g. \"data\"");
}

}  // namespace internal

// ---------------------------------------------------------------- Strategy

int64_t Strategy::axis_size(const std::string&) const { return 0; }

PartitionSpec Strategy::batch_spec(int ndim, int batch_dim) const {
  internal::check_batch("Strategy::batch_spec", ndim, batch_dim);
  return PartitionSpec::replicated(ndim);
}

std::string Strategy::explain(const ParamInfo& p) const {
  return fmt::format("{}: {} -> {}", name(), p.to_string(), param_spec(p).to_string());
}

// ---------------------------------------------------------------- DataParallel

DataParallelStrategy::DataParallelStrategy(std::string_view axis) : axis_(axis) {
  internal::check_axis_name("DataParallelStrategy", axis_);
}

std::string DataParallelStrategy::name() const { return fmt::format("DataParallel({})", axis_); }

PartitionSpec DataParallelStrategy::param_spec(const ParamInfo& p) const {
  internal::check_param("DataParallelStrategy::param_spec", p);
  return PartitionSpec::replicated(static_cast<int>(p.layout().shape.size()));
}

PartitionSpec DataParallelStrategy::batch_spec(int ndim, int batch_dim) const {
  internal::check_batch("DataParallelStrategy::batch_spec", ndim, batch_dim);
  std::vector<std::vector<std::string>> dims(ndim);
  dims[batch_dim] = {axis_};
  return PartitionSpec(std::move(dims));
}

std::string DataParallelStrategy::explain(const ParamInfo& p) const {
  internal::check_param("DataParallelStrategy::explain", p);
  return fmt::format("{}: {} replicated (data parallelism keeps a full copy on every replica)", name(),
                     p.to_string());
}

// ---------------------------------------------------------------- FSDP

FSDPStrategy::FSDPStrategy(std::string_view axis, int64_t axis_size, int64_t min_weight_size)
    : axis_(axis), axis_size_(axis_size), min_weight_size_(min_weight_size) {
  internal::check_axis_name("FSDPStrategy", axis_);
  if (axis_size_ < 1)
    throw InvalidArgument("FSDPStrategy", fmt::format("axis_size {} for axis '{}'", axis_size_, axis_),
                          "pass the number of ranks on the axis, >= 1");
  if (min_weight_size_ < 0)
    throw InvalidArgument("FSDPStrategy", fmt::format("min_weight_size {} < 0", min_weight_size_),
                          "pass 0 to shard every divisible parameter");
}

std::string FSDPStrategy::name() const {
  return fmt::format("FSDP({}={}, min_weight_size={})", axis_, axis_size_, min_weight_size_);
}

int64_t FSDPStrategy::axis_size(const std::string& axis) const { return axis == axis_ ? axis_size_ : 0; }

int FSDPStrategy::shard_dim(const ParamInfo& fused) const {
  internal::check_param("FSDPStrategy::param_spec", fused);
  const ParamInfo p = fused.layout();
  if (!large_enough(p.numel(), min_weight_size_) || p.shape.empty()) return -1;
  // The largest dimension divisible by the axis size; failing that, the
  // largest one, split unevenly (strict >: ties keep the first, outermost).
  int divisible = -1, largest = -1;
  for (size_t d = 0; d < p.shape.size(); ++d) {
    const int64_t n = p.shape[d];
    if (largest < 0 || n > p.shape[largest]) largest = static_cast<int>(d);
    if (n % axis_size_ == 0 && (divisible < 0 || n > p.shape[divisible])) divisible = static_cast<int>(d);
  }
  return divisible >= 0 ? divisible : largest;
}

PartitionSpec FSDPStrategy::param_spec(const ParamInfo& p) const {
  const int d = shard_dim(p);
  std::vector<std::vector<std::string>> dims(p.layout().shape.size());
  if (d >= 0) dims[d] = {axis_};
  return PartitionSpec(std::move(dims));
}

PartitionSpec FSDPStrategy::batch_spec(int ndim, int batch_dim) const {
  internal::check_batch("FSDPStrategy::batch_spec", ndim, batch_dim);
  std::vector<std::vector<std::string>> dims(ndim);
  dims[batch_dim] = {axis_};
  return PartitionSpec(std::move(dims));
}

std::string FSDPStrategy::explain(const ParamInfo& fused) const {
  const int d = shard_dim(fused);
  const ParamInfo p = fused.layout();
  const std::string head = fmt::format("{}: {}", name(), p.to_string());
  if (d >= 0 && p.shape[d] % axis_size_ == 0)
    return fmt::format("{} -> {}: dimension {} (size {}) is the largest divisible by {}", head,
                       param_spec(p).to_string(), d, p.shape[d], axis_size_);
  if (d >= 0)
    return fmt::format("{} -> {}: no dimension is divisible by {} size {}: dimension {} (size {}), the largest, is "
                       "split unevenly ({} per rank, the last ones fewer; the runtime pads)",
                       head, param_spec(p).to_string(), axis_, axis_size_, d, p.shape[d],
                       (p.shape[d] + axis_size_ - 1) / axis_size_);
  if (p.shape.empty()) return fmt::format("{} is a scalar: replicated", head);
  if (p.numel() == 0) return fmt::format("{} is empty: replicated", head);
  return fmt::format("{} has {} elements < min_weight_size {}: replicated", head, p.numel(), min_weight_size_);
}

// ---------------------------------------------------------------- TensorParallel

TensorParallelStrategy::TensorParallelStrategy(std::string_view axis, int64_t axis_size, bool uneven)
    : axis_(axis), axis_size_(axis_size), uneven_(uneven) {
  internal::check_axis_name("TensorParallelStrategy", axis_);
  if (axis_size_ < 1)
    throw InvalidArgument("TensorParallelStrategy", fmt::format("axis_size {} for axis '{}'", axis_size_, axis_),
                          "pass the number of ranks on the axis, >= 1");
}

std::string TensorParallelStrategy::name() const { return fmt::format("TensorParallel({}={})", axis_, axis_size_); }

int64_t TensorParallelStrategy::axis_size(const std::string& axis) const { return axis == axis_ ? axis_size_ : 0; }

PartitionSpec TensorParallelStrategy::column_weight_spec() const { return PartitionSpec({{}, {axis_}}); }
PartitionSpec TensorParallelStrategy::row_weight_spec() const { return PartitionSpec({{axis_}, {}}); }
PartitionSpec TensorParallelStrategy::column_bias_spec() const { return PartitionSpec({{axis_}}); }

LinearRole TensorParallelStrategy::effective_role(const ParamInfo& p) const {
  const char* op = "TensorParallelStrategy::param_spec";
  auto implied = [&](LinearRole r) {
    if (p.role != LinearRole::none && p.role != r)
      throw InvalidArgument(op,
                            fmt::format("parameter {}: kind {} is {}-parallel but role says {}", p.to_string(),
                                        to_string(p.kind), to_string(r), to_string(p.role)),
                            "leave role as none for attention parameters, or use kind linear_weight/linear_bias");
    return r;
  };
  switch (p.kind) {
    case ParamKind::linear_weight:
    case ParamKind::linear_bias: return p.role;
    case ParamKind::attention_qkv_weight:
    case ParamKind::attention_qkv_bias: return implied(LinearRole::column);
    case ParamKind::attention_out_weight:
    case ParamKind::attention_out_bias: return implied(LinearRole::row);
    case ParamKind::embedding:
    case ParamKind::norm:
    case ParamKind::other:
      if (p.role != LinearRole::none)
        throw InvalidArgument(op,
                              fmt::format("parameter {}: role {} given for kind {}", p.to_string(),
                                          to_string(p.role), to_string(p.kind)),
                              "a role only applies to linear and attention parameters");
      return LinearRole::none;
  }
  return LinearRole::none;
}

int TensorParallelStrategy::split_dim(const ParamInfo& fused) const {
  const char* op = "TensorParallelStrategy::param_spec";
  internal::check_param(op, fused);
  const ParamInfo p = fused.layout();
  const LinearRole role = effective_role(p);
  const bool is_bias = p.kind == ParamKind::linear_bias || p.kind == ParamKind::attention_qkv_bias ||
                       p.kind == ParamKind::attention_out_bias;
  const bool is_weight = p.kind == ParamKind::linear_weight || p.kind == ParamKind::attention_qkv_weight ||
                         p.kind == ParamKind::attention_out_weight || p.kind == ParamKind::embedding;
  // A fused q|k|v parameter is laid out with one more dim (its parts).
  const size_t want = (is_bias ? 1 : 2) + (fused.parts > 1 ? 1 : 0);
  const bool fused_view = p.shape.size() == want + 1 && (p.kind == ParamKind::attention_qkv_weight ||
                                                         p.kind == ParamKind::attention_qkv_bias);
  if ((is_bias || is_weight) && p.shape.size() != want && !fused_view)
    throw InvalidArgument(op,
                          fmt::format("parameter {}: a {} must be {}-D, got {}-D", p.to_string(), to_string(p.kind),
                                      want, p.shape.size()),
                          is_bias ? "biases are (out_features,)"
                                  : "weights are (in_features, out_features); embeddings (vocab, hidden)");
  int dim = -1;
  std::string what;
  const int last = static_cast<int>(p.shape.size()) - 1;
  if (p.kind == ParamKind::embedding) {
    dim = 0, what = "vocabulary";
  } else if (is_weight && role == LinearRole::column) {
    dim = last, what = "output features";
  } else if (is_weight && role == LinearRole::row) {
    dim = 0, what = "input features";
  } else if (is_bias && role == LinearRole::column) {
    dim = last, what = "output features";
  }
  if (dim < 0) return -1;
  const int64_t n = p.shape[dim];
  if (n % axis_size_ != 0 && !uneven_) {
    const int64_t padded = (n + axis_size_ - 1) / axis_size_ * axis_size_;
    throw InvalidArgument(op,
                          fmt::format("parameter {}: dimension {} ({}, size {}) is not divisible by {} size {}",
                                      p.to_string(), dim, what, n, axis_, axis_size_),
                          fmt::format("pad the {} to {} or pick a {} size that divides {}", what, padded, axis_, n));
  }
  if (p.num_heads > 0 && p.num_heads % axis_size_ != 0)
    throw InvalidArgument(op,
                          fmt::format("parameter {}: {} heads cannot be split evenly over {} size {}", p.to_string(),
                                      p.num_heads, axis_, axis_size_),
                          fmt::format("pick a {} size that divides the number of heads", axis_));
  return dim;
}

Box TensorParallelStrategy::block(const ParamInfo& p, int64_t rank) const {
  if (rank < 0 || rank >= axis_size_)
    throw InvalidArgument("TensorParallelStrategy::block", fmt::format("rank {} of {} ranks", rank, axis_size_),
                          "pass 0 <= rank < the axis size");
  const int d = split_dim(p);
  const std::vector<int64_t> shape = p.layout().shape;
  Box b{std::vector<int64_t>(shape.size(), 0), shape};
  if (d >= 0) {
    const auto [begin, end] = chunk_range(shape[d], rank, axis_size_);
    b.offsets[d] = begin;
    b.sizes[d] = end - begin;
  }
  return b;
}

PartitionSpec TensorParallelStrategy::param_spec(const ParamInfo& p) const {
  const int d = split_dim(p);
  std::vector<std::vector<std::string>> dims(p.layout().shape.size());
  if (d >= 0) dims[d] = {axis_};
  return PartitionSpec(std::move(dims));
}

std::string TensorParallelStrategy::explain(const ParamInfo& p) const {
  const int d = split_dim(p);
  const std::string head = fmt::format("{}: {} ({}", name(), p.to_string(), to_string(p.kind));
  const LinearRole role = effective_role(p);
  const std::string role_text = role == LinearRole::none ? "" : ", " + to_string(role) + "-parallel";
  if (d < 0) return fmt::format("{}{}) replicated", head, role_text);
  const std::string view =
      p.parts > 1 ? fmt::format(" of its view {} ({} fused parts)", shape_to_string(p.layout().shape), p.parts) : "";
  return fmt::format("{}{}) -> {}: dimension {}{} split over {}", head, role_text, param_spec(p).to_string(), d, view,
                     axis_);
}

}  // namespace meshtrain::sharding
