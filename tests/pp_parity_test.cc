// Pipeline parallelism through the real trainer (threads engine) equals one
// device: the GPT of tests/gpt_parity.h made 8 blocks deep (dropout on) on
// pipeline=2 and 4 with every schedule (GPipe, 1F1B, interleaved with 2
// chunks per rank, ZB-H1) and 4 or 8 micro-batches; pipeline=2 with
// data=2, tensor=2 (and sequence parallelism, and gradient clipping that
// binds) and fsdp=2 (zero1 interleaved, zero2); the MLP on pipeline=2 and
// pipeline=2 x tensor=2: per-step losses and final parameters within 1e-5
// relative over 30 steps against one device; bf16 zero1 on fsdp=2 x
// pipeline=2 follows the fp32 losses within 1e-2. Also:
// 1F1B holds p micro-batches' activations where GPipe holds m; the run
// directory holds the timeline; what pipelines cannot do is a clear error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "meshtrain/testing/parity.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

using ::testing::HasSubstr;

struct Run {
  std::string mesh;
  std::string schedule = "1f1b";
  int micro_batches = 4;
  std::string fsdp = {};
  bool sequence_parallel = false;
  double clip_norm = 0;
  DType precision = DType::f32;
};

train::TrainResult train_gpt(const Run& r) {
  const std::string tag = "pp_" + r.mesh + "_" + r.schedule + "_" + std::to_string(r.micro_batches) + r.fsdp +
                          (r.sequence_parallel ? "_sp" : "") + (r.clip_norm > 0 ? "_clip" : "") +
                          (r.precision == DType::f32 ? "" : "_half");
  train::TrainConfig tc = gpt_parity_config(tag);
  tc.layers = 8;
  tc.batch_size = 16;  // 8 rows per data-parallel rank: one per micro-batch at m = 8
  tc.micro_batches = r.micro_batches;
  tc.set("pipeline_schedule", r.schedule, "run.schedule");
  tc.sequence_parallel = r.sequence_parallel;
  tc.clip_norm = r.clip_norm;
  tc.set("fsdp", r.fsdp, "test");
  config::DistributedConfig dc = testing::threads_mesh_config(r.mesh);
  dc.mixed_precision = r.precision;
  return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                      .timeout = std::chrono::seconds(120)});
}

void expect_same(const train::TrainResult& got, const train::TrainResult& ref, const std::string& what) {
  ASSERT_EQ(ref.step_losses.size(), static_cast<size_t>(kGptParitySteps)) << what;
  for (const std::string& p : testing::run_differences(got, ref, 1e-5)) ADD_FAILURE() << what << ": " << p;
}

const train::TrainResult& one_device() {
  static const train::TrainResult r = train_gpt({.mesh = ""});
  return r;
}

TEST(PipelineParity, EveryScheduleEqualsOneDevice) {
  EXPECT_LT(one_device().step_losses.back(), one_device().step_losses.front());  // it learns
  for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zb"})
    for (const char* mesh : {"pipeline=2", "pipeline=4"})
      for (int m : {4, 8}) {
        const train::TrainResult got = train_gpt({.mesh = mesh, .schedule = schedule, .micro_batches = m});
        const std::string what = fmt::format("{} on {} with {} micro-batches", schedule, mesh, m);
        expect_same(got, one_device(), what);
        EXPECT_EQ(got.pipeline_schedule, schedule) << what;
        EXPECT_GE(got.pipeline_bubble, 0) << what;
        EXPECT_LT(got.pipeline_bubble, 1) << what;
      }
}

TEST(PipelineParity, ComposesWithDataTensorAndFullySharded) {
  expect_same(train_gpt({.mesh = "data=2,pipeline=2"}), one_device(), "data=2 x pipeline=2");
  expect_same(train_gpt({.mesh = "pipeline=2,tensor=2"}), one_device(), "pipeline=2 x tensor=2");
  expect_same(train_gpt({.mesh = "pipeline=2,tensor=2", .sequence_parallel = true}), one_device(),
              "pipeline=2 x tensor=2 with sequence parallelism");
  expect_same(train_gpt({.mesh = "fsdp=2,pipeline=2", .schedule = "interleaved", .fsdp = "zero1"}), one_device(),
              "zero1 on fsdp=2 x pipeline=2, interleaved");
  // The last stage's tied head is wte's only use there: its unit is gathered
  // and given a gradient around the head (GPT::head_use).
  expect_same(train_gpt({.mesh = "fsdp=2,pipeline=2", .fsdp = "zero2"}), one_device(), "zero2 on fsdp=2 x pipeline=2");
  const train::TrainResult half =
      train_gpt({.mesh = "fsdp=2,pipeline=2", .fsdp = "zero1", .precision = DType::bf16});
  ASSERT_EQ(half.step_losses.size(), one_device().step_losses.size());
  for (size_t i = 0; i < half.step_losses.size(); ++i)
    EXPECT_NEAR(half.step_losses[i], one_device().step_losses[i], 1e-2 * std::abs(one_device().step_losses[i]))
        << "bf16 zero1 on fsdp=2 x pipeline=2, step " << i + 1;
  // Clipping that binds: the norm adds every stage's squares, wte's once.
  const train::TrainResult clipped = train_gpt({.mesh = "", .clip_norm = 0.5});
  expect_same(train_gpt({.mesh = "pipeline=2,tensor=2", .clip_norm = 0.5}), clipped,
              "pipeline=2 x tensor=2 with clip_norm 0.5");
  const auto differs = testing::run_differences(clipped, one_device(), 1e-5);
  EXPECT_FALSE(differs.empty()) << "clip_norm 0.5 never clipped";
}

train::TrainResult train_mlp(const std::string& mesh, const std::string& tag) {
  train::TrainConfig tc;
  tc.model = "mlp";
  tc.hidden = {48, 30, 20};
  tc.dropout = 0.1;
  tc.batch_size = 64;
  tc.micro_batches = 4;
  tc.optimizer = "sgd";
  tc.lr = 0.05;
  tc.max_steps = 30;
  tc.lr_decay_steps = 30;
  tc.epochs = 1;
  tc.log_every = 1000;
  tc.threads_per_rank = 1;
  tc.run_dir = (std::filesystem::temp_directory_path() / ("meshtrain_pp_parity_mlp_" + tag)).string();
  tc.overwrite = true;
  const config::DistributedConfig dc = testing::threads_mesh_config(mesh);
  return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                      .timeout = std::chrono::seconds(120)});
}

TEST(PipelineParity, MlpEqualsOneDevice) {
  const train::TrainResult one = train_mlp("", "one");
  expect_same(train_mlp("pipeline=2", "pp2"), one, "mlp pipeline=2");
  expect_same(train_mlp("pipeline=2,tensor=2", "pp2_tp2"), one, "mlp pipeline=2 x tensor=2");
}

// 1F1B starts a micro-batch's backward as soon as it can: stage 0 holds p
// micro-batches' activations, GPipe's all m; the tracker sees the difference.
TEST(PipelineMemory, OneFOneBHoldsPipelineDepthMicroBatches) {
  const train::TrainResult gpipe = train_gpt({.mesh = "pipeline=2", .schedule = "gpipe", .micro_batches = 8});
  const train::TrainResult fb = train_gpt({.mesh = "pipeline=2", .schedule = "1f1b", .micro_batches = 8});
  EXPECT_EQ(gpipe.pipeline_peak_in_flight, 8);
  EXPECT_EQ(fb.pipeline_peak_in_flight, 2);
  const auto act = static_cast<size_t>(MemoryCategory::activations);
  EXPECT_LT(fb.memory_peak[act], gpipe.memory_peak[act]);
}

TEST(PipelineRunDirectory, HoldsTheTimeline) {
  const train::TrainResult r = train_gpt({.mesh = "pipeline=2", .schedule = "zb", .micro_batches = 4});
  const std::filesystem::path dir(r.run_dir);
  std::ifstream in(dir / "pipeline.trace.json");
  const nlohmann::json trace = nlohmann::json::parse(in);
  int computes = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && e["cat"] != "recv") ++computes;
  EXPECT_EQ(computes, 2 * 4 * 3);  // 2 stages x 4 micro-batches x (F, I, W)
  EXPECT_TRUE(std::filesystem::exists(dir / "pipeline.svg"));
  EXPECT_NEAR(r.pipeline_bubble_theory, 1.0 / 13, 1e-9);  // (p - 1) / (3 m + p - 1)
}

TEST(PipelineErrors, NameTheFix) {
  EXPECT_THAT(testing::error_of<Unsupported>([] {
                train::TrainConfig tc;
                tc.model = "vae";
                tc.epochs = 1;
                tc.max_steps = 1;
                tc.run_dir = (std::filesystem::temp_directory_path() / "meshtrain_pp_vae").string();
                tc.overwrite = true;
                const config::DistributedConfig dc = testing::threads_mesh_config("pipeline=2");
                train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = 2});
              }),
              HasSubstr("model vae with a pipeline axis"));
  EXPECT_THAT(testing::error_of([] {
                train::TrainConfig tc = gpt_parity_config("pp_too_deep");  // 2 blocks
                const config::DistributedConfig dc = testing::threads_mesh_config("pipeline=4");
                train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = 4});
              }),
              HasSubstr("model gpt has 2 layers to cut into 4 pipeline stages"));
  EXPECT_THAT(testing::error_of([] { train_gpt({.mesh = "data=4,pipeline=2", .micro_batches = 8}); }),
              HasSubstr("--micro-batches: 8 micro-batches with a batch of 16 over 4 data-parallel ranks (4 samples per rank)"));
  EXPECT_THAT(testing::error_of([] {
                train::TrainConfig tc;
                tc.set("schedule", "1f1b", "--schedule");
                tc.validate();
              }),
              HasSubstr("--pipeline-schedule 1f1b"));
}

}  // namespace
}  // namespace meshtrain
