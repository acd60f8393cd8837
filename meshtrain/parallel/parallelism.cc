// The Parallelism adapters of DataParallel and FullyShardedDataParallel:
// thin methods over what each strategy already does, kept beside the
// protocol (parallelism.h) so the strategies' own files hold their
// mechanics only.
#include "meshtrain/parallel/parallelism.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "meshtrain/core/error.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"

namespace meshtrain::parallel {

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
  for (const nn::Parameter* p : params_) out.push_back({p->name, p->value.shape(), 0, p->value.numel(), true});
  return out;
}

// ---- FullyShardedDataParallel: flat padded shards per unit ----

std::string FullyShardedDataParallel::describe() const {
  const int ranks = shard_->size() * (replicate_ != nullptr ? replicate_->size() : 1);
  return fmt::format("data parallel {}, fsdp {} ({} sharded + {} replicated elements, {} units)", ranks,
                     FsdpMode{options_.stage, replicate_ != nullptr}.name(), sharded_elements_,
                     replicated_elements_, unit_info_.size());
}

bool FullyShardedDataParallel::needs_loss_scaling() const {
  return options_.param_dtype == DType::f16 || reduce_dtype_ == DType::f16;
}

std::vector<ParamShard> FullyShardedDataParallel::parameter_shards() const {
  // A unit's sharded parameters are concatenated in flat order; this rank
  // owns flat [rank * S, (rank + 1) * S) of the padded vector (see the
  // header of fully_sharded.h).
  std::unordered_map<std::string, const UnitInfo*> unit_of;
  for (const UnitInfo& u : unit_info_)
    for (const std::string& name : u.sharded) unit_of[name] = &u;
  std::vector<ParamShard> out;
  std::unordered_map<const UnitInfo*, int64_t> next;  // running flat offset per unit
  for (nn::Parameter* p : model_->parameters()) {
    const std::vector<int64_t>& shape = p->info.shape;
    const int64_t n = p->info.numel();
    const auto it = unit_of.find(p->name);
    if (it == unit_of.end()) {
      out.push_back({p->name, shape, 0, n, true});
      continue;
    }
    const UnitInfo& u = *it->second;
    const int64_t start = next[&u];  // parameters() is definition order, the unit's flat order
    next[&u] = start + n;
    const int64_t lo = static_cast<int64_t>(rank_) * u.shard, hi = lo + u.shard;
    const int64_t a = std::max(start, lo), b = std::min(start + n, hi);
    out.push_back({p->name, shape, a < b ? a - start : 0, a < b ? b - a : 0, options_.stage == ZeroStage::no_shard});
  }
  return out;
}

}  // namespace meshtrain::parallel
