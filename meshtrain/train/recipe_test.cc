// A model recipe of this test's own, linear regression on synthetic data,
// registered by name, trains through the trainer's loop unchanged: typed
// batches with its own tensor names ("x", "y"), its own metric ("mse") in
// metrics.jsonl, its own artifact, plain data parallelism and fully sharded
// alike. Unknown names list the registered recipes.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/train/model_recipe.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int64_t kFeatures = 6;
// y = x . w + b + noise, noise N(0, 0.1^2): the best test mse is about 0.01.
const std::vector<float> kW = {0.5f, -1.0f, 2.0f, 0.25f, -0.75f, 1.5f};
constexpr float kB = 0.3f;

// Synthetic samples, a pure function of (seed, row).
class RegressionData final : public DataSource {
 public:
  RegressionData(int64_t n, uint64_t seed) : x_(Tensor::empty({n, kFeatures}, DType::f32)), y_(Tensor::empty({n, 1}, DType::f32)) {
    fill_normal(x_, seed, key_from_name("x"), 0.0, 1.0);
    Tensor noise = Tensor::empty({n, 1}, DType::f32);
    fill_normal(noise, seed, key_from_name("noise"), 0.0, 0.1);
    for (int64_t i = 0; i < n; ++i) {
      float v = kB + noise.data<float>()[i];
      for (int64_t k = 0; k < kFeatures; ++k) v += x_.data<float>()[i * kFeatures + k] * kW[static_cast<size_t>(k)];
      y_.data<float>()[i] = v;
    }
  }
  int64_t size() const override { return y_.size(0); }
  std::string source() const override { return "synthetic regression"; }
  void load(std::span<const int64_t> rows, Batch& batch, MemoryTracker* tracker) const override {
    const auto n = static_cast<int64_t>(rows.size());
    Tensor x = Tensor::empty({n, kFeatures}, DType::f32, Device::cpu(), tracker, MemoryCategory::activations);
    Tensor y = Tensor::empty({n, 1}, DType::f32, Device::cpu(), tracker, MemoryCategory::activations);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = rows[static_cast<size_t>(r)];
      for (int64_t k = 0; k < kFeatures; ++k) x.data<float>()[r * kFeatures + k] = x_.data<float>()[row * kFeatures + k];
      y.data<float>()[r] = y_.data<float>()[row];
    }
    batch.add("x", std::move(x));
    batch.add("y", std::move(y));
  }

 private:
  Tensor x_, y_;
};

class LinRegModel final : public RecipeModel {
 public:
  LinRegModel(uint64_t seed, bool defer)
      : linear_(kFeatures, 1, "linear", seed, nn::LinearOptions{.needs_input_grad = false, .defer_init = defer}) {}
  nn::Module& module() override { return linear_; }
  double loss_step(const Batch& micro, int64_t, double norm) override {
    const double loss = mse_.forward(linear_.forward(micro["x"]), micro["y"], norm);
    linear_.backward(mse_.backward());
    return loss;
  }
  std::vector<double> evaluate(const Batch& chunk, int64_t n) override {
    return {mse_.forward(linear_.forward(chunk["x"]), chunk["y"], static_cast<double>(n))};
  }
  Evaluation summarize(std::span<const double> s, int64_t) const override {
    return {.loss = s[0],
            .metrics = {{"mse", s[0]}},
            .epoch_line = fmt::format("test mse {:.5f}", s[0]),
            .final_line = fmt::format("test mse {:.5f}", s[0])};
  }
  void write_artifacts(const RunDirectory* dir) override {
    if (dir == nullptr) return;
    std::ofstream out(dir->file("fit.txt"));
    out << "bias " << linear_.bias().value.to_vector().at(0) << "\n";
  }

 private:
  nn::Linear linear_;
  nn::MSELoss mse_;
};

class LinRegRecipe final : public ModelRecipe {
 public:
  explicit LinRegRecipe(const TrainConfig& tc) : train_(512, tc.seed), test_(128, tc.seed + 1) {}
  const DataSource& train_data() const override { return train_; }
  const DataSource& test_data() const override { return test_; }
  MetricsDescription metrics() const override { return {"mse", "test mse", "linear regression"}; }
  std::vector<std::string> artifacts() const override { return {"fit.txt"}; }
  std::unique_ptr<RecipeModel> build(const ModelOptions& o) const override {
    return std::make_unique<LinRegModel>(o.seed, o.defer_init);
  }

 private:
  RegressionData train_, test_;
};

void register_linreg() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_model_recipe({"linreg", "linear regression on synthetic data",
                           [](const TrainConfig& tc) { return std::make_unique<LinRegRecipe>(tc); }});
  });
}

TrainResult train_linreg(const std::string& tag, int ranks, const std::string& fsdp,
                         const StopRequest* stop = nullptr, int64_t checkpoint_every = 0) {
  register_linreg();
  TrainConfig tc;
  tc.model = "linreg";
  tc.epochs = 8;
  tc.batch_size = 32;
  tc.micro_batches = 2;
  tc.optimizer = "sgd";
  tc.momentum = 0.9;
  tc.lr = 0.05;
  tc.schedule = "constant";
  tc.log_every = 16;
  tc.threads_per_rank = 1;
  tc.fsdp_min_weight_size = 0;  // under fsdp the weight is sharded too
  tc.set("fsdp", fsdp, "test");
  const fs::path dir = fs::temp_directory_path() / ("meshtrain_recipe_test_" + tag);
  tc.run_dir = dir.string();
  tc.overwrite = true;
  tc.checkpoint_every = checkpoint_every;
  config::DistributedConfig dc;
  dc.world_size = ranks;
  dc.num_processes_per_node = ranks;
  dc.mesh_shape = {ranks};
  dc.mesh_axis_names = {fsdp.empty() ? "data" : "fsdp"};
  return run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = ranks, .timeout = std::chrono::seconds(60)},
                      stop);
}

TEST(ModelRecipe, ARegisteredRecipeTrainsThroughTheSameLoop) {
  const TrainResult r = train_linreg("ddp", 2, "");
  EXPECT_EQ(r.steps, 8 * 512 / 32);
  // The loss falls to the noise floor (0.1^2) and the fit finds w and b.
  EXPECT_GT(r.step_losses.front(), 1.0);
  EXPECT_LT(r.test_loss, 0.02);
  ASSERT_EQ(r.test_metrics.size(), 1u);
  EXPECT_EQ(r.test_metrics[0].first, "mse");
  EXPECT_EQ(r.test_summary, fmt::format("test mse {:.5f}", r.test_loss));
  ASSERT_EQ(r.final_parameters.size(), 2u);
  EXPECT_EQ(r.final_parameters[0].first, "linear.weight");
  const std::vector<double> w = r.final_parameters[0].second.to_vector();
  for (size_t k = 0; k < kW.size(); ++k) EXPECT_NEAR(w[k], kW[k], 0.05) << k;
  EXPECT_NEAR(r.final_parameters[1].second.to_vector().at(0), kB, 0.05);
  // Its files beside the trainer's, its metric in metrics.jsonl.
  EXPECT_EQ(r.artifacts, std::vector<std::string>{"fit.txt"});
  EXPECT_TRUE(fs::exists(fs::path(r.run_dir) / "fit.txt"));
  EXPECT_TRUE(fs::exists(fs::path(r.run_dir) / "model.safetensors"));
  std::ifstream in(fs::path(r.run_dir) / "metrics.jsonl");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_THAT(ss.str(), HasSubstr("\"mse\":"));
  EXPECT_THAT(ss.str(), HasSubstr("\"hidden_fraction\":"));  // the strategy's own metric
}

TEST(ModelRecipe, FullyShardedRunsTheSameRecipeToTheSameNumbers) {
  const TrainResult ddp = train_linreg("ddp", 2, "");  // the first test's directory again: --overwrite replaces fit.txt too
  const TrainResult zero3 = train_linreg("zero3", 2, "zero3");
  EXPECT_EQ(zero3.fsdp, "zero3");
  ASSERT_EQ(ddp.step_losses.size(), zero3.step_losses.size());
  for (size_t s = 0; s < ddp.step_losses.size(); ++s)
    EXPECT_NEAR(ddp.step_losses[s], zero3.step_losses[s], 1e-5 * (1 + std::fabs(ddp.step_losses[s]))) << s;
  const std::vector<double> a = ddp.final_parameters[0].second.to_vector(),
                            b = zero3.final_parameters[0].second.to_vector();
  for (size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(a[k], b[k], 1e-5) << k;
}

TEST(StopRequest, ARequestBeforeTheFirstStepStopsEveryRankAfterIt) {
  StopRequest stop;
  stop.request();
  try {
    train_linreg("stop_first", 4, "zero3", &stop);
    ADD_FAILURE() << "no TrainingInterrupted";
  } catch (const TrainingInterrupted& e) {
    EXPECT_EQ(e.step(), 1);
    EXPECT_EQ(e.signal(), 0);
    EXPECT_THAT(e.what(), HasSubstr("stopped after step 1 of 128: "));
    EXPECT_THAT(e.what(), HasSubstr("was not committed and nothing was kept"));
  }
  // Nothing committed, nothing staged (no checkpoints were asked for).
  const fs::path dir = fs::temp_directory_path() / "meshtrain_recipe_test_stop_first";
  EXPECT_FALSE(fs::exists(dir / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dir.string() + ".incomplete"));
}

TEST(StopRequest, ARequestAtAnyMomentStopsEveryRankAfterTheSameStepWithACheckpoint) {
  // Requested from another thread while 4 ranks train: they read it at
  // different moments, but agree through the step's reduction (a rank that
  // went on alone would wait for the others and time out).
  for (int delay_us : {0, 300, 3000}) {
    StopRequest stop;
    std::thread requester([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      stop.request(SIGINT);
    });
    const std::string tag = fmt::format("stop_{}", delay_us);
    try {
      train_linreg(tag, 4, "zero3", &stop, /*checkpoint_every=*/1000);
      requester.join();
      ADD_FAILURE() << "no TrainingInterrupted";
      continue;
    } catch (const TrainingInterrupted& e) {
      requester.join();
      EXPECT_EQ(e.signal(), SIGINT);
      EXPECT_THAT(e.what(), HasSubstr(fmt::format("stopped after step {} of 128 (SIGINT)", e.step())));
      const fs::path staging = fs::temp_directory_path() / ("meshtrain_recipe_test_" + tag + ".incomplete");
      EXPECT_TRUE(fs::is_directory(staging / "checkpoints" / fmt::format("step_{:08d}", e.step()))) << e.what();
      fs::remove_all(staging);
    }
  }
}

TEST(ModelRecipe, UnknownNamesListTheRegisteredRecipes) {
  register_linreg();
  TrainConfig tc;
  tc.model = "bert";
  try {
    tc.validate();
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("model 'bert' is not a registered model recipe"));
    EXPECT_THAT(e.what(), HasSubstr("use model = \"mlp\", \"vae\", \"gpt\" or \"linreg\""));
  }
  EXPECT_EQ(model_recipe_names(), (std::vector<std::string>{"mlp", "vae", "gpt", "linreg"}));
  EXPECT_THROW(register_model_recipe({"mlp", "again", [](const TrainConfig& c) {
                                        return std::make_unique<LinRegRecipe>(c);
                                      }}),
               InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::train
