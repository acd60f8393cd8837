// The training layout's derived facts and the placement rule on small,
// hand-checked cases (tests/placement_property_test.cc checks the rule
// against real runs).
#include "meshtrain/layout/placement_rule.h"

#include <gtest/gtest.h>

#include "meshtrain/core/error.h"

namespace meshtrain::layout {
namespace {

TrainingLayout on(std::string_view mesh, std::string_view fsdp = "") {
  TrainingLayout l{.mesh = mesh::parse_mesh_spec(mesh), .fsdp_min_weight_size = 10};
  if (!fsdp.empty()) l.fsdp = parse_fsdp_mode(fsdp);
  return l;
}

TEST(TrainingLayout, FsdpShardsOverTheAxesThatSumGradients) {
  EXPECT_EQ(on("data=2,fsdp=2,context=2", "full").shard_size(), 8);
  EXPECT_EQ(on("data=2,fsdp=2,context=2", "hybrid_full").shard_size(), 2);
  EXPECT_EQ(on("data=4", "no_shard").shard_size(), 1);
  EXPECT_EQ(on("data=4").shard_size(), 1);
  EXPECT_EQ(on("node=2,fsdp=4", "zero3").shard_size(), 8);
  EXPECT_EQ(on("data=2,fsdp=2,tensor=2", "full").describe(),
            "mesh data=2,fsdp=2,tensor=2: fsdp full over data x fsdp (4 ranks), tensor 2");
  TrainingLayout p = on("pipeline=2,data=2");
  p.micro_batches = 4;
  EXPECT_EQ(p.describe(), "mesh pipeline=2,data=2: data parallel 2, pipeline 2 (1f1b, 4 micro-batches)");
  EXPECT_EQ(p.devices(), 4);
}

// The one default every entry point takes when no fsdp mode is given.
TEST(TrainingLayout, FsdpModeDefaults) {
  const auto mode = [](std::string_view given, std::string_view mesh, DType precision) {
    const std::optional<FsdpMode> m = resolve_fsdp_mode(given, mesh::parse_mesh_spec(mesh), precision);
    return m ? m->name() : std::string("none");
  };
  EXPECT_EQ(mode("", "data=4", DType::f32), "none");
  EXPECT_EQ(mode("", "fsdp=2", DType::f32), "full");
  EXPECT_EQ(mode("", "fsdp=1,data=2", DType::f32), "none");  // an fsdp axis of 1 shards nothing
  EXPECT_EQ(mode("", "data=2", DType::bf16), "no_shard");    // plain data parallelism is f32 only
  EXPECT_EQ(mode("", "fsdp=2", DType::bf16), "full");
  EXPECT_EQ(mode("zero2", "fsdp=2", DType::f32), "shard_grad_op");
  EXPECT_EQ(mode("hybrid_full", "data=2", DType::f16), "hybrid_full");
  EXPECT_THROW(mode("zero4", "fsdp=2", DType::f32), InvalidArgument);
}

// A unit of a (4, 6) weight and a (6,) bias, then a (5, 3) weight alone.
std::vector<ModelParameter> small_model() {
  using sharding::LinearRole;
  using sharding::ParamKind;
  return {{{.name = "a.weight", .shape = {4, 6}, .kind = ParamKind::linear_weight, .role = LinearRole::column}, 0},
          {{.name = "a.bias", .shape = {6}, .kind = ParamKind::linear_bias, .role = LinearRole::column}, 0},
          {{.name = "b.weight", .shape = {5, 3}, .kind = ParamKind::linear_weight, .role = LinearRole::none}, 1}};
}

// The seeds' per-dimension picture: a spec per parameter over the data,
// fsdp and tensor axes (node, context and pipeline split no tensor).
TEST(PlacementRule, SeedStrategiesGiveTheSpec) {
  const std::vector<ModelParameter> ps = small_model();
  const sharding::MultiDimensionalStrategy md = seed_strategies(on("pipeline=2,data=2,fsdp=2,tensor=2", "full"));
  EXPECT_EQ(md.combined_spec(ps[0].info).to_string(), "P(fsdp, tensor)");  // column-parallel: out over tensor
  EXPECT_EQ(md.combined_spec(ps[1].info).to_string(), "P(tensor)");        // 6 elements: under min_weight_size
  EXPECT_EQ(md.combined_spec(ps[2].info).to_string(), "P(fsdp, None)");
  EXPECT_EQ(seed_strategies(on("node=2,context=2")).combined_spec(ps[0].info).to_string(), "P(None, None)");
}

TEST(PlacementRule, TensorBlocksThenFlatRangesOfEachUnit) {
  // fsdp=2 x tensor=2: rank 3 is fsdp 1, tensor 1.
  const std::vector<HeldParameter> h = held_parameters(on("fsdp=2,tensor=2", "full"), small_model(), 3);
  ASSERT_EQ(h.size(), 3u);
  // a.weight's block [0:4, 3:6] (12 elements) is sharded; a.bias's (3) stays
  // whole (under min_weight_size 10): unit 0 packs 12 elements, 6 per rank.
  EXPECT_EQ(h[0].placement.to_string(), "[0:4, 3:6] of [4, 6] flat[6:12]");
  EXPECT_EQ(h[1].placement.to_string(), "[3:6] of [6]");
  // b.weight is not split by the tensor axis: 15 elements padded to 16, 8 each.
  EXPECT_EQ(h[2].placement.to_string(), "flat[8:15]");
  EXPECT_EQ(h[2].placement.shape, (std::vector<int64_t>{5, 3}));
}

TEST(PlacementRule, PipelineStagesAndReplicatingAxes) {
  std::vector<ModelParameter> ps = small_model();
  ps[2].stage = 1;
  const TrainingLayout l = on("pipeline=2,data=2");
  EXPECT_EQ(held_parameters(l, ps, 1).size(), 2u);  // pipeline rank 0: stage 0
  const std::vector<HeldParameter> last = held_parameters(l, ps, 3);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].name, "b.weight");
  EXPECT_EQ(last[0].stage, 1);
  EXPECT_EQ(last[0].placement, sharding::Placement::whole({5, 3}));
  EXPECT_THROW(held_parameters(l, ps, 4), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::layout
