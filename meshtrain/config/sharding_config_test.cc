// ShardingConfig and ParallelismConfig: device totals, the automatic split
// (every device used, unlike the reference), the mesh built from a config
// (pipeline-only keeps its axis), and every validation message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/testing/testing.h"

#include <functional>

#include "meshtrain/config/sharding_config.h"
#include "meshtrain/core/error.h"

namespace meshtrain::config {
namespace {

using ::testing::HasSubstr;
using Ints = std::vector<int>;
using Names = std::vector<std::string>;

using meshtrain::testing::error_of;

TEST(ShardingConfig, TotalDeviceCountMultipliesEverySize) {
  EXPECT_EQ(ShardingConfig{}.total_device_count(), 1);
  ShardingConfig c{.data_parallel_size = 4, .tensor_parallel_size = 2, .pipeline_parallel_size = 3,
                   .context_parallel_size = 2, .fsdp_enabled = true};
  EXPECT_EQ(c.total_device_count(), 48);  // fsdp adds no devices
  EXPECT_EQ(c.fsdp_min_weight_size, 1024);
  EXPECT_EQ(c.to_string(), "data=4 tensor=2 pipeline=3 context=2 fsdp=on fsdp_min_weight_size=1024");
}

TEST(ShardingConfig, ValidationMessages) {
  EXPECT_TRUE(ShardingConfig{}.is_valid());
  auto msg = [](ShardingConfig c) { return error_of([&] { c.validate(); }); };
  EXPECT_THAT(msg({.data_parallel_size = 0}), HasSubstr("ShardingConfig: data_parallel_size must be >= 1, got 0"));
  EXPECT_THAT(msg({.data_parallel_size = 0}), HasSubstr("use 1 for no data parallelism"));
  EXPECT_THAT(msg({.tensor_parallel_size = -2}), HasSubstr("tensor_parallel_size must be >= 1, got -2"));
  EXPECT_THAT(msg({.pipeline_parallel_size = 0}), HasSubstr("pipeline_parallel_size must be >= 1, got 0"));
  EXPECT_THAT(msg({.context_parallel_size = 0}), HasSubstr("context_parallel_size must be >= 1, got 0"));
  EXPECT_THAT(msg({.fsdp_min_weight_size = -1}), HasSubstr("fsdp_min_weight_size must be >= 0, got -1"));
  EXPECT_THAT(msg({.fsdp_min_weight_size = -1}), HasSubstr("use 0 to shard every weight"));
  EXPECT_THAT(msg({.data_parallel_size = 65536, .tensor_parallel_size = 65536}),
              HasSubstr("data 65536 x tensor 65536 x pipeline 1 x context 1 exceeds 2147483647 devices"));
  EXPECT_FALSE((ShardingConfig{.data_parallel_size = 0}.is_valid()));
}

TEST(ShardingConfig, FromDeviceCountUsesEveryDevice) {
  // The reference: 5 -> 2x2 (4 used), 32 -> 6x5 (30 used).
  auto split = [](int n) {
    const ShardingConfig c = ShardingConfig::from_device_count(n);
    return Ints{c.data_parallel_size, c.tensor_parallel_size};
  };
  EXPECT_EQ(split(1), (Ints{1, 1}));
  EXPECT_EQ(split(2), (Ints{2, 1}));
  EXPECT_EQ(split(4), (Ints{2, 2}));
  EXPECT_EQ(split(5), (Ints{5, 1}));
  EXPECT_EQ(split(8), (Ints{4, 2}));
  EXPECT_EQ(split(12), (Ints{6, 2}));
  EXPECT_EQ(split(16), (Ints{4, 4}));
  EXPECT_EQ(split(32), (Ints{8, 4}));
  EXPECT_EQ(split(64), (Ints{8, 8}));
  EXPECT_EQ(split(128), (Ints{16, 8}));
  for (int n = 1; n <= 1024; ++n) {
    const ShardingConfig c = ShardingConfig::from_device_count(n);
    EXPECT_EQ(c.total_device_count(), n);
    EXPECT_LE(c.tensor_parallel_size, 8);
    EXPECT_LE(c.tensor_parallel_size * c.tensor_parallel_size, n);
    EXPECT_TRUE(ParallelismConfig::from_sharding_config(c).is_valid()) << n;
  }
  EXPECT_THAT(error_of([] { ShardingConfig::from_device_count(0); }),
              HasSubstr("ShardingConfig::from_device_count: device count 0 < 1"));
  EXPECT_THAT(error_of([] { ShardingConfig::from_device_count(-4); }), HasSubstr("device count -4 < 1"));
}

TEST(ParallelismConfig, FromShardingConfigNamesTheAxesInMeshOrder) {
  auto mesh = [](ShardingConfig c) {
    const ParallelismConfig p = ParallelismConfig::from_sharding_config(c);
    EXPECT_TRUE(p.is_valid()) << p.to_string();
    EXPECT_EQ(p.sharding, c);
    return p.to_string();
  };
  EXPECT_EQ(mesh({}), "data=1");
  EXPECT_EQ(mesh({.data_parallel_size = 4}), "data=4");
  EXPECT_EQ(mesh({.data_parallel_size = 2, .tensor_parallel_size = 2}), "data=2,tensor=2");
  EXPECT_EQ(mesh({.data_parallel_size = 4, .tensor_parallel_size = 2, .fsdp_enabled = true}), "fsdp=4,tensor=2");
  // Pipeline-only keeps its pipeline axis (the reference's automatic mesh dropped it).
  EXPECT_EQ(mesh({.pipeline_parallel_size = 4}), "pipeline=4");
  EXPECT_EQ(mesh({.data_parallel_size = 2, .tensor_parallel_size = 2, .pipeline_parallel_size = 2,
                  .context_parallel_size = 2}),
            "pipeline=2,data=2,context=2,tensor=2");
  const ParallelismConfig p = ParallelismConfig::from_sharding_config({.data_parallel_size = 2, .tensor_parallel_size = 4});
  EXPECT_EQ(p.mesh_shape, (Ints{2, 4}));
  EXPECT_EQ(p.mesh_axis_names, (Names{"data", "tensor"}));
  EXPECT_EQ(p.axis_size("tensor"), 4);
  EXPECT_EQ(p.axis_size("pipeline"), 1);
  EXPECT_THAT(error_of([] { ParallelismConfig::from_sharding_config({.tensor_parallel_size = 0}); }),
              HasSubstr("tensor_parallel_size must be >= 1, got 0"));
}

TEST(ParallelismConfig, FromMeshPlan) {
  for (int n = 1; n <= 64; ++n)
    for (const char* model : {"350M", "7B", "70B"})
      for (int64_t seq : {4096, 131072}) {
        const plan::MeshPlan plan = plan::optimize_for_transformer(n, model, seq);
        const ParallelismConfig p = ParallelismConfig::from_mesh_plan(plan);
        EXPECT_TRUE(p.is_valid()) << plan.to_spec();
        EXPECT_EQ(p.sharding.total_device_count(), n);
      }
}

// The seeds' configs are a constructor (layout()) and views (from_layout)
// of the one training layout, not a copy of it: a round trip is exact.
TEST(ParallelismConfig, IsAViewOfTheTrainingLayout) {
  for (const ShardingConfig& s :
       {ShardingConfig{}, ShardingConfig{.data_parallel_size = 2, .tensor_parallel_size = 2},
        ShardingConfig{.data_parallel_size = 4, .pipeline_parallel_size = 2, .fsdp_enabled = true,
                       .fsdp_min_weight_size = 7},
        ShardingConfig{.data_parallel_size = 2, .tensor_parallel_size = 2, .context_parallel_size = 2,
                       .fsdp_enabled = true}}) {
    const ParallelismConfig p = ParallelismConfig::from_sharding_config(s);
    const layout::TrainingLayout l = p.layout();
    EXPECT_EQ(l.mesh, p.named_shape()) << s.to_string();
    EXPECT_EQ(l.fsdp.has_value(), s.fsdp_enabled) << s.to_string();
    EXPECT_EQ(l.fsdp_min_weight_size, s.fsdp_min_weight_size);
    EXPECT_EQ(ParallelismConfig::from_layout(l), p) << s.to_string();
    EXPECT_EQ(ShardingConfig::from_layout(l), s) << s.to_string();
  }
  // A layout the trainer runs (node x fsdp): the node axis splits the batch too.
  const layout::TrainingLayout hsdp{.mesh = mesh::parse_mesh_spec("node=2,fsdp=2,tensor=2"),
                                    .fsdp = layout::parse_fsdp_mode("zero3")};
  const ParallelismConfig p = ParallelismConfig::from_layout(hsdp);
  EXPECT_TRUE(p.is_valid());
  EXPECT_EQ(p.sharding.data_parallel_size, 4);
  EXPECT_EQ(p.sharding.tensor_parallel_size, 2);
  EXPECT_TRUE(p.sharding.fsdp_enabled);
  EXPECT_EQ(p.to_string(), "node=2,fsdp=2,tensor=2");
  EXPECT_THAT(error_of([] { (void)ParallelismConfig{{2}, {"fsdp"}, {.data_parallel_size = 2}}.layout(); }),
              HasSubstr("fsdp_enabled is false"));
}

TEST(ParallelismConfig, ValidationMessages) {
  const ShardingConfig dp2tp2{.data_parallel_size = 2, .tensor_parallel_size = 2};
  auto msg = [](Ints shape, Names names, ShardingConfig s) {
    return error_of([&] { ParallelismConfig{shape, names, s}.validate(); });
  };
  EXPECT_EQ(msg({2, 2}, {"data", "tensor"}, dp2tp2), "");
  EXPECT_EQ(msg({2, 2}, {"tensor", "data"}, dp2tp2), "");  // any order is valid
  EXPECT_THAT(msg({2, 2}, {"data", "tensor"}, {.data_parallel_size = 0}),
              HasSubstr("ShardingConfig: data_parallel_size must be >= 1"));
  EXPECT_THAT(msg({2, 2}, {"data"}, dp2tp2),
              HasSubstr("ParallelismConfig: the mesh has 2 sizes (2, 2) but 1 axis names"));
  EXPECT_THAT(msg({2, 2}, {"data", "model"}, dp2tp2),
              HasSubstr("mesh axis 'model' is not one of pipeline, data, node, fsdp, expert, context, tensor"));
  EXPECT_THAT(msg({2, 2}, {"data", "data"}, dp2tp2), HasSubstr("mesh axis 'data' appears twice"));
  EXPECT_THAT(msg({0, 2}, {"data", "tensor"}, dp2tp2), HasSubstr("axis 0 of shape (0, 2) has size 0"));
  EXPECT_THAT(msg({}, {}, dp2tp2), HasSubstr("has no axes"));
  EXPECT_THAT(msg({2}, {"data"}, dp2tp2), HasSubstr("mesh data=2: shape (2) uses 2 of 4 devices, leaving 2 idle"));
  EXPECT_THAT(msg({2}, {"data"}, dp2tp2), HasSubstr("product is exactly 4"));
  EXPECT_THAT(msg({4, 2}, {"data", "tensor"}, dp2tp2), HasSubstr("needs 8 devices but there are 4"));
  EXPECT_THAT(msg({1, 4}, {"data", "tensor"}, dp2tp2),
              HasSubstr("mesh data=1,tensor=4 has tensor=4 but tensor_parallel_size is 2"));
  EXPECT_THAT(msg({1, 4}, {"data", "tensor"}, dp2tp2),
              HasSubstr("set tensor_parallel_size = 4, or the tensor axis to 2"));
  EXPECT_THAT(msg({4}, {"data"}, dp2tp2), HasSubstr("mesh data=4 has no tensor axis but tensor_parallel_size is 2"));
  EXPECT_THAT(msg({4}, {"data"}, dp2tp2), HasSubstr("add tensor=2 to the mesh"));
  EXPECT_THAT(msg({4}, {"data"}, {.pipeline_parallel_size = 4}),
              HasSubstr("mesh data=4 has no pipeline axis but pipeline_parallel_size is 4"));
  EXPECT_THAT(msg({2, 2}, {"data", "context"}, {.data_parallel_size = 2, .context_parallel_size = 4}),
              HasSubstr("mesh data=2,context=2: shape (2, 2) uses 4 of 8 devices, leaving 4 idle"));
  EXPECT_THAT(msg({4, 2}, {"data", "context"}, {.data_parallel_size = 2, .context_parallel_size = 4}),
              HasSubstr("has context=2 but context_parallel_size is 4"));
  EXPECT_THAT(msg({2, 2}, {"fsdp", "tensor"}, dp2tp2),
              HasSubstr("mesh fsdp=2,tensor=2 has fsdp=2 but fsdp_enabled is false"));
  EXPECT_THAT(msg({2, 2}, {"fsdp", "tensor"}, dp2tp2), HasSubstr("set fsdp_enabled = true, or rename the axis to data"));
  // HSDP: data x fsdp together make the data-parallel size.
  EXPECT_EQ(msg({2, 4}, {"data", "fsdp"}, {.data_parallel_size = 8, .fsdp_enabled = true}), "");
  EXPECT_FALSE((ParallelismConfig{{4}, {"data"}, dp2tp2}.is_valid()));
}

}  // namespace
}  // namespace meshtrain::config
