#include "meshtrain/sharding/placement.h"

#include <gtest/gtest.h>

#include <random>

#include "meshtrain/core/error.h"

namespace meshtrain::sharding {
namespace {

TEST(Placement, WholeHoldsEveryElementOfItsShape) {
  const Placement p = Placement::whole({4, 6});
  EXPECT_FALSE(p.is_block());
  EXPECT_FALSE(p.is_flat());
  EXPECT_EQ(p.numel(), 24);
  EXPECT_EQ(p.block_box(), (Box{{0, 0}, {4, 6}}));
  EXPECT_EQ(p.to_string(), "whole");
}

TEST(Placement, ABlockOfAViewKeepsTheTensorsOwnShape) {
  // c_attn (8, 12) viewed (8, 3, 4), the second of two tensor ranks: heads 2..3 of q, k and v.
  const Placement p = Placement::block({{0, 0, 2}, {8, 3, 2}}, {8, 3, 4}, {8, 12});
  EXPECT_TRUE(p.is_block());
  EXPECT_EQ(p.shape, (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(p.view_shape(), (std::vector<int64_t>{8, 3, 4}));
  EXPECT_EQ(p.numel(), 48);
  EXPECT_EQ(p.to_string(), "[0:8, 0:3, 2:4] of [8, 3, 4]");
  // Without a separate shape the view is the shape.
  EXPECT_EQ(Placement::block({{2}, {3}}, {6}).shape, (std::vector<int64_t>{6}));
}

TEST(Placement, AFlatRangeNarrowsTheBlockAndStaysInsideIt) {
  const Placement b = Placement::block({{0, 3}, {4, 3}}, {4, 6});
  const Placement f = b.flat(5, 7);
  EXPECT_TRUE(f.is_flat());
  EXPECT_EQ(f.numel(), 7);
  EXPECT_EQ(f.block_numel(), 12);
  EXPECT_EQ(f.to_string(), "[0:4, 3:6] of [4, 6] flat[5:12]");
  EXPECT_EQ(Placement::whole({10}).flat(0, 0).to_string(), "flat[0:0]");
  EXPECT_THROW(b.flat(6, 7), InvalidArgument);
  EXPECT_THROW(b.flat(-1, 2), InvalidArgument);
}

TEST(FlatShards, PacksAUnitAndPadsTheLastShard) {
  const FlatShards f({5, 3, 10}, 4);  // 18 elements, padded to 20, shards of 5
  EXPECT_EQ(f.offsets, (std::vector<int64_t>{0, 5, 8}));
  EXPECT_EQ(f.numel, 18);
  EXPECT_EQ(f.padded, 20);
  EXPECT_EQ(f.shard, 5);
  using R = std::pair<int64_t, int64_t>;
  EXPECT_EQ(f.owned(0, 0), R(0, 5));
  EXPECT_EQ(f.owned(0, 1), R(0, 0));
  EXPECT_EQ(f.owned(1, 1), R(0, 3));
  EXPECT_EQ(f.owned(2, 1), R(0, 2));
  EXPECT_EQ(f.owned(2, 2), R(2, 5));
  EXPECT_EQ(f.owned(2, 3), R(7, 3));  // and 2 elements of padding
  EXPECT_THROW(FlatShards({1}, 0), InvalidArgument);
  EXPECT_THROW(FlatShards({-1}, 2), InvalidArgument);
}

TEST(FlatShards, EveryElementHasExactlyOneOwner) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> numels(static_cast<size_t>(1 + rng() % 5));
    for (int64_t& n : numels) n = static_cast<int64_t>(rng() % 40);
    const int64_t d = 1 + static_cast<int64_t>(rng() % 7);
    const FlatShards f(numels, d);
    for (size_t i = 0; i < numels.size(); ++i) {
      std::vector<int> owners(static_cast<size_t>(numels[i]), 0);
      for (int64_t r = 0; r < d; ++r) {
        const auto [start, count] = f.owned(i, r);
        for (int64_t k = start; k < start + count; ++k) ++owners[static_cast<size_t>(k)];
      }
      for (int n : owners) ASSERT_EQ(n, 1) << "trial " << trial << " parameter " << i;
    }
  }
}

}  // namespace
}  // namespace meshtrain::sharding
