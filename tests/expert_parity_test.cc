// Expert parallelism equals one device (issue 42's acceptance): the run of
// tests/expert_parity.h through the real trainer on the threads engine,
// per-step losses and final parameters (every expert, gathered) within
// 1e-5 relative of one device, over 30 steps:
// - expert=2 and expert=4; data=2 x expert=2; fsdp=2 (zero3) x expert=2;
//   tensor=2 x expert=2 (attention and experts split over tensor, experts
//   over expert); pipeline=2 x expert=2; in no-drop mode, and all six
//   again with a capacity factor that drops tokens (the pipeline under zb
//   with the sigmoid router);
// - DeepSeek-V3's bias balancing on data x expert and pipeline x expert
//   (with recompute);
// - gradient clipping that is active on expert x tensor x data: the norm
//   counts every parameter once (experts summed over the expert axis,
//   replicated parameters once, tensor blocks summed over tensor).
// Four of the layouts run as separate processes too, under mpirun and
// `meshtrain launch` (gloo) (expert_parity_mpi_main.cc).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/expert_parity.h"

namespace meshtrain {
namespace {

train::TrainResult train_moe(const ExpertLayout& l, const std::string& tag) {
  const train::TrainConfig tc = expert_config(l, tag);
  const config::DistributedConfig dc = testing::threads_mesh_config(l.mesh);
  train::TrainResult r = train::run_training(
      tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size, .timeout = std::chrono::seconds(120)});
  std::filesystem::remove_all(tc.run_dir);
  return r;
}

const train::TrainResult& one_device(const ExpertLayout& l) {
  static std::map<std::string, train::TrainResult> cache;
  const ExpertLayout ref = l.reference();
  const std::string key = ref.name();
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, train_moe(ref, fmt::format("one{}", cache.size()))).first;
  return it->second;
}

void expect_one_device(const ExpertLayout& l, const std::string& tag) {
  const std::string what = l.name();
  const train::TrainResult r = train_moe(l, tag);
  const train::TrainResult& one = one_device(l);
  ASSERT_EQ(one.step_losses.size(), static_cast<size_t>(kGptParitySteps)) << what;
  for (const std::string& p : testing::run_differences(r, one, 1e-5)) ADD_FAILURE() << what << ": " << p;
  fmt::print("{:<40} {} steps, final loss {:.6f} (one device {:.6f})\n", what, r.step_losses.size(),
             r.step_losses.back(), one.step_losses.back());
}

TEST(ExpertParity, NoDropLayoutsEqualOneDevice) {
  expect_one_device({.mesh = "expert=2"}, "e2");
  expect_one_device({.mesh = "expert=4"}, "e4");
  expect_one_device({.mesh = "data=2,expert=2"}, "d2e2");
  expect_one_device({.mesh = "fsdp=2,expert=2", .fsdp = "zero3"}, "f2e2");
  expect_one_device({.mesh = "expert=2,tensor=2"}, "e2t2");
  expect_one_device({.mesh = "pipeline=2,expert=2"}, "p2e2");
}

TEST(ExpertParity, DroppingLayoutsEqualOneDevice) {
  expect_one_device({.mesh = "expert=2", .capacity_factor = 1.0}, "e2_cf");
  expect_one_device({.mesh = "expert=4", .capacity_factor = 1.0}, "e4_cf");
  expect_one_device({.mesh = "data=2,expert=2", .capacity_factor = 1.0}, "d2e2_cf");
  expect_one_device({.mesh = "fsdp=2,expert=2", .fsdp = "zero3", .capacity_factor = 1.0}, "f2e2_cf");
  expect_one_device({.mesh = "expert=2,tensor=2", .capacity_factor = 1.0}, "e2t2_cf");
  expect_one_device({.mesh = "pipeline=2,expert=2", .schedule = "zb", .capacity_factor = 1.0, .router = "sigmoid"},
                    "p2e2_cf_sigmoid");
}

// DeepSeek-V3's bias balancing (sigmoid router, the selection bias moved
// after every step by the load summed over every rank), with dropping and
// recompute (a replayed forward counts its load once).
TEST(ExpertParity, BiasBalancingEqualsOneDevice) {
  expect_one_device({.mesh = "data=2,expert=2", .capacity_factor = 1.0, .router = "sigmoid", .bias_update_rate = 0.01},
                    "d2e2_bias");
  expect_one_device({.mesh = "pipeline=2,expert=2", .capacity_factor = 1.0, .router = "sigmoid",
                     .bias_update_rate = 0.01, .recompute = true},
                    "p2e2_bias_recompute");
}

TEST(ExpertParity, ClippingCountsEveryParameterOnce) {
  expect_one_device({.mesh = "data=2,expert=2,tensor=2", .clip_norm = 0.05}, "d2e2t2_clip");
}

}  // namespace
}  // namespace meshtrain
