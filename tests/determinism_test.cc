// The deterministic mode (docs/determinism.md) through the real trainer on
// Fashion-MNIST: with --deterministic, 20 steps of the MLP under AdamW (which
// turns any last-bit difference into a visible one) end in the same
// model.safetensors, byte for byte, and the same per-step losses, on 1, 2, 4
// and 8 data-parallel ranks, with 1 to 8 micro-batches, fully sharded at
// zero1, zero2, zero3 and no_shard over 2 and 4 ranks, through 2 pipeline
// stages under every schedule with 2, 4 and 8 micro-batches, data=2 x
// fsdp=2 x pipeline=2, and with 1 or 2
// threads per rank (threads engine; tests/determinism_mpi_main.cc runs the
// mpi and gloo engines); the same for a small GPT-2 and Llama on the
// fortunes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/parity.h"
#include "tests/determinism.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain {
namespace {

struct Outcome {
  std::vector<double> losses;
  std::string model;  // model.safetensors' bytes
};

using testing::deterministic_gpt;
using testing::deterministic_mlp;
using testing::read_bytes;

// On a mesh spec ("data=2,fsdp=2"; "" = one device), or on `ranks` data ranks.
Outcome train_on(const train::TrainConfig& tc, const std::string& mesh) {
  const config::DistributedConfig dc = testing::threads_mesh_config(mesh);
  const auto r = train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                              .timeout = std::chrono::seconds(120)});
  return {r.step_losses, read_bytes(tc.run_dir + "/model.safetensors")};
}
Outcome train_on(const train::TrainConfig& tc, int ranks) {
  return train_on(tc, ranks == 1 ? std::string() : fmt::format("data={}", ranks));
}

void expect_identical(const Outcome& got, const Outcome& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), 20u) << what;
  for (size_t s = 0; s < got.losses.size(); ++s) EXPECT_EQ(got.losses[s], want.losses[s]) << what << " step " << s;
  ASSERT_FALSE(want.model.empty());
  EXPECT_TRUE(got.model == want.model) << what << ": model.safetensors differs from one device's";
}

TEST(Determinism, DataParallelLayoutsGiveTheSameBytes) {
  const Outcome one = train_on(deterministic_mlp("one"), 1);
  for (int ranks : {2, 4, 8}) {
    SCOPED_TRACE(ranks);
    expect_identical(train_on(deterministic_mlp("data" + std::to_string(ranks)), ranks), one,
                     "data=" + std::to_string(ranks));
  }
  for (auto [ranks, micro] : {std::pair{1, 2}, {1, 8}, {2, 4}, {4, 2}}) {
    train::TrainConfig tc = deterministic_mlp("micro");
    tc.micro_batches = micro;
    expect_identical(train_on(tc, ranks), one, fmt::format("data={} with {} micro-batches", ranks, micro));
  }
  train::TrainConfig two_threads = deterministic_mlp("threads");
  two_threads.threads_per_rank = 2;
  expect_identical(train_on(two_threads, 1), one, "one device with 2 threads");
  expect_identical(train_on(two_threads, 2), one, "data=2 with 2 threads per rank");
}

TEST(Determinism, FullyShardedLayoutsGiveTheSameBytes) {
  const Outcome one = train_on(deterministic_mlp("fsdp_one"), 1);
  for (const char* stage : {"zero1", "zero2", "zero3", "no_shard"})
    for (const char* mesh : {"fsdp=2", "fsdp=4", "data=2,fsdp=2"}) {
      train::TrainConfig tc = deterministic_mlp("fsdp");
      tc.set("fsdp", stage, "test");
      tc.micro_batches = 2;
      expect_identical(train_on(tc, mesh), one, fmt::format("{} on {} with 2 micro-batches", stage, mesh));
    }
}

TEST(Determinism, PipelineSchedulesAndMicroBatchesGiveTheSameBytes) {
  const Outcome one = train_on(deterministic_mlp("pipeline_one"), 1);
  for (const char* schedule : {"gpipe", "1f1b", "zb", "interleaved"})
    for (int micro : {2, 4, 8}) {
      train::TrainConfig tc = deterministic_mlp("pipeline");
      tc.set("pipeline_schedule", schedule, "test");
      tc.micro_batches = micro;
      expect_identical(train_on(tc, "pipeline=2"), one,
                       fmt::format("pipeline=2 {} with {} micro-batches", schedule, micro));
    }
  for (const char* stage : {"zero1", "zero3"}) {
    train::TrainConfig tc = deterministic_mlp("pipeline_fsdp");
    tc.set("fsdp", stage, "test");
    tc.micro_batches = 2;
    expect_identical(train_on(tc, "data=2,fsdp=2,pipeline=2"), one,
                     fmt::format("data=2 x fsdp=2 ({}) x pipeline=2", stage));
  }
}

TEST(Determinism, GptLayoutsGiveTheSameBytes) {
  const Outcome one = train_on(deterministic_gpt("gpt_one"), 1);
  std::vector<std::tuple<std::string, std::string, int, std::string>> layouts = {
      {"data=2", "", 1, ""}, {"data=4", "", 2, ""}, {"data=8", "", 1, ""}, {"", "", 8, ""},
      {"data=2,fsdp=2,pipeline=2", "zero3", 2, "1f1b"}};
  for (const char* mesh : {"fsdp=2", "fsdp=4"})
    for (const char* stage : {"zero1", "zero2", "zero3"}) layouts.emplace_back(mesh, stage, 2, "");
  for (const char* schedule : {"gpipe", "1f1b", "zb"})
    for (int micro : {2, 4, 8}) layouts.emplace_back("pipeline=2", "", micro, schedule);
  for (const auto& [mesh, fsdp, micro, schedule] : layouts) {
    train::TrainConfig tc = deterministic_gpt("gpt");
    tc.set("fsdp", fsdp, "test");
    tc.micro_batches = micro;
    if (!schedule.empty()) tc.set("pipeline_schedule", schedule, "test");
    expect_identical(train_on(tc, mesh), one,
                     fmt::format("GPT on '{}' fsdp '{}' {} micro-batches {}", mesh, fsdp, micro, schedule));
  }
  train::TrainConfig two_threads = deterministic_gpt("gpt_threads");
  two_threads.threads_per_rank = 2;
  expect_identical(train_on(two_threads, "data=2"), one, "GPT on data=2 with 2 threads per rank");
}

TEST(Determinism, LlamaLayoutsGiveTheSameBytes) {
  train::TrainConfig llama = deterministic_gpt("llama_one");
  llama.set("arch", "llama", "test");
  llama.kv_heads = 1;
  llama.tie_embeddings = false;
  llama.dropout = 0;  // Llama's blocks have none
  const Outcome one = train_on(llama, 1);
  for (const auto& [mesh, micro] : {std::pair<std::string, int>{"data=2", 2}, {"fsdp=4", 1}, {"pipeline=2", 4}}) {
    train::TrainConfig tc = llama;
    tc.run_dir += "_layout";
    tc.micro_batches = micro;
    expect_identical(train_on(tc, mesh), one, fmt::format("Llama on {} with {} micro-batches", mesh, micro));
  }
}

// Global-norm clipping, active (0.05 is below the norms here): the norm
// from exact squares, the same on every layout.
TEST(Determinism, ClippingGivesTheSameBytes) {
  for (const bool gpt : {false, true}) {
    train::TrainConfig tc = gpt ? deterministic_gpt("clip_gpt") : deterministic_mlp("clip_mlp");
    tc.clip_norm = 0.05;
    const Outcome one = train_on(tc, 1);
    train::TrainConfig unclipped = tc;
    unclipped.clip_norm = 0;
    unclipped.run_dir += "_off";
    EXPECT_NE(train_on(unclipped, 1).model, one.model) << "clipping was not active";
    for (const auto& [mesh, fsdp, micro] :
         {std::tuple<std::string, std::string, int>{"data=4", "", 1}, {"fsdp=2", "zero3", 2},
          {"pipeline=2", "", 4}, {"data=2,fsdp=2,pipeline=2", "zero1", 2}}) {
      train::TrainConfig t = tc;
      t.run_dir += "_layout";
      t.set("fsdp", fsdp, "test");
      t.micro_batches = micro;
      expect_identical(train_on(t, mesh), one,
                       fmt::format("{} clipped on {} {} x{}", gpt ? "GPT" : "MLP", mesh, fsdp, micro));
    }
  }
}

TEST(Determinism, ThreeRanksContinueTheTreeOverSixBlocks) {
  // 96 samples = 6 blocks of 16: the tree ((b0 + b1) + (b2 + b3)) + (b4 + b5)
  // has each rank's two blocks as a node, so 3 ranks give one device's bits.
  train::TrainConfig tc = deterministic_mlp("three_one");
  tc.batch_size = 96;
  const Outcome one = train_on(tc, 1);
  tc.run_dir += "_3";
  expect_identical(train_on(tc, 3), one, "data=3");
}

std::vector<std::string> checksum_lines(const std::string& run_dir) {
  std::vector<std::string> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (line.find("\"checksum\"") != std::string::npos) out.push_back(line);
  return out;
}

// Saved at step 10 on data=4, resumed on data=2 (and on one device) to step
// 20: the uninterrupted one-device run's bytes, and the same checksum lines.
TEST(Determinism, AResumeOnAnotherMeshEndsIdenticalWithTheSameChecksumLog) {
  train::TrainConfig tc = deterministic_mlp("resume_one");
  tc.checksum_every = 5;
  const Outcome one = train_on(tc, 1);
  const std::vector<std::string> sums = checksum_lines(tc.run_dir);
  ASSERT_EQ(sums.size(), 4u);  // steps 5, 10, 15, 20
  for (int resume_ranks : {2, 1}) {
    train::TrainConfig first = deterministic_mlp("resume_saved" + std::to_string(resume_ranks));
    first.checksum_every = 5;
    first.max_steps = 10;
    first.checkpoint_every = 10;
    (void)train_on(first, 4);
    train::TrainConfig rest = first;  // the same run, on another mesh, to step 20
    rest.resume = first.run_dir;
    rest.max_steps = 20;
    const Outcome resumed = train_on(rest, resume_ranks);
    const std::string what = fmt::format("saved on data=4, resumed on data={}", resume_ranks);
    EXPECT_EQ(read_bytes(first.run_dir + "/model.safetensors"), one.model) << what;
    EXPECT_EQ(checksum_lines(first.run_dir), sums) << what;
    ASSERT_EQ(resumed.losses.size(), 10u) << what;
    for (size_t s = 0; s < 10; ++s) EXPECT_EQ(resumed.losses[s], one.losses[10 + s]) << what << " step " << 10 + s;
  }
}

std::string refusal(const train::TrainConfig& tc, int ranks) {
  config::DistributedConfig dc;
  dc.world_size = ranks;
  dc.mesh_shape = {ranks};
  dc.mesh_axis_names = {"data"};
  try {
    (void)train::resolve_training(tc, dc);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Determinism, SharesThatAreNotTreeNodesAreRefusedAtStartUp) {
  train::TrainConfig tc = deterministic_mlp("refused");
  tc.batch_size = 96;
  tc.deterministic_block = 64;  // 32 samples per rank on 3 ranks: not whole blocks
  EXPECT_NE(refusal(tc, 3).find("--deterministic-block"), std::string::npos) << refusal(tc, 3);
  tc.deterministic_block = 16;  // 3 blocks per rank on 2 ranks: blocks [0, 3) are not a node of the tree over 6
  const std::string e = refusal(tc, 2);
  EXPECT_NE(e.find("--deterministic"), std::string::npos) << e;
  EXPECT_NE(e.find("power-of-two number of blocks"), std::string::npos) << e;
  EXPECT_EQ(refusal(tc, 3), "");  // 2 blocks per rank: nodes
  tc.set("fsdp", "hybrid_full", "test");
  EXPECT_NE(refusal(tc, 3).find("hybrid"), std::string::npos) << refusal(tc, 3);
}

}  // namespace
}  // namespace meshtrain
