// The trainer's pipeline (trainer.h with a pipeline axis): this rank's
// stages of the recipe's model (RecipeStage) run by the schedule's executor
// (parallel/pipeline_executor.h), one optimizer step at a time; evaluation
// forwards through the stages; the parameters of every stage collected on
// pipeline rank 0 for saving; the step's timeline.
//
//   PipelineRun pipe(schedule, pp_comm, model->stages(), parallelism);
//   double loss = pipe.step(batch, step, norm);   // collective over pp: the last stage's loss, 0 elsewhere
//   std::vector<double> sums = pipe.evaluate(chunk, n);  // every pipeline rank gets the last stage's sums
//
// Contracts:
// - step() cuts the batch into schedule().micro_batches micro-batches of
//   consecutive rows (as the data-parallel trainer does), tells each stage's
//   strategy its micro-batch before the stage's weight pass of it, and
//   returns the sum of the last stage's micro-batch losses (0 on ranks
//   without the last stage). Every rank of the pipeline axis calls it with
//   the same batch rows (the sampler is the data axes').
// - evaluate() runs this rank's stages of one chunk, receiving (blocking)
//   and sending (asynchronous; tags above the executor's), so consecutive
//   chunks flow through the stages like micro-batches; the last stage's
//   rank returns the chunk's sums, the others nothing. share_sums()
//   (collective over the pipeline axis) then gives every rank the last
//   stage's totals.
// - collect_parameters(): collective over the pipeline axis; every rank
//   passes its stages' (name, full f32 value) pairs; pipeline rank 0 gets
//   all of them, in stage order, the others an empty vector.
// Thread-safety: the rank's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/parallel/pipeline_executor.h"
#include "meshtrain/parallel/pipeline_parallel.h"
#include "meshtrain/parallel/pipeline_timeline.h"
#include "meshtrain/train/model_recipe.h"

namespace meshtrain::train::internal {

// What write_timeline measured (rank 0's numbers).
struct PipelineReport {
  std::string schedule;     // parallel::to_string of its kind
  double bubble = 0;        // measured idle share of the step (parallel::measured_bubble)
  double theory = 0;        // parallel::theoretical_bubble
  int peak_in_flight = 0;   // micro-batches whose activations this rank held at once
};

class PipelineRun {
 public:
  // stages: this rank's (schedule.stage_rank(s) == pp.rank()), ascending;
  // strategies.stage(k) is stages[k]'s. All borrowed.
  PipelineRun(parallel::Schedule schedule, comm::Communicator& pp, std::vector<RecipeStage*> stages,
              parallel::PipelineParallel& strategies);
  ~PipelineRun();

  double step(const Batch& batch, int64_t step, double norm);
  std::vector<double> evaluate(const Batch& chunk, int64_t n);
  void share_sums(std::vector<double>& sums);
  std::vector<std::pair<std::string, Tensor>> collect_parameters(
      const std::vector<std::pair<std::string, Tensor>>& mine);

  // Collective over the pipeline axis: one line per stage, in stage order,
  // on pipeline rank 0 ("  stage 1 on pipeline rank 1: h.2.ln_1.weight ..
  // h.2.mlp.c_proj.bias, 12 tensors, 1774464 values": first and last
  // parameter, count, global elements), "" on the others.
  std::string describe_stages();
  // Collective over the pipeline axis: the last step's timeline of every
  // rank; where dir is given (world rank 0), written as
  // pipeline.trace.json and pipeline.svg, titled with `step`.
  PipelineReport write_timeline(const RunDirectory* dir, int64_t step);

  const parallel::Schedule& schedule() const { return schedule_; }
  const parallel::PipelineExecutor& executor() const { return *executor_; }
  // The last step's Saved states alive at once on this rank.
  int peak_saved() const { return executor_->peak_saved(); }

 private:
  class Adapter;  // a RecipeStage as the executor's PipelineStage
  parallel::Schedule schedule_;
  comm::Communicator& pp_;
  std::vector<RecipeStage*> stages_;
  std::vector<int> indices_;  // stages_' indices in the pipeline
  std::vector<std::unique_ptr<Adapter>> adapters_;
  std::unique_ptr<parallel::PipelineExecutor> executor_;
  std::vector<Batch> micro_;  // the current step's micro-batches
};

// The whole model (recipe.build without stages) holding `params` (every
// stage's, by name); InvalidArgument naming `model` and the parameter no
// stage held.
std::unique_ptr<RecipeModel> assemble_model(const ModelRecipe& recipe, uint64_t seed, const std::string& model,
                                            std::vector<std::pair<std::string, Tensor>>& params);

}  // namespace meshtrain::train::internal
