// The Parallelism adapters of DataParallel and FullyShardedDataParallel:
// thin methods over what each strategy already does, kept beside the
// protocol (parallelism.h) so the strategies' own files hold their
// mechanics only; and WrappedParallelism's reductions over an axis.
#include "meshtrain/parallel/parallelism.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/error.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"

namespace meshtrain::parallel {

ExactSquares Parallelism::grad_squares_exact(const std::function<bool(const nn::Parameter&)>&) {
  throw Unsupported("the deterministic mode's gradient norm", describe(),
                    "the mode's norm adds exact squares over data, fsdp and pipeline axes only");
}

namespace {

// The squares of every element of `params` whose model parameter is counted.
ExactSquares squares_of(const std::vector<nn::Parameter*>& params, const std::vector<nn::Parameter*>& models,
                        const std::function<bool(const nn::Parameter&)>& counted) {
  ExactSquares s;
  for (size_t i = 0; i < params.size(); ++i)
    if (counted(*models[i]) && params[i]->grad.defined())
      s.add(params[i]->grad.contiguous().data<float>(), params[i]->grad.numel());
  return s;
}

}  // namespace

// Collective over c: every rank's squares merged (integers: any order).
ExactSquares merged_over(comm::Communicator& c, const ExactSquares& mine) {
  if (c.size() == 1) return mine;
  const std::vector<uint64_t> words = mine.words();
  std::vector<uint64_t> all(words.size() * static_cast<size_t>(c.size()));
  c.all_gather(words.data(), all.data(), words.size(), DType::i64);
  ExactSquares out;
  for (int r = 0; r < c.size(); ++r)
    out.merge(ExactSquares::from_words(std::span<const uint64_t>(all).subspan(static_cast<size_t>(r) * words.size(),
                                                                              words.size())));
  return out;
}

// ---- DataParallel: replicated parameters, gradients all-reduced ----

std::string DataParallel::describe() const { return fmt::format("data parallel {}", comm_->size()); }

std::vector<nn::Parameter*> DataParallel::optimizer_parameters() { return params_; }

// After finish() every rank holds the same gradient bytes (an all-reduce
// gives every rank the same result on every engine), so every rank reaches
// the same answer without communicating, as grad_norm does; the trainer's
// step stays at one small reduction, as before the protocol existed.
bool DataParallel::grads_finite() { return optim::grads_finite(params_); }

// Every rank holds the whole (replicated) gradient: no communication, and
// the same sum in the same order as optim::clip_grad_norm.
double DataParallel::grad_norm() { return std::sqrt(optim::local_sq_norm(params_)); }

std::pair<double, double> DataParallel::grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) {
  std::vector<nn::Parameter*> a, b;
  for (nn::Parameter* p : params_) (first(*p) ? a : b).push_back(p);
  return {optim::local_sq_norm(a), optim::local_sq_norm(b)};
}

// Replicated: every rank holds every element; no communication.
ExactSquares DataParallel::grad_squares_exact(const std::function<bool(const nn::Parameter&)>& counted) {
  return squares_of(params_, params_, counted);
}

void DataParallel::after_step() {}  // the optimizer updated the model's own parameters

void DataParallel::zero_grad() {
  for (nn::Parameter* p : params_)
    if (p->grad.defined()) p->grad.fill(0.0);
}

void DataParallel::gather_full_parameters() {}  // every rank holds them
void DataParallel::reshard() {}

std::optional<double> DataParallel::hidden_fraction() const { return stats_.hidden_fraction; }

std::vector<ParamShard> DataParallel::parameter_shards() const {
  std::vector<ParamShard> out;
  for (const nn::Parameter* p : params_) out.push_back({p->name, p->placement, true});
  return out;
}

// ---- FullyShardedDataParallel: flat padded shards per unit ----

std::string FullyShardedDataParallel::describe() const {
  const int ranks = shard_->size() * (replicate_ != nullptr ? replicate_->size() : 1);
  const FullyShardedOptions& o = options_;
  std::string zeropp;
  std::vector<std::string> parts;
  if (o.quantize_weights)
    parts.push_back(fmt::format("qwZ int{} per {}", o.weight_quant.bits, o.weight_quant.block));
  if (o.quantize_gradients) parts.push_back(fmt::format("qgZ int{} per {}", o.grad_quant.bits, o.grad_quant.block));
  if (o.hierarchical_partition)
    parts.push_back(fmt::format("hpZ {} secondary", format_bytes(static_cast<uint64_t>(secondary_bytes()))));
  if (!parts.empty())
    zeropp = fmt::format(", ZeRO++ {} over {} node(s)", fmt::join(parts, " + "),
                         o.cross_node != nullptr ? o.cross_node->size() : 1);
  return fmt::format("data parallel {}, fsdp {} ({} sharded + {} replicated elements, {} units){}", ranks,
                     FsdpMode{options_.stage, replicate_ != nullptr}.name(), sharded_elements_,
                     replicated_elements_, unit_info_.size(), zeropp);
}

bool FullyShardedDataParallel::needs_loss_scaling() const {
  return options_.param_dtype == DType::f16 || reduce_dtype_ == DType::f16;
}

std::vector<ParamShard> FullyShardedDataParallel::parameter_shards() const {
  // The optimizer's parameters carry what this rank holds (flat ranges of
  // sharded parameters, whole replicated ones); a sharded parameter this
  // rank owns nothing of gets an empty flat range.
  std::unordered_map<std::string, const nn::Parameter*> held;
  for (const auto& sp : shard_params_) held[sp->name] = sp.get();
  std::unordered_map<const nn::Parameter*, bool> replicated;
  for (const nn::Parameter* p : replicated_) replicated[p] = true;
  std::vector<ParamShard> out;
  for (nn::Parameter* p : model_->parameters()) {
    if (replicated.count(p)) {
      out.push_back({p->name, p->placement, true});
      continue;
    }
    const auto it = held.find(p->name);
    out.push_back({p->name, it != held.end() ? it->second->placement : p->placement.flat(0, 0),
                   options_.stage == ZeroStage::no_shard});
  }
  return out;
}

bool FullyShardedDataParallel::grads_finite() {
  int32_t bad = optim::grads_finite(optimizer_parameters()) ? 0 : 1;
  shard_->all_reduce(&bad, &bad, 1, DType::i32, comm::ReduceOp::max);
  if (replicate_) replicate_->all_reduce(&bad, &bad, 1, DType::i32, comm::ReduceOp::max);
  return bad == 0;
}

double FullyShardedDataParallel::grad_norm() {
  std::vector<nn::Parameter*> sharded;
  for (auto& sp : shard_params_) sharded.push_back(sp.get());
  double sq = optim::local_sq_norm(sharded);
  if (options_.stage != ZeroStage::no_shard) shard_->all_reduce(&sq, &sq, 1, DType::f64, comm::ReduceOp::sum);
  return std::sqrt(sq + optim::local_sq_norm(replicated_));
}

std::pair<double, double> FullyShardedDataParallel::grad_sq_split(
    const std::function<bool(const nn::Parameter&)>& first) {
  std::vector<nn::Parameter*> sa, sb, ra, rb;
  for (size_t i = 0; i < shard_params_.size(); ++i) (first(*shard_param_models_[i]) ? sa : sb).push_back(shard_params_[i].get());
  for (nn::Parameter* p : replicated_) (first(*p) ? ra : rb).push_back(p);
  double sq[2] = {optim::local_sq_norm(sa), optim::local_sq_norm(sb)};
  if (options_.stage != ZeroStage::no_shard) shard_->all_reduce(sq, sq, 2, DType::f64, comm::ReduceOp::sum);
  return {sq[0] + optim::local_sq_norm(ra), sq[1] + optim::local_sq_norm(rb)};
}

ExactSquares FullyShardedDataParallel::grad_squares_exact(const std::function<bool(const nn::Parameter&)>& counted) {
  ExactSquares sharded;
  for (size_t i = 0; i < shard_params_.size(); ++i)
    if (counted(*shard_param_models_[i]))
      sharded.add(shard_params_[i]->grad.data<float>(), shard_params_[i]->grad.numel());
  if (options_.stage != ZeroStage::no_shard) sharded = merged_over(*shard_, sharded);
  if (replicate_) throw Unsupported("FullyShardedDataParallel::grad_squares_exact", "hybrid sharding", "");
  for (nn::Parameter* p : replicated_)  // every rank holds them whole: counted once
    if (counted(*p)) sharded.add(p->grad.data<float>(), p->grad.numel());
  return sharded;
}

// ---- WrappedParallelism: the reductions one more axis adds ----

bool WrappedParallelism::grads_finite_over(comm::Communicator& axis) {
  double bad = inner_->grads_finite() ? 0.0 : 1.0;
  axis.all_reduce(&bad, &bad, 1, DType::f64, comm::ReduceOp::sum);  // a count of ranks: every rank decides alike
  return bad == 0;
}

std::pair<double, double> WrappedParallelism::grad_sq_split_over(
    comm::Communicator& axis, const std::function<bool(const nn::Parameter&)>& first,
    const std::function<bool(const nn::Parameter&)>& distinct) {
  // The distinct parameters of each part add over the axis, the rest
  // counts once: each part's distinct ones, then each part whole.
  double summed[2] = {inner_->grad_sq_split([&](const nn::Parameter& p) { return first(p) && distinct(p); }).first,
                      inner_->grad_sq_split([&](const nn::Parameter& p) { return !first(p) && distinct(p); }).first};
  const auto [in_first, in_second] = inner_->grad_sq_split(first);
  const double local[2] = {summed[0], summed[1]};
  axis.all_reduce(summed, summed, 2, DType::f64, comm::ReduceOp::sum);
  return {summed[0] + (in_first - local[0]), summed[1] + (in_second - local[1])};
}

double WrappedParallelism::grad_norm_over(comm::Communicator& axis,
                                          const std::function<bool(const nn::Parameter&)>& distinct) {
  auto [summed, once] = inner_->grad_sq_split(distinct);
  axis.all_reduce(&summed, &summed, 1, DType::f64, comm::ReduceOp::sum);
  return std::sqrt(summed + once);
}

}  // namespace meshtrain::parallel
