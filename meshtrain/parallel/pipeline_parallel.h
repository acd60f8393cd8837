// PipelineParallel: the Parallelism (parallelism.h) of one pipeline rank.
// The rank holds one or more stages of the model (a schedule with virtual
// stages gives it several chunks); each stage has its own data-parallel
// strategy (DataParallel or FullyShardedDataParallel over the data axes),
// and this class combines them over the pipeline axis, so the trainer's step
// protocol stays the one of parallelism.h:
//
//   std::vector<PipelineParallel::Stage> stages;                 // this rank's, ascending
//   stages.push_back({.index = s, .strategy = std::make_unique<DataParallel>(part, dp, {}), .tied = {}});
//   PipelineParallel par(std::move(stages), pp_comm);           // collective over pp_comm
//   ... executor: par.stage(k).begin_micro_batch(mb, m) before stage k's weight pass of mb ...
//   par.finish();             // every stage's reduction, then the tied gradients summed
//   par.grads_finite(); par.grad_norm();                        // over every stage of the pipeline
//
// Contracts:
// - Micro-batches: the pipeline schedule runs a stage's weight passes in
//   micro-batch order but interleaves the stages of a rank, so each stage's
//   strategy is told separately (stage(k).begin_micro_batch);
//   begin_micro_batch on this object is an InvalidArgument.
// - Tied parameters (a GPT's wte: the first stage's embedding and the last
//   stage's head): every stage that holds one lists its name in
//   Stage::tied. After every stage's finish(), the ranks holding tied stages
//   add those gradients (this rank's optimizer parameters of that name: the
//   whole tensor, or a flat shard that must cover the same elements on both
//   stages, checked at construction) over a communicator of their own, so
//   both copies take the same update. In norms and finiteness checks the
//   copy on the lowest stage counts, the others not; parameter_shards()
//   lists every copy a rank holds (the placement rule's view: each stage
//   holds its own).
// - Collective calls (construction, finish, grads_finite, grad_norm,
//   grad_sq_split, after_step, gather_full_parameters) are collective over
//   the pipeline communicator and every stage strategy's group; every rank
//   of the job makes them in the same order.
// Thread-safety: one rank's thread, like its strategies.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/parallel/parallelism.h"

namespace meshtrain::parallel {

class PipelineParallel final : public Parallelism {
 public:
  struct Stage {
    int index = 0;                            // the stage's index in the pipeline
    std::unique_ptr<Parallelism> strategy;    // over that stage's part of the model
    std::vector<std::string> tied = {};       // its parameters another stage holds too
  };
  // stages: this rank's, ascending by index, at least one; pp: the pipeline
  // axis (borrowed). InvalidArgument for tied parameters whose optimizer
  // parts differ between the stages that hold them.
  PipelineParallel(std::vector<Stage> stages, comm::Communicator& pp);

  int num_stages_here() const { return static_cast<int>(stages_.size()); }
  // The strategy of this rank's k-th stage (ascending).
  Parallelism& stage(int k) { return *stages_.at(static_cast<size_t>(k)).strategy; }

  std::string describe() const override;
  std::vector<nn::Parameter*> optimizer_parameters() override;
  void begin_micro_batch(int index, int count) override;
  void finish() override;
  bool grads_finite() override;
  double grad_norm() override;
  std::pair<double, double> grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) override;
  ExactSquares grad_squares_exact(const std::function<bool(const nn::Parameter&)>& counted) override;
  void after_step() override;
  void zero_grad() override;
  void gather_full_parameters() override;
  void reshard() override;
  bool needs_loss_scaling() const override;
  std::optional<double> hidden_fraction() const override;
  std::vector<ParamShard> parameter_shards() const override;
  // {"tied", tied_communicator()}.
  std::vector<std::pair<std::string, comm::Communicator*>> own_communicators() const override {
    return {{"tied", tied_communicator()}};
  }

  // The communicator of the ranks holding tied stages, which sums the tied
  // gradients in finish() (null on the others, and without tied parameters).
  comm::Communicator* tied_communicator() const { return tied_comm_.get(); }

 private:
  // The tied copies this rank does not count (on a stage above the lowest holder).
  bool counted_elsewhere(const Stage& s, const std::string& name) const;
  std::vector<Stage> stages_;
  comm::Communicator& pp_;
  std::unique_ptr<comm::Communicator> tied_comm_;  // the ranks holding tied stages (null elsewhere)
  std::vector<nn::Parameter*> tied_params_;        // this rank's optimizer parts of them
  int lowest_tied_stage_ = -1;                     // the stage whose copy counts
};

}  // namespace meshtrain::parallel
