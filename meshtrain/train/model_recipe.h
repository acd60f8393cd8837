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
#include "meshtrain/nn/module.h"
#include "meshtrain/nn/tensor_parallel.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/train/sampler.h"
#include "meshtrain/train/train_config.h"

namespace meshtrain::train {

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
  // The module the parallelism wraps (it must outlive nothing of the recipe).
  virtual nn::Module& module() = 0;
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
};

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
