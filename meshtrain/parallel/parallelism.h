// Parallelism: the one protocol a training loop drives, whatever spreads the
// model over the devices. DataParallel (data_parallel.h) and
// FullyShardedDataParallel (fully_sharded.h) implement it; the trainer holds
// one std::unique_ptr<Parallelism> and runs one step protocol:
//
//   std::unique_ptr<Parallelism> par = std::make_unique<DataParallel>(model, dp_comm, options);
//   optim::AdamW opt(par->optimizer_parameters(), lr);
//   for (...) {                                        // one optimizer step
//     for (int i = 0; i < m; ++i) {
//       par->begin_micro_batch(i, m);
//       model.backward(loss_grad(model.forward(x_i)));  // the strategy's hooks communicate
//     }
//     par->finish();                                   // gradients reduced
//     if (par->grads_finite()) {                       // collective: the same answer on every rank
//       opt.set_grad_scale(optim::clip_factor(par->grad_norm(), max_norm));
//       opt.step();
//       par->after_step();                             // publish the update (masters -> compute copies)
//     }
//     par->zero_grad();
//   }
//   par->gather_full_parameters();                     // collective: full f32 values to save
//   ...
//   par->reshard();
//
// Contracts:
// - Collective calls (finish, grads_finite, grad_norm, after_step,
//   gather_full_parameters) are made by every rank of the strategy's group,
//   in the same order; the others are local. A strategy may answer a
//   "collective" call locally when every rank provably holds the same
//   numbers (DataParallel's replicated gradients); callers never rely on
//   the communication, only on every rank getting the same answer.
// - optimizer_parameters() are what the optimizer updates: the model's
//   parameters (data parallelism) or this rank's parts of them (sharded),
//   each named like the model parameter it is (a part of); their grads hold
//   the reduced gradient after finish(). The pointers stay valid for the
//   strategy's lifetime.
// - grads_finite() and grad_norm() see every gradient element of the model
//   once (shards summed across ranks, replicated parameters counted once);
//   divide grad_norm by a loss scale yourself.
// - parameter_shards() describes, for every model parameter, the block of
//   the full tensor this rank holds (its Placement): what a checkpoint saves beside the
//   optimizer's state (optim::Optimizer::export_state over
//   optimizer_parameters(), whose names match).
//
// Composition: tensor parallelism changes what a Parameter is (a column or
// row block of the global weight) and adds its own collectives inside the
// modules' forward and backward; the data-parallel strategies here then
// wrap the tensor-parallel model unchanged over the data axis,
// parameter_shards reports block placements, and TensorParallel
// (tensor_parallel.h) wraps the result with the axis's once-per-step
// reductions. A pipeline holds one Parallelism per stage (its
// data-parallel strategy over that stage's model part), calls
// begin_micro_batch on each as its schedule runs the micro-batches, and
// combines grads_finite / grad_norm across stages (one more reduction over
// the pipeline axis). The protocol stays the same for the trainer.
//
// Thread-safety: a strategy belongs to its rank's thread, like the model
// and communicators it borrows.
#pragma once

#include <cstdint>
#include <utility>
#include <memory>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/core/exact_squares.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::parallel {

// What this rank holds of one model parameter, in the one description every
// layout uses (sharding::Placement: whole, a block, and under fsdp a range
// of the block's elements; a range of count 0 means nothing). replicated: every rank
// of the strategy's group holds the same block (data parallelism, small
// parameters FSDP keeps replicated, no_shard); otherwise the ranks of the
// shard group hold disjoint blocks that cover the tensor (hybrid sharding
// repeats them on every replica).
struct ParamShard {
  std::string name;
  sharding::Placement placement;  // placement.shape: the full parameter's shape
  bool replicated = true;
  bool operator==(const ParamShard&) const = default;
};

class Parallelism {
 public:
  virtual ~Parallelism() = default;

  // One line for the start-up log, e.g. "data parallel 4" or "data parallel
  // 4, fsdp full (1000 sharded + 10 replicated elements, 3 units)".
  virtual std::string describe() const = 0;

  // What the optimizer updates (see above).
  virtual std::vector<nn::Parameter*> optimizer_parameters() = 0;

  // Declares that the next backward is micro-batch `index` of a window of
  // `count` (gradient accumulation); the last one communicates.
  virtual void begin_micro_batch(int index, int count) = 0;
  // Collective: ends the window; afterwards optimizer_parameters()' grads
  // hold the reduced gradients.
  virtual void finish() = 0;
  // Collective: true when every gradient element on every rank is finite.
  virtual bool grads_finite() = 0;
  // Collective: the global L2 norm of the gradients.
  virtual double grad_norm() = 0;
  // Collective: the gradients' squares as one device of this group sees
  // them, split by whether `first(p)` holds for the model parameter p:
  // {sum over the p where it holds, sum over the others}. Tensor
  // parallelism adds the first part (its blocks) over the tensor axis and
  // counts the second (replicated parameters) once.
  virtual std::pair<double, double> grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) = 0;
  // Collective: the deterministic mode's squares (docs/determinism.md): the
  // exact sum of the squares of every gradient element of the model
  // parameters p where counted(p) holds, each element once, as one device
  // holds them (core/exact_squares.h: the same bits on any layout). The
  // default throws Unsupported (tensor and expert axes).
  virtual ExactSquares grad_squares_exact(const std::function<bool(const nn::Parameter&)>& counted);
  // Collective: after an optimizer step changed optimizer_parameters(),
  // makes the model compute with the new values.
  virtual void after_step() = 0;
  // Zeroes every gradient the strategy accumulates into.
  virtual void zero_grad() = 0;

  // Collective: every model parameter's value becomes its full f32 tensor
  // (for saving and inspection) until the next use; reshard() ends that and
  // frees working copies an evaluation forward left behind.
  virtual void gather_full_parameters() = 0;
  virtual void reshard() = 0;

  // True when the gradients are computed or reduced in fp16, so a dynamic
  // loss scaler must guard them (bf16 and f32 have f32's range).
  virtual bool needs_loss_scaling() const = 0;
  // Share of the last step's gradient communication hidden behind backward,
  // where the strategy measures it.
  virtual std::optional<double> hidden_fraction() const { return std::nullopt; }

  // For checkpoints: what this rank holds of every model parameter, in the
  // model's parameter order.
  virtual std::vector<ParamShard> parameter_shards() const = 0;

  // Communicators the strategy owns beyond the mesh's, by name, for traffic
  // figures (a pipeline's "tied"; an entry may be null on ranks that do not
  // take part, but every rank lists the same names). Default: none.
  virtual std::vector<std::pair<std::string, comm::Communicator*>> own_communicators() const { return {}; }
};

// Collective over c: every rank's exact squares merged (integer sums: the
// same result on every rank, whatever the order).
ExactSquares merged_over(comm::Communicator& c, const ExactSquares& mine);

// A strategy's once-per-step part for one more mesh axis around another
// strategy (TensorParallel, ExpertParallel): every call goes to the inner
// strategy unless the axis adds to it. The helpers below are what such an
// axis adds, over its communicator.
class WrappedParallelism : public Parallelism {
 public:
  std::vector<nn::Parameter*> optimizer_parameters() override { return inner_->optimizer_parameters(); }
  void begin_micro_batch(int index, int count) override { inner_->begin_micro_batch(index, count); }
  void finish() override { inner_->finish(); }
  bool grads_finite() override { return inner_->grads_finite(); }
  double grad_norm() override { return inner_->grad_norm(); }
  std::pair<double, double> grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) override {
    return inner_->grad_sq_split(first);
  }
  void after_step() override { inner_->after_step(); }
  void zero_grad() override { inner_->zero_grad(); }
  void gather_full_parameters() override { inner_->gather_full_parameters(); }
  void reshard() override { inner_->reshard(); }
  bool needs_loss_scaling() const override { return inner_->needs_loss_scaling(); }
  std::optional<double> hidden_fraction() const override { return inner_->hidden_fraction(); }
  std::vector<ParamShard> parameter_shards() const override { return inner_->parameter_shards(); }
  std::vector<std::pair<std::string, comm::Communicator*>> own_communicators() const override {
    return inner_->own_communicators();
  }

 protected:
  explicit WrappedParallelism(std::unique_ptr<Parallelism> inner) : inner_(std::move(inner)) {}
  // Collective over `axis`: the inner strategy's grads_finite on every rank of it.
  bool grads_finite_over(comm::Communicator& axis);
  // Collective over `axis`: the inner strategy's squares split by `first`,
  // the parameters where `distinct` holds (tensor blocks, experts: each rank
  // of the axis holds its own) added over the axis, the others counted once.
  std::pair<double, double> grad_sq_split_over(comm::Communicator& axis,
                                               const std::function<bool(const nn::Parameter&)>& first,
                                               const std::function<bool(const nn::Parameter&)>& distinct);
  // Collective over `axis`: the global norm, `distinct` parameters' squares
  // added over the axis, the others counted once.
  double grad_norm_over(comm::Communicator& axis, const std::function<bool(const nn::Parameter&)>& distinct);

  std::unique_ptr<Parallelism> inner_;
};

}  // namespace meshtrain::parallel
