// A trainer of its own, built against an installed meshtrain (docs/install.md):
// a model meshtrain does not ship (an MLP that tells three interleaved
// spirals apart) on data it makes itself, registered as a model recipe
// (meshtrain/train/model_recipe.h) and trained through meshtrain's loop
// (meshtrain/train/trainer.h) on simulated devices of the threads engine,
// twice: plain data parallelism over a mesh data=N, then ZeRO-3 over a
// mesh fsdp=N (parameters, gradients and optimizer state sharded).
//
//   consumer [--devices N] [--epochs E] [--out DIR]
//
// Prints the loss of each run falling and its test accuracy; exits 1 when a
// loss did not fall to half its start, the accuracy is below 90%, or the two
// runs disagree (meshtrain's parity contract: any strategy computes what
// one device does), 2 on bad arguments.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/sequential.h"
#include "meshtrain/train/model_recipe.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/version.h"

namespace {

using namespace meshtrain;

constexpr int kClasses = 3;
constexpr int kHidden = 64;

// Points on three spiral arms (one per class) with a little noise; a pure
// function of (seed, n), made once per process and shared by its ranks.
class SpiralData final : public data::DataSource {
 public:
  SpiralData(int64_t n, uint64_t seed) : points_(static_cast<size_t>(2 * n)), labels_(static_cast<size_t>(n)) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> along(0.05, 1.0);
    std::normal_distribution<double> noise(0.0, 0.03);
    for (int64_t i = 0; i < n; ++i) {
      const int label = static_cast<int>(i % kClasses);
      const double r = along(rng);
      const double angle = 3.0 * std::numbers::pi * r + 2.0 * std::numbers::pi * label / kClasses;
      points_[static_cast<size_t>(2 * i)] = static_cast<float>(r * std::cos(angle) + noise(rng));
      points_[static_cast<size_t>(2 * i + 1)] = static_cast<float>(r * std::sin(angle) + noise(rng));
      labels_[static_cast<size_t>(i)] = label;
    }
  }
  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  std::string source() const override { return "three spirals (synthetic)"; }
  void load(std::span<const int64_t> rows, data::Batch& batch, MemoryTracker* tracker) const override {
    const auto n = static_cast<int64_t>(rows.size());
    Tensor x = Tensor::empty({n, 2}, DType::f32, Device::cpu(), tracker, MemoryCategory::activations);
    Tensor y = Tensor::empty({n}, DType::i64, Device::cpu(), tracker, MemoryCategory::activations);
    for (int64_t r = 0; r < n; ++r) {
      const auto row = static_cast<size_t>(rows[static_cast<size_t>(r)]);
      x.data<float>()[2 * r] = points_[2 * row];
      x.data<float>()[2 * r + 1] = points_[2 * row + 1];
      y.data<int64_t>()[r] = labels_[row];
    }
    batch.add("points", std::move(x));
    batch.add("labels", std::move(y));
  }

 private:
  std::vector<float> points_;
  std::vector<int64_t> labels_;
};

// One rank's MLP 2 -> 64 -> 64 -> 3 (tanh) with a softmax cross-entropy.
class SpiralModel final : public train::RecipeModel {
 public:
  explicit SpiralModel(const train::ModelOptions& o) {
    // Under ZeRO-3 (defer_init) each rank builds only its shard of the
    // parameters; their values are the same either way.
    const auto linear = [&](int64_t in, int64_t out, bool input_grad) {
      return std::make_unique<nn::Linear>(in, out, net_.next_name(), o.seed,
                                          nn::LinearOptions{.needs_input_grad = input_grad, .defer_init = o.defer_init});
    };
    net_.add(linear(2, kHidden, false));
    net_.add(std::make_unique<nn::Tanh>());
    net_.add(linear(kHidden, kHidden, true));
    net_.add(std::make_unique<nn::Tanh>());
    net_.add(linear(kHidden, kClasses, true));
  }
  nn::Module& module() override { return net_; }
  double loss_step(const data::Batch& micro, int64_t, double norm) override {
    // The loss is divided by the global batch (norm): the data-parallel sum
    // of the ranks' gradients is the whole batch's.
    const double loss = loss_.forward(net_.forward(micro["points"]), micro["labels"], norm);
    net_.backward(loss_.backward());
    return loss;
  }
  std::vector<double> evaluate(const data::Batch& chunk, int64_t n) override {
    const Tensor logits = net_.forward(chunk["points"]);
    const double loss = loss_.forward(logits, chunk["labels"], static_cast<double>(n));
    double correct = 0;
    for (int64_t r = 0; r < chunk.size(); ++r) {
      const float* z = logits.data<float>() + r * kClasses;
      int best = 0;
      for (int c = 1; c < kClasses; ++c)
        if (z[c] > z[best]) best = c;
      correct += best == chunk["labels"].data<int64_t>()[r] ? 1 : 0;
    }
    return {loss, correct / static_cast<double>(n)};
  }
  train::Evaluation summarize(std::span<const double> s, int64_t) const override {
    char line[96];
    std::snprintf(line, sizeof line, "test accuracy %.2f%% (test loss %.4f)", 100 * s[1], s[0]);
    return {.loss = s[0], .metrics = {{"loss", s[0]}, {"accuracy", s[1]}}, .epoch_line = line, .final_line = line};
  }

 private:
  nn::Sequential net_;
  nn::CrossEntropyLoss loss_;
};

class SpiralRecipe final : public train::ModelRecipe {
 public:
  explicit SpiralRecipe(const train::TrainConfig& tc) : train_(6144, tc.seed), test_(1536, tc.seed + 1) {}
  const data::DataSource& train_data() const override { return train_; }
  const data::DataSource& test_data() const override { return test_; }
  train::MetricsDescription metrics() const override { return {"loss", "test loss", "three spirals (consumer)"}; }
  std::unique_ptr<train::RecipeModel> build(const train::ModelOptions& o) const override {
    return std::make_unique<SpiralModel>(o);
  }

 private:
  SpiralData train_, test_;
};

struct Options {
  int devices = 2;
  int epochs = 16;
  std::filesystem::path out = std::filesystem::temp_directory_path() / "meshtrain_consumer";
};

// One run of the recipe on `devices` simulated devices along `axis`
// ("data": DataParallel; "fsdp" with fsdp = zero3: ZeRO-3).
train::TrainResult train_spirals(const Options& opt, const std::string& axis, const std::string& fsdp) {
  train::TrainConfig tc;
  tc.model = "spirals";
  tc.epochs = opt.epochs;
  tc.batch_size = 128;  // the global batch: 64 rows per rank on 2 devices
  tc.optimizer = "adamw";
  tc.lr = 0.03;
  tc.schedule = "cosine";
  tc.log_every = 24;
  tc.threads_per_rank = 1;
  tc.set("fsdp", fsdp, "consumer");
  tc.fsdp_min_weight_size = 0;  // shard every parameter, the biases too
  tc.run_dir = (opt.out / (fsdp.empty() ? axis : fsdp)).string();
  tc.overwrite = true;
  config::DistributedConfig dc;
  dc.world_size = opt.devices;
  dc.num_processes_per_node = opt.devices;
  dc.mesh_shape = {opt.devices};
  dc.mesh_axis_names = {axis};
  return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = opt.devices});
}

// Prints the run's loss curve (the mean step loss of each sixth of the run)
// and whether it fell to half its start; false when it did not.
bool report(const char* name, const train::TrainResult& r) {
  const std::vector<double>& l = r.step_losses;
  std::printf("%s: %s\n  loss by sixths of %zu steps:", name, r.parallelism.c_str(), l.size());
  constexpr size_t kParts = 6;
  std::vector<double> means;
  for (size_t p = 0; p < kParts && l.size() >= kParts; ++p) {
    double sum = 0;
    const size_t lo = p * l.size() / kParts, hi = (p + 1) * l.size() / kParts;
    for (size_t i = lo; i < hi; ++i) sum += l[i];
    means.push_back(sum / static_cast<double>(hi - lo));
    std::printf(" %.4f", means.back());
  }
  const bool fell = !means.empty() && means.back() < 0.5 * means.front() && r.test_accuracy >= 0.9;
  std::printf("\n  %s: %s\n", fell ? "the loss fell" : "FAILED: the loss did not fall to half, or accuracy < 90%",
              r.test_summary.c_str());
  return fell;
}

Options parse(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (i + 1 < argc && arg == "--devices") {
      opt.devices = std::atoi(argv[++i]);
    } else if (i + 1 < argc && arg == "--epochs") {
      opt.epochs = std::atoi(argv[++i]);
    } else if (i + 1 < argc && arg == "--out") {
      opt.out = argv[++i];
    } else {
      std::fprintf(stderr, "usage: consumer [--devices N] [--epochs E] [--out DIR]\n");
      std::exit(2);
    }
  }
  if (opt.devices < 1 || opt.devices > 64 || opt.epochs < 1) {
    std::fprintf(stderr, "consumer: --devices takes 1 to 64, --epochs at least 1\n");
    std::exit(2);
  }
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  try {
    std::string engines;
    for (const std::string& e : comm::engines().names()) engines += (engines.empty() ? "" : ", ") + e;
    std::printf("meshtrain %s (engines: %s); %d simulated devices\n", meshtrain::version_string, engines.c_str(),
                opt.devices);
    train::register_model_recipe({.name = "spirals",
                                  .help = "an MLP on three interleaved spirals (examples/consumer)",
                                  .make = [](const train::TrainConfig& tc) { return std::make_unique<SpiralRecipe>(tc); }});
    const train::TrainResult dp = train_spirals(opt, "data", "");
    const train::TrainResult zero3 = train_spirals(opt, "fsdp", "zero3");
    bool ok = report("data parallel", dp);
    ok = report("ZeRO-3", zero3) && ok;
    // Same global batch, same numbers: the strategies differ only in float
    // summation order.
    bool same = dp.step_losses.size() == zero3.step_losses.size();
    double gap = 0;
    for (size_t i = 0; same && i < dp.step_losses.size(); ++i)
      gap = std::max(gap, std::fabs(dp.step_losses[i] - zero3.step_losses[i]) / (1 + std::fabs(dp.step_losses[i])));
    same = same && gap <= 1e-4;
    std::printf("data parallel and ZeRO-3: largest step-loss difference %.2g: %s\n", gap,
                same ? "the same run" : "FAILED: they differ");
    std::printf("result: %s, test accuracy %.2f%% (data parallel) and %.2f%% (ZeRO-3)\n", ok && same ? "PASS" : "FAIL",
                100 * dp.test_accuracy, 100 * zero3.test_accuracy);
    return ok && same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: error: %s\n", e.what());
    return 1;
  }
}
