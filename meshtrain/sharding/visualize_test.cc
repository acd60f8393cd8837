// visualize_sharding tests: exact text grids for 1-D and 2-D layouts (even,
// uneven with an empty shard, replicated and partial axes, a 64-device mesh
// drawn without communicators), rank-label compression, the SVG's blocks, and
// the error for other ranks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>

#include "meshtrain/core/error.h"
#include "meshtrain/sharding/visualize.h"

namespace meshtrain::testing {
namespace {

using sharding::Layout;
using sharding::PartitionSpec;
using sharding::visualize_sharding;
using sharding::visualize_sharding_svg;
using ::testing::HasSubstr;

Layout dt(const std::string& spec, std::vector<int64_t> shape, sharding::PartialAxes partial = {}) {
  return Layout({2, 2}, {"data", "tensor"}, PartitionSpec::parse(spec), std::move(shape),
                {.partial = std::move(partial), .strict = false});
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + what.size())) ++n;
  return n;
}

TEST(Visualize, TwoDimensionalGridWithUnevenColumns) {
  EXPECT_EQ(visualize_sharding(dt("data,tensor", {8, 7}), {.width = 20, .height = 4}),
            "P(data, tensor) on mesh (data=2, tensor=2), shape [8, 7]\n"
            "┌───────────┬─────────┐\n"
            "│     0     │    1    │\n"
            "│           │         │\n"
            "├───────────┼─────────┤\n"
            "│     2     │    3    │\n"
            "│           │         │\n"
            "└───────────┴─────────┘\n"
            "dim 0 (size 8) over (data): 2 shards, sizes 4 x2\n"
            "dim 1 (size 7) over (tensor): 2 shards, sizes 4, 3\n");
}

TEST(Visualize, OneDimensionalMultiAxisWithAnEmptyShard) {
  EXPECT_EQ(visualize_sharding(dt("(data,tensor)", {5}), {.width = 20, .height = 8}),
            "P((data, tensor)) on mesh (data=2, tensor=2), shape [5]\n"
            "┌────────┬────────┬────┐\n"
            "│   0    │   1    │ 2  │\n"
            "└────────┴────────┴────┘\n"
            "dim 0 (size 5) over (data, tensor): 4 shards, sizes 2 x2, 1, 0\n"
            "empty blocks on rank 3\n");
}

TEST(Visualize, ReplicatedAndPartialAxesListEveryHolder) {
  EXPECT_EQ(visualize_sharding(dt("None,tensor", {4, 8}, {{"data", comm::ReduceOp::sum}}), {.width = 16, .height = 1}),
            "P(None, tensor) on mesh (data=2, tensor=2), shape [4, 8], partial over data (sum)\n"
            "┌────────┬────────┐\n"
            "│  0,2   │  1,3   │\n"
            "└────────┴────────┘\n"
            "dim 1 (size 8) over (tensor): 2 shards, sizes 4 x2\n");
  // Unsplit: one block held by all, compressed.
  EXPECT_THAT(visualize_sharding(dt("None", {3})), HasSubstr("│                      0-3                       │\n"));
}

TEST(Visualize, LargePureMeshNeedsNoCommunicatorAndCompressesRuns) {
  // 64 devices: rows over tensor (8 shards), each held by the 8 data ranks.
  const Layout l({8, 8}, {"data", "tensor"}, PartitionSpec::parse("None,(data,tensor)"), {16, 64});
  const std::string text = visualize_sharding(l, {.width = 64, .height = 2});
  EXPECT_THAT(text, HasSubstr("dim 1 (size 64) over (data, tensor): 64 shards, sizes 1 x64\n"));
  EXPECT_EQ(count(text, "┬"), 63);
  const Layout rows({8, 8}, {"data", "tensor"}, PartitionSpec::parse("tensor,None"), {1024, 1024});
  EXPECT_THAT(visualize_sharding(rows), HasSubstr("0,8,16,24,32,40,48,56"));
  const Layout blocks({4, 16}, {"data", "tensor"}, PartitionSpec::parse("data,None"), {8, 8});
  EXPECT_THAT(visualize_sharding(blocks), HasSubstr("│                     16-31                      │"));
}

TEST(Visualize, LinesHaveNoTrailingSpaces) {
  for (const char* spec : {"data,tensor", "(tensor,data),None", "None,None"}) {
    std::istringstream in(visualize_sharding(dt(spec, {9, 5})));
    for (std::string line; std::getline(in, line);) EXPECT_TRUE(line.empty() || line.back() != ' ') << line;
  }
}

TEST(Visualize, SvgHasOneLabelledRectanglePerBlock) {
  const std::string svg = visualize_sharding_svg(dt("data,tensor", {8, 7}));
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_THAT(svg, HasSubstr("</svg>\n"));
  EXPECT_EQ(count(svg, "<rect"), 4);
  EXPECT_THAT(svg, HasSubstr("<title>[4:8, 4:7] ranks 3</title>"));
  EXPECT_THAT(svg, HasSubstr("<rect x=\"282.29\" y=\"28.00\" width=\"205.71\" height=\"240.00\""));
  EXPECT_THAT(svg, HasSubstr("dim 1 (size 7) over (tensor): 2 shards, sizes 4, 3"));
  const std::string one_d = visualize_sharding_svg(dt("(data,tensor)", {5}));
  EXPECT_EQ(count(one_d, "<rect"), 3);  // the empty shard has no block
  EXPECT_THAT(one_d, HasSubstr("empty blocks on rank 3"));
}

TEST(Visualize, OtherRanksAreRejected) {
  try {
    visualize_sharding(dt("data,tensor,None", {2, 2, 2}));
    ADD_FAILURE() << "3-D";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("is 3-D (hint: pictures are drawn for 1-D and 2-D tensors"));
  }
  EXPECT_THROW(visualize_sharding_svg(dt("", {})), InvalidArgument);
}

// issue 9: --width 2000000000 took 14 GB and a huge shape indexed block -1;
// pictures are bounded now.
TEST(VisualizeSharding, SizesAreBounded) {
  EXPECT_THROW(visualize_sharding(dt("data,tensor", {8, 8}), {.width = 2000000000}), InvalidArgument);
  EXPECT_THROW(visualize_sharding(dt("data,tensor", {8, 8}), {.width = 0}), InvalidArgument);
  EXPECT_THROW(visualize_sharding_svg(dt("data,tensor", {8, 8}), {.height = 1 << 30}), InvalidArgument);
  try {
    visualize_sharding(dt("data", {8}), {.width = 1001});
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("width 1001 is outside [1, 1000]"));
  }
  const Layout big({5000}, {"data"}, PartitionSpec::parse("data"), {5000});
  EXPECT_THROW(visualize_sharding(big), InvalidArgument);
  const Layout huge({2, 2}, {"data", "tensor"}, PartitionSpec::parse("data,tensor"), {INT64_MAX, 1});
  EXPECT_THAT(visualize_sharding(huge), HasSubstr("sizes 4611686018427387904, 4611686018427387903"));
}

}  // namespace
}  // namespace meshtrain::testing
