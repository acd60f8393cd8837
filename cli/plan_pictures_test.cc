// The mesh picture of `meshtrain plan` (cli/plan_pictures.h): ranks in the
// runtime's mesh order, nodes, pipeline colours, tensor groups and the
// captions that say where each axis's groups sit.
#include "cli/plan_pictures.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "meshtrain/core/error.h"

namespace meshtrain::cli {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + what.size())) ++n;
  return n;
}

TEST(MeshPicture, TensorTwoDataFourOnOneNode) {
  const plan::TrainingLayout l{.data = 4, .tensor = 2};
  const MeshPictureOptions o{.devices_per_node = 8, .title = "data=4,tensor=2"};
  EXPECT_THAT(mesh_axis_captions(l, o),
              ElementsAre("data=4: 2 groups of 4 ranks 2 apart, within a node; gradients reduced once a step",
                          "tensor=2: 4 groups of 2 consecutive ranks, within a node; activations all-reduced in "
                          "every layer"));
  EXPECT_EQ(tensor_groups_split_over_nodes(l, o), 0);
  const std::string svg = mesh_svg(l, o);
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_THAT(svg, HasSubstr(">node 0: ranks 0-7</text>"));
  EXPECT_THAT(svg, Not(HasSubstr("node 1")));
  EXPECT_EQ(count(svg, "<title>rank "), 8);  // one square per device
  EXPECT_THAT(svg, HasSubstr("<title>rank 5 on node 0: data 2, tensor 1</title>"));
  EXPECT_EQ(count(svg, "stroke=\"#222222\" stroke-width=\"1.5\""), 4);  // 4 tensor groups, each one outline
  EXPECT_THAT(svg, Not(HasSubstr("#d62728")));                         // nothing split
  EXPECT_THAT(svg, HasSubstr("world ranks in mesh order data=4,tensor=2"));
  EXPECT_THAT(svg, HasSubstr(">one pipeline stage</text>"));
  // Well-formed as far as its elements go: every one opened is closed.
  EXPECT_EQ(count(svg, "<text"), count(svg, "</text>"));
  EXPECT_EQ(count(svg, "<g>"), count(svg, "</g>"));
  EXPECT_EQ(count(svg, "<title>"), count(svg, "</title>"));
  EXPECT_EQ(count(svg, "<rect"), count(svg, "/>"));  // the only empty elements
}

TEST(MeshPicture, TensorGroupsSplitOverSmallNodes) {
  const plan::TrainingLayout l{.tensor = 8, .pipeline = 2};
  const MeshPictureOptions o{.devices_per_node = 4};
  EXPECT_THAT(mesh_axis_captions(l, o),
              ElementsAre("pipeline=2: 8 groups of 2 ranks 8 apart, across nodes (one rank per node); activations "
                          "to the next stage every micro-batch",
                          "tensor=8: 2 groups of 8 consecutive ranks, across 2 nodes each (4 ranks per node); "
                          "activations all-reduced in every layer"));
  EXPECT_EQ(tensor_groups_split_over_nodes(l, o), 2);
  const std::string svg = mesh_svg(l, o);
  for (const char* node : {">node 0: ranks 0-3<", ">node 1: ranks 4-7<", ">node 2: ranks 8-11<", ">node 3: ranks 12-15<"})
    EXPECT_THAT(svg, HasSubstr(node));  // too narrow for ", stage 0"
  // Each group is outlined in red on both of its nodes; none in black.
  EXPECT_EQ(count(svg, "stroke=\"#d62728\" stroke-width=\"2.5\"/>"), 4);
  EXPECT_EQ(count(svg, "stroke=\"#222222\" stroke-width=\"1.5\""), 0);
  EXPECT_THAT(svg, HasSubstr("all 2 tensor-parallel groups are split over nodes (red)"));
  EXPECT_THAT(svg, HasSubstr(">tensor-parallel group split over nodes</text>"));
  // Coloured by stage: ranks 0-7 stage 0, 8-15 stage 1.
  EXPECT_THAT(svg, HasSubstr(">stage 1</text>"));
  EXPECT_EQ(count(svg, "fill=\"#8dd3c7\" stroke=\"#666666\""), 8 + 1);  // 8 devices and the legend's swatch
  EXPECT_EQ(count(svg, "fill=\"#ffffb3\" stroke=\"#666666\""), 8 + 1);
}

TEST(MeshPicture, OrderOfTheMeshFlagNumbersTheRanks) {
  // --mesh tensor=2,data=4: the data axis varies fastest, so a tensor group
  // is ranks 4 apart (each rank outlined alone) -- still within the node.
  const plan::TrainingLayout l{.data = 4, .tensor = 2};
  const MeshPictureOptions o{.order = {"tensor", "data"}};
  EXPECT_THAT(mesh_axis_captions(l, o)[0], HasSubstr("tensor=2: 4 groups of 2 ranks 4 apart, within a node"));
  const std::string svg = mesh_svg(l, o);
  EXPECT_THAT(svg, HasSubstr("<title>rank 1 on node 0: tensor 0, data 1</title>"));
  EXPECT_EQ(count(svg, "stroke=\"#222222\" stroke-width=\"1.5\""), 8);
  EXPECT_THROW(mesh_svg(l, {.order = {"data"}}), InvalidArgument);  // leaves out tensor=2
  EXPECT_THROW(mesh_svg(l, {.order = {"data", "data", "tensor"}}), InvalidArgument);
  EXPECT_THROW(mesh_svg(l, {.order = {"node", "data", "tensor"}}), InvalidArgument);
  EXPECT_THROW(mesh_svg(l, {.devices_per_node = 0}), InvalidArgument);
}

TEST(MeshPicture, LargeMeshDrawsThirtyTwoNodesAndNamesTheRest) {
  // GPT-3's Megatron layout: 1024 devices, 128 nodes.
  const plan::TrainingLayout l{.data = 8, .tensor = 8, .pipeline = 16};
  const std::string svg = mesh_svg(l, {.devices_per_node = 8, .title = "a <b> & \"c\""});
  EXPECT_THAT(svg, HasSubstr(">node 31: ranks 248-255, stage 3<"));
  EXPECT_THAT(svg, Not(HasSubstr(">node 32")));
  EXPECT_EQ(count(svg, "<title>rank "), 256);
  EXPECT_THAT(svg, HasSubstr("... and 96 more nodes not drawn: nodes 32-127, ranks 256-1023, pipeline stages 4-15"));
  EXPECT_THAT(svg, HasSubstr("pipeline=16: 64 groups of 16 ranks 64 apart, across nodes (one rank per node)"));
  EXPECT_THAT(svg, HasSubstr("data=8: 128 groups of 8 ranks 8 apart, across nodes (one rank per node)"));
  EXPECT_THAT(svg, HasSubstr("tensor=8: 128 groups of 8 consecutive ranks, within a node"));
  EXPECT_THAT(svg, HasSubstr("(colours repeat: stage s as stage s mod 12)"));
  EXPECT_THAT(svg, HasSubstr(">a &lt;b&gt; &amp; &quot;c&quot;</text>"));  // escaped
  EXPECT_LT(svg.size(), 200000u);
}

TEST(MeshPicture, GroupsPartlySplit) {
  // tensor=3 on nodes of 8: 0-2 and 3-5 within node 0, 6-8 and 15-17 split.
  const plan::TrainingLayout l{.data = 8, .tensor = 3};
  const MeshPictureOptions o{.devices_per_node = 8};
  EXPECT_THAT(mesh_axis_captions(l, o)[1], HasSubstr("tensor=3: 8 groups of 3 consecutive ranks, 2 of the 8 groups "
                                                    "split over nodes"));
  EXPECT_EQ(tensor_groups_split_over_nodes(l, o), 2);
  EXPECT_THAT(mesh_axis_captions({}, o), ElementsAre("one device"));
}

}  // namespace
}  // namespace meshtrain::cli
