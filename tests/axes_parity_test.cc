// Combinations of mesh axes at odd sizes equal one device (issue 39's
// matrix): the run of tests/axes_parity.h (5 blocks, 6 heads, 40 tokens,
// dropout 0.1, 20 steps, 4 micro-batches) through the real trainer on the
// threads engine, against one device: per-step losses and final
// parameters within 1e-5 relative. The 4- and 8-rank layouts run under
// mpirun too (axes_parity_mpi_main.cc).
// - ZeRO-3 under a pipeline: fsdp=2 x pipeline=2 at zero3 for gpipe, 1f1b,
//   interleaved (2 chunks per rank) and zb, each stage's units gathered per
//   micro-batch (and kept gathered across them with
//   reshard_after_forward off); hybrid_full on data=2 x fsdp=2 x pipeline=2.
// - Sequence parallelism where the tensor size does not divide the
//   sequence: tensor=3 with dropout (the masks are numbered by the real
//   length, so padding changes none), and pipeline=2 x tensor=3 (a later
//   stage learns the real length from the batch context).
// - Context parallelism inside every schedule (ring and all_to_all),
//   data=2 x context=2 x pipeline=2, and with sequence parallelism
//   (context=2 x tensor=2; context=2 x tensor=3, padding each context
//   rank's 20 steps to 21; pipeline=2 x context=2 x tensor=2 under zb).
// - Llama's blocks: data x tensor (sequence parallel, overlap), ZeRO-3
//   under zb, pipeline x tensor, context (ring, all_to_all, beside tensor);
//   key/value heads replicated over tensor=6 (2 and 3 heads; with sequence
//   parallelism) and tensor=2 and 3 (1 head).
// - ZeRO++ on Llama's blocks: hpZ bit for bit against zero3, qwZ + qgZ close.
// - Tensor parallelism's communication overlap (--tp-overlap): its rings
//   at tensor=3 with sequence parallelism, under zb's split backward, and
//   its blocked all-reduces without sequence parallelism.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>

#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/axes_parity.h"

namespace meshtrain {
namespace {

using Layout = AxesLayout;

train::TrainResult train_gpt(const Layout& l, const std::string& tag) {
  const train::TrainConfig tc = axes_config(l, tag);
  const config::DistributedConfig dc = testing::threads_mesh_config(l.mesh);
  train::TrainResult r = train::run_training(
      tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size, .timeout = std::chrono::seconds(120)});
  std::filesystem::remove_all(tc.run_dir);
  return r;
}

// The one-device run of the layout's model (GPT-2's blocks, or Llama's
// with its key/value heads).
const train::TrainResult& one_device(const Layout& l) {
  static std::map<int, train::TrainResult> runs;  // by kv_heads (negative: untied); 0: GPT-2's blocks
  const int key = l.llama ? (l.untied ? -l.kv_heads : l.kv_heads) : 0;
  auto it = runs.find(key);
  if (it == runs.end())
    it = runs.emplace(key, train_gpt({.llama = l.llama, .kv_heads = l.kv_heads, .untied = l.untied},
                                     fmt::format("one_{}", key)))
             .first;
  return it->second;
}

void expect_one_device(const Layout& l, const std::string& tag) {
  const std::string what = l.name();
  const train::TrainResult r = train_gpt(l, tag);
  const train::TrainResult& one = one_device(l);
  ASSERT_EQ(one.step_losses.size(), static_cast<size_t>(kAxesSteps)) << what;
  for (const std::string& p : testing::run_differences(r, one, 1e-5)) ADD_FAILURE() << what << ": " << p;
  fmt::print("{:<32} {} steps, final loss {:.6f} (one device {:.6f})\n", what, r.step_losses.size(),
             r.step_losses.back(), one.step_losses.back());
}

TEST(AxesParity, SequenceParallelPadsWithDropout) {
  expect_one_device({.mesh = "tensor=3", .sequence_parallel = true}, "tensor3_sp");
}

// Tensor parallelism's communication overlap: the rings with sequence
// parallelism at a size that pads (tensor=3: three ring steps per
// boundary), under the zero-bubble schedule's split backward, and the
// blocked all-reduces without sequence parallelism.
TEST(AxesParity, TensorCommunicationOverlap) {
  expect_one_device({.mesh = "tensor=3", .sequence_parallel = true, .tp_overlap = true}, "tensor3_sp_overlap");
  expect_one_device({.mesh = "pipeline=2,tensor=2", .sequence_parallel = true, .schedule = "zb", .tp_overlap = true},
                    "pipeline_tensor_sp_overlap");
  expect_one_device({.mesh = "data=2,tensor=2", .tp_overlap = true}, "data_tensor_overlap");
}

// Llama's blocks (6 query heads, 2 key/value heads) through the trainer
// equal one device: data x tensor with sequence parallelism and overlap,
// ZeRO-3 under the zero-bubble schedule, zero1, zero2 and hybrid_full,
// pipeline x tensor, and context
// parallelism (rotary positions at each rank's global steps) by ring with
// data, by all_to_all, and beside a sequence-parallel tensor axis.
TEST(AxesParity, LlamaBlocks) {
  expect_one_device({.mesh = "data=2,context=2", .llama = true}, "llama_data_context");
  expect_one_device({.mesh = "context=2", .cp_comm = "all_to_all", .llama = true}, "llama_context_a2a");
  expect_one_device({.mesh = "context=2,tensor=2", .sequence_parallel = true, .llama = true}, "llama_context_tensor");
  expect_one_device({.mesh = "data=2,tensor=2", .sequence_parallel = true, .tp_overlap = true, .llama = true},
                    "llama_data_tensor_sp");
  expect_one_device({.mesh = "fsdp=2,pipeline=2", .fsdp = "zero3", .schedule = "zb", .llama = true},
                    "llama_fsdp_pipeline");
  expect_one_device({.mesh = "pipeline=2,tensor=2", .sequence_parallel = true, .llama = true},
                    "llama_pipeline_tensor_sp");
  // Fully sharded at every stage.
  expect_one_device({.mesh = "data=2", .fsdp = "zero1", .llama = true}, "llama_zero1");
  expect_one_device({.mesh = "fsdp=2", .fsdp = "zero2", .llama = true}, "llama_zero2");
  expect_one_device({.mesh = "data=2,fsdp=2", .fsdp = "hybrid_full", .llama = true}, "llama_hybrid");
}

// Llama's key/value heads replicated over a tensor axis larger than
// kv_heads (Megatron's rule): 2 heads over tensor=6 (each on 3 ranks), 3
// heads (each on 2), and 1 head over tensor=2 beside data and under a
// pipeline, each head's gradients summed over the ranks holding it once per
// step; with sequence parallelism too.
TEST(AxesParity, LlamaReplicatedKeyValueHeads) {
  expect_one_device({.mesh = "tensor=6", .llama = true, .kv_heads = 2}, "llama_kv2_tensor6");
  expect_one_device({.mesh = "tensor=6", .llama = true, .kv_heads = 3}, "llama_kv3_tensor6");
  expect_one_device({.mesh = "data=2,tensor=2", .llama = true, .kv_heads = 1}, "llama_kv1_data_tensor");
  expect_one_device({.mesh = "pipeline=2,tensor=3", .llama = true, .kv_heads = 1}, "llama_kv1_pipeline_tensor3");
  // With sequence parallelism (k and v on the gathered sequence): tensor=6,
  // and tensor=3 padding the 40 steps to 42 under a pipeline.
  expect_one_device({.mesh = "tensor=6", .sequence_parallel = true, .llama = true, .kv_heads = 2},
                    "llama_kv2_tensor6_sp");
  expect_one_device({.mesh = "pipeline=2,tensor=3", .sequence_parallel = true, .llama = true, .kv_heads = 1},
                    "llama_kv1_pipeline_tensor3_sp");
}

// Llama's head untied (its own lm_head table): vocabulary-parallel beside
// sequence parallelism, on a pipeline's last stage alone (no tied gradient
// between stages), and gathered by ZeRO-3 under the zero-bubble schedule.
TEST(AxesParity, LlamaUntiedHead) {
  expect_one_device({.mesh = "data=2,tensor=2", .sequence_parallel = true, .llama = true, .untied = true},
                    "llama_untied_data_tensor_sp");
  expect_one_device({.mesh = "pipeline=2,tensor=2", .llama = true, .untied = true}, "llama_untied_pipeline_tensor");
  expect_one_device({.mesh = "fsdp=2,pipeline=2", .fsdp = "zero3", .schedule = "zb", .llama = true, .untied = true},
                    "llama_untied_zero3_pipeline");
}

// ZeRO++ on Llama's blocks: hpZ changes no value (zero3 over fsdp=4, bit
// for bit), and qwZ + qgZ follows one device closely.
TEST(AxesParity, LlamaZeroPlusPlus) {
  const train::TrainResult hpz =
      train_gpt({.mesh = "node=2,fsdp=2", .fsdp = "zero3", .zeropp = "hpz", .llama = true}, "llama_zeropp_hpz");
  const train::TrainResult zero3 = train_gpt({.mesh = "fsdp=4", .fsdp = "zero3", .llama = true}, "llama_zero3");
  for (const std::string& p : testing::run_differences(hpz, zero3, 0.0)) ADD_FAILURE() << "hpz vs zero3: " << p;
  const train::TrainResult q =
      train_gpt({.mesh = "node=2,fsdp=2", .fsdp = "zero3", .zeropp = "qwz,qgz", .llama = true}, "llama_zeropp_q");
  const train::TrainResult& one = one_device({.llama = true});
  double worst = 0;
  for (size_t s = 0; s < q.step_losses.size(); ++s)
    worst = std::max(worst, std::fabs(q.step_losses[s] - one.step_losses[s]) / one.step_losses[s]);
  fmt::print("Llama ZeRO++ qwZ+qgZ on node=2,fsdp=2 vs one device: worst step {:.2e} relative\n", worst);
  EXPECT_LT(worst, 2e-3);
  EXPECT_GT(worst, 0);  // the quantization is real
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
  // Llama's blocks with the padding (3 key/value heads over tensor=3): ring
  // and all_to_all.
  expect_one_device({.mesh = "context=2,tensor=3", .sequence_parallel = true, .llama = true, .kv_heads = 3},
                    "llama_context_tensor3_sp");
  expect_one_device({.mesh = "context=2,tensor=3", .sequence_parallel = true, .cp_comm = "all_to_all",
                     .llama = true, .kv_heads = 3},
                    "llama_context_tensor3_sp_a2a");
}

// ZeRO++ under a pipeline: each stage shards over its node=2 x fsdp=2
// ranks. hpZ changes no value (zero3 over fsdp=4 x pipeline=2, bit for
// bit; likewise beside a tensor axis), qwZ+qgZ+hpZ equals qwZ+qgZ, and the
// quantized run follows one device closely.
TEST(AxesParity, ZeroPlusPlusUnderAPipeline) {
  const auto bitwise = [](const train::TrainResult& got, const train::TrainResult& want, const std::string& what) {
    for (const std::string& p : testing::run_differences(got, want, 0.0)) ADD_FAILURE() << what << ": " << p;
  };
  const Layout zero3{.mesh = "fsdp=4,pipeline=2", .fsdp = "zero3"};
  Layout hpz{.mesh = "node=2,fsdp=2,pipeline=2", .fsdp = "zero3", .zeropp = "hpz"};
  bitwise(train_gpt(hpz, "zeropp_hpz"), train_gpt(zero3, "zeropp_zero3"), "hpz vs zero3");
  bitwise(train_gpt({.mesh = "node=2,fsdp=2,tensor=2", .fsdp = "zero3", .zeropp = "hpz"}, "zeropp_hpz_tensor"),
          train_gpt({.mesh = "fsdp=4,tensor=2", .fsdp = "zero3"}, "zeropp_zero3_tensor"), "hpz vs zero3 (tensor=2)");
  const Layout quantized{.mesh = "node=2,fsdp=2,pipeline=2", .fsdp = "zero3", .zeropp = "qwz,qgz"};
  Layout all = quantized;
  all.zeropp = "qwz,qgz,hpz";
  const train::TrainResult q = train_gpt(quantized, "zeropp_q");
  bitwise(train_gpt(all, "zeropp_all"), q, "qwz,qgz,hpz vs qwz,qgz");
  double worst = 0;
  for (size_t s = 0; s < q.step_losses.size(); ++s)
    worst = std::max(worst,
                     std::fabs(q.step_losses[s] - one_device({}).step_losses[s]) / one_device({}).step_losses[s]);
  fmt::print("ZeRO++ qwZ+qgZ on node=2,fsdp=2,pipeline=2 vs one device: worst step {:.2e} relative\n", worst);
  EXPECT_LT(worst, 2e-3);
  EXPECT_GT(worst, 0);  // the quantization is real
}

}  // namespace
}  // namespace meshtrain
