// Parity of fully sharded data parallelism with one device, through the real
// trainer on Fashion-MNIST (threads engine):
// - fp32, 50 steps, dropout on: zero1, zero2 and zero3 on 2 and 4 ranks,
//   hybrid_full and hybrid_shard_grad_op on data=2,fsdp=2, zero3 with 2
//   micro-batches, and the VAE under zero3 (SGD, see dp_parity_test.cc) give
//   the 1-device run's per-step losses and final parameters within 1e-5
//   relative; also with gradient clipping. fsdp_min_weight_size = 64 shards every weight and leaves the
//   biases replicated, so both paths are exercised.
// - bf16 (zero3, 2 ranks, one epoch): the loss curve (means over 50 steps,
//   the logged points) within 1e-2 relative of the fp32 1-device run, final
//   test accuracy within 0.5 points.
// - fp16 (zero3 with a dynamic loss scaler): the run finishes with finite
//   losses; with a learning rate that overflows the gradients, steps are
//   skipped and the scale backs off; with one that overflows the forward,
//   the run stops with TrainingDiverged.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "meshtrain/core/memory.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain {
namespace {

struct RunSpec {
  std::string model = "mlp";
  std::string mesh = "";  // "" = one device
  std::string fsdp = "";  // "" = plain data parallelism
  int micro_batches = 1;
  // SGD with momentum for the 1e-5 comparisons: AdamW's g / sqrt(v) turns a
  // last-bit summation-order difference in a gradient that nearly cancels
  // (first-layer weights of almost-always-zero pixels) into a difference of
  // up to lr per step (4e-5 relative after 50 steps when OpenBLAS picks its
  // AVX-512 kernels, whose blocking depends on the per-rank batch).
  // AdamW itself is checked against PyTorch (golden_test) and across ranks
  // over a few steps (parallel_test).
  std::string optimizer = "sgd";
  DType precision = DType::f32;
  int64_t max_steps = 50;
  std::vector<int> hidden = {64, 32};
  int batch_size = 64;
  double clip_norm = 0;
  double lr = 0;  // 0: the default for the optimizer and model
};

train::TrainResult train_on(const RunSpec& run, const std::string& tag) {
  train::TrainConfig tc;
  tc.model = run.model;
  tc.hidden = run.hidden;
  tc.latent = 8;
  tc.dropout = run.model == "mlp" ? 0.1 : 0.0;
  tc.batch_size = run.batch_size;
  tc.micro_batches = run.micro_batches;
  tc.optimizer = run.optimizer;
  tc.lr = run.lr > 0 ? run.lr : run.optimizer == "sgd" ? (run.model == "vae" ? 1e-4 : 0.05) : 1e-3;
  tc.max_steps = run.max_steps;
  tc.lr_decay_steps = run.max_steps;  // the cosine decays within the run (0: the epoch), as these bounds were set for
  tc.epochs = 1;
  tc.log_every = 50;
  tc.threads_per_rank = 1;
  tc.set("fsdp", run.fsdp, "RunSpec.fsdp");
  tc.fsdp_min_weight_size = 64;
  tc.clip_norm = run.clip_norm;
  tc.run_dir = (std::filesystem::temp_directory_path() / ("meshtrain_fsdp_parity_" + tag)).string();
  tc.overwrite = true;  // the previous test run's directory
  config::DistributedConfig dc = testing::threads_mesh_config(run.mesh);
  dc.mixed_precision = run.precision;
  return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                      .timeout = std::chrono::seconds(120)});
}

void expect_same(const train::TrainResult& a, const train::TrainResult& b, const std::string& what) {
  ASSERT_EQ(a.step_losses.size(), 50u) << what;
  ASSERT_EQ(a.step_losses.size(), b.step_losses.size()) << what;
  for (size_t s = 0; s < a.step_losses.size(); ++s)
    EXPECT_LT(std::fabs(a.step_losses[s] - b.step_losses[s]) / std::fabs(a.step_losses[s]), 1e-5)
        << what << " step " << s;
  ASSERT_EQ(a.final_parameters.size(), b.final_parameters.size()) << what;
  for (size_t i = 0; i < a.final_parameters.size(); ++i) {
    ASSERT_EQ(a.final_parameters[i].first, b.final_parameters[i].first) << what;
    const auto va = a.final_parameters[i].second.to_vector(), vb = b.final_parameters[i].second.to_vector();
    ASSERT_EQ(va.size(), vb.size()) << what << " " << a.final_parameters[i].first;
    double diff = 0, scale = 1e-30;
    for (size_t k = 0; k < va.size(); ++k) {
      diff = std::max(diff, std::fabs(va[k] - vb[k]));
      scale = std::max(scale, std::fabs(va[k]));
    }
    EXPECT_LT(diff / scale, 1e-5) << what << " " << a.final_parameters[i].first;
  }
}

const train::TrainResult& one_device_mlp() {
  static const train::TrainResult r = train_on({}, "mlp1");
  return r;
}

TEST(FullyShardedParity, ZeroStagesOnTwoAndFourRanks) {
  const auto& one = one_device_mlp();
  EXPECT_LT(one.step_losses.back(), one.step_losses.front());  // it learns
  for (const char* stage : {"zero1", "zero2", "zero3"})
    for (int d : {2, 4}) {
      const std::string tag = fmt::format("{}_{}", stage, d);
      const auto r = train_on({.mesh = fmt::format("fsdp={}", d), .fsdp = stage}, tag);
      EXPECT_EQ(r.fsdp, stage);
      expect_same(one, r, tag);
    }
}

TEST(FullyShardedParity, SafetensorsHoldTheGatheredParameters) {
  const auto r = train_on({.mesh = "fsdp=2", .fsdp = "zero3"}, "zero3_file");
  const auto file = checkpoint::load_safetensors(r.run_dir + "/model.safetensors");
  ASSERT_EQ(file.size(), r.final_parameters.size());
  for (size_t i = 0; i < file.size(); ++i) {
    EXPECT_EQ(file[i].first, r.final_parameters[i].first);
    EXPECT_EQ(file[i].second.to_vector(), r.final_parameters[i].second.to_vector()) << file[i].first;
  }
  // Stage 3 on 2 ranks: each rank holds half of the sharded state.
  EXPECT_GT(r.memory_peak[static_cast<size_t>(MemoryCategory::parameters)], 0u);
  EXPECT_GT(r.memory_peak[static_cast<size_t>(MemoryCategory::working)], 0u);
}

TEST(FullyShardedParity, HybridOnDataTwoFsdpTwo) {
  const auto& one = one_device_mlp();
  expect_same(one, train_on({.mesh = "data=2,fsdp=2", .fsdp = "hybrid_full"}, "hybrid_full"), "hybrid_full");
  expect_same(one, train_on({.mesh = "data=2,fsdp=2", .fsdp = "hybrid_shard_grad_op"}, "hybrid_sgo"),
              "hybrid_shard_grad_op");
}

TEST(FullyShardedParity, Zero3WithTwoMicroBatches) {
  expect_same(one_device_mlp(), train_on({.mesh = "fsdp=2", .fsdp = "zero3", .micro_batches = 2}, "zero3_mb2"),
              "zero3 2 ranks x 2 micro-batches");
}

// Global-norm clipping through grad_norm() (owned shards summed over the
// shard group, replicated parameters counted once) and the grad scale.
TEST(FullyShardedParity, ClippingMatches) {
  RunSpec one{.clip_norm = 0.5};
  const auto ref = train_on(one, "clip1");
  EXPECT_NE(ref.step_losses.back(), one_device_mlp().step_losses.back());  // clipping is active
  RunSpec zero3 = one, hybrid = one;
  zero3.mesh = "fsdp=4";
  zero3.fsdp = "zero3";
  hybrid.mesh = "data=2,fsdp=2";
  hybrid.fsdp = "hybrid_shard_grad_op";
  expect_same(ref, train_on(zero3, "clip_zero3"), "zero3 4 ranks, clip 0.5");
  expect_same(ref, train_on(hybrid, "clip_hybrid"), "hybrid_shard_grad_op, clip 0.5");
}

TEST(FullyShardedParity, VaeZero3) {
  expect_same(train_on({.model = "vae"}, "vae1"), train_on({.model = "vae", .mesh = "fsdp=2", .fsdp = "zero3"}, "vae_zero3"),
              "vae zero3 2 ranks");
}

// Means over windows of 50 steps: the points metrics.jsonl logs.
std::vector<double> window_means(const std::vector<double>& losses) {
  std::vector<double> out;
  for (size_t a = 0; a < losses.size(); a += 50) {
    const size_t b = std::min(losses.size(), a + 50);
    double sum = 0;
    for (size_t i = a; i < b; ++i) sum += losses[i];
    out.push_back(sum / static_cast<double>(b - a));
  }
  return out;
}

TEST(FullyShardedParity, Bf16Zero3FollowsFp32) {
  const RunSpec base{.optimizer = "adamw", .max_steps = 0, .hidden = {128, 64}, .batch_size = 128};  // one epoch
  RunSpec bf16 = base;
  bf16.mesh = "fsdp=2";
  bf16.fsdp = "zero3";
  bf16.precision = DType::bf16;
  const auto ref = train_on(base, "fp32_epoch");
  const auto got = train_on(bf16, "bf16_epoch");
  ASSERT_EQ(ref.step_losses.size(), got.step_losses.size());
  const auto a = window_means(ref.step_losses), b = window_means(got.step_losses);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LT(std::fabs(a[i] - b[i]) / a[i], 1e-2) << "window " << i << ": fp32 " << a[i] << " bf16 " << b[i];
    worst = std::max(worst, std::fabs(a[i] - b[i]) / a[i]);
  }
  fmt::print("bf16 zero3 vs fp32 1 device: worst window {:.2e} relative, test accuracy {:.2f}% vs {:.2f}%\n", worst,
             100 * got.test_accuracy, 100 * ref.test_accuracy);
  EXPECT_GT(worst, 1e-6);  // bf16 really is in use
  EXPECT_LT(std::fabs(ref.test_accuracy - got.test_accuracy), 0.005)
      << "fp32 " << ref.test_accuracy << " bf16 " << got.test_accuracy;
  EXPECT_GT(got.test_accuracy, 0.8);
}

TEST(FullyShardedParity, Fp16WithLossScalingFinishes) {
  const auto r = train_on({.mesh = "fsdp=2", .fsdp = "zero3", .optimizer = "adamw",
                           .precision = DType::f16, .max_steps = 100},
                          "fp16");
  ASSERT_EQ(r.step_losses.size(), 100u);
  for (double l : r.step_losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(r.step_losses.back(), r.step_losses.front());
  fmt::print("fp16 zero3: loss {:.4f} -> {:.4f}, loss scale {} at the end, {} steps skipped\n", r.step_losses.front(),
             r.step_losses.back(), r.loss_scale, r.skipped_steps);
  EXPECT_GT(r.loss_scale, 0);
  EXPECT_LT(r.skipped_steps, 10);
}

// The skip path: a learning rate that grows the weights overflows the fp16
// gradients at the loss scale while the loss stays finite; every rank skips
// those steps (nothing else halves the scale) and the scale backs off.
TEST(FullyShardedParity, Fp16OverflowSkipsStepsAndBacksOff) {
  RunSpec r{.mesh = "fsdp=2", .fsdp = "zero3", .optimizer = "adamw", .precision = DType::f16,
            .max_steps = 20};
  r.hidden = {256, 128};
  r.lr = 0.1;
  const auto got = train_on(r, "fp16_overflow");
  ASSERT_EQ(got.step_losses.size(), 20u);
  for (double l : got.step_losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_GT(got.skipped_steps, 0);
  EXPECT_EQ(got.loss_scale, std::ldexp(32768.0, -static_cast<int>(got.skipped_steps)));
  // Each skipped step is a line of metrics.jsonl naming the reason.
  std::ifstream in(got.run_dir + "/metrics.jsonl");
  int64_t events = 0;
  for (std::string line; std::getline(in, line);)
    if (line.find("\"event\":\"skipped_step\"") != std::string::npos) {
      ++events;
      EXPECT_NE(line.find("gradients overflowed fp16 at loss scale"), std::string::npos) << line;
    }
  EXPECT_EQ(events, got.skipped_steps);
}

// A learning rate that makes the fp16 forward itself overflow: no loss scale
// can help, so the run stops on every rank at the same step, naming the
// value and suggesting bf16, instead of skipping every step to the end.
TEST(FullyShardedParity, Fp16NonFiniteLossStopsTheRun) {
  RunSpec r{.mesh = "fsdp=2", .fsdp = "zero3", .optimizer = "adamw", .precision = DType::f16,
            .max_steps = 20};
  r.hidden = {256, 128};
  r.lr = 0.5;
  try {
    (void)train_on(r, "fp16_diverged");
    ADD_FAILURE() << "no error";
  } catch (const train::TrainingDiverged& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("step 2 of 20: the loss is inf"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("--precision bf16"));
  }
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::temp_directory_path() /
                                       "meshtrain_fsdp_parity_fp16_diverged.incomplete"));
}

}  // namespace
}  // namespace meshtrain
