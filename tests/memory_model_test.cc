// plan::predict_memory against what real training runs allocate: the GPT of
// tests/gpt_parity.h (AdamW, 2 steps) through the trainer on the threads
// engine, every rank's MemoryTracker peak through the training steps
// (TrainResult::train_memory_by_rank), for data parallelism, zero1/2/3,
// tensor=2 (with and without sequence parallelism), pipeline=2 (1F1B),
// context=2 and a 3-D mesh. Each rank's total within 5% of the prediction
// for its (pipeline stage, tensor rank), except zero2/zero3 (an upper bound
// within 15%: see Case::upper_bound); what each category held at the peak
// is printed beside its prediction.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "meshtrain/core/memory.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

struct Case {
  std::string mesh;  // "" = one device
  std::string fsdp = "";
  bool sequence_parallel = false;
  int micro_batches = 1;
  config::MixedPrecision precision = config::MixedPrecision::no;
  // Fully sharded zero2/zero3: the model adds the working memory's peak to
  // the activations', which come at different times (the activations peak
  // in the input pass, the gathered units and reductions in the weight
  // pass), so it over-predicts: checked as an upper bound within this.
  double upper_bound = 0;
};

constexpr double kTolerance = 0.05;

void check(const Case& c) {
  SCOPED_TRACE(c.mesh + " " + c.fsdp);
  train::TrainConfig tc = gpt_parity_config("memory_" + std::to_string(std::hash<std::string>{}(c.mesh + c.fsdp)),
                                            "adamw");
  tc.max_steps = 2;
  tc.dropout = 0;
  tc.sequence_parallel = c.sequence_parallel;
  tc.micro_batches = c.micro_batches;
  tc.set("fsdp", c.fsdp, "Case.fsdp");
  config::DistributedConfig dc = testing::threads_mesh_config(c.mesh);
  dc.mixed_precision = c.precision;
  const train::TrainResult r =
      train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                   .timeout = std::chrono::seconds(120)});
  const plan::NamedShape shape = c.mesh.empty() ? plan::NamedShape{{1}, {"data"}} : plan::parse_mesh_spec(c.mesh);
  plan::TrainingLayout l{.data = shape.size_of("data"),
                         .fsdp = shape.size_of("fsdp"),
                         .tensor = shape.size_of("tensor"),
                         .pipeline = shape.size_of("pipeline"),
                         .context = shape.size_of("context"),
                         .sequence_parallel = c.sequence_parallel,
                         .micro_batches = c.micro_batches,
                         .min_weight_size = tc.fsdp_min_weight_size,
                         .batch = tc.batch_size};
  plan::parse_sharding(r.fsdp, l);
  if (c.precision == config::MixedPrecision::bf16) l.param_dtype = l.reduce_dtype = DType::bf16;
  const plan::GptShape g{.vocab = tc.vocab, .seq = tc.context, .layers = tc.layers, .heads = tc.heads,
                         .width = tc.width};
  const plan::MemoryPrediction m = plan::predict_memory(g, l);
  ASSERT_EQ(static_cast<int>(r.train_memory_by_rank.size()), l.devices());
  // World rank -> (pipeline stage, tensor rank): the mesh's row-major order
  // (axes in kMeshAxisOrder, tensor fastest).
  const int tensor = l.tensor, pipeline_stride = l.devices() / l.pipeline;
  for (int w = 0; w < l.devices(); ++w) {
    const int stage = w / pipeline_stride, t = w % tensor;
    const plan::DeviceMemory& want = m.devices.at(static_cast<size_t>(stage * tensor + t));
    const auto& got = r.train_memory_by_rank[static_cast<size_t>(w)];
    const double measured = static_cast<double>(got[kNumMemoryCategories]);
    std::string cats;
    const double predicted[] = {want.parameters, want.gradients, want.optimizer,  want.working,
                                want.activations, want.comm_buffers, 0.0};
    for (size_t k = 0; k < kNumMemoryCategories; ++k)
      cats += fmt::format(" {} {}/{:.0f}", memory_category_name(kAllMemoryCategories[k]), got[k], predicted[k]);
    fmt::print("{:<28} rank {} (stage {}, tensor {}): total {} measured / {:.0f} predicted ({:+.1f}%);{}\n",
               (c.mesh.empty() ? "one device" : c.mesh) + (c.fsdp.empty() ? "" : " " + c.fsdp), w, stage, t,
               static_cast<uint64_t>(measured), want.total(), 100 * (want.total() / measured - 1), cats);
    if (c.upper_bound > 0) {
      EXPECT_GE(want.total() / measured, 1.0) << "rank " << w;
      EXPECT_LE(want.total() / measured, 1.0 + c.upper_bound) << "rank " << w;
    } else {
      EXPECT_NEAR(want.total() / measured, 1.0, kTolerance) << "rank " << w;
    }
  }
}

TEST(MemoryModel, OneDevice) { check({}); }
TEST(MemoryModel, DataParallel) { check({.mesh = "data=2"}); }
TEST(MemoryModel, Zero1) { check({.mesh = "data=2", .fsdp = "zero1"}); }
TEST(MemoryModel, Zero2) { check({.mesh = "data=2", .fsdp = "zero2", .upper_bound = 0.15}); }
TEST(MemoryModel, Zero3) { check({.mesh = "fsdp=2", .fsdp = "zero3", .upper_bound = 0.15}); }
TEST(MemoryModel, Zero3Bf16) {
  check({.mesh = "fsdp=2", .fsdp = "zero3", .precision = config::MixedPrecision::bf16, .upper_bound = 0.15});
}
TEST(MemoryModel, Tensor) { check({.mesh = "tensor=2"}); }
TEST(MemoryModel, TensorSequenceParallel) { check({.mesh = "tensor=2", .sequence_parallel = true}); }
TEST(MemoryModel, Pipeline1F1B) { check({.mesh = "pipeline=2", .micro_batches = 4}); }
TEST(MemoryModel, Context) { check({.mesh = "context=2"}); }
TEST(MemoryModel, ThreeD) { check({.mesh = "pipeline=2,data=2,tensor=2", .micro_batches = 2}); }

}  // namespace
}  // namespace meshtrain
