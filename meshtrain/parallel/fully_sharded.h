// FullyShardedDataParallel: ZeRO stages 1-3 (and no_shard) with optional
// hybrid sharding (HSDP) and mixed precision, over meshtrain's Module hooks.
//
//   comm::Communicator& shard = mesh.comm({"data"});   // shard over all DP ranks
//   FullyShardedDataParallel fsdp(model, shard, nullptr,
//       {.stage = ZeroStage::zero3, .param_dtype = DType::bf16});
//   optim::AdamW opt(fsdp.optimizer_parameters(), 1e-3);
//   for (...) {                                        // one optimizer step
//     for (int i = 0; i < m; ++i) {                    // micro-batches
//       fsdp.begin_micro_batch(i, m);
//       model.backward(loss_grad(model.forward(x_i)));  // gathers, frees, reduce-scatters
//     }
//     fsdp.finish();                                   // waits; owned grads are reduced
//     if (fsdp.grads_finite()) { opt.step(); fsdp.after_step(); }
//     fsdp.zero_grad();
//   }
//
// Units. By default a unit is the set of parameters of one module that owns
// parameters (Linear, LayerNorm), i.e. every such module is wrapped, like
// FSDP's size-based auto-wrap with a threshold of 0; options.unit_modules
// makes whole subtrees (a transformer block) one unit each. A unit is named
// by its parameters' common module path. Within a unit, parameters with
// at least min_weight_size elements are SHARDED; smaller ones (biases,
// norms) stay REPLICATED in f32 (also under mixed precision) and their
// gradients are all-reduced at finish(), like data parallelism. no_shard
// handles the large parameters like the others with one owner of everything
// (d = 1 in the formulas), so mixed precision applies to them too.
//
// Flat shards and padding. A unit's sharded parameters are concatenated in
// definition order into one flat vector of N elements, zero-padded to
// Np = ceil(N / d) * d (d = shard_comm.size()); rank r owns elements
// [r * S, (r + 1) * S) with S = Np / d. A parameter may span two ranks; each
// rank's optimizer sees the part of each parameter it owns as a 1-D
// Parameter (optimizer_parameters()). Padding is never seen by the
// optimizer and stays zero.
//
// What is stored per rank (P = sharded elements, p = param_dtype bytes,
// g = reduce_dtype bytes; "master" is an f32 copy kept only when p < 4):
//   stage       parameters   gradients   optimizer (master + state)
//   no_shard    p * P        g * P       (4 if p < 4) * P + state(P)
//   zero1       p * P        g * P       ((4 if p < 4) * P + state(P)) / d
//   zero2       p * P        g * P / d   ((4 if p < 4) * P + state(P)) / d
//   zero3       p * P / d    g * P / d   ((4 if p < 4) * P + state(P)) / d
// With AdamW (state 8 bytes/element): bf16 gives 16, 4 + 12/d, 2 + 14/d, 16/d
// bytes per parameter; f32 gives 16, 8 + 8/d, 4 + 12/d, 16/d. Charged to
// options.tracker as parameters / gradients / optimizer (the master), the
// optimizer charges its own state. Transient copies are charged as
// MemoryCategory::working (see below).
//
// Use of a unit (the ParamHook calls of its module; a split backward's
// backward_input uses values like backward, its backward_weight gradients
// like backward, so a unit's values are gathered for the first and its
// gradient is reduced after the second):
//   before_use(forward)  stage 3: all-gather the unit (unless prefetched or
//                        kept). p.value becomes a view of the unit's values
//                        in param_dtype: under mixed precision a bf16/f16
//                        view that layers compute on as it is (their GEMMs
//                        take it directly; small parameters such as biases
//                        and norms are widened per use: nn never converts a
//                        whole weight here). forward_prefetch starts the
//                        next unit's all-gather in the order units were
//                        first used in a forward (FSDP1's recorded execution
//                        order: none before a unit's successor is known).
//   after_use(forward)   reshard_after_forward: drop the views (stage 3:
//                        free the gathered copy).
//   before_use(backward) materialize again if freed; p.grad becomes a view of
//                        a zeroed f32 working gradient (or, stage 0/1 with
//                        f32 gradients, of the persistent full gradient).
//                        backward_prefetch pre: start the gather of the unit
//                        used before this one in the forward (the backward's
//                        next: on a pipeline's last stage the tied head's
//                        wte follows the blocks, though defined before).
//   after_use(backward)  free the values; zero2/zero3: round the gradient to
//                        reduce_dtype and start an async reduce-scatter whose
//                        result is added to the owned gradient shard (every
//                        micro-batch: no full gradient outlives the unit's
//                        backward); no_shard/zero1: accumulate into the full
//                        gradient and, on the window's last micro-batch,
//                        start its all-reduce (no_shard) or in-place
//                        reduce-scatter (zero1). backward_prefetch post:
//                        start the next unit's gather here.
//   Outside these windows a stage-3 (or mixed-precision) parameter's value
//   and grad are undefined tensors; gather_full_parameters() gives f32 ones.
//
// finish() waits for every reduction, all-reduces the replicated parameters'
// gradients, and with a replicate communicator (HSDP) all-reduces the owned
// gradient shards across replicas. Results after finish(), per owned element,
// with m micro-batches in the window:
//   GradReduce::sum  g = sum over ranks (shard x replicate) and micro-batches
//   GradReduce::avg  g = that sum / (ranks * m)
// after_step() publishes the optimizer's update: master -> param_dtype and,
// for zero1/zero2, an in-place all-gather of the full parameters.
//
// Collective order: every hook call happens in the same order on every rank
// (same model, same program), so the gathers and reductions are issued in
// the same order everywhere. Mixed-precision grads are rounded to
// reduce_dtype before communication (fp16 overflow shows up as inf there:
// use a DynamicLossScaler and grads_finite()).
//
// Thread-safety: one rank's thread, like the model and communicators it
// borrows (they must outlive it).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/quantize.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/layout/placement_rule.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/parallelism.h"

namespace meshtrain::parallel {

// The stages, modes and prefetch policies are the layout vocabulary's
// (layout/vocabulary.h: the one definition and parser of each name).
using layout::BackwardPrefetch;
using layout::FsdpMode;
using layout::parse_backward_prefetch;
using layout::parse_fsdp_mode;
using layout::ZeroStage;

// The units of `model`'s subtree, in definition order, each with its
// parameters: each module of unit_modules is one unit (its subtree, less
// the listed modules nested in it, which are units of their own); elsewhere
// every module that owns parameters. What FullyShardedDataParallel gathers
// and frees together.
using UnitList = std::vector<std::pair<nn::Module*, std::vector<nn::Parameter*>>>;
UnitList fsdp_units(nn::Module& model, const std::vector<nn::Module*>& unit_modules);

// The model's parameters as the placement rule (layout/placement_rule.h)
// sees them, in parameters() order: global descriptions (build the model
// whole, e.g. deferred), fsdp_units' unit index, and `stage`.
std::vector<layout::ModelParameter> model_parameters(nn::Module& model, const std::vector<nn::Module*>& unit_modules,
                                                     int stage = 0);

struct FullyShardedOptions {
  ZeroStage stage = ZeroStage::zero3;
  // Parameters with fewer elements stay replicated (seeds' fsdp_min_weight_size;
  // the decision is sharding::FSDPStrategy::should_shard, also for scalars).
  int64_t min_weight_size = 1024;
  // Compute / all-gather dtype of sharded parameters: f32, bf16 or f16.
  DType param_dtype = DType::f32;
  // Dtype gradients are stored and reduced in; defaults to param_dtype.
  std::optional<DType> reduce_dtype = std::nullopt;
  GradReduce reduce = GradReduce::sum;
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::pre;
  // zero3 (and mixed-precision working copies): free a unit's gathered
  // values after its forward and gather again for backward (true), or keep
  // them until its backward (false: less communication, more memory).
  bool reshard_after_forward = true;
  // Rate limit (FSDP's limit_all_gathers): at most this many gradient
  // reductions in flight; launching one more first waits for the oldest.
  // Bounds the unsharded gradients alive at once (>= 1).
  int max_reductions_in_flight = 2;
  // Broadcast every parameter from rank 0 of the shard (and replicate)
  // communicator at construction (seeds' sync_module_states).
  bool sync_module_states = true;
  // Modules that are one unit each with their subtree (FSDP2's
  // fully_shard(block)): e.g. every transformer block, so a block's
  // parameters are gathered and reduced together. A listed module may
  // contain listed ones (list the blocks and the model itself): it keeps
  // what they leave (embeddings, final norm, a tied head), gathered around
  // its whole forward and backward. Elsewhere every module that owns
  // parameters is a unit (the default when empty). Borrowed.
  std::vector<nn::Module*> unit_modules = {};
  MemoryTracker* tracker = nullptr;  // must outlive the wrapper; may be null
  // ZeRO++ (parallel/zeropp.h, docs/zeropp.md). quantize_weights (qwZ):
  // stage 3's all-gathers send each shard block-quantized (`weight_quant`)
  // and dequantize on arrival, so forward and backward compute with the
  // quantized weights; the f32 masters stay exact (stage 3, param_dtype
  // f32). quantize_gradients (qgZ): stage 2/3's reduce-scatters run
  // quantized_reduce_scatter (`grad_quant`) over node_local x cross_node
  // (reduce_dtype f32), asynchronously like the f32 ones (and under the
  // same max_reductions_in_flight). hierarchical_partition (hpZ, stage
  // 3, node_local required): the first gather of a unit after a step
  // crosses nodes as usual and leaves a secondary copy of the gathered
  // values (as computed with: qwZ's dequantized f32, else param_dtype)
  // sharded over node_local only, Np / L elements per rank; every later
  // gather of the unit until after_step() (backward's, recomputation's,
  // the next micro-batches') is an all-gather of those within the node.
  // The values are the same as a full gather's, bit for bit; the cost is
  // secondary_bytes() per rank, charged as parameters.
  // node_local / cross_node: the shard communicator's ranks split
  // node-major (shard rank = node * node_local.size() + node_local.rank(),
  // node = cross_node.rank()); null node_local: one node (the shard
  // communicator). InvalidArgument for any other combination.
  bool quantize_weights = false;
  bool quantize_gradients = false;
  bool hierarchical_partition = false;
  BlockQuant weight_quant = {.bits = 8, .block = 256};
  BlockQuant grad_quant = {.bits = 8, .block = 256};
  comm::Communicator* node_local = nullptr;
  comm::Communicator* cross_node = nullptr;
  // The deterministic mode (docs/determinism.md): every stage keeps the
  // unit's full f32 gradient through the window (as zero1 does), so its
  // micro-batches add up in the canonical tree (nn::add_gradient), and
  // finish() reduces each unit once, in the canonical tree over the ranks
  // (comm::tree_reduce_scatter; no_shard and the replicated parameters:
  // comm::tree_all_reduce), not overlapped with backward. zero2 and zero3
  // then hold full gradients during backward. Not with hybrid sharding,
  // ZeRO++, reduce avg or half-precision gradients.
  bool deterministic = false;
};

// Bytes of model state per rank that the table above predicts, for P sharded
// elements in units with the given padding, d ranks and an optimizer with
// `state_bytes_per_element` of state (AdamW 8, SGD with momentum 4).
struct ModelStateBytes {
  double parameters = 0, gradients = 0, optimizer = 0;
  double total() const { return parameters + gradients + optimizer; }
};
ModelStateBytes predicted_model_state(ZeroStage stage, int64_t elements, int d, DType param_dtype,
                                      DType reduce_dtype, double state_bytes_per_element);

// One unit, for inspection and the memory benchmark.
struct UnitInfo {
  std::string name;                   // module path, e.g. "layers.0"
  std::vector<std::string> sharded;   // parameter names in flat order
  std::vector<std::string> replicated;
  int64_t numel = 0;                  // N: sharded elements
  int64_t padded = 0;                 // Np
  int64_t shard = 0;                  // S = Np / d (Np for no_shard)
};

class FullyShardedDataParallel final : public nn::ParamHook, public Parallelism {
 public:
  // Collective over shard_comm (and replicate_comm when given: HSDP). Takes
  // over the model's parameters: sharded ones move into flat storage (their
  // value/grad become views or undefined, see above), replicated ones get
  // tracked f32 copies; installs itself as the model's hook. Checks that
  // every rank has the same parameter names and shapes (InvalidArgument
  // naming the first rank that differs). Parameters must be f32, or
  // deferred (undefined value, Parameter::init set: a model built with
  // defer_init), in which case each rank builds only what it stores (a
  // zero3 rank: its shard; the full model never exists on any rank). Sets the
  // model's compute dtype to param_dtype (Module::set_compute_dtype).
  FullyShardedDataParallel(nn::Module& model, comm::Communicator& shard_comm,
                           comm::Communicator* replicate_comm, FullyShardedOptions options = {});
  // Waits for work in flight; removes the hook and resets the compute
  // dtype to f32. Parameters keep whatever
  // they point to (call gather_full_parameters() first to keep values).
  ~FullyShardedDataParallel() override;
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // What the optimizer updates: for every sharded parameter, the 1-D part
  // this rank owns (f32 master value, grad in reduce_dtype; parameters this
  // rank owns nothing of are left out), then every replicated parameter.
  // Pointers stay valid for the wrapper's lifetime. Each records what it
  // holds in Parameter::placement: a sharded part is flat[start:start+count]
  // of its parameter's row-major elements; a replicated one is whole.
  std::vector<nn::Parameter*> optimizer_parameters() override;

  // Same contract as DataParallel::begin_micro_batch.
  void begin_micro_batch(int index, int count) override;
  // Ends the window: see the header comment. A no-op without a backward.
  void finish() override;
  // Collective over shard and replicate communicators: true when every
  // owned gradient element on every rank is finite (after finish()).
  bool grads_finite() override;
  // Collective: the global L2 norm of the gradients after finish(), each
  // element counted once (owned shards summed over the shard communicator,
  // replicated parameters counted once). Divide by a loss scale yourself.
  double grad_norm() override;
  std::pair<double, double> grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) override;
  ExactSquares grad_squares_exact(const std::function<bool(const nn::Parameter&)>& counted) override;
  // Call after an optimizer step that changed the parameters (see above).
  void after_step() override;
  // Zeroes the owned gradients (and the replicated ones).
  void zero_grad() override;
  // Frees working copies kept by reshard_after_forward = false (e.g. after
  // an evaluation forward that has no backward).
  void reshard() override;

  // Collective: makes every parameter's value a full f32 tensor (values as
  // the optimizer last left them, i.e. the master weights, not their
  // param_dtype copies) until the next use of its unit; for saving and
  // inspection. Call after after_step().
  void gather_full_parameters() override;

  // Parallelism (parallelism.h; defined in parallelism.cc): the rest of the
  // protocol. describe() names the canonical strategy (FsdpMode::name);
  // loss scaling is needed when param_dtype or reduce_dtype is f16;
  // parameter_shards() gives each sharded parameter's Placement (the flat
  // part of it this rank owns), replicated ones whole.
  std::string describe() const override;
  bool needs_loss_scaling() const override;
  std::vector<ParamShard> parameter_shards() const override;

  // nn::ParamHook: the units' modules are this hook's scopes.
  bool scopes(nn::Module& m) override;
  void before_use(nn::Module& owner, nn::Pass pass) override;
  void after_use(nn::Module& owner, nn::Pass pass) override;

  const std::vector<UnitInfo>& units() const { return unit_info_; }
  const FullyShardedOptions& options() const { return options_; }
  DType reduce_dtype() const { return reduce_dtype_; }
  comm::Communicator& shard_comm() const { return *shard_; }
  comm::Communicator* replicate_comm() const { return replicate_; }
  // Sharded elements (P of the table) and replicated elements.
  int64_t sharded_elements() const { return sharded_elements_; }
  int64_t replicated_elements() const { return replicated_elements_; }
  // Elements materialized so far (Np per unit use: all-gathered for zero3,
  // viewed in the persistent param_dtype copy otherwise).
  int64_t gathered_elements() const { return gathers_; }
  // hpZ: bytes of the secondary copies this rank holds between a unit's
  // first gather after a step and the next after_step() (all units), and
  // how many it holds now.
  int64_t secondary_bytes() const;
  int64_t secondary_bytes_held() const;

 private:
  struct Unit;
  struct Reduction;

  void check_structure(const std::vector<nn::Parameter*>& params);
  void check_zeropp() const;
  void sync_states();
  void build_units(nn::Module& model, const std::vector<nn::Parameter*>& params);
  static void fill_flat(const Unit& u, int64_t from, int64_t count, float* out);
  Tensor alloc(int64_t n, DType dtype, MemoryCategory category) const;
  Tensor owned_grad(Unit& u);
  // Values (grads) live in persistent f32 storage that p.value (p.grad) views.
  bool values_persistent() const;
  bool grads_persistent() const;
  // finish() in the deterministic mode.
  void finish_deterministic();
  Unit* unit_of(nn::Module& owner);  // null: not a unit, or nothing sharded in it
  Unit* neighbour(const Unit& u, int step);  // +1: the unit used after u in the forward; -1: before
  void set_value_views(Unit& u, const Tensor& flat);
  void start_gather(Unit& u);
  void materialize(Unit& u);
  void release_values(Unit& u);
  void keep_secondary(Unit& u);  // hpZ: this rank's node-local part of the gathered values
  int64_t secondary_numel(const Unit& u) const;
  void reduce_unit(Unit& u);
  void launch_full_reduction(Unit& u);
  void make_room();  // waits for the oldest reductions beyond the rate limit
  void complete(Reduction& r);
  void poll();

  nn::Module* model_;
  comm::Communicator* shard_;
  comm::Communicator* replicate_;
  FullyShardedOptions options_;
  DType reduce_dtype_;
  int d_ = 1, rank_ = 0;  // shard degree and rank in it (1 and 0 for no_shard)
  std::vector<std::unique_ptr<Unit>> units_;    // definition order
  std::vector<Unit*> use_order_;                // units with sharded parameters by first forward use
  std::vector<UnitInfo> unit_info_;
  std::unordered_map<const nn::Module*, Unit*> unit_of_module_;
  std::unordered_map<const nn::Parameter*, std::vector<int64_t>> shapes_;
  std::vector<nn::Parameter*> replicated_;      // borrowed model parameters
  Tensor replicated_grads_;                     // f32, flat; their grads view it
  std::vector<std::unique_ptr<nn::Parameter>> shard_params_;
  std::vector<const nn::Parameter*> shard_param_models_;  // the model parameter of each shard_params_ entry
  std::vector<std::unique_ptr<Reduction>> in_flight_;  // issue order
  int window_count_ = 1, window_index_ = 0;
  int micro_batches_ = 0;     // begin_micro_batch calls in the window
  bool window_open_ = false;  // a backward ran since finish()
  int64_t sharded_elements_ = 0, replicated_elements_ = 0, gathers_ = 0;
};

}  // namespace meshtrain::parallel
