// resolve_training: which strategy a run really uses, and the errors for
// meshes and strategies that do not fit (no dataset needed).
#include "meshtrain/train/trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/parity.h"

namespace meshtrain::train {
namespace {

using ::testing::HasSubstr;

// One simulated device per position of `mesh` ("data=2,tensor=2"), the
// tensor/pipeline/context sizes it implies set (as --mesh does).
config::DistributedConfig on_mesh(const std::string& mesh,
                                  DType precision = DType::f32) {
  config::DistributedConfig dc = testing::threads_mesh_config(mesh);
  dc.mixed_precision = precision;
  return dc;
}

std::string error_of(const TrainConfig& tc, const config::DistributedConfig& dc) {
  try {
    (void)resolve_training(tc, dc);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST(ResolveTraining, PlainDataParallelismStaysPlain) {
  const auto r = resolve_training(TrainConfig{}, on_mesh("data=4"));
  EXPECT_EQ(r.config.fsdp.name, "");
  EXPECT_TRUE(r.notes.empty());
}

TEST(ResolveTraining, AnFsdpAxisDefaultsToFull) {
  const auto r = resolve_training(TrainConfig{}, on_mesh("data=2,fsdp=2"));
  EXPECT_EQ(r.config.fsdp.name, "full");
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_THAT(r.notes[0], HasSubstr("fsdp=2"));
  TrainConfig given;
  given.set("fsdp", "zero1", "test");
  EXPECT_EQ(resolve_training(given, on_mesh("fsdp=2")).config.fsdp.name, "zero1");  // an explicit choice stays
}

TEST(ResolveTraining, MixedPrecisionWithoutFsdpIsNoShard) {
  const auto r = resolve_training(TrainConfig{}, on_mesh("data=2", DType::bf16));
  EXPECT_EQ(r.config.fsdp.name, "no_shard");
  EXPECT_THAT(r.notes.at(0), HasSubstr("f32 only"));
  const auto h = resolve_training(TrainConfig{}, on_mesh("data=2", DType::f16));
  ASSERT_EQ(h.notes.size(), 2u);
  EXPECT_THAT(h.notes[1], HasSubstr("loss scaling"));
}

TEST(ResolveTraining, ErrorsSayWhatToChange) {
  TrainConfig hybrid;
  hybrid.set("fsdp", "hybrid_full", "test");
  EXPECT_THAT(error_of(hybrid, on_mesh("data=4")), HasSubstr("mesh data=4 lacks fsdp"));
  EXPECT_THAT(error_of(hybrid, on_mesh("fsdp=4")), HasSubstr("--mesh data=2,fsdp=2"));
  EXPECT_EQ(error_of(hybrid, on_mesh("data=2,fsdp=2")), "no error");
  auto tensor = on_mesh("data=2,tensor=2");
  EXPECT_EQ(error_of(TrainConfig{}, tensor), "no error");  // data x tensor: the recipe decides if it can split
  TrainConfig full;
  full.set("fsdp", "full", "test");
  auto fsdp_tensor = on_mesh("fsdp=2,tensor=2");
  EXPECT_EQ(error_of(full, fsdp_tensor), "no error");  // zero3 over the tensor-parallel blocks
  auto pipeline = on_mesh("data=2,pipeline=2");
  EXPECT_EQ(error_of(TrainConfig{}, pipeline), "no error");  // data x pipeline
  EXPECT_EQ(error_of(full, pipeline), "no error");  // zero3 per stage, gathered per micro-batch
  // The recipe's check decides what its model can split (the default, mlp, has no sequence).
  auto context = on_mesh("data=2,context=2");
  EXPECT_THAT(error_of(TrainConfig{}, context), HasSubstr("a context axis of 2 with model mlp"));
  TrainConfig gpt;
  gpt.model = "gpt";
  EXPECT_EQ(error_of(gpt, context), "no error");
  TrainConfig sp = gpt;
  sp.set("sequence_parallel", "true", "test");
  auto context_tensor = on_mesh("context=2,tensor=2");
  EXPECT_EQ(error_of(gpt, context_tensor), "no error");
  EXPECT_EQ(error_of(sp, context_tensor), "no error");
  auto context_pipeline = on_mesh("pipeline=2,context=2");
  EXPECT_EQ(error_of(gpt, context_pipeline), "no error");
  gpt.heads = 8;
  EXPECT_THAT(error_of(gpt, on_mesh("tensor=3")), HasSubstr("--heads: 8 heads over a tensor axis of 3"));
  EXPECT_THAT(error_of(gpt, on_mesh("data=3")), HasSubstr("--batch-size: a global batch of"));
  TrainConfig zeropp = gpt;  // ZeRO++ over each stage's node x fsdp ranks, not beside data or context ranks
  zeropp.set("fsdp", "zero3", "test");
  zeropp.set("zeropp", "qwz,hpz", "test");
  EXPECT_EQ(error_of(zeropp, on_mesh("pipeline=2,node=2,fsdp=2")), "no error");
  EXPECT_THAT(error_of(zeropp, on_mesh("node=2,fsdp=2,context=2")), HasSubstr("has a context axis"));
  // Strategy names are parsed once, when set: a bad one never reaches resolve_training.
  const auto set_error = [](const char* key, const char* value) {
    try {
      TrainConfig c;
      c.set(key, value, "test");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(set_error("fsdp", "zero4"), HasSubstr("fsdp 'zero4'"));
  EXPECT_THAT(set_error("backward_prefetch", "later"), HasSubstr("use none, pre or post"));
  EXPECT_THAT(set_error("cp_comm", "tree"), HasSubstr("test: cp_comm 'tree' is not one of its choices"));
  EXPECT_THAT(set_error("pipeline_schedule", "dualpipe"), HasSubstr("use gpipe, 1f1b, interleaved or zb"));
  EXPECT_THAT(set_error("zeropp", "qwz,zpp"), HasSubstr("test: zeropp 'qwz,zpp': unknown part 'zpp'"));
  EXPECT_THAT(set_error("reduce_precision", "no"), HasSubstr("reduce_precision 'no' is not one of its choices"));
}

TEST(TrainConfigFsdp, FieldsRoundTripThroughToml) {
  auto c = TrainConfig::from_toml(R"(
[train]
fsdp = "hybrid_shard_grad_op"
fsdp_min_weight_size = 64
forward_prefetch = true
backward_prefetch = "post"
reshard_after_forward = false
)");
  EXPECT_EQ(c.fsdp.name, "hybrid_shard_grad_op");
  EXPECT_EQ(c.fsdp_min_weight_size, 64);
  EXPECT_TRUE(c.forward_prefetch);
  EXPECT_EQ(c.backward_prefetch, layout::BackwardPrefetch::post);
  EXPECT_FALSE(c.reshard_after_forward);
  c.validate();
  EXPECT_EQ(TrainConfig::from_toml(c.to_toml()).to_toml(), c.to_toml());
  EXPECT_THAT(TrainConfig{}.to_toml(), HasSubstr("fsdp = \"\"\n"));
}

}  // namespace
}  // namespace meshtrain::train
