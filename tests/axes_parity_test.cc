// Combinations of mesh axes at odd sizes equal one device (issue 39's
// matrix, as it lands): the GPT of tests/gpt_parity.h made awkward (5
// blocks, which 2 stages or 4 chunks do not split evenly; 6 heads of 8;
// 40-token windows, which 3 tensor ranks do not divide; dropout 0.1), 20
// steps of fp32 training through the real trainer on the threads engine,
// against one device with the same 4 micro-batches: per-step losses and
// final parameters within 1e-5 relative.
// - ZeRO-3 under a pipeline: fsdp=2 x pipeline=2 at zero3 for gpipe, 1f1b,
//   interleaved (2 chunks per rank) and zb, each stage's units gathered per
//   micro-batch (and kept gathered across them with
//   reshard_after_forward off); hybrid_full on data=2 x fsdp=2 x pipeline=2.
// - Sequence parallelism where the tensor size does not divide the
//   sequence: tensor=3 with dropout (the masks are numbered by the real
//   length, so padding changes none), and pipeline=2 x tensor=3 (a later
//   stage learns the real length from the batch context).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

constexpr int64_t kSteps = 20;

struct Layout {
  std::string mesh = "";  // "" = one device
  std::string fsdp = "";
  bool sequence_parallel = false;
  std::string schedule = "1f1b";
  bool reshard_after_forward = true;
  std::string cp_comm = "ring";
};

train::TrainResult train_gpt(const Layout& l, const std::string& tag) {
  train::TrainConfig tc = gpt_parity_config("axes_" + tag);
  tc.context = 40;
  tc.layers = 5;
  tc.heads = 6;
  tc.width = 48;
  tc.micro_batches = 4;  // every layout, one device too: the same micro-batches
  tc.max_steps = kSteps;
  tc.lr_decay_steps = kSteps;
  tc.batch_size = 16;  // 4 micro-batches on each of up to 4 data-parallel ranks
  tc.sequence_parallel = l.sequence_parallel;
  tc.set("fsdp", l.fsdp, "Layout.fsdp");
  tc.set("pipeline_schedule", l.schedule, "Layout.schedule");
  tc.reshard_after_forward = l.reshard_after_forward;
  tc.set("cp_comm", l.cp_comm, "Layout.cp_comm");
  const config::DistributedConfig dc = testing::threads_mesh_config(l.mesh);
  train::TrainResult r = train::run_training(
      tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size, .timeout = std::chrono::seconds(120)});
  std::filesystem::remove_all(tc.run_dir);
  return r;
}

const train::TrainResult& one_device() {
  static const train::TrainResult r = train_gpt({}, "one");
  return r;
}

void expect_one_device(const Layout& l, const std::string& tag) {
  const bool pipeline = l.mesh.find("pipeline") != std::string::npos;
  const bool context = l.mesh.find("context") != std::string::npos;
  const std::string what = fmt::format("{}{}{}{}{}{}", l.mesh, l.fsdp.empty() ? "" : " " + l.fsdp,
                                       l.sequence_parallel ? " +sp" : "", pipeline ? " " + l.schedule : "",
                                       context ? " " + l.cp_comm : "", l.reshard_after_forward ? "" : " no-reshard");
  const train::TrainResult r = train_gpt(l, tag);
  ASSERT_EQ(one_device().step_losses.size(), static_cast<size_t>(kSteps)) << what;
  for (const std::string& p : testing::run_differences(r, one_device(), 1e-5)) ADD_FAILURE() << what << ": " << p;
  fmt::print("{:<32} {} steps, final loss {:.6f} (one device {:.6f})\n", what, r.step_losses.size(),
             r.step_losses.back(), one_device().step_losses.back());
}

TEST(AxesParity, SequenceParallelPadsWithDropout) {
  expect_one_device({.mesh = "tensor=3", .sequence_parallel = true}, "tensor3_sp");
}

TEST(AxesParity, SequenceParallelPadsInAPipeline) {
  expect_one_device({.mesh = "pipeline=2,tensor=3", .sequence_parallel = true}, "pipeline2_tensor3_sp");
}

TEST(AxesParity, Zero3UnderEverySchedule) {
  for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zb"})
    expect_one_device({.mesh = "fsdp=2,pipeline=2", .fsdp = "zero3", .schedule = schedule},
                      std::string("zero3_pipeline_") + schedule);
  expect_one_device({.mesh = "fsdp=2,pipeline=2", .fsdp = "zero3", .reshard_after_forward = false},
                    "zero3_pipeline_keep");
  expect_one_device({.mesh = "data=2,fsdp=2,pipeline=2", .fsdp = "hybrid_full"}, "hybrid_pipeline");
}

TEST(AxesParity, ContextInsideEverySchedule) {
  for (const char* cp_comm : {"ring", "all_to_all"})
    for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zb"})
      expect_one_device({.mesh = "pipeline=2,context=2", .schedule = schedule, .cp_comm = cp_comm},
                        fmt::format("context_pipeline_{}_{}", cp_comm, schedule));
  expect_one_device({.mesh = "pipeline=2,data=2,context=2"}, "data_context_pipeline");
}

TEST(AxesParity, ContextWithSequenceParallel) {
  // 40 steps: 20 per context rank, 10 per tensor rank; tensor=3 pads 20 to
  // 21 (all_to_all: 2 heads per tensor rank, 1 per context rank).
  expect_one_device({.mesh = "context=2,tensor=2", .sequence_parallel = true}, "context_tensor_sp");
  expect_one_device({.mesh = "context=2,tensor=3", .sequence_parallel = true, .cp_comm = "all_to_all"},
                    "context_tensor3_sp");
  expect_one_device({.mesh = "pipeline=2,context=2,tensor=2", .sequence_parallel = true, .schedule = "zb"},
                    "pipeline_context_tensor_sp");
}

}  // namespace
}  // namespace meshtrain
