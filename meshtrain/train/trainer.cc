#include "meshtrain/train/trainer.h"

#include <fmt/format.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <mutex>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/vae.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/optim/schedule.h"
#include "meshtrain/optim/sgd.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/train/idx.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/sampler.h"

namespace meshtrain::train {
namespace {

using Clock = std::chrono::steady_clock;

int process_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return 1;
}

// The data-parallel axis: "data" when the mesh has it; every other axis must
// have size 1 (tensor, pipeline, fsdp... arrive with later strategies).
std::string data_axis(const plan::NamedShape& m) {
  std::string axis;
  for (size_t i = 0; i < m.shape.size(); ++i) {
    if (m.axis_names[i] == "data") axis = "data";
    else if (m.shape[i] != 1)
      throw Unsupported("meshtrain train",
                        fmt::format("mesh {} has axis '{}' of size {}", m.to_spec(), m.axis_names[i], m.shape[i]),
                        "training supports data parallelism (--mesh data=N) so far");
  }
  return axis;
}

// The rows [lo, hi) of a (B, ...) tensor as a view.
Tensor rows(const Tensor& t, int64_t lo, int64_t hi) { return t.narrow(0, lo, hi - lo); }

struct Shared {  // results and files of rank 0
  std::mutex mu;
  TrainResult result;
};

class Run {
 public:
  Run(const TrainConfig& tc, const Dataset& train, const Dataset& test, comm::Communicator& world,
      const plan::NamedShape& mesh_shape, Shared& shared)
      : tc_(tc), train_(train), test_(test), shared_(shared),
        mesh_(world, mesh_shape.shape, mesh_shape.axis_names),
        main_(world.rank() == 0) {
    const std::string axis = data_axis(mesh_shape);
    dp_comm_ = axis.empty() ? &world : &mesh_.comm(axis);
    if (tc.model == "mlp") {
      std::vector<int64_t> sizes = {train.features()};
      for (int h : tc.hidden) sizes.push_back(h);
      sizes.push_back(train.num_classes);
      nn::MLPConfig mc;
      mc.sizes = sizes;
      mc.dropout = tc.dropout;
      mc.seed = tc.seed;
      mlp_ = std::make_unique<nn::MLP>(mc);
      model_ = mlp_.get();
    } else {
      std::vector<int64_t> hidden(tc.hidden.begin(), tc.hidden.end());
      nn::VAEConfig vc;
      vc.input = train.features();
      vc.hidden = hidden;
      vc.latent = tc.latent;
      vc.seed = tc.seed;
      vae_ = std::make_unique<nn::VAE>(vc);
      model_ = vae_.get();
    }
    ddp_ = std::make_unique<parallel::DataParallel>(
        *model_, *dp_comm_,
        parallel::DataParallelOptions{.bucket_bytes = static_cast<size_t>(tc.bucket_mb * (1 << 20)),
                                      .reduce = parallel::GradReduce::sum,
                                      .tracker = &memory_});
    auto params = model_->parameters();
    if (tc.optimizer == "adamw")
      opt_ = std::make_unique<optim::AdamW>(params, tc.lr, std::pair{0.9, 0.999}, 1e-8, tc.weight_decay, &memory_);
    else
      opt_ = std::make_unique<optim::SGD>(params, tc.lr, tc.momentum, false, tc.weight_decay, 0.0, &memory_);
  }

  void run() {
    DistributedSampler sampler(train_.size(), tc_.batch_size, tc_.seed, tc_.drop_last, dp_comm_->rank(),
                               dp_comm_->size());
    const int64_t per_epoch = sampler.num_batches();
    int64_t total = per_epoch * tc_.epochs;
    if (tc_.max_steps > 0) total = std::min(total, tc_.max_steps);
    const auto schedule = tc_.schedule == "cosine"
                              ? optim::LrSchedule::cosine_with_warmup(
                                    tc_.lr, std::min<int64_t>(tc_.warmup_steps, total), total, tc_.min_lr_ratio)
                              : optim::LrSchedule::constant(tc_.lr);
    std::unique_ptr<MetricsLog> log;
    if (main_) {
      std::filesystem::create_directories(tc_.run_dir);
      log = std::make_unique<MetricsLog>(tc_.run_dir + "/metrics.jsonl");
      fmt::print("model {}: {} parameters; {} steps of {} samples ({} epochs x {} batches), data parallel {}\n",
                 tc_.model, model_->num_parameters(), total, tc_.batch_size, tc_.epochs, per_epoch, dp_comm_->size());
      std::fflush(stdout);
    }
    ProgressBar bar(total, main_);
    Series train_curve{"train loss", {}, {}}, test_curve{"test loss", {}, {}};
    int64_t step = 0, samples = 0;
    double window_loss = 0, hidden_sum = 0;
    int window_n = 0;
    const auto t0 = Clock::now();
    for (int epoch = 0; epoch < tc_.epochs && step < total; ++epoch) {
      const int64_t batches = std::min(per_epoch, total - step);
      Prefetcher pre([&, epoch](int64_t b) { return load_batch(train_, sampler, epoch, b, &memory_); }, 0, batches);
      model_->set_training(true);
      while (auto batch = pre.next()) {
        opt_->set_lr(schedule.lr(step));
        const double loss = train_step(*batch, step);
        ++step;
        samples += batch->global_size;
        hidden_sum += ddp_->stats().hidden_fraction;
        window_loss += loss;
        ++window_n;
        if (main_) {
          shared_.result.step_losses.push_back(loss);
          train_curve.x.push_back(static_cast<double>(step));
          train_curve.y.push_back(loss);
        }
        const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
        bar.update(step, {{"loss", loss}, {"lr", opt_->lr()}}, samples / elapsed);
        if (step % tc_.log_every == 0 || step == total) {
          if (log)
            log->write({{"step", static_cast<double>(step)}, {"epoch", static_cast<double>(epoch)},
                        {"loss", window_loss / window_n}, {"lr", opt_->lr()}, {"samples_per_s", samples / elapsed},
                        {"hidden_fraction", ddp_->stats().hidden_fraction}},
                       {{"split", "train"}});
          if (main_) shared_.result.final_train_loss = window_loss / window_n;
          window_loss = 0;
          window_n = 0;
        }
      }
      const auto [test_loss, accuracy] = evaluate();
      if (main_) {
        bar.finish();
        test_curve.x.push_back(static_cast<double>(step));
        test_curve.y.push_back(test_loss);
        if (mlp_)
          fmt::print("epoch {:>2}: test loss {:.4f}  test accuracy {:.2f}%\n", epoch + 1, test_loss, 100 * accuracy);
        else
          fmt::print("epoch {:>2}: test ELBO loss {:.2f} nats per image\n", epoch + 1, test_loss);
        std::fflush(stdout);
        log->write({{"step", static_cast<double>(step)}, {"epoch", static_cast<double>(epoch + 1)},
                    {"loss", test_loss}, {"accuracy", accuracy}},
                   {{"split", "test"}});
        shared_.result.test_loss = test_loss;
        shared_.result.test_accuracy = accuracy;
      }
      if (step < total) bar = ProgressBar(total, main_);  // a fresh line after the summary
    }
    if (!main_) return;
    auto& r = shared_.result;
    r.steps = step;
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    r.samples_per_second = samples / r.seconds;
    r.hidden_fraction = step ? hidden_sum / step : 0;
    r.run_dir = tc_.run_dir;
    write_artifacts(train_curve, test_curve);
  }

 private:
  // One optimizer step over one global batch; returns its global mean loss.
  double train_step(const Batch& batch, int64_t step) {
    const int m = tc_.micro_batches;
    const int64_t local = batch.images.size(0);
    double loss = 0;
    for (int i = 0; i < m; ++i) {
      const int64_t lo = local * i / m, hi = local * (i + 1) / m;
      model_->set_batch_context(static_cast<uint64_t>(step), batch.first_global_sample + lo);
      ddp_->begin_micro_batch(i, m);
      const Tensor x = rows(batch.images, lo, hi);
      const double norm = static_cast<double>(batch.global_size);
      if (mlp_) {
        const Tensor logits = mlp_->forward(x);
        loss += ce_.forward(logits, rows(batch.labels, lo, hi), norm);
        mlp_->backward(ce_.backward());
      } else {
        loss += vae_->forward_backward(x, norm).total;
      }
    }
    ddp_->finish();
    if (tc_.clip_norm > 0) optim::clip_grad_norm(model_->parameters(), tc_.clip_norm);  // grads are replicated
    opt_->step();
    opt_->zero_grad();
    dp_comm_->all_reduce(&loss, &loss, 1, DType::f64, comm::ReduceOp::sum);
    return loss;
  }

  // Test loss (mean per sample) and accuracy, each rank on its slice.
  std::pair<double, double> evaluate() {
    model_->set_training(false);
    const int64_t n = test_.size(), d = dp_comm_->size(), r = dp_comm_->rank();
    const int64_t lo = n * r / d, hi = n * (r + 1) / d;
    double sums[2] = {0, 0};  // loss (already divided by n), correct
    constexpr int64_t kChunk = 1000;
    for (int64_t a = lo; a < hi; a += kChunk) {
      const int64_t b = std::min(hi, a + kChunk);
      const Tensor x = rows(test_.images, a, b).to(DType::f32);
      scale(x, 1.0 / 255.0);
      if (mlp_) {
        const Tensor logits = mlp_->forward(x);
        const Tensor labels = rows(test_.labels, a, b).to(DType::i64);
        sums[0] += ce_.forward(logits, labels, static_cast<double>(n));
        sums[1] += static_cast<double>(nn::count_correct(logits, labels));
      } else {
        vae_->set_batch_context(0, a);
        sums[0] += vae_->evaluate(x, static_cast<double>(n)).total;
      }
    }
    dp_comm_->all_reduce(sums, sums, 2, DType::f64, comm::ReduceOp::sum);
    model_->set_training(true);
    return {sums[0], sums[1] / static_cast<double>(n)};
  }

  void write_artifacts(const Series& train_curve, const Series& test_curve) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (nn::Parameter* p : model_->parameters()) tensors.emplace_back(p->name, p->value);
    save_safetensors(tc_.run_dir + "/model.safetensors", tensors,
                     {{"format", "meshtrain"}, {"model", tc_.model}, {"weights", "(in, out)"}});
    write_file_atomic(tc_.run_dir + "/loss.svg",
                      line_chart_svg(fmt::format("{} on Fashion-MNIST", tc_.model), "step", {train_curve, test_curve}));
    if (vae_) {
      model_->set_training(false);
      constexpr int kN = 16;
      const Tensor x = rows(test_.images, 0, kN).to(DType::f32);
      scale(x, 1.0 / 255.0);
      const Tensor rec = vae_->reconstruct(x);
      std::vector<std::vector<float>> pics;
      for (int i = 0; i < kN; ++i) pics.push_back(row_values(x, i));
      for (int i = 0; i < kN; ++i) pics.push_back(row_values(rec, i));
      write_image_grid_png(tc_.run_dir + "/reconstructions.png", pics, 28, 28, kN);
      Tensor z = Tensor::empty({64, tc_.latent}, DType::f32);
      fill_normal(z, tc_.seed, key_from_name("samples.z"), 0.0, 1.0);
      const Tensor gen = vae_->decode(z);
      pics.clear();
      for (int i = 0; i < 64; ++i) pics.push_back(row_values(gen, i));
      write_image_grid_png(tc_.run_dir + "/samples.png", pics, 28, 28, 8);
    }
  }

  static std::vector<float> row_values(const Tensor& t, int64_t i) {
    const Tensor row = t.select(0, i).contiguous();
    const float* p = row.data<float>();
    return {p, p + row.numel()};
  }

  const TrainConfig& tc_;
  const Dataset& train_;
  const Dataset& test_;
  Shared& shared_;
  MemoryTracker memory_;
  mesh::DeviceMesh mesh_;
  bool main_;
  comm::Communicator* dp_comm_ = nullptr;
  std::unique_ptr<nn::MLP> mlp_;
  std::unique_ptr<nn::VAE> vae_;
  nn::Module* model_ = nullptr;
  nn::CrossEntropyLoss ce_;
  std::unique_ptr<parallel::DataParallel> ddp_;
  std::unique_ptr<optim::Optimizer> opt_;
};

}  // namespace

TrainResult run_training(const TrainConfig& tc, const config::DistributedConfig& dc,
                         const comm::LaunchOptions& launch) {
  tc.validate();
  if (dc.rank == 0) {
    std::filesystem::create_directories(tc.run_dir);
    write_file_atomic(tc.run_dir + "/config.toml", tc.to_toml() + "\n[distributed]\n" + dc.to_toml());
  }
  const plan::NamedShape mesh_shape = dc.mesh();
  const int ranks_here = launch.engine == comm::Engine::threads ? launch.ranks : 1;
  set_blas_threads(tc.threads_per_rank > 0 ? tc.threads_per_rank : std::max(1, process_cores() / ranks_here));
  // Loaded once per process; the threads engine's ranks share them read-only.
  const Dataset train = load_fashion_mnist(tc.data_dir, Split::train);
  const Dataset test = load_fashion_mnist(tc.data_dir, Split::test);
  Shared shared;
  comm::launch(launch, [&](comm::Communicator& world) {
    Run run(tc, train, test, world, mesh_shape, shared);
    run.run();
  });
  return shared.result;
}

}  // namespace meshtrain::train
