// Tests for the sharding strategies: strategy.h, stage_assignment.h, multi_dimensional.h.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <set>

#include "meshtrain/core/error.h"
#include "meshtrain/sharding/multi_dimensional.h"
#include "meshtrain/sharding/stage_assignment.h"
#include "meshtrain/sharding/layout.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::sharding {
namespace {

using ::testing::HasSubstr;

PartitionSpec P(std::vector<std::vector<std::string>> dims) { return PartitionSpec(std::move(dims)); }

// The message of the InvalidArgument that f throws ("" and a failure if none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return {};
}

ParamInfo linear(std::string name, std::vector<int64_t> shape, LinearRole role) {
  return {.name = std::move(name), .shape = std::move(shape), .kind = ParamKind::linear_weight, .role = role};
}

ParamInfo param(std::string name, std::vector<int64_t> shape, ParamKind kind) {
  return {.name = std::move(name), .shape = std::move(shape), .kind = kind};
}

// ------------------------------------------------------------------ DataParallel

TEST(DataParallel, ReplicatesParamsAndSplitsTheBatchDim) {
  DataParallelStrategy dp("data");
  EXPECT_EQ(dp.name(), "DataParallel(data)");
  EXPECT_EQ(dp.param_spec(linear("fc", {4096, 4096}, LinearRole::column)), P({{}, {}}));
  EXPECT_EQ(dp.param_spec(param("scalar", {}, ParamKind::other)), P({}));
  EXPECT_EQ(dp.batch_spec(3, 0), P({{"data"}, {}, {}}));
  EXPECT_EQ(dp.batch_spec(2, 1), P({{}, {"data"}}));
  EXPECT_THAT(error_of([&] { dp.batch_spec(2, 2); }), HasSubstr("batch_dim 2 is not a dimension of a 2-D tensor"));
  EXPECT_THAT(error_of([] { DataParallelStrategy(""); }), HasSubstr("the mesh axis name is empty"));
}

// ------------------------------------------------------------------ FSDP

TEST(FSDP, ReplicatesWeightsBelowMinWeightSize) {
  FSDPStrategy fsdp("fsdp", 8, 1024);
  const auto bias = param("h.0.mlp.fc1.bias", {512}, ParamKind::linear_bias);
  EXPECT_EQ(fsdp.param_spec(bias), P({{}}));
  EXPECT_FALSE(fsdp.should_shard(bias));
  EXPECT_THAT(fsdp.explain(bias), HasSubstr("has 512 elements < min_weight_size 1024: replicated"));
  // The threshold is inclusive: 1024 elements are sharded.
  EXPECT_EQ(fsdp.param_spec(param("b", {1024}, ParamKind::linear_bias)), P({{"fsdp"}}));
  // Scalars stay whole even with no threshold.
  EXPECT_EQ(FSDPStrategy("fsdp", 8, 0).param_spec(param("s", {}, ParamKind::other)), P({}));
}

TEST(FSDP, ShardsTheLargestDivisibleDimension) {
  FSDPStrategy fsdp("fsdp", 8);
  EXPECT_EQ(fsdp.param_spec(linear("fc1", {1024, 4096}, LinearRole::column)), P({{}, {"fsdp"}}));
  EXPECT_EQ(fsdp.shard_dim(linear("fc1", {1024, 4096}, LinearRole::column)), 1);
  // Ties: the first (outermost) dimension.
  EXPECT_EQ(fsdp.param_spec(linear("fc", {4096, 4096}, LinearRole::row)), P({{"fsdp"}, {}}));
  // The largest dimension does not divide by 8: the next largest that does.
  EXPECT_EQ(fsdp.param_spec(param("w", {4100, 2048, 16}, ParamKind::other)), P({{}, {"fsdp"}, {}}));
  // The kind does not matter to FSDP.
  EXPECT_EQ(fsdp.param_spec(param("ln", {8192}, ParamKind::norm)), P({{"fsdp"}}));
  EXPECT_THAT(fsdp.explain(linear("fc1", {1024, 4096}, LinearRole::column)),
              HasSubstr("-> P(None, fsdp): dimension 1 (size 4096) is the largest divisible by 8"));
}

// Like the runtime (which pads a unit's flat vector), a large parameter no
// dimension of which divides evenly is still sharded: its largest dimension,
// unevenly. Scalars and small parameters stay replicated.
TEST(FSDP, SplitsIndivisibleWeightsUnevenlyAndSaysWhy) {
  FSDPStrategy fsdp("fsdp", 8);
  const auto w = param("odd", {1001, 1003}, ParamKind::other);
  EXPECT_EQ(fsdp.param_spec(w), P({{}, {"fsdp"}}));
  EXPECT_TRUE(fsdp.should_shard(w));
  EXPECT_EQ(fsdp.explain(w),
            "FSDP(fsdp=8, min_weight_size=1024): 'odd' (1001, 1003) -> P(None, fsdp): no dimension is divisible by "
            "fsdp size 8: dimension 1 (size 1003), the largest, is split unevenly (126 per rank, the last ones "
            "fewer; the runtime pads)");
  const Layout l({8}, {"fsdp"}, fsdp.param_spec(w), w.shape);
  EXPECT_EQ(l.local_shape(0), (std::vector<int64_t>{1001, 126}));
  EXPECT_EQ(l.local_shape(7), (std::vector<int64_t>{1001, 121}));
  EXPECT_FALSE(FSDPStrategy("fsdp", 8, 0).should_shard(param("scalar", {}, ParamKind::other)));
}

TEST(FSDP, SplitsTheBatchTooAndValidatesSettings) {
  FSDPStrategy fsdp("fsdp", 4);
  EXPECT_EQ(fsdp.batch_spec(3, 0), P({{"fsdp"}, {}, {}}));
  EXPECT_THAT(error_of([] { FSDPStrategy("fsdp", 0); }), HasSubstr("axis_size 0 for axis 'fsdp'"));
  EXPECT_THAT(error_of([] { FSDPStrategy("fsdp", 2, -1); }), HasSubstr("min_weight_size -1 < 0"));
  EXPECT_THAT(error_of([&] { fsdp.param_spec(param("bad", {4, -2}, ParamKind::other)); }),
              HasSubstr("parameter 'bad' (4, -2): dimension 1 has negative size"));
}

// ------------------------------------------------------------------ TensorParallel

TEST(TensorParallel, ColumnAndRowParallelLinear) {
  TensorParallelStrategy tp("tensor", 4);
  EXPECT_EQ(tp.name(), "TensorParallel(tensor=4)");
  // Weights are (in, out): column splits out (dim 1), row splits in (dim 0).
  EXPECT_EQ(tp.param_spec(linear("fc1.weight", {4096, 16384}, LinearRole::column)), P({{}, {"tensor"}}));
  EXPECT_EQ(tp.param_spec(linear("fc2.weight", {16384, 4096}, LinearRole::row)), P({{"tensor"}, {}}));
  auto bias = [](std::vector<int64_t> shape, LinearRole role) {
    return ParamInfo{.name = "b", .shape = std::move(shape), .kind = ParamKind::linear_bias, .role = role};
  };
  EXPECT_EQ(tp.param_spec(bias({16384}, LinearRole::column)), P({{"tensor"}}));
  EXPECT_EQ(tp.param_spec(bias({4096}, LinearRole::row)), P({{}}));
  EXPECT_EQ(tp.param_spec(linear("head", {4096, 10}, LinearRole::none)), P({{}, {}}));
  EXPECT_EQ(tp.column_weight_spec(), P({{}, {"tensor"}}));
  EXPECT_EQ(tp.row_weight_spec(), P({{"tensor"}, {}}));
  EXPECT_EQ(tp.column_bias_spec(), P({{"tensor"}}));
}

TEST(TensorParallel, AttentionEmbeddingAndReplicatedKinds) {
  TensorParallelStrategy tp("tensor", 4);
  const ParamInfo qkv{.name = "attn.qkv.weight", .shape = {4096, 12288}, .kind = ParamKind::attention_qkv_weight,
                      .num_heads = 32};
  EXPECT_EQ(tp.param_spec(qkv), P({{}, {"tensor"}}));
  EXPECT_EQ(tp.param_spec(qkv), tp.attention_qkv_spec());
  EXPECT_EQ(tp.effective_role(qkv), LinearRole::column);
  EXPECT_EQ(tp.param_spec(param("attn.qkv.bias", {12288}, ParamKind::attention_qkv_bias)), P({{"tensor"}}));
  const auto out = param("attn.out.weight", {4096, 4096}, ParamKind::attention_out_weight);
  EXPECT_EQ(tp.param_spec(out), P({{"tensor"}, {}}));
  EXPECT_EQ(tp.param_spec(out), tp.attention_output_spec());
  EXPECT_EQ(tp.param_spec(param("attn.out.bias", {4096}, ParamKind::attention_out_bias)), P({{}}));
  // Vocab-parallel embedding: (vocab, hidden) split on vocab.
  EXPECT_EQ(tp.param_spec(param("wte", {50304, 4096}, ParamKind::embedding)), P({{"tensor"}, {}}));
  EXPECT_EQ(tp.param_spec(param("ln.weight", {4096}, ParamKind::norm)), P({{}}));
  EXPECT_EQ(tp.param_spec(param("wpe", {2048, 4096}, ParamKind::other)), P({{}, {}}));
  EXPECT_EQ(tp.explain(qkv),
            "TensorParallel(tensor=4): 'attn.qkv.weight' (4096, 12288) (attention_qkv_weight, column-parallel) -> "
            "P(None, tensor): dimension 1 split over tensor");
}

TEST(TensorParallel, IndivisibleSplitIsAnErrorNamingParamDimAndAxis) {
  TensorParallelStrategy tp("tensor", 4);
  EXPECT_EQ(error_of([&] { tp.param_spec(param("wte", {50257, 768}, ParamKind::embedding)); }),
            "TensorParallelStrategy::param_spec: parameter 'wte' (50257, 768): dimension 0 (vocabulary, size 50257) "
            "is not divisible by tensor size 4 (hint: pad the vocabulary to 50260 or pick a tensor size that "
            "divides 50257)");
  EXPECT_THAT(error_of([&] { tp.param_spec(linear("fc1", {768, 3070}, LinearRole::column)); }),
              HasSubstr("parameter 'fc1' (768, 3070): dimension 1 (output features, size 3070) is not divisible by "
                        "tensor size 4"));
  EXPECT_THAT(error_of([&] { tp.param_spec(linear("fc2", {3070, 768}, LinearRole::row)); }),
              HasSubstr("dimension 0 (input features, size 3070)"));
  // 2304 features divide by 8, but 12 heads do not.
  const ParamInfo qkv{.name = "qkv", .shape = {768, 2304}, .kind = ParamKind::attention_qkv_weight, .num_heads = 12};
  EXPECT_THAT(error_of([&] { TensorParallelStrategy("tensor", 8).param_spec(qkv); }),
              HasSubstr("parameter 'qkv' (768, 2304): 12 heads cannot be split evenly over tensor size 8"));
}

// GPT-2's c_attn stores [q | k | v]: described with parts = 3, every
// strategy lays it out as (in, 3, C) and tensor parallelism splits C, so
// each rank holds q, k and v of its own heads.
TEST(TensorParallel, FusedQkvSplitsEachPart) {
  TensorParallelStrategy tp("tensor", 4);
  const ParamInfo qkv{.name = "c_attn.weight", .shape = {768, 2304}, .kind = ParamKind::attention_qkv_weight,
                      .num_heads = 12, .parts = 3};
  EXPECT_EQ(qkv.layout().shape, (std::vector<int64_t>{768, 3, 768}));
  EXPECT_EQ(tp.param_spec(qkv), P({{}, {}, {"tensor"}}));
  EXPECT_EQ(tp.block(qkv, 1).to_string(), "[0:768, 0:3, 192:384]");
  const ParamInfo bias{.name = "c_attn.bias", .shape = {2304}, .kind = ParamKind::attention_qkv_bias, .parts = 3};
  EXPECT_EQ(tp.param_spec(bias), P({{}, {"tensor"}}));
  EXPECT_EQ(tp.block(bias, 3).to_string(), "[0:3, 576:768]");
  EXPECT_THAT(tp.explain(qkv), HasSubstr("-> P(None, None, tensor): dimension 2 of its view (768, 3, 768) (3 fused "
                                         "parts) split over tensor"));
  // With FSDP on top, FSDP shards what a tensor rank holds of the view.
  MultiDimensionalStrategy md({std::make_shared<FSDPStrategy>("fsdp", 2, 0), std::make_shared<TensorParallelStrategy>("tensor", 4)},
                              {"fsdp", "tensor"});
  EXPECT_EQ(md.combined_spec(qkv), P({{"fsdp"}, {}, {"tensor"}}));
  EXPECT_THAT(error_of([&] { ParamInfo{.name = "x", .shape = {4, 10}, .parts = 3}.layout(); }),
              HasSubstr("3 fused parts"));
}

// uneven = true (what the runtime builds): torch.chunk's rule, heads still whole.
TEST(TensorParallel, UnevenSplitsFollowTorchChunk) {
  TensorParallelStrategy tp("tensor", 4, /*uneven=*/true);
  const ParamInfo wte{.name = "wte", .shape = {13, 8}, .kind = ParamKind::embedding};
  EXPECT_EQ(tp.param_spec(wte), P({{"tensor"}, {}}));
  std::vector<std::string> blocks;
  for (int r = 0; r < 4; ++r) blocks.push_back(tp.block(wte, r).to_string());
  EXPECT_EQ(blocks, (std::vector<std::string>{"[0:4, 0:8]", "[4:8, 0:8]", "[8:12, 0:8]", "[12:13, 0:8]"}));
  EXPECT_EQ(tp.block(param("ln", {8}, ParamKind::norm), 2).to_string(), "[0:8]");  // replicated: whole
  const ParamInfo qkv{.name = "qkv", .shape = {8, 24}, .kind = ParamKind::attention_qkv_weight, .num_heads = 6, .parts = 3};
  EXPECT_THAT(error_of([&] { tp.block(qkv, 0); }), HasSubstr("6 heads cannot be split evenly over tensor size 4"));
  EXPECT_THAT(error_of([&] { tp.block(wte, 4); }), HasSubstr("rank 4 of 4 ranks"));
}

TEST(TensorParallel, RejectsContradictoryMetadata) {
  TensorParallelStrategy tp("tensor", 2);
  ParamInfo qkv = param("qkv", {64, 192}, ParamKind::attention_qkv_weight);
  qkv.role = LinearRole::row;
  EXPECT_THAT(error_of([&] { tp.param_spec(qkv); }),
              HasSubstr("kind attention_qkv_weight is column-parallel but role says row"));
  ParamInfo emb = param("wte", {64, 8}, ParamKind::embedding);
  emb.role = LinearRole::column;
  EXPECT_THAT(error_of([&] { tp.param_spec(emb); }), HasSubstr("role column given for kind embedding"));
  EXPECT_THAT(error_of([&] { tp.param_spec(linear("w3", {2, 4, 8}, LinearRole::column)); }),
              HasSubstr("a linear_weight must be 2-D, got 3-D"));
  EXPECT_THAT(error_of([] { TensorParallelStrategy("tensor", 0); }), HasSubstr("axis_size 0 for axis 'tensor'"));
}

// ------------------------------------------------------------------ PipelineParallel

TEST(Pipeline, BalancesByCount) {
  EXPECT_EQ(PipelineParallelStrategy("pipeline", 4).assign_layers_to_stages(24), (std::vector<int>{6, 6, 6, 6}));
  EXPECT_EQ(PipelineParallelStrategy("pipeline", 4).assign_layers_to_stages(10), (std::vector<int>{3, 3, 2, 2}));
  EXPECT_EQ(PipelineParallelStrategy("pipeline", 4).assign_layers_to_stages(4), (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(PipelineParallelStrategy("pipeline", 1).assign_layers_to_stages(5), (std::vector<int>{5}));
}

TEST(Pipeline, EmptyStagesAndBadSettingsAreErrors) {
  PipelineParallelStrategy pp("pipeline", 4);
  EXPECT_EQ(error_of([&] { pp.assign_layers_to_stages(3); }),
            "PipelineParallelStrategy::assign_layers_to_stages: 3 layers on 4 stages would leave stage 3 empty "
            "(hint: use at most 3 stages, or split the model into more layers)");
  EXPECT_THAT(error_of([&] { pp.assign_layers_to_stages(std::vector<double>{1, 2}); }),
              HasSubstr("2 layers on 4 stages would leave stage 2 empty"));
  EXPECT_THAT(error_of([] { PipelineParallelStrategy("pipeline", 0); }), HasSubstr("num_stages 0 on axis 'pipeline'"));
  EXPECT_THAT(error_of([] { PipelineParallelStrategy("pipeline", -2); }), HasSubstr("num_stages -2"));
  EXPECT_THAT(error_of([&] { pp.assign_layers_to_stages({1, 1, -1, 1, 1}); }), HasSubstr("layer 2 has cost -1"));
  EXPECT_THAT(error_of([&] { pp.assign_layers_to_stages({1, 1, 1, std::nan(""), 1}); }),
              HasSubstr("layer 3 has cost nan"));
}

TEST(Pipeline, BalancesByCost) {
  PipelineParallelStrategy two("pipeline", 2);
  // Stage costs 4 and 8; [5, 1] (8, 4) is as fast but puts 5 layers on one stage.
  EXPECT_EQ(two.assign_layers_to_stages({1, 1, 1, 1, 4, 4}), (std::vector<int>{4, 2}));
  EXPECT_EQ(two.assign_layers_to_stages({4, 4, 1, 1, 1, 1}), (std::vector<int>{2, 4}));
  PipelineParallelStrategy three("pipeline", 3);
  // The heavy last layer gets a stage to itself.
  EXPECT_EQ(three.assign_layers_to_stages({1, 1, 1, 1, 1, 10}), (std::vector<int>{3, 2, 1}));
  // Stage costs 0.3, 0.4, 0.5 (up to rounding): no split stays under 0.5.
  EXPECT_EQ(three.assign_layers_to_stages({0.1, 0.2, 0.3, 0.1, 0.2, 0.3}), (std::vector<int>{2, 2, 2}));
  // All costs zero: every split ties, so the count rule.
  EXPECT_EQ(two.assign_layers_to_stages({0, 0, 0, 0, 0}), (std::vector<int>{3, 2}));
}

TEST(Pipeline, EqualCostsReproduceTheCountRule) {
  for (int stages = 1; stages <= 8; ++stages) {
    PipelineParallelStrategy pp("pipeline", stages);
    for (int layers = stages; layers <= 40; ++layers)
      EXPECT_EQ(pp.assign_layers_to_stages(std::vector<double>(layers, 2.5)), pp.assign_layers_to_stages(layers))
          << layers << " layers on " << stages << " stages";
  }
}

// Every composition of n into s positive parts, by brute force.
void compositions(int n, int s, std::vector<int>& cur, const std::function<void(const std::vector<int>&)>& f) {
  if (s == 1) {
    cur.push_back(n);
    f(cur);
    cur.pop_back();
    return;
  }
  for (int c = 1; c <= n - (s - 1); ++c) {
    cur.push_back(c);
    compositions(n - c, s - 1, cur, f);
    cur.pop_back();
  }
}

TEST(Pipeline, CostBalanceIsOptimalAgainstBruteForce) {
  uint64_t state = 12345;  // a local LCG: deterministic, no global state
  auto next = [&state] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % 9);
  };
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + trial % 9, stages = 1 + trial % std::min(n, 5);
    std::vector<double> costs(n);
    for (auto& c : costs) c = next();
    PipelineParallelStrategy pp("pipeline", stages);
    const auto got = pp.assign_layers_to_stages(costs);
    auto max_cost = [&](const std::vector<int>& counts) {
      double worst = 0;
      for (size_t s = 0, i = 0; s < counts.size(); i += counts[s], ++s) {
        double sum = 0;
        for (int k = 0; k < counts[s]; ++k) sum += costs[i + k];
        worst = std::max(worst, sum);
      }
      return worst;
    };
    double best = std::numeric_limits<double>::infinity();
    std::vector<int> cur;
    compositions(n, stages, cur, [&](const std::vector<int>& c) { best = std::min(best, max_cost(c)); });
    ASSERT_EQ(static_cast<int>(got.size()), stages);
    EXPECT_EQ(std::count_if(got.begin(), got.end(), [](int c) { return c < 1; }), 0);
    EXPECT_EQ(max_cost(got), best) << "trial " << trial;
  }
}

TEST(Pipeline, StagesOfLayersAndPeers) {
  PipelineParallelStrategy pp("pipeline", 4);
  const std::vector<int> counts{3, 3, 2, 2};
  EXPECT_EQ(pp.stage_of_layer(0, counts), 0);
  EXPECT_EQ(pp.stage_of_layer(5, counts), 1);
  EXPECT_EQ(pp.stage_of_layer(6, counts), 2);
  EXPECT_EQ(pp.stage_of_layer(9, counts), 3);
  EXPECT_EQ(pp.layer_range(2, counts), (std::pair<int, int>{6, 8}));
  EXPECT_THAT(error_of([&] { pp.stage_of_layer(10, counts); }), HasSubstr("layer 10 is not in [0, 10)"));
  EXPECT_THAT(error_of([&] { pp.stage_of_layer(0, {3, 3, 4}); }), HasSubstr("assignment has 3 stages"));
  EXPECT_THAT(error_of([&] { pp.stage_of_layer(0, {5, 5, 0, 0}); }), HasSubstr("stage 2 has 0 layers"));
  EXPECT_EQ(pp.forward_peer(0), 1);
  EXPECT_EQ(pp.forward_peer(2), 3);
  EXPECT_EQ(pp.forward_peer(3), -1);
  EXPECT_EQ(pp.backward_peer(0), -1);
  EXPECT_EQ(pp.backward_peer(3), 2);
  EXPECT_THAT(error_of([&] { pp.forward_peer(4); }), HasSubstr("stage 4 is not in [0, 4)"));
  PipelineParallelStrategy one("pipeline", 1);
  EXPECT_EQ(one.forward_peer(0), -1);
  EXPECT_EQ(one.backward_peer(0), -1);
  // Parameters live whole on their stage; the batch is not split over stages.
  EXPECT_EQ(pp.param_spec(linear("fc", {64, 64}, LinearRole::column)), P({{}, {}}));
  EXPECT_EQ(pp.batch_spec(2, 0), P({{}, {}}));
}

// ------------------------------------------------------------------ MultiDimensional

std::shared_ptr<const Strategy> fsdp(std::string axis, int64_t n, int64_t min = 1024) {
  return std::make_shared<FSDPStrategy>(std::move(axis), n, min);
}
std::shared_ptr<const Strategy> tp(std::string axis, int64_t n) {
  return std::make_shared<TensorParallelStrategy>(std::move(axis), n);
}
std::shared_ptr<const Strategy> dp(std::string axis) { return std::make_shared<DataParallelStrategy>(std::move(axis)); }

TEST(MultiDimensional, FsdpPlusTensorGivesTwoDimensionalSharding) {
  MultiDimensionalStrategy md({fsdp("fsdp", 8), tp("tensor", 4)}, {"fsdp", "tensor"});
  EXPECT_EQ(md.name(), "MultiDimensional[FSDP(fsdp=8, min_weight_size=1024), TensorParallel(tensor=4)]");
  // Column: TP splits out (dim 1); FSDP splits the per-rank (4096, 1024) on dim 0.
  EXPECT_EQ(md.combined_spec(linear("fc1", {4096, 4096}, LinearRole::column)), P({{"fsdp"}, {"tensor"}}));
  // Row: TP splits in (dim 0); FSDP the per-rank (1024, 4096) on dim 1.
  EXPECT_EQ(md.combined_spec(linear("fc2", {4096, 4096}, LinearRole::row)), P({{"tensor"}, {"fsdp"}}));
  // Both on one dimension: tensor outer, fsdp inner.
  EXPECT_EQ(md.combined_spec(linear("fc2", {16384, 4096}, LinearRole::row)), P({{"tensor", "fsdp"}, {}}));
  EXPECT_EQ(md.combined_spec(param("wte", {50304, 768}, ParamKind::embedding)), P({{"tensor", "fsdp"}, {}}));
  EXPECT_EQ(md.combined_spec(param("ln", {4096}, ParamKind::norm)), P({{"fsdp"}}));
  EXPECT_EQ(md.combined_spec(param("ln.bias", {64}, ParamKind::norm)), P({{}}));
  EXPECT_EQ(md.combined_batch_spec(3, 0), P({{"fsdp"}, {}, {}}));
  // The list order does not matter.
  MultiDimensionalStrategy swapped({tp("tensor", 4), fsdp("fsdp", 8)});
  EXPECT_EQ(swapped.combined_spec(linear("fc2", {16384, 4096}, LinearRole::row)), P({{"tensor", "fsdp"}, {}}));
}

TEST(MultiDimensional, FsdpSeesThePerRankShape) {
  MultiDimensionalStrategy md({fsdp("fsdp", 2), tp("tensor", 4)});
  // 2048 elements globally, but a tensor rank holds (32, 16) = 512 < 1024.
  EXPECT_EQ(md.combined_spec(linear("small", {32, 64}, LinearRole::column)), P({{}, {"tensor"}}));
  // Per rank (3, 4096): FSDP cannot split dim 0 of size 3 but splits dim 1.
  EXPECT_EQ(md.combined_spec(linear("fc", {12, 4096}, LinearRole::row)), P({{"tensor"}, {"fsdp"}}));
  EXPECT_THAT(md.explain(linear("fc", {12, 4096}, LinearRole::row)),
              HasSubstr("FSDP(fsdp=2, min_weight_size=1024): 'fc' (3, 4096) -> P(None, fsdp)"));
}

TEST(MultiDimensional, SeedFlawCannotRepeatAnAxis) {
  // The reference merged FSDP('fsdp') + TP('model') on (hidden, hidden) into
  // P(model, model). Here no spec uses an axis twice, for any kind of parameter.
  MultiDimensionalStrategy md({fsdp("fsdp", 4), tp("model", 2)}, {"fsdp", "model"});
  EXPECT_EQ(md.combined_spec(linear("attn.query", {768, 768}, LinearRole::column)), P({{"fsdp"}, {"model"}}));
  for (ParamKind kind : {ParamKind::linear_weight, ParamKind::embedding, ParamKind::attention_qkv_weight,
                         ParamKind::attention_out_weight, ParamKind::norm, ParamKind::other}) {
    ParamInfo p = param("h", {768, 768}, kind);
    const PartitionSpec spec = md.combined_spec(p);
    const auto axes = spec.used_axes();
    EXPECT_EQ(std::set<std::string>(axes.begin(), axes.end()).size(), axes.size()) << spec.to_string();
    EXPECT_NE(spec.to_string(), "P(model, model)");
  }
  // PartitionSpec itself refuses the flawed result.
  EXPECT_THROW(P({{"model"}, {"model"}}), InvalidArgument);
}

TEST(MultiDimensional, DataPlusTensorAndHsdp) {
  MultiDimensionalStrategy dp_tp({dp("data"), tp("tensor", 2)});
  EXPECT_EQ(dp_tp.combined_spec(linear("fc1", {1024, 4096}, LinearRole::column)), P({{}, {"tensor"}}));
  EXPECT_EQ(dp_tp.combined_batch_spec(3, 0), P({{"data"}, {}, {}}));
  // HSDP: replicas over data, shards over fsdp; the batch is split over both.
  MultiDimensionalStrategy hsdp({fsdp("fsdp", 4), dp("data"), tp("tensor", 2)}, {"data", "fsdp", "tensor"});
  EXPECT_EQ(hsdp.combined_batch_spec(3, 0), P({{"data", "fsdp"}, {}, {}}));
  // Per tensor rank (1024, 2048): FSDP splits the larger dim 1 further.
  EXPECT_EQ(hsdp.combined_spec(linear("fc1", {1024, 4096}, LinearRole::column)), P({{}, {"tensor", "fsdp"}}));
  // With pipeline: parameters are not split over it.
  auto pp = std::make_shared<PipelineParallelStrategy>("pipeline", 2);
  MultiDimensionalStrategy three_d({dp("data"), tp("tensor", 2), pp});
  EXPECT_EQ(three_d.combined_spec(linear("fc2", {4096, 1024}, LinearRole::row)), P({{"tensor"}, {}}));
  EXPECT_EQ(three_d.axes(), (std::vector<std::string>{"data", "tensor", "pipeline"}));
  EXPECT_EQ(three_d.axis_size("pipeline"), 2);
  EXPECT_EQ(three_d.owner("tensor")->name(), "TensorParallel(tensor=2)");
}

TEST(MultiDimensional, OneMeshAxisPerStrategyAtConstruction) {
  EXPECT_EQ(error_of([] { MultiDimensionalStrategy({tp("model", 2), fsdp("model", 4)}); }),
            "MultiDimensionalStrategy: mesh axis 'model' is claimed by both TensorParallel(model=2) and "
            "FSDP(model=4, min_weight_size=1024) (hint: give each strategy its own mesh axis; two strategies may "
            "still split one dimension, each over its own axis)");
  EXPECT_THAT(error_of([] { MultiDimensionalStrategy({dp("data"), fsdp("data", 4)}); }),
              HasSubstr("hint: FSDP already splits the batch over its own axis"));
  EXPECT_THAT(error_of([] { MultiDimensionalStrategy({tp("tensor", 2)}, {"data", "model"}); }),
              HasSubstr("TensorParallel(tensor=2) uses mesh axis 'tensor', which the mesh (data, model) does not "
                        "have"));
  EXPECT_THAT(error_of([] { MultiDimensionalStrategy({dp("data"), nullptr}); }), HasSubstr("strategy 1 is null"));
}

// A custom strategy that misbehaves: it owns "rogue" but splits dim 0 over `axis`.
class Rogue final : public Strategy {
 public:
  explicit Rogue(std::string axis) : axis_(std::move(axis)) {}
  std::string name() const override { return "Rogue(" + axis_ + ")"; }
  std::vector<std::string> axes() const override { return {"rogue"}; }
  PartitionSpec param_spec(const ParamInfo& p) const override {
    std::vector<std::vector<std::string>> dims(p.shape.size());
    dims[0] = {axis_};
    return PartitionSpec(std::move(dims));
  }

 private:
  std::string axis_;
};

// A well-behaved custom strategy (kind other): splits dim 0 of expert weights.
class ExpertParallel final : public Strategy {
 public:
  std::string name() const override { return "ExpertParallel(expert=2)"; }
  std::vector<std::string> axes() const override { return {"expert"}; }
  int64_t axis_size(const std::string& axis) const override { return axis == "expert" ? 2 : 0; }
  PartitionSpec param_spec(const ParamInfo& p) const override {
    std::vector<std::vector<std::string>> dims(p.shape.size());
    if (p.shape.size() == 3) dims[0] = {"expert"};
    return PartitionSpec(std::move(dims));
  }
};

TEST(MultiDimensional, ConflictsNameTheParameterAndBothStrategies) {
  MultiDimensionalStrategy md({tp("tensor", 4), std::make_shared<Rogue>("tensor")});
  EXPECT_EQ(error_of([&] { md.combined_spec(linear("h.0.mlp.fc1.weight", {4096, 4096}, LinearRole::column)); }),
            "MultiDimensionalStrategy::combined_spec: parameter 'h.0.mlp.fc1.weight' (4096, 4096): mesh axis "
            "'tensor' is put on dimension 1 by TensorParallel(tensor=4) and on dimension 0 by Rogue(tensor) (hint: a "
            "mesh axis may split only one dimension, for the one strategy that owns it)");
  // TP replicates a norm, but the axis still is not Rogue's to use.
  EXPECT_THAT(error_of([&] { md.combined_spec(param("ln", {4096}, ParamKind::norm)); }),
              HasSubstr("parameter 'ln' (4096,): Rogue(tensor) puts mesh axis 'tensor' on dimension 0, but the axis "
                        "belongs to TensorParallel(tensor=4)"));
}

TEST(MultiDimensional, CustomStrategiesCombine) {
  MultiDimensionalStrategy md({fsdp("fsdp", 8), std::make_shared<ExpertParallel>()});
  // Experts split dim 0 first; FSDP shards the per-rank (4, 4096, 1024).
  EXPECT_EQ(md.combined_spec(param("moe.w1", {8, 4096, 1024}, ParamKind::other)), P({{"expert"}, {"fsdp"}, {}}));
}

TEST(MultiDimensional, SpecsByNameAndErrors) {
  MultiDimensionalStrategy md({dp("data"), fsdp("fsdp", 2, 0), tp("tensor", 2)});
  const std::vector<ParamInfo> block{
      param("ln1", {64}, ParamKind::norm),
      {.name = "qkv", .shape = {64, 192}, .kind = ParamKind::attention_qkv_weight, .num_heads = 4},
      param("out", {64, 64}, ParamKind::attention_out_weight),
      linear("fc1", {64, 256}, LinearRole::column),
      linear("fc2", {256, 64}, LinearRole::row),
  };
  const auto specs = md.specs(block);
  ASSERT_EQ(specs.size(), 5u);
  EXPECT_EQ(specs.at("ln1"), P({{"fsdp"}}));
  EXPECT_EQ(specs.at("qkv"), P({{}, {"tensor", "fsdp"}}));
  EXPECT_EQ(specs.at("out"), P({{"tensor"}, {"fsdp"}}));
  EXPECT_EQ(specs.at("fc1"), P({{}, {"tensor", "fsdp"}}));
  EXPECT_EQ(specs.at("fc2"), P({{"tensor", "fsdp"}, {}}));
  auto dup = block;
  dup.push_back(param("fc1", {4, 4}, ParamKind::other));
  EXPECT_THAT(error_of([&] { md.specs(dup); }), HasSubstr("parameter 'fc1' appears twice (entries 3 and 5)"));
  EXPECT_THAT(error_of([&] { md.specs({param("", {4}, ParamKind::other)}); }), HasSubstr("parameter 0 (4,) has no name"));
  // Errors from a strategy name the parameter.
  EXPECT_THAT(error_of([&] { md.specs({linear("odd", {64, 63}, LinearRole::column)}); }),
              HasSubstr("parameter 'odd' (64, 63): dimension 1 (output features, size 63) is not divisible by tensor "
                        "size 2"));
  EXPECT_THAT(error_of([&] { md.combined_batch_spec(2, -1); }), HasSubstr("batch_dim -1"));
}

}  // namespace
}  // namespace meshtrain::sharding
