#include "meshtrain/parallel/zeropp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
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

// Sizes: every count from 1 to 2 blocks + 3 (each remainder of the block,
// one and several blocks), then 2^k - 1 and 2^k + 3 up to 2^20 + 3 (up to
// 2^16 + 3 at 3 and 5 to 8 ranks, which this machine's 2 cores run as
// threads).
constexpr int64_t kBlock = 64;
std::vector<int64_t> counts_up_to(int max_log2) {
  std::vector<int64_t> out;
  for (int64_t n = 1; n <= 2 * kBlock + 3; ++n) out.push_back(n);
  for (int k = 8; k <= max_log2; ++k) {
    out.push_back((int64_t{1} << k) - 1);
    out.push_back((int64_t{1} << k) + 3);
  }
  return out;
}
int max_log2_for(int ranks) { return ranks == 2 || ranks == 4 ? 20 : 16; }

void check_all_gather(int ranks, const BlockQuant& q) {
  std::vector<std::vector<float>> sent(static_cast<size_t>(ranks));  // row r: rank r's values
  comm::launch({.engine = comm::Engine::threads, .ranks = ranks, .timeout = std::chrono::seconds(120)},
               [&](comm::Communicator& world) {
                 for (int64_t count : counts_up_to(max_log2_for(ranks))) {
                   sent[static_cast<size_t>(world.rank())] = values(count, world.rank());
                   world.barrier();
                   std::vector<float> all(static_cast<size_t>(count * ranks));
                   quantized_all_gather(world, sent[static_cast<size_t>(world.rank())].data(), all.data(),
                                        static_cast<size_t>(count), q);
                   for (int r = 0; r < ranks; ++r) {
                     const std::vector<float>& x = sent[static_cast<size_t>(r)];
                     for (int64_t b0 = 0; b0 < count; b0 += q.block) {
                       const double bound = scale_of(x, b0, q) / 2 * (1 + 6 * q.qmax() * std::exp2(-24.0));
                       for (int64_t i = b0; i < std::min(count, b0 + q.block); ++i)
                         ASSERT_LE(std::fabs(all[static_cast<size_t>(r * count + i)] - x[static_cast<size_t>(i)]), bound)
                             << "int" << q.bits << " ranks " << ranks << " count " << count << " from rank " << r;
                     }
                   }
                   world.barrier();  // before a row is overwritten
                 }
               });
}

TEST(QuantizedAllGather, EveryValueWithinHalfItsScale) {
  for (int bits : {8, 4})
    for (int ranks = 2; ranks <= 8; ++ranks) check_all_gather(ranks, BlockQuant{.bits = bits, .block = kBlock});
}

// qgZ against the exact f32 sum (in double): within the sum of half-scales
// of every quantization the element went through, on 1 node (L = ranks)
// and 2 simulated nodes (node=2 x fsdp=ranks/2).
void check_reduce_scatter(int ranks, int nodes, const std::vector<int64_t>& counts, const BlockQuant& q) {
  const int l_ranks = ranks / nodes;
  std::vector<std::vector<float>> sent(static_cast<size_t>(ranks));  // row r: rank r's ranks chunks
  comm::launch({.engine = comm::Engine::threads, .ranks = ranks, .timeout = std::chrono::seconds(120)},
               [&](comm::Communicator& world) {
                 mesh::DeviceMesh grid(world, {nodes, l_ranks}, {"node", "fsdp"});
                 comm::Communicator* inter = nodes > 1 ? &grid.comm("node") : nullptr;
                 for (int64_t count : counts) {
                   sent[static_cast<size_t>(world.rank())] = values(count * ranks, world.rank());
                   world.barrier();
                   std::vector<float> got(static_cast<size_t>(count));
                   quantized_reduce_scatter(grid.comm("fsdp"), inter, sent[static_cast<size_t>(world.rank())].data(),
                                            got.data(), static_cast<size_t>(count), q);
                   // Per source rank, the scales of its step-1 message to local l
                   // (the chunks {k L + l}, k in order).
                   const int chunk = world.rank(), my_node = chunk / l_ranks, l = chunk % l_ranks;
                   std::vector<std::vector<float>> scales1;
                   for (int r = 0; r < ranks; ++r) {
                     std::vector<float> group(static_cast<size_t>(count * nodes));
                     for (int k = 0; k < nodes; ++k)
                       std::copy_n(sent[static_cast<size_t>(r)].begin() + (k * l_ranks + l) * count, count,
                                   group.begin() + k * count);
                     std::vector<float> sc;
                     for (int64_t b = 0; b < q.blocks(count * nodes); ++b) sc.push_back(scale_of(group, b * q.block, q));
                     scales1.push_back(std::move(sc));
                   }
                   auto value = [&](int r, int64_t i) {
                     return sent[static_cast<size_t>(r)][static_cast<size_t>(chunk * count + i)];
                   };
                   std::vector<double> exact(static_cast<size_t>(count), 0.0), bound(static_cast<size_t>(count), 0.0),
                       magnitude(static_cast<size_t>(count), 0.0);
                   for (int node = 0; node < nodes; ++node) {
                     std::vector<double> node_sum(static_cast<size_t>(count), 0.0),
                         node_err(static_cast<size_t>(count), 0.0);
                     for (int src = node * l_ranks; src < (node + 1) * l_ranks; ++src)
                       for (int64_t i = 0; i < count; ++i) {
                         node_sum[static_cast<size_t>(i)] += value(src, i);
                         magnitude[static_cast<size_t>(i)] += std::fabs(value(src, i));
                         node_err[static_cast<size_t>(i)] +=
                             scales1[static_cast<size_t>(src)][static_cast<size_t>((my_node * count + i) / q.block)] / 2;
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
                   world.barrier();  // before a row is overwritten
                 }
               });
}

TEST(QuantizedReduceScatter, WithinTheQuantizationBoundOnOneAndTwoNodes) {
  for (int bits : {8, 4}) {
    const BlockQuant q{.bits = bits, .block = kBlock};
    for (int ranks = 2; ranks <= 8; ++ranks) {
      // The large sizes once (int8): int4 only changes the codes' width.
      const std::vector<int64_t> counts = counts_up_to(bits == 8 ? max_log2_for(ranks) : 12);
      check_reduce_scatter(ranks, 1, counts, q);
      if (ranks % 2 == 0) check_reduce_scatter(ranks, 2, counts, q);
    }
  }
}

// The asynchronous form, several in flight and advanced oldest first with
// test() (as FullyShardedDataParallel does), gives the blocking form's
// results bit for bit.
TEST(QuantizedReduceScatter, AsynchronousEqualsBlocking) {
  const BlockQuant q{.bits = 8, .block = kBlock};
  comm::launch({.engine = comm::Engine::threads, .ranks = 4, .timeout = std::chrono::seconds(60)},
               [&](comm::Communicator& world) {
                 mesh::DeviceMesh grid(world, {2, 2}, {"node", "fsdp"});
                 const std::vector<int64_t> counts = {1, 63, 64, 1000, 4099};
                 std::vector<std::vector<float>> want, got;
                 for (int64_t count : counts) {
                   const std::vector<float> x = values(count * 4, world.rank() + static_cast<int>(count));
                   want.emplace_back(static_cast<size_t>(count));
                   quantized_reduce_scatter(grid.comm("fsdp"), &grid.comm("node"), x.data(), want.back().data(),
                                            static_cast<size_t>(count), q);
                 }
                 std::vector<std::unique_ptr<QuantizedReduceScatter>> ops;
                 for (int64_t count : counts) {
                   const std::vector<float> x = values(count * 4, world.rank() + static_cast<int>(count));
                   got.emplace_back(static_cast<size_t>(count), -1.0f);
                   ops.push_back(std::make_unique<QuantizedReduceScatter>(grid.comm("fsdp"), &grid.comm("node"),
                                                                          x.data(), got.back().data(),
                                                                          static_cast<size_t>(count), q));
                 }  // each x freed: the constructor quantized it
                 size_t done = 0;
                 while (done < ops.size()) {
                   if (ops[done]->test())
                     ++done;
                   else
                     std::this_thread::yield();
                 }
                 EXPECT_EQ(got, want);
               });
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
