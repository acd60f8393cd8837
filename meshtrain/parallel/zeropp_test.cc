#include "meshtrain/parallel/zeropp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/mesh/device_mesh.h"

namespace meshtrain::parallel {
namespace {

// Rank r's n values: normal, scaled per stretch of 97 so blocks differ in magnitude.
std::vector<float> values(int64_t n, int r) {
  std::vector<float> x(static_cast<size_t>(n));
  fill_normal(x.data(), x.size(), 5, 1000 + static_cast<uint64_t>(r), 0, 0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] *= std::exp2(static_cast<float>((i / 97 + r) % 7) - 3);
  return x;
}

// The scale quantize_blocks gives the block of x[0, n) holding element i.
float scale_of(const std::vector<float>& x, int64_t i, const BlockQuant& q) {
  const int64_t b = i / q.block, lo = b * q.block, hi = std::min<int64_t>(static_cast<int64_t>(x.size()), lo + q.block);
  float amax = 0;
  for (int64_t j = lo; j < hi; ++j) amax = std::max(amax, std::fabs(x[static_cast<size_t>(j)]));
  return amax / static_cast<float>(q.qmax());
}

const std::vector<int64_t> kCounts = {1, 2, 3, 127, 128, 129, 255, 256, 257, 4097};

TEST(QuantizedAllGather, EveryValueWithinHalfItsScale) {
  for (int bits : {8, 4})
    for (int ranks : {2, 3, 5, 8})
      for (int64_t count : kCounts) {
        const BlockQuant q{.bits = bits, .block = 128};
        comm::launch({.engine = comm::Engine::threads, .ranks = ranks, .timeout = std::chrono::seconds(60)},
                     [&](comm::Communicator& world) {
                       const std::vector<float> mine = values(count, world.rank());
                       std::vector<float> all(static_cast<size_t>(count * ranks));
                       quantized_all_gather(world, mine.data(), all.data(), static_cast<size_t>(count), q);
                       for (int r = 0; r < ranks; ++r) {
                         const std::vector<float> x = values(count, r);
                         for (int64_t i = 0; i < count; ++i)
                           ASSERT_LE(std::fabs(all[static_cast<size_t>(r * count + i)] - x[static_cast<size_t>(i)]),
                                     scale_of(x, i, q) / 2 * (1 + 1e-6))
                               << "int" << bits << " ranks " << ranks << " count " << count << " from rank " << r;
                       }
                     });
      }
}

// qgZ against the exact f32 sum (in double): within the sum of half-scales
// of every quantization the element went through, on 1 node (L = ranks)
// and 2 simulated nodes (node=2 x fsdp=ranks/2).
void expect_reduce_scatter_within_bound(int ranks, int nodes, int64_t count, const BlockQuant& q) {
  const int l_ranks = ranks / nodes;
  comm::launch({.engine = comm::Engine::threads, .ranks = ranks, .timeout = std::chrono::seconds(120)},
               [&](comm::Communicator& world) {
                 mesh::DeviceMesh grid(world, {nodes, l_ranks}, {"node", "fsdp"});
                 comm::Communicator* inter = nodes > 1 ? &grid.comm("node") : nullptr;
                 const std::vector<float> mine = values(count * ranks, world.rank());
                 std::vector<float> got(static_cast<size_t>(count));
                 quantized_reduce_scatter(grid.comm("fsdp"), inter, mine.data(), got.data(), static_cast<size_t>(count), q);
                 // What each rank sent; per source rank the scales of its step-1
                 // message to local l (the chunks {k L + l}, k in order).
                 const int chunk = world.rank(), my_node = chunk / l_ranks, l = chunk % l_ranks;
                 std::vector<std::vector<float>> sent, scales1;
                 for (int r = 0; r < ranks; ++r) {
                   sent.push_back(values(count * ranks, r));
                   std::vector<float> group(static_cast<size_t>(count * nodes));
                   for (int k = 0; k < nodes; ++k)
                     std::copy_n(sent.back().begin() + (k * l_ranks + l) * count, count, group.begin() + k * count);
                   std::vector<float> sc;
                   for (int64_t b = 0; b < q.blocks(count * nodes); ++b) sc.push_back(scale_of(group, b * q.block, q));
                   scales1.push_back(std::move(sc));
                 }
                 auto value = [&](int r, int64_t i) { return sent[static_cast<size_t>(r)][static_cast<size_t>(chunk * count + i)]; };
                 std::vector<double> exact(static_cast<size_t>(count), 0.0), bound(static_cast<size_t>(count), 0.0),
                     magnitude(static_cast<size_t>(count), 0.0);
                 for (int node = 0; node < nodes; ++node) {
                   std::vector<double> node_sum(static_cast<size_t>(count), 0.0), node_err(static_cast<size_t>(count), 0.0);
                   for (int s = node * l_ranks; s < (node + 1) * l_ranks; ++s)
                     for (int64_t i = 0; i < count; ++i) {
                       node_sum[static_cast<size_t>(i)] += value(s, i);
                       magnitude[static_cast<size_t>(i)] += std::fabs(value(s, i));
                       node_err[static_cast<size_t>(i)] +=
                           scales1[static_cast<size_t>(s)][static_cast<size_t>((my_node * count + i) / q.block)] / 2;
                     }
                   for (int64_t i = 0; i < count; ++i) {
                     exact[static_cast<size_t>(i)] += node_sum[static_cast<size_t>(i)];
                     bound[static_cast<size_t>(i)] += node_err[static_cast<size_t>(i)];
                   }
                   if (nodes == 1) continue;
                   // Step 2 quantizes this node's sum of my chunk: a block's largest
                   // magnitude is at most the exact one plus step 1's largest error.
                   for (int64_t b0 = 0; b0 < count; b0 += q.block) {
                     const int64_t b1 = std::min(count, b0 + q.block);
                     double amax = 0, err = 0;
                     for (int64_t j = b0; j < b1; ++j) {
                       amax = std::max(amax, std::fabs(node_sum[static_cast<size_t>(j)]));
                       err = std::max(err, node_err[static_cast<size_t>(j)]);
                     }
                     for (int64_t j = b0; j < b1; ++j) bound[static_cast<size_t>(j)] += (amax + err) / q.qmax() / 2;
                   }
                 }
                 for (int64_t i = 0; i < count; ++i)
                   ASSERT_LE(std::fabs(got[static_cast<size_t>(i)] - exact[static_cast<size_t>(i)]),
                             bound[static_cast<size_t>(i)] + 1e-6 * magnitude[static_cast<size_t>(i)] + 1e-30)
                       << "ranks " << ranks << " nodes " << nodes << " count " << count << " int" << q.bits
                       << " element " << i;
               });
}

TEST(QuantizedReduceScatter, WithinTheQuantizationBoundOnOneAndTwoNodes) {
  for (int bits : {8, 4}) {
    const BlockQuant q{.bits = bits, .block = 64};
    for (int ranks : {2, 3, 4, 8})
      for (int64_t count : kCounts) expect_reduce_scatter_within_bound(ranks, 1, count, q);
    for (int ranks : {2, 4, 8})
      for (int64_t count : kCounts) expect_reduce_scatter_within_bound(ranks, 2, count, q);
  }
}

TEST(QuantizedReduceScatter, LargeCountOnTwoNodes) {
  expect_reduce_scatter_within_bound(4, 2, (int64_t{1} << 18) + 3, BlockQuant{.bits = 8, .block = 256});
}

// The bytes on the wire (the communicator's own count): 8-bit codes and
// an f32 scale per 256 values, about 0.254 of f32's; 4-bit about 0.129.
// qgZ's cross-node all-to-all carries the node's sums, one chunk per node.
TEST(QuantizedCollectives, BytesOnTheWire) {
  const int64_t count = 4096;
  for (int bits : {8, 4}) {
    const BlockQuant q{.bits = bits, .block = 256};
    comm::launch({.engine = comm::Engine::threads, .ranks = 4, .timeout = std::chrono::seconds(30)},
                 [&](comm::Communicator& world) {
                   mesh::DeviceMesh grid(world, {2, 2}, {"node", "fsdp"});
                   world.reset_traffic();  // the mesh's own set-up
                   const std::vector<float> x = values(count * 4, world.rank());
                   std::vector<float> out(static_cast<size_t>(count * 4));
                   quantized_all_gather(world, x.data(), out.data(), static_cast<size_t>(count), q);
                   const double f32 = 4.0 * count;
                   const double ag = static_cast<double>(world.traffic(comm::CollectiveOp::all_gather).bytes);
                   EXPECT_EQ(ag, static_cast<double>(quantized_message_bytes(count, q)));
                   EXPECT_NEAR(ag / f32, bits == 8 ? 0.254 : 0.129, 0.001);
                   quantized_reduce_scatter(grid.comm("fsdp"), &grid.comm("node"), x.data(), out.data(),
                                            static_cast<size_t>(count), q);
                   // Across nodes: one message of `count` values to each node (the
                   // counter records the all-to-all's block per peer).
                   const double cross = static_cast<double>(grid.comm("node").traffic(comm::CollectiveOp::all_to_all).bytes);
                   EXPECT_EQ(cross, static_cast<double>(quantized_message_bytes(count, q)));
                 });
  }
}

TEST(QuantizedCollectives, ZerosStayZeroAndBadQuantizationIsRefused) {
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 std::vector<float> zeros(6, 0.0f), out(6, 1.0f);
                 quantized_reduce_scatter(world, nullptr, zeros.data(), out.data(), 3, BlockQuant{});
                 EXPECT_EQ(out[0], 0.0f);
                 EXPECT_THAT([&] { quantized_all_gather(world, zeros.data(), out.data(), 3, BlockQuant{.bits = 2}); },
                             ::testing::ThrowsMessage<InvalidArgument>(::testing::HasSubstr("bits 2")));
               });
}

}  // namespace
}  // namespace meshtrain::parallel
