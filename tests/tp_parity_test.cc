// Tensor parallelism of the Fashion-MNIST models through the real trainer
// (threads engine): the MLP (hidden 48, 30, 10: four Linears in two
// column/row pairs, widths the axis does not divide: 30 over 4 is 8, 8, 8,
// 6; dropout 0.1 on, each rank drawing its columns of the one-device mask)
// on tensor=2, tensor=4, data=2 x tensor=2 and zero3 on fsdp=2 x tensor=2,
// and the VAE (hidden 64, 32: the encoder one pair, the decoder a pair and
// a whole last layer) on data=2 x tensor=2, equal one device: per-step
// losses and final parameters within 1e-5 relative over 30 steps.
// --sequence-parallel with them is a clear error (no sequence).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "meshtrain/testing/parity.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain {
namespace {

constexpr int kSteps = 30;

train::TrainResult train_on(const std::string& model, const std::string& mesh, const std::string& fsdp,
                            const std::string& tag, bool sequence_parallel = false) {
  train::TrainConfig tc;
  tc.model = model;
  tc.hidden = model == "mlp" ? std::vector<int>{48, 30, 10} : std::vector<int>{64, 32};
  tc.latent = 8;
  tc.dropout = model == "mlp" ? 0.1 : 0.0;
  tc.batch_size = 64;
  tc.optimizer = "sgd";  // see dp_parity_test: AdamW magnifies last-bit differences
  tc.lr = model == "vae" ? 1e-4 : 0.05;
  tc.max_steps = kSteps;
  tc.lr_decay_steps = kSteps;
  tc.epochs = 1;
  tc.log_every = 1000;
  tc.threads_per_rank = 1;
  tc.sequence_parallel = sequence_parallel;
  tc.fsdp_min_weight_size = 64;
  tc.set("fsdp", fsdp, "train_on");
  tc.run_dir = (std::filesystem::temp_directory_path() / ("meshtrain_tp_parity_" + tag)).string();
  tc.overwrite = true;
  const config::DistributedConfig dc = testing::threads_mesh_config(mesh);
  return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                      .timeout = std::chrono::seconds(120)});
}

void expect_same(const train::TrainResult& got, const train::TrainResult& ref, const std::string& what) {
  ASSERT_EQ(ref.step_losses.size(), static_cast<size_t>(kSteps)) << what;
  for (const std::string& p : testing::run_differences(got, ref, 1e-5)) ADD_FAILURE() << what << ": " << p;
}

TEST(TensorParallelParity, MlpEqualsOneDevice) {
  const auto one = train_on("mlp", "", "", "mlp_one");
  EXPECT_LT(one.step_losses.back(), one.step_losses.front());  // it learns
  for (const char* mesh : {"tensor=2", "tensor=4", "data=2,tensor=2"})
    expect_same(train_on("mlp", mesh, "", std::string("mlp_") + mesh), one, std::string("mlp ") + mesh);
  expect_same(train_on("mlp", "fsdp=2,tensor=2", "zero3", "mlp_zero3"), one, "mlp zero3 on fsdp=2,tensor=2");
}

TEST(TensorParallelParity, VaeEqualsOneDevice) {
  expect_same(train_on("vae", "data=2,tensor=2", "", "vae_dp_tp"), train_on("vae", "", "", "vae_one"),
              "vae data=2,tensor=2");
}

TEST(TensorParallelParity, SequenceParallelNeedsASequence) {
  EXPECT_THAT(testing::error_of([] { train_on("mlp", "tensor=2", "", "mlp_sp", true); }),
              ::testing::HasSubstr("--sequence-parallel with model mlp: it has no sequence to split"));
}

}  // namespace
}  // namespace meshtrain
