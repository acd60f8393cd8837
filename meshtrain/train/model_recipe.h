// Model recipes: how a model plugs into the trainer (trainer.h) without
// editing it. A recipe, registered by name, loads its data once per process
// and builds one RecipeModel per rank; the trainer runs every step,
// evaluation and artifact through these interfaces.
//
//   register_model_recipe({.name = "linreg", .help = "linear regression on synthetic data",
//                          .make = [](const TrainConfig& tc) { return std::make_unique<LinRegRecipe>(tc); }});
//   TrainConfig tc;
//   tc.model = "linreg";                   // TOML `model = "linreg"`, --model linreg
//   run_training(tc, dc, launch);          // the same loop as mlp and vae
//
// Built in: "mlp" (classifier) and "vae" on Fashion-MNIST
// (builtin_recipes.cc).
//
// Contracts:
// - ModelRecipe is made once per process (make_model_recipe); its data is
//   shared read-only by the ranks of that process (the threads engine runs
//   them all in one). build() is called once per rank, concurrently on the
//   threads engine: it must only read the recipe.
// - RecipeModel::loss_step gets this rank's rows of one micro-batch and a
//   normalizer: the loss it backpropagates is (sum over its samples) /
//   norm, so the data-parallel sum of the gradients is the global batch's
//   (norm = global batch size / loss scale). It returns that local part of
//   the (scaled) loss; forward and backward run inside (the parallelism's
//   hooks communicate there).
// - evaluate() returns sums over its samples (each divided by `n`, the test
//   set's size, where that makes a mean); the trainer adds them over chunks,
//   all-reduces them across data-parallel ranks in f64 and passes them to
//   summarize(), which every rank calls with the same numbers. Every rank
//   calls evaluate() the same number of times (forwards may be collective).
// - write_artifacts() is collective (forwards under fsdp); `dir` is null on
//   the ranks that do not write. It writes the files ModelRecipe::artifacts()
//   names (declared up front: an --overwrite may replace only known names).
// Errors: make_model_recipe and find_model_recipe throw InvalidArgument for
// an unknown name, listing the registered ones.
// Thread-safety: the registry is guarded by a mutex; a RecipeModel belongs to
// its rank's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/layout/training_layout.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/nn/moe.h"
#include "meshtrain/nn/parallel/context_parallel.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/data/sampler.h"
#include "meshtrain/train/train_config.h"

namespace meshtrain::train {

// The data layer's batches and sources, as a recipe sees them (data/sampler.h).
using data::Batch;
using data::DataSource;

// How a rank builds its model.
struct ModelOptions {
  uint64_t seed = 0;
  // Sharded strategies: leave parameter values undefined (Parameter::init
  // set) so the wrapper builds only what the rank stores.
  bool defer_init = false;
  DType compute_dtype = DType::f32;  // the dtype forward and backward compute in
  MemoryTracker* tracker = nullptr;  // activation buffers; may be null
  // The mesh's tensor axis: a recipe splits its model over it (the GPT:
  // nn::GPTConfig::tensor) or throws Unsupported naming the model.
  nn::TensorParallelGroup tensor = {};
  // The mesh's context axis: a recipe splits each sample's sequence over it
  // (the GPT: nn::GPTConfig::context; its loss and evaluation then cover
  // this rank's tokens, which the trainer's sums over the axis add up) or
  // throws Unsupported naming the model.
  nn::ContextParallelGroup context = {};
  // The mesh's expert axis: a recipe splits its mixture-of-experts layers'
  // experts over it (the GPT: nn::GPTConfig::expert; every other parameter
  // replicated); a recipe without experts never gets one (the start-up
  // check refuses it).
  nn::ExpertParallelGroup expert = {};
  // Pipeline parallelism: the model cut into `pipeline_stages` consecutive
  // stages (the first reads the data, the last computes the loss); build
  // only `stages` of them (this rank's, ascending), reached through
  // RecipeModel::stages(). pipeline_stages 1: the whole model. A recipe
  // that cannot be cut throws Unsupported naming the model.
  int pipeline_stages = 1;
  std::vector<int> stages = {};
};

// A model's mixture-of-experts layers with their block index in the whole
// model (RecipeModel::moe_layers).
using MoELayers = std::vector<std::pair<int64_t, nn::MoE*>>;

// One pipeline stage of a recipe's model (ModelOptions::pipeline_stages),
// as the trainer's pipeline executor drives it: every micro-batch of a step
// is in flight with its own nn::Saved, so nothing of a micro-batch may live
// in the stage object between calls (the Saved holds it).
class RecipeStage {
 public:
  virtual ~RecipeStage() = default;
  // This stage's part of the model (what its data-parallel strategy wraps).
  virtual nn::Module& module() = 0;
  // Its FSDP units (RecipeModel::fsdp_units); empty: one per module that
  // owns parameters.
  virtual std::vector<nn::Module*> fsdp_units() { return {}; }
  // Its mixture-of-experts layers (RecipeModel::moe_layers).
  virtual MoELayers moe_layers() { return {}; }
  // Forward of micro-batch `micro` (this rank's rows) at step `step`:
  // stage 0 reads micro's data, the others take `input`, the previous
  // stage's output. Returns the next stage's input; the last stage instead
  // returns an undefined tensor and its loss (loss_step's number) in *loss.
  virtual Tensor forward(const Batch& micro, int64_t step, double norm, const Tensor& input, nn::Saved& saved,
                         double* loss) = 0;
  // The gradient of forward's input from that of its output (undefined on
  // the last stage: it starts from its loss); undefined on stage 0.
  virtual Tensor backward_input(const Tensor& grad, nn::Saved& saved) = 0;
  // The weight gradients of that backward.
  virtual void backward_weight(nn::Saved& saved) = 0;
  // The two as one pass (the module's fused backward, which frees each
  // layer's buffers as it goes); the default runs backward_input, then
  // backward_weight.
  virtual Tensor backward(const Tensor& grad, nn::Saved& saved) {
    Tensor g = backward_input(grad, saved);
    backward_weight(saved);
    return g;
  }
  // The shape of forward's input for `micro` (stages after the first).
  virtual std::vector<int64_t> input_shape(const Batch& micro) const = 0;
  // Evaluation mode: forward of a test chunk; the last stage adds
  // RecipeModel::evaluate's sums into *sums (sized by it) and returns an
  // undefined tensor.
  virtual Tensor evaluate(const Batch& chunk, int64_t n, const Tensor& input, std::vector<double>* sums) = 0;
  // Parameters this stage holds that another stage holds too (a GPT's wte:
  // the first stage's embedding, the last stage's head), listed by every
  // stage that holds them: their gradients are added over those stages, and
  // the copy on the lowest stage is the one counted (norms, saving).
  virtual std::vector<std::string> tied_parameters() const { return {}; }
};

// The numbers of one evaluation over the test set.
struct Evaluation {
  double loss = 0;  // per test sample; the test curve, TrainResult::test_loss; must be finite
  // The test line of metrics.jsonl after "step" and "epoch", in order (the
  // loss under its own name, e.g. "loss" or "neg_elbo").
  std::vector<std::pair<std::string, double>> metrics;
  std::string epoch_line;  // printed after "epoch N: "
  std::string final_line;  // printed after "final " when the run is done
};

// How the trainer names a recipe's numbers.
struct MetricsDescription {
  std::string test_loss = "loss";        // in messages: "the test {test_loss} after step 5 is nan"
  std::string test_curve = "test loss";  // the series in loss.svg
  std::string chart_title = {};          // loss.svg's title
  // The progress line's and summary's rate in other units than samples
  // (a language model: "tokens", context tokens per sample); "" = samples.
  std::string rate_unit = {};
  double units_per_sample = 1.0;
};

// One rank's model and what it computes.
class RecipeModel {
 public:
  virtual ~RecipeModel() = default;
  // The module the parallelism wraps (it must outlive nothing of the recipe);
  // with pipeline stages, the first of this rank's.
  virtual nn::Module& module() = 0;
  // This rank's pipeline stages (ModelOptions::stages' order); empty for a
  // whole model. The trainer then runs them instead of loss_step and
  // evaluate (summarize still makes the numbers).
  virtual std::vector<RecipeStage*> stages() { return {}; }
  // The test set's chunk size the trainer hands evaluate() (at most;
  // forwards of more rows would hold too many activations at once).
  virtual int64_t evaluation_rows() const { return 1000; }
  // Forward, loss and backward of `micro` (this rank's rows of a
  // micro-batch) at optimizer step `step`, the loss divided by `norm`;
  // returns this rank's part of the scaled loss (see above).
  virtual double loss_step(const Batch& micro, int64_t step, double norm) = 0;
  // Sums over the test samples in `chunk` (see above); the same count of
  // numbers on every call. The module is in evaluation mode.
  virtual std::vector<double> evaluate(const Batch& chunk, int64_t n) = 0;
  // The evaluation from the all-reduced sums over the whole test set of n.
  virtual Evaluation summarize(std::span<const double> sums, int64_t n) const = 0;
  // Collective: writes the recipe's own files (ModelRecipe::artifacts())
  // into `dir` (null on ranks that do not write). model.safetensors,
  // metrics.jsonl and loss.svg are the trainer's.
  virtual void write_artifacts(const RunDirectory* dir) { (void)dir; }
  // The modules fully sharded training makes one unit each (gathered and
  // freed together), e.g. each transformer block and then the root for the
  // rest; empty: one unit per module that owns parameters.
  virtual std::vector<nn::Module*> fsdp_units() { return {}; }
  // The model's mixture-of-experts layers, each with its block index in the
  // whole model: the trainer reports their expert load once per step
  // (summed over the ranks that see other tokens) and applies DeepSeek-V3's
  // bias update (MoE::update_bias). None by default.
  virtual MoELayers moe_layers() { return {}; }
};

// A RecipeModel built in pipeline stages (ModelOptions::stages): holds this
// rank's stages for the trainer's executor; loss_step and evaluate, which
// the trainer does not call then, are InvalidArgument; summarize is the
// recipe's function.
class StagedModel final : public RecipeModel {
 public:
  using Summarize = std::function<Evaluation(std::span<const double>, int64_t)>;
  StagedModel(std::vector<std::unique_ptr<RecipeStage>> stages, Summarize summarize, int64_t evaluation_rows = 1000);
  nn::Module& module() override { return stages_.front()->module(); }
  std::vector<RecipeStage*> stages() override;
  double loss_step(const Batch& micro, int64_t step, double norm) override;
  std::vector<double> evaluate(const Batch& chunk, int64_t n) override;
  int64_t evaluation_rows() const override { return evaluation_rows_; }
  Evaluation summarize(std::span<const double> sums, int64_t n) const override { return summarize_(sums, n); }

 private:
  std::vector<std::unique_ptr<RecipeStage>> stages_;
  Summarize summarize_;
  int64_t evaluation_rows_;
};

// A model with its data, once per process.
class ModelRecipe {
 public:
  virtual ~ModelRecipe() = default;
  virtual const DataSource& train_data() const = 0;
  virtual const DataSource& test_data() const = 0;
  virtual MetricsDescription metrics() const = 0;
  // The files RecipeModel::write_artifacts writes (names in the run directory).
  virtual std::vector<std::string> artifacts() const { return {}; }
  // One rank's model (see the contracts above).
  virtual std::unique_ptr<RecipeModel> build(const ModelOptions& options) const = 0;
};

struct RecipeRegistration {
  std::string name;  // the value of `model`
  std::string help;  // one line for --help
  // Loads the data and returns the recipe for a validated config.
  std::function<std::unique_ptr<ModelRecipe>(const TrainConfig&)> make;
  // The files its recipes write (ModelRecipe::artifacts()), known before
  // any data is loaded: the CLI's early run-directory check uses them.
  std::vector<std::string> artifacts = {};
  // Part of the start-up checks (resolve_training calls it before any data
  // is loaded or rank started): throws, naming the flag and the fix, for a
  // layout the model cannot take (sizes its heads, sequence or layers do
  // not divide; an axis it has no use for), so build() never refuses one
  // after start-up. Empty: every layout.
  std::function<void(const TrainConfig&, const layout::TrainingLayout&)> check = {};
};

// A pipeline's cut for recipes: `costs` holds one cost per layer (units
// that may not be split, in model order; a stage's extra work such as a
// head added to its end layer); returns each stage's layers [first, last),
// consecutive, none empty, balanced by cost (sharding::PipelineParallelStrategy).
// InvalidArgument naming `model` when there are fewer layers than stages.
std::vector<std::pair<int, int>> pipeline_cut(const std::vector<double>& costs, int stages, std::string_view model);

// Adds a recipe; throws InvalidArgument when the name is taken or empty, or
// make is empty.
void register_model_recipe(RecipeRegistration registration);
// Registered names in registration order (the built-ins first).
std::vector<std::string> model_recipe_names();
// The registration of `name`; InvalidArgument listing the names otherwise.
const RecipeRegistration& find_model_recipe(std::string_view name);
// find_model_recipe(tc.model).make(tc).
std::unique_ptr<ModelRecipe> make_model_recipe(const TrainConfig& tc);

}  // namespace meshtrain::train
