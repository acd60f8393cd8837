// The built-in model recipes (model_recipe.h): "mlp", a classifier, and
// "vae", a variational autoencoder, both on Fashion-MNIST. What each
// computes is exactly what the trainer computed before recipes existed
// (same forwards, same normalizers, same keys for dropout and noise).
#include "meshtrain/train/internal/builtin_recipes.h"

#include <fmt/format.h>

#include <memory>
#include <numeric>

#include "meshtrain/core/random.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/vae.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/data/idx.h"

namespace meshtrain::train::internal {

using data::Dataset;
using data::ImageDataSource;
using data::Split;
using data::load_fashion_mnist;
namespace {

// The Fashion-MNIST models split their Linear chains over a tensor axis;
// they have no sequence to split (their start-up checks).
void refuse_sequence_parallel(const layout::TrainingLayout& l, const char* model) {
  if (const int context = l.size(mesh::kContext); context > 1)
    throw Unsupported("meshtrain train",
                      fmt::format("a context axis of {} with model {}: it has no sequence to split", context, model),
                      "drop the context axis (it applies to model = \"gpt\")");
  if (l.sequence_parallel && l.size(mesh::kTensor) > 1)
    throw InvalidArgument("meshtrain train",
                          fmt::format("--sequence-parallel with model {}: it has no sequence to split", model),
                          "drop --sequence-parallel (it applies to model = \"gpt\")");
  if (const int expert = l.size(mesh::kExpert); expert > 1)
    throw Unsupported("meshtrain train",
                      fmt::format("an expert axis of {} with model {}: it has no experts to split", expert, model),
                      "use a data axis instead (experts: model = \"gpt\" with --arch llama --experts N)");
}

// The mlp's layer sizes: Fashion-MNIST's features, the hidden layers, its classes.
std::vector<int64_t> mlp_sizes(const TrainConfig& tc) {
  std::vector<int64_t> sizes = {data::kFashionMnistFeatures};
  for (int h : tc.hidden) sizes.push_back(h);
  sizes.push_back(static_cast<int64_t>(data::kFashionMnistClasses.size()));
  return sizes;
}

void check_mlp_layout(const TrainConfig& tc, const layout::TrainingLayout& l) {
  refuse_sequence_parallel(l, "mlp");
  if (const int stages = l.size(mesh::kPipeline) * l.virtual_stages; stages > 1) {
    nn::MLPConfig whole;
    whole.sizes = mlp_sizes(tc);
    (void)mlp_stage_configs(whole, l.size(mesh::kTensor), stages);  // InvalidArgument when a stage would be empty
  }
}

void check_vae_layout(const TrainConfig&, const layout::TrainingLayout& l) {
  refuse_sequence_parallel(l, "vae");
  if (l.size(mesh::kPipeline) > 1)
    throw Unsupported("meshtrain train", "model vae with a pipeline axis",
                      "train the VAE with data, fsdp and tensor axes; the mlp and gpt models cut into stages");
}

// Both recipes train on Fashion-MNIST: loaded once per process, shared
// read-only by the ranks.
class FashionMnistRecipe : public ModelRecipe {
 public:
  explicit FashionMnistRecipe(const TrainConfig& tc)
      : tc_(tc),
        train_set_(load_fashion_mnist(tc.data_dir, Split::train)),
        test_set_(load_fashion_mnist(tc.data_dir, Split::test)),
        train_(train_set_),
        test_(test_set_) {}
  const DataSource& train_data() const override { return train_; }
  const DataSource& test_data() const override { return test_; }

 protected:
  TrainConfig tc_;
  Dataset train_set_, test_set_;
  ImageDataSource train_, test_;
};

Evaluation mlp_summary(std::span<const double> s, int64_t n) {
  const double loss = s[0], accuracy = s[1] / static_cast<double>(n);
  return {.loss = loss,
          .metrics = {{"loss", loss}, {"accuracy", accuracy}},
          .epoch_line = fmt::format("test loss {:.4f}  test accuracy {:.2f}%", loss, 100 * accuracy),
          .final_line = fmt::format("test accuracy {:.2f}% (test loss {:.4f})", 100 * accuracy, loss)};
}

std::vector<float> row_values(const Tensor& t, int64_t i) {
  const Tensor row = t.select(0, i).contiguous();
  const float* p = row.data<float>();
  return {p, p + row.numel()};
}

// ---- mlp ----

class MlpModel final : public RecipeModel {
 public:
  MlpModel(const nn::MLPConfig& c, MemoryTracker* tracker) : mlp_(c) { mlp_.set_memory_tracker(tracker); }
  nn::Module& module() override { return mlp_; }

  double loss_step(const Batch& micro, int64_t step, double norm) override {
    mlp_.set_batch_context(static_cast<uint64_t>(step), micro.first_global_sample);  // dropout keys
    const Tensor logits = mlp_.forward(micro["images"]);
    const double loss = ce_.forward(logits, micro["labels"], norm);
    mlp_.backward(ce_.backward());
    return loss;
  }

  // {cross-entropy summed / n, correct predictions}
  std::vector<double> evaluate(const Batch& chunk, int64_t n) override {
    const Tensor logits = mlp_.forward(chunk["images"]);
    const Tensor& labels = chunk["labels"];
    return {ce_.forward(logits, labels, static_cast<double>(n)), static_cast<double>(nn::count_correct(logits, labels))};
  }

  Evaluation summarize(std::span<const double> s, int64_t n) const override { return mlp_summary(s, n); }

 private:
  nn::MLP mlp_;
  nn::CrossEntropyLoss ce_;
};

// One pipeline stage: Linears [first_layer, last_layer) (with their ReLUs
// and dropouts); the last stage also the loss. A micro-batch's Saved holds
// the part's state in child 0, the loss's in child 1.
class MlpStage final : public RecipeStage {
 public:
  MlpStage(const nn::MLPConfig& c, bool last, MemoryTracker* tracker)
      : mlp_(c), first_(c.first_layer == 0), last_(last), in_(c.sizes.at(static_cast<size_t>(c.first_layer))) {
    mlp_.set_memory_tracker(tracker);
  }
  nn::Module& module() override { return mlp_; }
  Tensor forward(const Batch& micro, int64_t step, double norm, const Tensor& input, nn::Saved& saved,
                 double* loss) override {
    mlp_.set_batch_context(static_cast<uint64_t>(step), micro.first_global_sample);  // dropout keys
    const Tensor out = mlp_.forward(first_ ? micro["images"] : input, saved.child(0));
    if (!last_) return out;
    *loss = ce_.forward(out, micro["labels"], saved.child(1), norm);
    return Tensor();
  }
  Tensor backward_input(const Tensor& grad, nn::Saved& saved) override {
    return mlp_.backward_input(last_ ? ce_.backward(saved.child(1)) : grad, saved.child(0));
  }
  void backward_weight(nn::Saved& saved) override { mlp_.backward_weight(saved.child(0)); }
  Tensor backward(const Tensor& grad, nn::Saved& saved) override {
    return mlp_.backward(last_ ? ce_.backward(saved.child(1)) : grad, saved.child(0));
  }
  std::vector<int64_t> input_shape(const Batch& micro) const override { return {micro.size(), in_}; }
  // {cross-entropy summed / n, correct predictions}, as MlpModel::evaluate.
  Tensor evaluate(const Batch& chunk, int64_t n, const Tensor& input, std::vector<double>* sums) override {
    const Tensor out = mlp_.forward(first_ ? chunk["images"] : input, eval_saved_);
    if (!last_) return out;
    const Tensor& labels = chunk["labels"];
    sums->resize(2);
    (*sums)[0] += ce_.forward(out, labels, eval_loss_saved_, static_cast<double>(n));
    (*sums)[1] += static_cast<double>(nn::count_correct(out, labels));
    return Tensor();
  }

 private:
  nn::MLP mlp_;
  nn::CrossEntropyLoss ce_;
  bool first_, last_;
  int64_t in_;
  nn::Saved eval_saved_, eval_loss_saved_;
};

class MlpRecipe final : public FashionMnistRecipe {
 public:
  using FashionMnistRecipe::FashionMnistRecipe;
  MetricsDescription metrics() const override {
    return {.test_loss = "loss", .test_curve = "test loss", .chart_title = "mlp on Fashion-MNIST"};
  }
  // check_mlp_layout passed (the start-up checks).
  std::unique_ptr<RecipeModel> build(const ModelOptions& o) const override {
    nn::MLPConfig mc;
    mc.tensor = o.tensor;
    mc.sizes = mlp_sizes(tc_);
    mc.dropout = tc_.dropout;
    mc.seed = o.seed;
    mc.defer_init = o.defer_init;
    if (o.pipeline_stages > 1) {
      const std::vector<nn::MLPConfig> parts = mlp_stage_configs(mc, o.tensor.size(), o.pipeline_stages);
      std::vector<std::unique_ptr<RecipeStage>> stages;
      for (int s : o.stages) {
        stages.push_back(std::make_unique<MlpStage>(parts.at(static_cast<size_t>(s)), s == o.pipeline_stages - 1,
                                                    o.tracker));
        stages.back()->module().set_compute_dtype(o.compute_dtype);
      }
      return std::make_unique<StagedModel>(std::move(stages), mlp_summary);
    }
    auto m = std::make_unique<MlpModel>(mc, o.tracker);
    m->module().set_compute_dtype(o.compute_dtype);
    return m;
  }
};

// ---- vae ----

class VaeModel final : public RecipeModel {
 public:
  VaeModel(const nn::VAEConfig& c, const TrainConfig& tc, const DataSource& test, MemoryTracker* tracker)
      : vae_(c), latent_(tc.latent), seed_(tc.seed), test_(test) {
    vae_.set_memory_tracker(tracker);
  }
  nn::Module& module() override { return vae_; }

  double loss_step(const Batch& micro, int64_t step, double norm) override {
    vae_.set_batch_context(static_cast<uint64_t>(step), micro.first_global_sample);  // noise keys
    return vae_.forward_backward(micro["images"], norm).total;
  }

  // {negative ELBO / n, reconstruction / n, KL / n}, z sampled and keyed by
  // the global test-sample index (so the split over ranks does not matter).
  std::vector<double> evaluate(const Batch& chunk, int64_t n) override {
    vae_.set_batch_context(0, chunk.first_global_sample);
    const nn::VAELoss l = vae_.evaluate_sampled(chunk["images"], static_cast<double>(n));
    return {l.total, l.recon, l.kl};
  }

  Evaluation summarize(std::span<const double> s, int64_t) const override {
    const std::string line = fmt::format(
        "test negative ELBO {:.2f} nats per image (reconstruction {:.2f} + KL {:.2f}; one sampled z per image)", s[0],
        s[1], s[2]);
    return {.loss = s[0],
            .metrics = {{"neg_elbo", s[0]}, {"reconstruction", s[1]}, {"kl", s[2]}},
            .epoch_line = line,
            .final_line = line};
  }

  // Reconstructions of the first 16 test images and 64 samples from the
  // prior (z keyed by "samples.z").
  void write_artifacts(const RunDirectory* dir) override {
    vae_.set_training(false);
    constexpr int kN = 16;
    Batch first;
    std::vector<int64_t> rows(kN);
    std::iota(rows.begin(), rows.end(), 0);
    test_.load(rows, first, nullptr);
    const Tensor& x = first["images"];
    const Tensor rec = vae_.reconstruct(x);
    std::vector<std::vector<float>> pics;
    for (int i = 0; i < kN; ++i) pics.push_back(row_values(x, i));
    for (int i = 0; i < kN; ++i) pics.push_back(row_values(rec, i));
    if (dir != nullptr) write_image_grid_png(dir->file("reconstructions.png"), pics, 28, 28, kN);
    Tensor z = Tensor::empty({64, latent_}, DType::f32);
    fill_normal(z, seed_, key_from_name("samples.z"), 0.0, 1.0);
    const Tensor gen = vae_.decode(z);
    pics.clear();
    for (int i = 0; i < 64; ++i) pics.push_back(row_values(gen, i));
    if (dir != nullptr) write_image_grid_png(dir->file("samples.png"), pics, 28, 28, 8);
    vae_.set_training(true);
  }

 private:
  nn::VAE vae_;
  int64_t latent_;
  uint64_t seed_;
  const DataSource& test_;
};

class VaeRecipe final : public FashionMnistRecipe {
 public:
  using FashionMnistRecipe::FashionMnistRecipe;
  MetricsDescription metrics() const override {
    return {.test_loss = "negative ELBO",
            .test_curve = "test negative ELBO (sampled)",
            .chart_title = "vae on Fashion-MNIST"};
  }
  std::vector<std::string> artifacts() const override { return {"reconstructions.png", "samples.png"}; }
  // check_vae_layout passed (the start-up checks).
  std::unique_ptr<RecipeModel> build(const ModelOptions& o) const override {
    nn::VAEConfig vc;
    vc.tensor = o.tensor;
    vc.input = train_set_.features();
    vc.hidden.assign(tc_.hidden.begin(), tc_.hidden.end());
    vc.latent = tc_.latent;
    vc.seed = o.seed;
    vc.defer_init = o.defer_init;
    auto m = std::make_unique<VaeModel>(vc, tc_, test_, o.tracker);
    m->module().set_compute_dtype(o.compute_dtype);
    return m;
  }
};

}  // namespace

// The MLP's Linears cut by their weights (in x out); under tensor
// parallelism a column/row pair is one unit (a stage may not cut it).
std::vector<nn::MLPConfig> mlp_stage_configs(const nn::MLPConfig& whole, int tensor, int stages) {
  const std::vector<int64_t>& sizes = whole.sizes;
  const size_t layers = sizes.size() - 1;
  const std::vector<nn::ChainRole> roles =
      tensor > 1 ? nn::chain_roles(sizes) : std::vector<nn::ChainRole>(layers, nn::ChainRole::whole);
  std::vector<int> unit_start;
  std::vector<double> costs;
  for (size_t i = 0; i < layers; ++i) {
    const double cost = static_cast<double>(sizes[i]) * static_cast<double>(sizes[i + 1]);
    if (i > 0 && roles[i] == nn::ChainRole::row) {
      costs.back() += cost;
      continue;
    }
    unit_start.push_back(static_cast<int>(i));
    costs.push_back(cost);
  }
  unit_start.push_back(static_cast<int>(layers));
  std::vector<nn::MLPConfig> out;
  for (const auto& [a, b] : pipeline_cut(costs, stages, "mlp")) {
    nn::MLPConfig part = whole;
    part.first_layer = unit_start[static_cast<size_t>(a)];
    part.last_layer = unit_start[static_cast<size_t>(b)];
    out.push_back(std::move(part));
  }
  return out;
}

std::vector<RecipeRegistration> builtin_recipes() {
  return {{"mlp", "MLP classifier on Fashion-MNIST (hidden, dropout)",
           [](const TrainConfig& tc) { return std::make_unique<MlpRecipe>(tc); }, {}, check_mlp_layout},
          {"vae", "variational autoencoder on Fashion-MNIST (hidden, latent); writes reconstructions.png, samples.png",
           [](const TrainConfig& tc) { return std::make_unique<VaeRecipe>(tc); },
           {"reconstructions.png", "samples.png"}, check_vae_layout},
          gpt_recipe()};
}

}  // namespace meshtrain::train::internal
