#include "meshtrain/parallel/fully_sharded.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/nn/deterministic.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/parallel/zeropp.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::parallel {

namespace {

constexpr const char* kOp = "FullyShardedDataParallel";

bool is_float_dtype(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// The module path of a unit: the longest dotted prefix its parameters'
// names share ("layers.0" for "layers.0.weight" and "layers.0.bias").
std::string unit_name(const std::vector<nn::Parameter*>& params) {
  if (params.empty()) return "";
  std::string prefix = params[0]->name;
  const size_t last = prefix.rfind('.');
  prefix = last == std::string::npos ? std::string() : prefix.substr(0, last);
  for (const nn::Parameter* p : params) {
    while (!prefix.empty() && !(p->name.starts_with(prefix) && p->name.size() > prefix.size() &&
                                p->name[prefix.size()] == '.')) {
      const size_t dot = prefix.rfind('.');
      prefix = dot == std::string::npos ? std::string() : prefix.substr(0, dot);
    }
  }
  return prefix;
}

bool is_listed(const std::vector<nn::Module*>& listed, const nn::Module* m) {
  return std::find(listed.begin(), listed.end(), m) != listed.end();
}

// The listed modules below m (not m itself), as units, outermost first.
void collect_listed_below(nn::Module& m, const std::vector<nn::Module*>& listed, UnitList& out);

// A listed module's unit: its parameters except those of listed modules
// inside it, which are units of their own (FSDP2's fully_shard on blocks,
// then on the root: the root keeps what is left, e.g. embeddings, the final
// norm and a tied head). Placed before its nested units (forward order).
void add_listed_unit(nn::Module& m, const std::vector<nn::Module*>& listed, UnitList& out) {
  const size_t at = out.size();
  out.push_back({&m, {}});
  collect_listed_below(m, listed, out);
  std::vector<const nn::Parameter*> nested;
  for (size_t i = at + 1; i < out.size(); ++i) nested.insert(nested.end(), out[i].second.begin(), out[i].second.end());
  for (nn::Parameter* p : m.parameters())
    if (std::find(nested.begin(), nested.end(), p) == nested.end()) out[at].second.push_back(p);
}

void collect_listed_below(nn::Module& m, const std::vector<nn::Module*>& listed, UnitList& out) {
  for (nn::Module* c : m.children()) {
    if (is_listed(listed, c))
      add_listed_unit(*c, listed, out);
    else
      collect_listed_below(*c, listed, out);
  }
}

void collect_units(nn::Module& m, const std::vector<nn::Module*>& listed, UnitList& out) {
  if (is_listed(listed, &m)) {
    add_listed_unit(m, listed, out);
    return;
  }
  if (m.owns_parameters()) {
    out.push_back({&m, m.parameters()});
    return;
  }
  for (nn::Module* c : m.children()) collect_units(*c, listed, out);
}

}  // namespace

UnitList fsdp_units(nn::Module& model, const std::vector<nn::Module*>& unit_modules) {
  UnitList out;
  collect_units(model, unit_modules, out);
  return out;
}

std::vector<layout::ModelParameter> model_parameters(nn::Module& model, const std::vector<nn::Module*>& unit_modules,
                                                     int stage) {
  std::unordered_map<const nn::Parameter*, int> unit_of;
  const UnitList units = fsdp_units(model, unit_modules);
  for (size_t u = 0; u < units.size(); ++u)
    for (const nn::Parameter* p : units[u].second) unit_of[p] = static_cast<int>(u);
  std::vector<layout::ModelParameter> out;
  for (const nn::Parameter* p : model.parameters()) out.push_back({p->info, unit_of.at(p), stage});
  return out;
}

// ---- state ----

struct FullyShardedDataParallel::Unit {
  std::string name;
  int use_position = -1;                // in use_order_ (-1: not used in a forward yet)
  std::vector<nn::Parameter*> params;   // sharded, flat order
  std::vector<int64_t> offsets;         // flat offset of each
  int64_t numel = 0, padded = 0, shard = 0;
  int64_t lo = 0;                       // first owned flat element
  // Persistent.
  Tensor full_param;   // stage 0-2: param_dtype (padded)
  Tensor shard_param;  // stage 3: param_dtype (shard)
  Tensor master;       // f32 (shard); a view of the above when param_dtype is f32
  Tensor full_grad;    // stage 0-1: reduce_dtype (padded)
  Tensor shard_grad;   // stage 2-3: reduce_dtype (shard)
  bool has_grad = false;  // shard_grad holds a contribution since zero_grad
  // Transient.
  Tensor gathered;     // stage 3: param_dtype (padded), being gathered or in use
  comm::Work gather;   // in flight when gathering
  bool gathering = false;
  std::vector<uint8_t> wire_mine, wire_all;  // qwZ: this shard's message, every rank's
  bool from_secondary = false;  // hpZ: the gather in flight is node-local, from `secondary`
  Tensor secondary;    // hpZ: this rank's node-local part of the last full gather (until after_step)
  std::vector<nn::Parameter*> shards;  // this rank's parts of the unit's parameters (shard_params_)
  Tensor work_value;   // param_dtype, or f32 when inspecting (padded): what p.value views, when not persistent
  Tensor work_grad;    // f32 (padded): what p.grad views during backward
  bool materialized = false;  // p.value is valid
  bool inspecting = false;    // values are master copies from gather_full_parameters
  bool reduced = false;       // stage 0-1: full reduction launched this window
};

struct FullyShardedDataParallel::Reduction {
  Unit* unit = nullptr;
  Tensor buffer;       // stage 2-3: the padded gradient being reduce-scattered in place (qgZ: the shard's result)
  comm::Work work;
  std::unique_ptr<QuantizedReduceScatter> qgz;  // qgZ: the two all-to-alls, instead of `work`
  bool done() { return qgz ? qgz->test() : work.is_completed(); }
};

// Elements [from, from + count) of the unit's flat initial vector (zero
// padding past its N elements) into out, from each parameter's value or,
// when deferred, its init.
void FullyShardedDataParallel::fill_flat(const Unit& u, int64_t from, int64_t count, float* out) {
  std::fill(out, out + count, 0.0f);
  for (size_t i = 0; i < u.params.size(); ++i) {
    const nn::Parameter& p = *u.params[i];
    const int64_t o = u.offsets[i], a = std::max(o, from), b = std::min(o + p.info.numel(), from + count);
    if (a >= b) continue;
    if (p.value.defined())
      std::memcpy(out + (a - from), p.value.data<float>() + (a - o), static_cast<size_t>(b - a) * sizeof(float));
    else
      p.init(a - o, b - a, out + (a - from));
  }
}

// ---- construction ----

FullyShardedDataParallel::FullyShardedDataParallel(nn::Module& model, comm::Communicator& shard_comm,
                                                   comm::Communicator* replicate_comm, FullyShardedOptions options)
    : model_(&model), shard_(&shard_comm), replicate_(replicate_comm), options_(options),
      reduce_dtype_(options.reduce_dtype.value_or(options.param_dtype)) {
  if (!is_float_dtype(options_.param_dtype) || !is_float_dtype(reduce_dtype_))
    throw InvalidArgument(kOp,
                          fmt::format("param_dtype {} / reduce_dtype {}", dtype_name(options_.param_dtype),
                                      dtype_name(reduce_dtype_)),
                          "use f32, bf16 or f16");
  if (options_.min_weight_size < 0)
    throw InvalidArgument(kOp, fmt::format("min_weight_size {}", options_.min_weight_size), "need >= 0");
  if (options_.max_reductions_in_flight < 1)
    throw InvalidArgument(kOp, fmt::format("max_reductions_in_flight {}", options_.max_reductions_in_flight),
                          "need >= 1");
  if (replicate_ == shard_)
    throw InvalidArgument(kOp, "the replicate communicator is the shard communicator",
                          "pass nullptr for no replication, or the mesh's replicate axis");
  check_zeropp();
  if (options_.deterministic &&
      (replicate_ != nullptr || options_.quantize_weights || options_.quantize_gradients ||
       options_.hierarchical_partition || options_.reduce != GradReduce::sum || reduce_dtype_ != DType::f32))
    throw InvalidArgument(kOp, "deterministic with hybrid sharding, ZeRO++, reduce avg or half-precision gradients",
                          "the deterministic mode shards over one communicator with f32 gradients summed");
  d_ = options_.stage == ZeroStage::no_shard ? 1 : shard_->size();
  rank_ = options_.stage == ZeroStage::no_shard ? 0 : shard_->rank();
  const std::vector<nn::Parameter*> params = model.parameters();
  for (const nn::Parameter* p : params) {
    const bool deferred = !p->value.defined() && p->init;
    if (!deferred && (!p->value.defined() || p->value.dtype() != DType::f32 || !p->value.is_contiguous() ||
                      p->value.device().type != DeviceType::cpu || p->value.shape() != p->info.shape))
      throw InvalidArgument(kOp,
                            fmt::format("parameter '{}' is neither a contiguous f32 cpu tensor of its shape nor "
                                        "deferred (undefined value with an init)",
                                        p->name),
                            "wrap a freshly built model (f32 master weights, or defer_init) once");
  }
  check_structure(params);
  if (options_.sync_module_states) sync_states();
  build_units(model, params);
  model.set_compute_dtype(options_.param_dtype);
  model.add_hook(this);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  model_->remove_hook(this);
  model_->set_compute_dtype(DType::f32);
  for (auto& r : in_flight_) {  // drains; errors were or will not be seen
    r->work = comm::Work();
    r->qgz.reset();
  }
  for (auto& u : units_) u->gather = comm::Work();
}

Tensor FullyShardedDataParallel::alloc(int64_t n, DType dtype, MemoryCategory category) const {
  return Tensor::zeros({n}, dtype, Device{}, options_.tracker, category);
}

void FullyShardedDataParallel::build_units(nn::Module& model, const std::vector<nn::Parameter*>& params) {
  UnitList groups = fsdp_units(model, options_.unit_modules);
  // Every parameter in exactly one unit.
  std::unordered_map<const nn::Parameter*, nn::Module*> owner;
  for (auto& [m, ps] : groups)
    for (nn::Parameter* p : ps)
      if (!owner.emplace(p, m).second)
        throw InvalidArgument(kOp,
                              fmt::format("parameter '{}' is used by two units (a tied weight?); the second is '{}'",
                                          p->name, unit_name(ps)),
                              "list a module that contains every user of it in unit_modules");
  for (nn::Module* m : options_.unit_modules)
    if (std::none_of(groups.begin(), groups.end(), [&](const auto& g) { return g.first == m; }))
      throw InvalidArgument(kOp, "a module in unit_modules is not in the model",
                            "list modules of the wrapped model (reachable through children())");
  for (const nn::Parameter* p : params)
    if (!owner.count(p))
      throw InvalidArgument(kOp,
                            fmt::format("parameter '{}' belongs to no module reachable through children()", p->name),
                            "a container must list its submodules in children()");
  const DType pd = options_.param_dtype, gd = reduce_dtype_;
  const ZeroStage stage = options_.stage;
  // Which parameters are sharded is the strategy's decision (one rule for
  // the runtime, the planner and pictures); how is the runtime's: flat and
  // padded per unit.
  const sharding::FSDPStrategy rule(mesh::kFsdp, d_, options_.min_weight_size);
  int64_t replicated = 0;
  for (auto& [module, ps] : groups) {
    const std::string name = unit_name(ps);
    auto u = std::make_unique<Unit>();
    u->name = name;
    unit_of_module_[module] = u.get();
    UnitInfo info;
    info.name = name;
    std::vector<int64_t> numels;
    for (nn::Parameter* p : ps) {
      const int64_t n = p->info.numel();
      shapes_[p] = p->info.shape;
      if (rule.should_shard(p->info)) {
        u->params.push_back(p);
        numels.push_back(n);
        info.sharded.push_back(p->name);
      } else {
        replicated_.push_back(p);
        replicated += n;
        info.replicated.push_back(p->name);
      }
    }
    const sharding::FlatShards flat(std::move(numels), d_);
    u->offsets = flat.offsets;
    u->numel = flat.numel;
    u->padded = flat.padded;
    u->shard = flat.shard;
    u->lo = static_cast<int64_t>(rank_) * u->shard;
    info.numel = u->numel;
    info.padded = u->padded;
    info.shard = u->shard;
    sharded_elements_ += u->numel;
    if (u->numel > 0) {
      // The initial f32 values of what this rank stores, from the model's
      // tensors (freed below) or, for deferred parameters, their init: a
      // zero3 rank builds only its shard.
      Tensor owned;
      if (stage == ZeroStage::zero3) {
        owned = Tensor::empty({u->shard}, DType::f32);
        fill_flat(*u, u->lo, u->shard, owned.data<float>());
        u->shard_param = alloc(u->shard, pd, MemoryCategory::parameters);
        u->shard_param.copy_from(owned);
      } else {
        Tensor flat = Tensor::empty({u->padded}, DType::f32);
        fill_flat(*u, 0, u->padded, flat.data<float>());
        u->full_param = alloc(u->padded, pd, MemoryCategory::parameters);
        u->full_param.copy_from(flat);
        owned = flat.narrow(0, u->lo, u->shard);
      }
      if (pd == DType::f32) {
        u->master = stage == ZeroStage::zero3 ? u->shard_param : u->full_param.narrow(0, u->lo, u->shard);
      } else {
        u->master = alloc(u->shard, DType::f32, MemoryCategory::optimizer);
        u->master.copy_from(owned);  // exact f32 masters, not the rounded copies
      }
      if (stage <= ZeroStage::zero1 || options_.deterministic)
        u->full_grad = alloc(u->padded, gd, MemoryCategory::gradients);
      if (stage > ZeroStage::zero1) u->shard_grad = alloc(u->shard, gd, MemoryCategory::gradients);
      for (size_t i = 0; i < u->params.size(); ++i) {
        nn::Parameter* p = u->params[i];
        const std::vector<int64_t>& shape = shapes_.at(p);
        const int64_t n = p->info.numel();
        p->value = values_persistent() ? u->full_param.narrow(0, u->offsets[i], n).view(shape) : Tensor();
        p->grad = grads_persistent() ? u->full_grad.narrow(0, u->offsets[i], n).view(shape) : Tensor();
        // The part of p this rank owns: its elements [start, start + count),
        // at flat a within [lo, lo + shard).
        const auto [start, count] = flat.owned(i, rank_);
        if (count == 0) continue;
        const int64_t a = u->offsets[i] + start;
        auto sp = std::make_unique<nn::Parameter>();
        sp->name = p->name;
        sp->value = u->master.narrow(0, a - u->lo, count);
        sp->grad = owned_grad(*u).narrow(0, a - u->lo, count);
        sp->weight_decay = p->weight_decay;
        sp->info = p->info;
        sp->placement = p->placement.flat(start, count);
        if (pd != DType::f32) {  // the optimizer writes the param_dtype copy as it updates the master
          const Tensor copy = stage == ZeroStage::zero3 ? u->shard_param : u->full_param.narrow(0, u->lo, u->shard);
          sp->rounded = copy.narrow(0, a - u->lo, count);
        }
        u->shards.push_back(sp.get());
        shard_params_.push_back(std::move(sp));
        shard_param_models_.push_back(p);
      }
    }
    unit_info_.push_back(std::move(info));
    units_.push_back(std::move(u));
  }
  // Replicated parameters: tracked f32 copies, grads in one flat buffer.
  replicated_elements_ = replicated;
  replicated_grads_ = alloc(std::max<int64_t>(replicated, 1), DType::f32, MemoryCategory::gradients);
  int64_t off = 0;
  for (nn::Parameter* p : replicated_) {
    if (!p->value.defined()) nn::materialize(*p);
    const std::vector<int64_t> shape = p->value.shape();
    Tensor v = Tensor::empty(shape, DType::f32, Device{}, options_.tracker, MemoryCategory::parameters);
    v.copy_from(p->value);
    p->value = v;
    p->grad = replicated_grads_.narrow(0, off, p->value.numel()).view(shape);
    off += p->value.numel();
  }
}

Tensor FullyShardedDataParallel::owned_grad(Unit& u) {
  if (options_.stage <= ZeroStage::zero1) return u.full_grad.narrow(0, u.lo, u.shard);
  return u.shard_grad;
}

std::vector<nn::Parameter*> FullyShardedDataParallel::optimizer_parameters() {
  std::vector<nn::Parameter*> out;
  for (auto& sp : shard_params_) out.push_back(sp.get());
  for (nn::Parameter* p : replicated_) out.push_back(p);
  return out;
}

// ---- use of a unit ----

FullyShardedDataParallel::Unit* FullyShardedDataParallel::unit_of(nn::Module& owner) {
  auto it = unit_of_module_.find(&owner);
  if (it == unit_of_module_.end() || it->second->params.empty()) return nullptr;
  return it->second;
}

bool FullyShardedDataParallel::scopes(nn::Module& m) { return unit_of_module_.count(&m) > 0; }

bool FullyShardedDataParallel::values_persistent() const {
  return options_.param_dtype == DType::f32 && options_.stage != ZeroStage::zero3;
}

bool FullyShardedDataParallel::grads_persistent() const {
  return reduce_dtype_ == DType::f32 && (options_.stage <= ZeroStage::zero1 || options_.deterministic);
}

void FullyShardedDataParallel::start_gather(Unit& u) {
  if (options_.stage != ZeroStage::zero3 || u.gathering || u.materialized) return;
  if (u.secondary.defined()) {  // hpZ: within the node, from the secondary copy
    u.gathered = alloc(u.padded, u.secondary.dtype(), MemoryCategory::working);
    u.gather = options_.node_local->all_gather_async(u.secondary.data_ptr(), u.gathered.data_ptr(),
                                                     static_cast<size_t>(u.secondary.numel()), u.secondary.dtype());
    u.gathering = true;
    u.from_secondary = true;
    return;
  }
  if (options_.quantize_weights) {  // qwZ: codes and scales on the wire
    const size_t m = quantized_message_bytes(u.shard, options_.weight_quant);
    u.wire_mine.resize(m);
    u.wire_all.resize(m * static_cast<size_t>(d_));
    quantize_message(u.shard_param.data<float>(), u.shard, options_.weight_quant, u.wire_mine.data());
    u.gather = shard_->all_gather_async(u.wire_mine.data(), u.wire_all.data(), m, DType::u8);
    u.gathering = true;
    return;
  }
  u.gathered = alloc(u.padded, options_.param_dtype, MemoryCategory::working);
  u.gather = shard_->all_gather_async(u.shard_param.data_ptr(), u.gathered.data_ptr(),
                                      static_cast<size_t>(u.shard), options_.param_dtype);
  u.gathering = true;
}

void FullyShardedDataParallel::set_value_views(Unit& u, const Tensor& flat) {
  for (size_t i = 0; i < u.params.size(); ++i) {
    nn::Parameter* p = u.params[i];
    const std::vector<int64_t>& shape = shapes_.at(p);
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    p->value = flat.narrow(0, u.offsets[i], n).view(shape);
  }
}

void FullyShardedDataParallel::materialize(Unit& u) {
  if (u.inspecting) release_values(u);
  if (values_persistent() || u.materialized) return;
  Tensor src;
  if (options_.stage == ZeroStage::zero3) {
    start_gather(u);
    u.gather.wait();  // idempotent: may have been waited for by finish()
    u.gathering = false;
    if (options_.quantize_weights && !u.from_secondary) {
      u.gathered = alloc(u.padded, DType::f32, MemoryCategory::working);
      const size_t m = quantized_message_bytes(u.shard, options_.weight_quant);
      for (int r = 0; r < d_; ++r)
        dequantize_message(u.wire_all.data() + m * static_cast<size_t>(r), u.shard, options_.weight_quant,
                           u.gathered.data<float>() + u.shard * r);
      std::vector<uint8_t>().swap(u.wire_mine);
      std::vector<uint8_t>().swap(u.wire_all);
    }
    u.from_secondary = false;
    src = std::move(u.gathered);
    u.gathered = Tensor();
  } else {
    src = u.full_param;
  }
  // Under mixed precision the values are param_dtype views: layers run
  // their products on them as they are and widen small ones (nn's
  // internal::param_value), so nothing converts the whole unit here.
  u.work_value = src;
  gathers_ += u.padded;
  set_value_views(u, u.work_value);
  u.materialized = true;
}

int64_t FullyShardedDataParallel::secondary_numel(const Unit& u) const {
  return u.padded / options_.node_local->size();  // Np = ceil(N / KL) KL divides by L
}

void FullyShardedDataParallel::keep_secondary(Unit& u) {
  if (!options_.hierarchical_partition || u.secondary.defined() || !u.materialized || u.inspecting) return;
  const int64_t part = secondary_numel(u);
  u.secondary = alloc(part, u.work_value.dtype(), MemoryCategory::parameters);
  u.secondary.copy_from(u.work_value.narrow(0, part * options_.node_local->rank(), part));
}

int64_t FullyShardedDataParallel::secondary_bytes() const {
  if (!options_.hierarchical_partition) return 0;
  const DType t = options_.quantize_weights ? DType::f32 : options_.param_dtype;
  int64_t n = 0;
  for (const auto& u : units_)
    if (!u->params.empty()) n += secondary_numel(*u);
  return n * static_cast<int64_t>(dtype_size(t));
}

int64_t FullyShardedDataParallel::secondary_bytes_held() const {
  int64_t n = 0;
  for (const auto& u : units_)
    if (u->secondary.defined()) n += u->secondary.numel() * static_cast<int64_t>(dtype_size(u->secondary.dtype()));
  return n;
}

void FullyShardedDataParallel::release_values(Unit& u) {
  if (values_persistent()) return;  // the values are views of the persistent f32 parameters
  u.inspecting = false;
  for (nn::Parameter* p : u.params) p->value = Tensor();
  u.work_value = Tensor();
  u.materialized = false;
}

FullyShardedDataParallel::Unit* FullyShardedDataParallel::neighbour(const Unit& u, int step) {
  if (u.use_position < 0) return nullptr;
  const int i = u.use_position + step;
  return i >= 0 && i < static_cast<int>(use_order_.size()) ? use_order_[static_cast<size_t>(i)] : nullptr;
}

void FullyShardedDataParallel::before_use(nn::Module& owner, nn::Pass pass) {
  Unit* u = unit_of(owner);
  if (!u) return;
  poll();
  const bool uses_values = pass != nn::Pass::backward_weight;
  const bool uses_grads = pass == nn::Pass::backward || pass == nn::Pass::backward_weight;
  if (pass != nn::Pass::forward && uses_values && options_.stage == ZeroStage::zero3 &&
      options_.backward_prefetch == BackwardPrefetch::pre) {
    // Start the next unit's gather before waiting for this one's, so both
    // are in flight together.
    if (!u->materialized) start_gather(*u);
    if (Unit* next = neighbour(*u, -1)) start_gather(*next);
  }
  if (uses_values) materialize(*u);
  if (pass == nn::Pass::forward) {
    if (u->use_position < 0) {
      u->use_position = static_cast<int>(use_order_.size());
      use_order_.push_back(u);
    }
    if (options_.forward_prefetch)
      if (Unit* next = neighbour(*u, +1)) start_gather(*next);
    return;
  }
  if (!uses_grads) return;
  // A gradient to accumulate into.
  window_open_ = true;
  if (grads_persistent()) return;
  u->work_grad = alloc(u->padded, DType::f32, MemoryCategory::working);
  for (size_t i = 0; i < u->params.size(); ++i) {
    nn::Parameter* p = u->params[i];
    p->grad = u->work_grad.narrow(0, u->offsets[i], p->info.numel()).view(shapes_.at(p));
  }
}

void FullyShardedDataParallel::after_use(nn::Module& owner, nn::Pass pass) {
  Unit* u = unit_of(owner);
  if (!u) return;
  if (pass == nn::Pass::forward) {
    keep_secondary(*u);
    if (options_.reshard_after_forward) release_values(*u);
    return;
  }
  if (pass != nn::Pass::backward_weight) {  // the values' last use in this backward
    release_values(*u);
    if (options_.stage == ZeroStage::zero3 && options_.backward_prefetch == BackwardPrefetch::post)
      if (Unit* next = neighbour(*u, -1)) start_gather(*next);
  }
  if (pass == nn::Pass::backward_input) return;
  reduce_unit(*u);
  poll();
}

void FullyShardedDataParallel::reduce_unit(Unit& u) {
  if (options_.deterministic) return;  // once per window, in finish()
  const bool last = window_index_ == window_count_ - 1;
  if (options_.stage <= ZeroStage::zero1) {
    if (!grads_persistent()) {
      accumulate(u.work_grad, u.full_grad);
      u.work_grad = Tensor();
      for (nn::Parameter* p : u.params) p->grad = Tensor();
    }
    if (last) launch_full_reduction(u);
    return;
  }
  // zero2 / zero3: reduce-scatter this micro-batch's gradient now.
  Tensor buf = std::move(u.work_grad);
  u.work_grad = Tensor();
  for (nn::Parameter* p : u.params) p->grad = Tensor();
  if (options_.quantize_gradients) {  // qgZ, in f32 around quantized all-to-alls
    make_room();
    auto r = std::make_unique<Reduction>();
    r->unit = &u;
    r->buffer = alloc(u.shard, DType::f32, MemoryCategory::working);
    r->qgz = std::make_unique<QuantizedReduceScatter>(
        options_.node_local != nullptr ? *options_.node_local : *shard_, options_.cross_node, buf.data<float>(),
        r->buffer.data<float>(), static_cast<size_t>(u.shard), options_.grad_quant);
    in_flight_.push_back(std::move(r));  // buf is quantized already: freed here
    return;
  }
  if (reduce_dtype_ != DType::f32) {
    Tensor half = alloc(u.padded, reduce_dtype_, MemoryCategory::working);
    half.copy_from(buf);
    buf = std::move(half);
  }
  make_room();
  auto r = std::make_unique<Reduction>();
  r->unit = &u;
  const size_t es = dtype_size(reduce_dtype_);
  char* base = static_cast<char*>(buf.data_ptr());
  r->work = shard_->reduce_scatter_async(base, base + static_cast<size_t>(u.lo) * es, static_cast<size_t>(u.shard),
                                         reduce_dtype_, comm::ReduceOp::sum);
  r->buffer = std::move(buf);
  in_flight_.push_back(std::move(r));
}

void FullyShardedDataParallel::launch_full_reduction(Unit& u) {
  if (u.reduced) return;
  u.reduced = true;
  make_room();
  auto r = std::make_unique<Reduction>();
  r->unit = &u;
  char* base = static_cast<char*>(u.full_grad.data_ptr());
  if (options_.stage == ZeroStage::no_shard) {
    r->work = shard_->all_reduce_async(base, base, static_cast<size_t>(u.padded), reduce_dtype_, comm::ReduceOp::sum);
  } else {
    const size_t es = dtype_size(reduce_dtype_);
    r->work = shard_->reduce_scatter_async(base, base + static_cast<size_t>(u.lo) * es,
                                           static_cast<size_t>(u.shard), reduce_dtype_, comm::ReduceOp::sum);
  }
  in_flight_.push_back(std::move(r));
}

void FullyShardedDataParallel::make_room() {
  while (static_cast<int>(in_flight_.size()) >= options_.max_reductions_in_flight) {
    complete(*in_flight_.front());
    in_flight_.erase(in_flight_.begin());
  }
}

void FullyShardedDataParallel::complete(Reduction& r) {
  if (r.qgz)
    r.qgz->wait();
  else
    r.work.wait();
  if (!r.buffer.defined()) return;  // a full reduction: the result is in place
  Unit& u = *r.unit;
  const Tensor mine = r.qgz ? r.buffer : r.buffer.narrow(0, u.lo, u.shard);
  if (u.has_grad)
    accumulate(mine, u.shard_grad);
  else
    u.shard_grad.copy_from(mine);
  u.has_grad = true;
  r.buffer = Tensor();
}

void FullyShardedDataParallel::poll() {
  size_t done = 0;
  // Oldest first, stopping at the first not done: qgZ's second all-to-alls
  // start in issue order on every rank.
  while (done < in_flight_.size() && in_flight_[done]->done()) complete(*in_flight_[done++]);
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
}

// ---- the window ----

void FullyShardedDataParallel::begin_micro_batch(int index, int count) {
  const char* op = "FullyShardedDataParallel::begin_micro_batch";
  if (count < 1 || index < 0 || index >= count)
    throw InvalidArgument(op, fmt::format("index {} of count {}", index, count), "need 0 <= index < count");
  const bool open = micro_batches_ > 0;
  if (!open && index != 0)
    throw InvalidArgument(op, fmt::format("index {} of count {} but no window is open", index, count),
                          "start every window with index 0");
  if (open && (index != window_index_ + 1 || count != window_count_))
    throw InvalidArgument(op,
                          fmt::format("got micro-batch {} of {}, expected {} of {}", index, count,
                                      window_index_ + 1, window_count_),
                          "number micro-batches 0..count-1 with one count per window; end a window early with "
                          "finish()");
  window_index_ = index;
  window_count_ = count;
  ++micro_batches_;
}

void FullyShardedDataParallel::finish() {
  if (!window_open_) {
    micro_batches_ = 0;
    window_index_ = 0;
    window_count_ = 1;
    return;
  }
  const int m = std::max(1, micro_batches_);
  if (options_.deterministic) return finish_deterministic();
  if (options_.stage <= ZeroStage::zero1)
    for (auto& u : units_)
      if (!u->params.empty()) launch_full_reduction(*u);
  // Replicated parameters reduce while the unit reductions finish.
  comm::Work rep;
  if (replicated_elements_ > 0)
    rep = shard_->all_reduce_async(replicated_grads_.data_ptr(), replicated_grads_.data_ptr(),
                                   static_cast<size_t>(replicated_elements_), DType::f32, comm::ReduceOp::sum);
  for (auto& r : in_flight_) complete(*r);
  in_flight_.clear();
  rep.wait();
  for (auto& u : units_)
    if (u->gathering) u->gather.wait();  // prefetched, unused: nothing may read shards during the step
  if (replicate_) {
    std::vector<comm::Work> works;
    for (auto& u : units_) {
      if (u->params.empty()) continue;
      const Tensor g = owned_grad(*u);
      works.push_back(replicate_->all_reduce_async(g.data_ptr(), g.data_ptr(), static_cast<size_t>(u->shard),
                                                   reduce_dtype_, comm::ReduceOp::sum));
    }
    if (replicated_elements_ > 0)
      works.push_back(replicate_->all_reduce_async(replicated_grads_.data_ptr(), replicated_grads_.data_ptr(),
                                                   static_cast<size_t>(replicated_elements_), DType::f32,
                                                   comm::ReduceOp::sum));
    for (auto& w : works) w.wait();
  }
  if (options_.reduce == GradReduce::avg) {
    const int ranks = shard_->size() * (replicate_ ? replicate_->size() : 1);
    const double f = 1.0 / (static_cast<double>(ranks) * m);
    for (auto& u : units_)
      if (!u->params.empty()) scale(owned_grad(*u), f);
    if (replicated_elements_ > 0) scale(replicated_grads_, f);
  }
  for (auto& u : units_) u->reduced = false;
  window_open_ = false;
  micro_batches_ = 0;
  window_index_ = 0;
  window_count_ = 1;
}

void FullyShardedDataParallel::finish_deterministic() {
  // reduced = the tree over the ranks of a full gradient of the unit: the
  // unit's owned part (all of it under no_shard).
  auto reduce = [&](Unit& u, float* full, float* owned) {
    if (options_.stage == ZeroStage::no_shard) {
      comm::tree_all_reduce(*shard_, full, static_cast<size_t>(u.padded));
      if (owned != full) std::copy(full, full + u.padded, owned);
    } else {
      comm::tree_reduce_scatter(*shard_, full, owned, static_cast<size_t>(u.shard));
    }
  };
  for (auto& u : units_) {
    if (u->params.empty()) continue;
    Tensor owned = owned_grad(*u);
    reduce(*u, u->full_grad.data<float>(), owned.data<float>());
    u->has_grad = true;
    // A tied parameter's other users: each summed over the ranks on its own,
    // then added to the parameter's own elements of the owned part.
    for (size_t i = 0; i < u->params.size(); ++i)
      for (const Tensor& other : nn::take_other_users(*u->params[i])) {
        Tensor full = Tensor::zeros({u->padded}, DType::f32);
        full.narrow(0, u->offsets[i], other.numel()).copy_from(other.view({other.numel()}));
        Tensor mine = options_.stage == ZeroStage::no_shard ? full : Tensor::zeros({u->shard}, DType::f32);
        reduce(*u, full.data<float>(), mine.data<float>());
        const int64_t base = options_.stage == ZeroStage::no_shard ? 0 : u->lo;
        const int64_t a = std::max(u->offsets[i], base);
        const int64_t b = std::min(u->offsets[i] + other.numel(), base + owned.numel());
        if (a >= b) continue;
        float* parts[] = {owned.data<float>() + (a - base), mine.data<float>() + (a - base)};
        tree_sum(parts, b - a);
      }
  }
  if (replicated_elements_ > 0)
    comm::tree_all_reduce(*shard_, replicated_grads_.data<float>(), static_cast<size_t>(replicated_elements_));
  for (auto& u : units_)
    if (u->gathering) u->gather.wait();  // prefetched, unused: nothing may read shards during the step
  window_open_ = false;
  micro_batches_ = 0;
  window_index_ = 0;
  window_count_ = 1;
}

void FullyShardedDataParallel::after_step() {
  reshard();
  for (auto& u : units_) u->secondary = Tensor();  // hpZ: the parameters changed
  std::vector<comm::Work> works;
  for (auto& u : units_) {
    if (u->params.empty()) continue;
    if (options_.param_dtype != DType::f32) {
      // The optimizer rounded the masters into param_dtype as it updated
      // them (nn::Parameter::rounded); round here what it did not.
      const bool fresh = std::all_of(u->shards.begin(), u->shards.end(), [](const nn::Parameter* sp) { return sp->rounded_fresh; });
      if (!fresh) {
        const Tensor dst = options_.stage == ZeroStage::zero3 ? u->shard_param : u->full_param.narrow(0, u->lo, u->shard);
        dst.copy_from(u->master);
      }
      for (nn::Parameter* sp : u->shards) sp->rounded_fresh = false;
    }
    if (options_.stage == ZeroStage::zero1 || options_.stage == ZeroStage::zero2) {
      char* base = static_cast<char*>(u->full_param.data_ptr());
      const size_t es = dtype_size(options_.param_dtype);
      works.push_back(shard_->all_gather_async(base + static_cast<size_t>(u->lo) * es, base,
                                               static_cast<size_t>(u->shard), options_.param_dtype));
    }
  }
  for (auto& w : works) w.wait();
}

void FullyShardedDataParallel::zero_grad() {
  for (auto& u : units_) {
    if (u->full_grad.defined()) u->full_grad.fill(0.0);
    if (u->shard_grad.defined()) u->shard_grad.fill(0.0);
    u->has_grad = false;
  }
  replicated_grads_.fill(0.0);
}

void FullyShardedDataParallel::reshard() {
  for (auto& u : units_) {
    if (u->params.empty()) continue;
    if (u->gathering) {
      u->gather.wait();
      u->gathering = false;
      u->from_secondary = false;
      u->gathered = Tensor();
      std::vector<uint8_t>().swap(u->wire_mine);
      std::vector<uint8_t>().swap(u->wire_all);
    }
    release_values(*u);
  }
}

void FullyShardedDataParallel::gather_full_parameters() {
  reshard();
  if (values_persistent()) return;  // the values are the f32 masters (after_step gathered them)
  for (auto& u : units_) {
    if (u->params.empty()) continue;
    Tensor full = alloc(u->padded, DType::f32, MemoryCategory::working);
    if (options_.stage == ZeroStage::no_shard)
      full.copy_from(u->master);
    else
      shard_->all_gather(u->master.data_ptr(), full.data_ptr(), static_cast<size_t>(u->shard), DType::f32);
    u->work_value = full;
    set_value_views(*u, full);
    u->inspecting = true;
  }
}

}  // namespace meshtrain::parallel
