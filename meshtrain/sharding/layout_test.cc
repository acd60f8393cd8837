// Layout tests without communication: rank -> block math (even, uneven,
// multi-axis, empty shards), validation messages, placements, and the
// collectives plan_redistribute picks for every kind of transition.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <functional>

#include "meshtrain/core/error.h"
#include "meshtrain/sharding/layout.h"

namespace meshtrain::testing {
namespace {

using comm::ReduceOp;
using sharding::Box;
using sharding::Layout;
using sharding::PartitionSpec;
using sharding::AxisPlacement;
using sharding::StepKind;
using ::testing::HasSubstr;
using I64 = std::vector<int64_t>;
using Names = std::vector<std::string>;

const Names kDT = {"data", "tensor"};

Layout dt(const std::string& spec, I64 shape, sharding::LayoutOptions options = {}) {
  return Layout({2, 2}, kDT, PartitionSpec::parse(spec), std::move(shape), std::move(options));
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// "all_gather(tensor) local_slice" for a plan.
std::string plan_kinds(const Layout& from, const Layout& to) {
  std::string s;
  for (const auto& step : sharding::plan_redistribute(from, to)) {
    if (!s.empty()) s += " ";
    s += std::string(sharding::step_kind_name(step.kind));
    if (!step.axes.empty()) s += fmt::format("({})", fmt::join(step.axes, ","));
    if (step.fallback) s += "!";
  }
  return s;
}

// ---- rank -> block --------------------------------------------------------------

TEST(Layout, EvenTwoByTwoGivesEveryRankItsQuarter) {
  const Layout l = dt("data,tensor", {8, 6});
  EXPECT_TRUE(l.is_even());
  EXPECT_EQ(l.num_shards(0), 2);
  EXPECT_EQ(l.chunk_size(1), 3);
  // rank = 2 * data + tensor
  EXPECT_EQ(l.local_offsets(0), (I64{0, 0}));
  EXPECT_EQ(l.local_offsets(1), (I64{0, 3}));
  EXPECT_EQ(l.local_offsets(2), (I64{4, 0}));
  EXPECT_EQ(l.local_offsets(3), (I64{4, 3}));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(l.local_shape(r), (I64{4, 3}));
  EXPECT_EQ(l.local_box(3).to_string(), "[4:8, 3:6]");
}

TEST(Layout, ReplicatedAxesRepeatTheBlock) {
  const Layout l = dt("None,tensor", {8, 6});
  EXPECT_EQ(l.local_box(0), l.local_box(2));  // data 0 and 1, tensor 0
  EXPECT_EQ(l.local_box(1), l.local_box(3));
  EXPECT_EQ(l.local_shape(1), (I64{8, 3}));
  EXPECT_FALSE(l.is_replicated());
  EXPECT_TRUE(dt("None,None", {8, 6}).is_replicated());
}

TEST(Layout, UnevenShardsUseCeilDivisionAndMayBeEmpty) {
  // 7 over 2: 4, 3.
  const Layout a = dt("None,tensor", {2, 7});
  EXPECT_FALSE(a.is_even());
  EXPECT_EQ(a.local_shape(0), (I64{2, 4}));
  EXPECT_EQ(a.local_shape(1), (I64{2, 3}));
  EXPECT_EQ(a.local_offsets(1), (I64{0, 4}));
  // 5 over (data, tensor) = 4 shards: 2, 2, 1, 0.
  const Layout b = dt("(data,tensor)", {5});
  std::vector<I64> sizes, offsets;
  for (int r = 0; r < 4; ++r) {
    sizes.push_back(b.local_shape(r));
    offsets.push_back(b.local_offsets(r));
  }
  EXPECT_EQ(sizes, (std::vector<I64>{{2}, {2}, {1}, {0}}));
  EXPECT_EQ(offsets, (std::vector<I64>{{0}, {2}, {4}, {5}}));
  EXPECT_TRUE(b.local_box(3).empty());
  // 2 over 4 shards: 1, 1, 0, 0 (fewer elements than shards).
  const Layout c = dt("(data,tensor)", {2});
  EXPECT_EQ(c.local_shape(1), (I64{1}));
  EXPECT_EQ(c.local_shape(2), (I64{0}));
  EXPECT_EQ(c.shard_range(0, 3), (std::pair<int64_t, int64_t>{2, 2}));
  // Size 0: every shard empty.
  EXPECT_EQ(dt("data", {0}).local_shape(1), (I64{0}));
}

TEST(Layout, MultiAxisShardIndexIsRowMajorInListedOrder) {
  // (data, tensor): shard = 2 * data + tensor = world rank.
  const Layout dt_order = dt("(data,tensor)", {8});
  // (tensor, data): shard = 2 * tensor + data; rank 1 = (data 0, tensor 1) -> shard 2.
  const Layout td_order = dt("(tensor,data)", {8});
  for (int r = 0; r < 4; ++r) EXPECT_EQ(dt_order.shard_index(r, 0), r);
  EXPECT_EQ(td_order.shard_index(1, 0), 2);
  EXPECT_EQ(td_order.shard_index(2, 0), 1);
  EXPECT_EQ(td_order.local_offsets(1), (I64{4}));
  // Three axes, two on one dim: mesh (2, 3, 2) = (a, b, c); dim 1 over (c, a).
  const Layout l({2, 3, 2}, {"a", "b", "c"}, PartitionSpec::parse("b,(c,a)"), {6, 9});
  // rank 7 = (a 1, b 0, c 1): dim 0 shard 0, dim 1 shard 2 * 1 + 1 = 3 of 4, chunk 3.
  EXPECT_EQ(l.local_box(7).to_string(), "[0:2, 9:9]");
  EXPECT_EQ(l.local_box(6).to_string(), "[0:2, 3:6]");  // (a 1, b 0, c 0): shard 1
}

TEST(Layout, ZeroDimTensorIsOneElementEverywhere) {
  const Layout l = dt("", {});
  EXPECT_EQ(l.local_numel(3), 1);
  EXPECT_TRUE(l.local_shape(3).empty());
}

// ---- validation -------------------------------------------------------------------

TEST(Layout, StrictRejectsUnevenNamingDimensionSizeShardsAndAxes) {
  EXPECT_EQ(error_of([] { dt("data,tensor", {8, 6}, {.partial = {}, .strict = true}); }), "");
  EXPECT_EQ(error_of([] { dt("None,(data,tensor)", {8, 7}, {.partial = {}, .strict = true}); }),
            "Layout: strict layout P(None, (data, tensor)): dimension 1 of size 7 does not divide into 4 shards "
            "over axes (data, tensor) of sizes (2, 2) (hint: make the size a multiple of 4, or drop strict to allow "
            "ceil-division shards (the trailing ones smaller or empty))");
  EXPECT_EQ(error_of([] { dt("None,(data,tensor)", {8, 7}); }), "");  // non-strict accepts it
}

TEST(Layout, AxisUsedTwiceIsRejected) {
  EXPECT_THAT(error_of([] { PartitionSpec::parse("data,data"); }), HasSubstr("mesh axis 'data' is used twice"));
  EXPECT_THAT(error_of([] { PartitionSpec({{"data", "tensor"}, {"tensor"}}); }),
              HasSubstr("mesh axis 'tensor' is used twice"));
}

TEST(Layout, UnknownAxisAndNdimMismatchAreRejected) {
  EXPECT_THAT(error_of([] { dt("data,pipe", {8, 6}); }),
              HasSubstr("P(data, pipe) uses axis 'pipe', which the mesh (data, tensor) does not have"));
  EXPECT_THAT(error_of([] { dt("data", {8, 6}); }),
              HasSubstr("P(data) has 1 entries but the tensor has 2 dimensions"));
  EXPECT_THAT(error_of([] { dt("data,None", {8, -1}); }), HasSubstr("dimension 1 has negative size -1"));
  EXPECT_THAT(error_of([] { Layout({2, 0}, kDT, PartitionSpec::parse("data"), {4}); }),
              HasSubstr("axis 'tensor' (axis 1) has size 0"));
}

TEST(Layout, PartialAxesAreCheckedAgainstTheSpecAndEachOther) {
  EXPECT_THAT(error_of([] { dt("data,None", {8, 6}, {.partial = {{"data", ReduceOp::sum}}}); }),
              HasSubstr("mesh axis 'data' both shards dimension 0 of P(data, None) and is partial"));
  EXPECT_THAT(error_of([] { dt("data,None", {8, 6}, {.partial = {{"pipe", ReduceOp::sum}}}); }),
              HasSubstr("partial axis 'pipe' is not in the mesh (data, tensor)"));
  EXPECT_THAT(error_of([] {
                dt("None,None", {8, 6}, {.partial = {{"data", ReduceOp::max}, {"tensor", ReduceOp::sum}}});
              }),
              HasSubstr("partial axes mix reductions: {data: max, tensor: sum}"));
  EXPECT_EQ(error_of([] {
              dt("None,None", {8, 6}, {.partial = {{"data", ReduceOp::avg}, {"tensor", ReduceOp::sum}}});
            }),
            "");
}

// ---- placements and strings -----------------------------------------------------------

TEST(Layout, PlacementsListShardReplicateAndPartialPerAxis) {
  const Layout l = dt("None,data", {8, 6}, {.partial = {{"tensor", ReduceOp::avg}}});
  const std::vector<AxisPlacement> p = l.placements();
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0], AxisPlacement::Shard(1));
  EXPECT_EQ(p[1], AxisPlacement::Partial(ReduceOp::avg));
  EXPECT_EQ(l.to_string(), "Layout(P(None, data), shape [8, 6], mesh (data=2, tensor=2), partial {tensor: avg})");
  EXPECT_EQ(dt("None,(data,tensor)", {8, 7}, {.partial = {}, .strict = false}).to_string(),
            "Layout(P(None, (data, tensor)), shape [8, 7], mesh (data=2, tensor=2), uneven)");
  EXPECT_EQ(sharding::to_placements(PartitionSpec::parse("(data,tensor),None"), kDT),
            (std::vector<AxisPlacement>{AxisPlacement::Shard(0), AxisPlacement::Shard(0)}));
}

TEST(Layout, ParseAcceptsItsOwnToString) {
  for (const char* text : {"data, (tensor, pipe)", "P(data, None, (tensor, pipe))", "(pipe,data) , tensor"}) {
    const PartitionSpec s = PartitionSpec::parse(text);
    EXPECT_EQ(PartitionSpec::parse(s.to_string()), s) << text;
  }
  EXPECT_EQ(PartitionSpec::parse("data, (tensor, pipe)"), PartitionSpec({{"data"}, {"tensor", "pipe"}}));
}

// ---- plans ----------------------------------------------------------------------------

TEST(Plan, SingleAxisTransitionsUseTheCheapestCollective) {
  const I64 s = {8, 6};
  const sharding::PartialAxes psum = {{"tensor", ReduceOp::sum}};
  EXPECT_EQ(plan_kinds(dt("None,None", s), dt("None,None", s)), "");
  EXPECT_EQ(plan_kinds(dt("None,None", s), dt("data,None", s)), "local_slice");
  EXPECT_EQ(plan_kinds(dt("data,None", s), dt("None,None", s)), "all_gather(data)");
  EXPECT_EQ(plan_kinds(dt("data,None", s), dt("None,data", s)), "all_to_all(data)");
  EXPECT_EQ(plan_kinds(dt("None,None", s, {.partial = psum}), dt("None,None", s)), "all_reduce(tensor)");
  EXPECT_EQ(plan_kinds(dt("None,None", s, {.partial = psum}), dt("tensor,None", s)), "reduce_scatter(tensor)");
  EXPECT_EQ(plan_kinds(dt("None,None", s), dt("None,None", s, {.partial = psum})), "make_partial(tensor)");
  EXPECT_EQ(plan_kinds(dt("None,None", s, {.partial = psum}), dt("None,None", s, {.partial = psum})), "");
  EXPECT_EQ(plan_kinds(dt("None,None", s, {.partial = psum}),
                       dt("None,None", s, {.partial = {{"tensor", ReduceOp::max}}})),
            "all_reduce(tensor) make_partial(tensor)");
  // Both axes at once: one step per axis.
  EXPECT_EQ(plan_kinds(dt("data,tensor", s), dt("None,None", s)), "all_gather(data) all_gather(tensor)");
  // Swapping two axes between dims is a cycle of moves: one exchange.
  EXPECT_EQ(plan_kinds(dt("data,tensor", s), dt("tensor,data", s)), "all_to_all(data,tensor)!");
  EXPECT_EQ(plan_kinds(dt("data,tensor", {8, 8}), dt("None,(tensor,data)", {8, 8})), "all_to_all(data)");
  EXPECT_EQ(plan_kinds(dt("data,None", s, {.partial = psum}), dt("data,tensor", s)), "reduce_scatter(tensor)");
  EXPECT_EQ(plan_kinds(dt("data,None", s), dt("None,None", s, {.partial = psum})),
            "all_gather(data) make_partial(tensor)");
}

TEST(Plan, MultiAxisDimensionsNestInnerAxesDirectlyAndWidenOtherwise) {
  const I64 s = {8};
  EXPECT_EQ(plan_kinds(dt("data", s), dt("(data,tensor)", s)), "local_slice");
  EXPECT_EQ(plan_kinds(dt("(data,tensor)", s), dt("data", s)), "all_gather(tensor)");
  EXPECT_EQ(plan_kinds(dt("(data,tensor)", s), dt("None", s)), "all_gather(tensor) all_gather(data)");
  EXPECT_EQ(plan_kinds(dt("None", s), dt("(tensor,data)", s)), "local_slice local_slice");
  // Removing or inserting the outer axis reorders blocks: a fallback over both axes.
  EXPECT_EQ(plan_kinds(dt("(data,tensor)", s), dt("tensor", s)), "all_to_all(data,tensor)!");
  EXPECT_EQ(plan_kinds(dt("tensor", s), dt("(data,tensor)", s)), "all_to_all(data,tensor)!");
  EXPECT_EQ(plan_kinds(dt("(data,tensor)", s), dt("(tensor,data)", s)), "all_to_all(data,tensor)!");
  // Uneven: 5 over (data, tensor) is 2,2,1,0 but over data 3,2: the tensor
  // groups do not cover the data blocks, so the step widens.
  EXPECT_EQ(plan_kinds(dt("(data,tensor)", {5}), dt("data", {5})), "all_to_all(data,tensor)!");
  EXPECT_EQ(plan_kinds(dt("data", {5}), dt("(data,tensor)", {5})), "all_to_all(data,tensor)!");
  // Partial -> Shard on an outer position cannot reduce-scatter in place.
  EXPECT_EQ(plan_kinds(dt("tensor", s, {.partial = {{"data", ReduceOp::sum}}}), dt("(data,tensor)", s)),
            "all_reduce(data)! all_to_all(data,tensor)!");
}

TEST(Plan, StepsDescribeThemselvesAndChainFromSourceToTarget) {
  const Layout from = dt("data,None", {8, 6}, {.partial = {{"tensor", ReduceOp::sum}}});
  const Layout to = dt("None,tensor", {8, 6});
  const auto steps = sharding::plan_redistribute(from, to);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].to_string(), "reduce_scatter over (tensor): P(data, None) partial {tensor: sum} -> P(data, tensor)");
  EXPECT_EQ(steps[1].to_string(), "all_gather over (data): P(data, tensor) -> P(None, tensor)");
  EXPECT_EQ(steps.front().from, from);
  EXPECT_EQ(steps.back().to, to);
  for (size_t i = 1; i < steps.size(); ++i) EXPECT_EQ(steps[i - 1].to, steps[i].from);
}

TEST(Plan, RejectsOtherMeshesAndShapes) {
  const Layout a = dt("data", {8});
  EXPECT_THAT(error_of([&] { sharding::plan_redistribute(a, Layout({4}, {"data"}, PartitionSpec::parse("data"), {8})); }),
              HasSubstr("layouts on different meshes: (data=2, tensor=2) and (data=4)"));
  EXPECT_THAT(error_of([&] { sharding::plan_redistribute(a, dt("data", {9})); }),
              HasSubstr("global shapes differ: [8] and [9]"));
}

TEST(Plan, LargePureMeshPlansQuickly) {
  // 64 devices, no communicator: a CLI can plan and print this.
  const std::vector<int> shape = {4, 4, 4};
  const Names names = {"data", "fsdp", "tensor"};
  const Layout from(shape, names, PartitionSpec::parse("(data,fsdp),tensor"), {4096, 1000});
  const Layout to(shape, names, PartitionSpec::parse("None,(tensor,fsdp)"), {4096, 1000},
                  {.partial = {{"data", ReduceOp::sum}}});
  const auto t0 = std::chrono::steady_clock::now();
  const auto steps = sharding::plan_redistribute(from, to);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.back().to, to);
  EXPECT_LT(ms, 2000.0);
}

// issue 9: shard --shape 9223372036854775807,... overflowed the ceil-division
// (n + k - 1) and crashed.
TEST(Layout, HugeDimensionsDoNotOverflow) {
  constexpr int64_t kMax = INT64_MAX;
  const Layout l({3}, {"data"}, PartitionSpec::parse("data"), {kMax});
  EXPECT_EQ(l.chunk_size(0), kMax / 3 + 1);
  int64_t total = 0;
  for (int r = 0; r < 3; ++r) {
    const auto [b, e] = l.shard_range(0, r);
    EXPECT_LE(b, e);
    total += e - b;
  }
  EXPECT_EQ(total, kMax);
  EXPECT_EQ(l.shard_range(0, 2).second, kMax);
  const Layout two({4, 2}, {"data", "tensor"}, PartitionSpec::parse("data,tensor"), {kMax, 1});
  EXPECT_EQ(two.local_box(7).to_string(), fmt::format("[{}:{}, 1:1]", 3 * (kMax / 4 + 1), kMax));
  EXPECT_THAT(error_of([] { Layout({4, 2}, {"data", "tensor"}, PartitionSpec::parse("data,tensor"), {kMax, 4}); }),
              HasSubstr("shape [9223372036854775807, 4] has more than 2^63 - 1 elements"));
}

}  // namespace
}  // namespace meshtrain::testing
