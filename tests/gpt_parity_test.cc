// The GPT (model = "gpt") through the real trainer on real text (threads
// engine) equals one device:
// - fp32, 30 steps (tests/gpt_parity.h): data parallelism on 2 and 4 ranks, zero1/zero2/zero3 on
//   2 and 4 ranks, hybrid_full on data=2,fsdp=2: per-step losses and final
//   parameters within 1e-5 relative of the 1-device run (SGD with
//   momentum: gpt_parity.h says why).
// - FSDP units are the transformer blocks plus the root (layers + 1 units).
// - Tensor parallelism: tensor=2 and 4, data=2 x tensor=2, and zero3 on
//   fsdp=2 x tensor=2 and data=2 x fsdp=2 x tensor=2 (8 ranks) within 1e-5
//   too, also with clipping (the gradient norm adds the blocks over the
//   tensor axis once); the same meshes with sequence parallelism.
// - Context parallelism: context=2 and 4, data=2 x context=2, context=2 x
//   tensor=2 (ring attention, zig-zag chunks), all_to_all (Ulysses), chunks
//   in order, zero3 over fsdp=2 x context=2, recompute and clipping, within 1e-5.
// - Recomputing every block's activations gives the same run bit for bit on
//   one device, and within 1e-5 under zero3.
// - bf16 zero3 (also on fsdp=2 x tensor=2, with and without sequence parallelism) and fp16 zero3 (dynamic loss
//   scaler) follow the fp32 curve within 1e-2 relative.
// - ZeRO++ on node=2 x fsdp=2: hpZ changes nothing (bit for bit, with
//   recompute and micro-batches); qwZ+qgZ follows fp32 within 2e-3.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

struct GptRun {
  std::string mesh = "";  // "" = one device
  std::string fsdp = "";  // "" = plain data parallelism
  bool recompute = false;
  bool sequence_parallel = false;
  DType precision = DType::f32;
  std::string optimizer = "sgd";
  double clip_norm = 0;
  std::string cp_comm = "ring";
  bool cp_load_balance = true;
  std::string zeropp = "";
  int micro_batches = 1;
};

constexpr int64_t kSteps = kGptParitySteps;

train::TrainResult train_gpt(const GptRun& run, const std::string& tag) {
  train::TrainConfig tc = gpt_parity_config(tag, run.optimizer);
  tc.recompute = run.recompute;
  tc.sequence_parallel = run.sequence_parallel;
  tc.clip_norm = run.clip_norm;
  tc.set("cp_comm", run.cp_comm, "GptRun.cp_comm");
  tc.cp_load_balance = run.cp_load_balance;
  tc.set("zeropp", run.zeropp, "GptRun.zeropp");
  tc.micro_batches = run.micro_batches;
  tc.set("fsdp", run.fsdp, "GptRun.fsdp");
  config::DistributedConfig dc = testing::threads_mesh_config(run.mesh);
  dc.mixed_precision = run.precision;
  return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                      .timeout = std::chrono::seconds(120)});
}

void expect_same(const train::TrainResult& got, const train::TrainResult& ref, const std::string& what) {
  ASSERT_EQ(ref.step_losses.size(), static_cast<size_t>(kSteps)) << what;
  for (const std::string& p : testing::run_differences(got, ref, 1e-5)) ADD_FAILURE() << what << ": " << p;
}

const train::TrainResult& one_device() {
  static const train::TrainResult r = train_gpt({}, "one");
  return r;
}

TEST(GptParity, OneDeviceLearns) {
  const auto& one = one_device();
  ASSERT_EQ(one.step_losses.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(one.step_losses.back(), one.step_losses.front() - 0.5);  // from about ln(512) = 6.24 down
  EXPECT_EQ(one.rate_unit, "tokens");
}

TEST(GptParity, DataParallelOnTwoAndFourRanks) {
  for (int d : {2, 4}) expect_same(train_gpt({.mesh = fmt::format("data={}", d)}, fmt::format("dp{}", d)), one_device(), fmt::format("data={}", d));
}

TEST(GptParity, ZeroStagesOnTwoAndFourRanks) {
  for (const char* stage : {"zero1", "zero2", "zero3"})
    for (int d : {2, 4}) {
      const std::string what = fmt::format("{} on fsdp={}", stage, d);
      const auto r = train_gpt({.mesh = fmt::format("fsdp={}", d), .fsdp = stage}, fmt::format("{}_{}", stage, d));
      // One unit per block and one for the root's own parameters.
      EXPECT_THAT(r.parallelism, ::testing::HasSubstr(", 3 units)")) << what;
      expect_same(r, one_device(), what);
    }
}

TEST(GptParity, HybridFull) {
  expect_same(train_gpt({.mesh = "data=2,fsdp=2", .fsdp = "hybrid_full"}, "hybrid"), one_device(), "hybrid_full");
}

TEST(GptParity, TensorParallel) {
  for (const char* mesh : {"tensor=2", "tensor=4", "data=2,tensor=2"}) {
    const auto r = train_gpt({.mesh = mesh}, std::string("tp_") + mesh);
    expect_same(r, one_device(), mesh);
  }
  // Fully sharded data parallelism over the tensor-parallel blocks.
  for (const char* mesh : {"fsdp=2,tensor=2", "data=2,fsdp=2,tensor=2"})
    expect_same(train_gpt({.mesh = mesh, .fsdp = "zero3"}, std::string("tp_zero3_") + mesh), one_device(),
                std::string("zero3 on ") + mesh);
  // Sequence parallelism: the same numbers (dropout 0.1 on: each rank draws
  // its time steps of the masks), LayerNorm, bias and position gradients
  // summed over the tensor axis once per step.
  for (const char* mesh : {"tensor=2", "tensor=4", "data=2,tensor=2"}) {
    const auto r = train_gpt({.mesh = mesh, .sequence_parallel = true}, std::string("sp_") + mesh);
    expect_same(r, one_device(), std::string("sequence parallel ") + mesh);
  }
  for (const char* mesh : {"fsdp=2,tensor=2", "data=2,fsdp=2,tensor=2"})
    expect_same(train_gpt({.mesh = mesh, .fsdp = "zero3", .sequence_parallel = true}, std::string("sp_zero3_") + mesh),
                one_device(), std::string("sequence parallel zero3 on ") + mesh);
  const auto clipped = train_gpt({.clip_norm = 0.5}, "clip_one");
  EXPECT_NE(clipped.step_losses.back(), one_device().step_losses.back());  // clipping is active
  expect_same(train_gpt({.mesh = "data=2,tensor=2", .clip_norm = 0.5}, "tp_clip"), clipped,
              "data=2,tensor=2 with clip 0.5");
  expect_same(train_gpt({.mesh = "fsdp=2,tensor=2", .fsdp = "zero3", .clip_norm = 0.5}, "tp_zero3_clip"), clipped,
              "zero3 on fsdp=2,tensor=2 with clip 0.5");
  expect_same(train_gpt({.mesh = "data=2,tensor=2", .sequence_parallel = true, .clip_norm = 0.5}, "sp_clip"), clipped,
              "sequence parallel data=2,tensor=2 with clip 0.5");
}

// Each context rank trains on its chunks of every sample's 16 tokens
// (dropout 0.1: its pieces of the one-device masks); gradients and losses
// summed over data x context.
TEST(GptParity, ContextParallel) {
  for (const char* mesh : {"context=2", "context=4", "data=2,context=2", "context=2,tensor=2"})
    expect_same(train_gpt({.mesh = mesh}, std::string("cp_") + mesh), one_device(), std::string("ring ") + mesh);
  for (const char* mesh : {"context=2", "context=2,tensor=2"})
    expect_same(train_gpt({.mesh = mesh, .cp_comm = "all_to_all"}, std::string("cp_a2a_") + mesh), one_device(),
                std::string("all_to_all ") + mesh);
  expect_same(train_gpt({.mesh = "context=4", .cp_load_balance = false}, "cp_in_order"), one_device(),
              "ring context=4, chunks in order");
  expect_same(train_gpt({.mesh = "fsdp=2,context=2", .fsdp = "zero3"}, "cp_zero3"), one_device(),
              "zero3 on fsdp=2,context=2");
  // Recompute replays each block's forward, ring exchanges included, in backward.
  expect_same(train_gpt({.mesh = "context=2", .recompute = true}, "cp_recompute"), one_device(),
              "ring context=2 with recompute");
  const auto clipped = train_gpt({.clip_norm = 0.5}, "cp_clip_one");
  expect_same(train_gpt({.mesh = "data=2,context=2", .clip_norm = 0.5}, "cp_clip"), clipped,
              "data=2,context=2 with clip 0.5");
}

TEST(GptParity, RecomputeChangesNothing) {
  const auto r = train_gpt({.recompute = true}, "recompute");
  EXPECT_EQ(r.step_losses, one_device().step_losses);
  ASSERT_EQ(r.final_parameters.size(), one_device().final_parameters.size());
  for (size_t i = 0; i < r.final_parameters.size(); ++i)
    EXPECT_EQ(r.final_parameters[i].second.to_vector(), one_device().final_parameters[i].second.to_vector())
        << r.final_parameters[i].first;
  expect_same(train_gpt({.mesh = "fsdp=2", .fsdp = "zero3", .recompute = true}, "zero3_recompute"), one_device(),
              "zero3 with recompute");
}

void expect_bitwise(const train::TrainResult& got, const train::TrainResult& want, const std::string& what) {
  for (const std::string& p : testing::run_differences(got, want, 0.0)) ADD_FAILURE() << what << ": " << p;
}

// The largest per-step relative difference of b's losses from a's.
double worst_step(const train::TrainResult& a, const train::TrainResult& b) {
  EXPECT_EQ(a.step_losses.size(), b.step_losses.size());
  double worst = 0;
  for (size_t s = 0; s < std::min(a.step_losses.size(), b.step_losses.size()); ++s)
    worst = std::max(worst, std::fabs(b.step_losses[s] - a.step_losses[s]) / a.step_losses[s]);
  return worst;
}

// ZeRO++ on 2 simulated nodes of 2 ranks. hpZ alone changes no value: with
// recomputation and 2 micro-batches (gathers from the secondary copies in
// the recomputed forward and the second micro-batch) it equals zero3 over
// the same 4 ranks bit for bit, and qwZ+qgZ+hpZ equals qwZ+qgZ. With AdamW
// the quantized run follows the fp32 one within 0.2% per step.
TEST(GptParity, ZeroPlusPlus) {
  const GptRun zero3{.mesh = "fsdp=4", .fsdp = "zero3", .recompute = true, .micro_batches = 2};
  GptRun hpz = zero3;
  hpz.mesh = "node=2,fsdp=2";
  hpz.zeropp = "hpz";
  expect_bitwise(train_gpt(hpz, "zeropp_hpz"), train_gpt(zero3, "zeropp_zero3"), "hpz vs zero3");
  const GptRun quantized{.mesh = "node=2,fsdp=2", .fsdp = "zero3", .recompute = true, .optimizer = "adamw",
                         .zeropp = "qwz,qgz", .micro_batches = 2};
  GptRun all = quantized;
  all.zeropp = "qwz,qgz,hpz";
  const auto q = train_gpt(quantized, "zeropp_q");
  expect_bitwise(train_gpt(all, "zeropp_all"), q, "qwz,qgz,hpz vs qwz,qgz");
  const auto fp32 = train_gpt({.optimizer = "adamw"}, "fp32_adamw");
  const double worst = worst_step(fp32, q);
  fmt::print("GPT ZeRO++ qwZ+qgZ(+hpZ) on node=2,fsdp=2 vs fp32 one device: worst step {:.2e} relative\n", worst);
  EXPECT_LT(worst, 2e-3);
  EXPECT_GT(worst, 0);  // the quantization is real
}

// AdamW (compared by curve, not bit for bit).
TEST(GptParity, HalfPrecisionZero3FollowsFp32) {
  const auto fp32 = train_gpt({.optimizer = "adamw"}, "fp32_adamw");
  EXPECT_LT(fp32.step_losses.back(), fp32.step_losses.front() - 0.3);
  EXPECT_FALSE(testing::run_differences(fp32, one_device(), 1e-5).empty());  // the comparison can fail
  for (auto precision : {DType::bf16, DType::f16}) {
    const auto half = train_gpt({.mesh = "fsdp=2", .fsdp = "zero3", .precision = precision, .optimizer = "adamw"},
                                precision == DType::bf16 ? "bf16" : "fp16");
    const double worst = worst_step(fp32, half);
    fmt::print("GPT {} zero3 vs fp32 one device: worst step {:.2e} relative, {} skipped steps\n",
               config::mixed_precision_name(precision), worst, half.skipped_steps);
    EXPECT_LT(worst, 1e-2) << config::mixed_precision_name(precision);
    EXPECT_GT(worst, 0) << config::mixed_precision_name(precision);  // half precision really is in use
    if (precision == DType::f16) {
      EXPECT_GT(half.loss_scale, 0);  // the scaler is on
    }
  }
  // bf16 over a tensor-parallel split, fully sharded, without and with
  // sequence parallelism.
  for (bool sp : {false, true}) {
    const auto tp = train_gpt({.mesh = "fsdp=2,tensor=2", .fsdp = "zero3", .sequence_parallel = sp,
                               .precision = DType::bf16, .optimizer = "adamw"},
                              sp ? "bf16_sp" : "bf16_tp");
    const double worst = worst_step(fp32, tp);
    fmt::print("GPT bf16 zero3 on fsdp=2 x tensor=2{} vs fp32 one device: worst step {:.2e} relative\n",
               sp ? " (sequence parallel)" : "", worst);
    EXPECT_LT(worst, 1e-2);
    EXPECT_GT(worst, 0);
  }
  // fp16 over data=2 x tensor=2: the loss scaler's overflow flag is reduced
  // over the data and tensor axes (every rank skips alike or none does).
  const auto fp16 = train_gpt({.mesh = "data=2,tensor=2", .fsdp = "zero3", .sequence_parallel = true,
                               .precision = DType::f16, .optimizer = "adamw"},
                              "fp16_tp");
  fmt::print("GPT fp16 zero3 on data=2 x tensor=2 (sequence parallel) vs fp32 one device: worst step {:.2e} "
             "relative, loss scale {}\n",
             worst_step(fp32, fp16), fp16.loss_scale);
  EXPECT_LT(worst_step(fp32, fp16), 1e-2);
  EXPECT_GT(fp16.loss_scale, 0);
}

}  // namespace
}  // namespace meshtrain
