// ZeRO++ in FullyShardedDataParallel on the threads engine: quantized
// weight gathers (qwZ) and gradient reduce-scatters (qgZ) follow the f32
// reference loosely; hpZ changes no value and moves later gathers into the
// node; what ZeRO++ cannot do is refused with a reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/parallel/fully_sharded_test_util.h"

namespace meshtrain::parallel {
namespace {

using ::testing::HasSubstr;
using namespace fsdp_testing;

// ZeRO++: quantized weight gathers (qwZ), the hierarchical quantized
// gradient reduce-scatter (qgZ) and both, on 1 and 2 simulated nodes of 2
// ranks, int8 and int4: the losses follow the f32 reference loosely (the
// quantization is real: they differ), the masters stay f32.
TEST(FullySharded, ZeroPlusPlusTracksTheReferenceLoosely) {
  const Outcome want = reference(8);
  for (int nodes : {1, 2})
    for (int bits : {8, 4})
      for (auto [qw, qg] : {std::pair{true, false}, {false, true}, {true, true}}) {
        RunSpec s;
        s.ranks = 4;
        s.steps = 8;
        s.strategy = {ZeroStage::zero3, false};
        s.zeropp_nodes = nodes;
        s.options.quantize_weights = qw;
        s.options.quantize_gradients = qg;
        s.options.weight_quant = {.bits = bits, .block = 32};
        s.options.grad_quant = {.bits = bits, .block = 32};
        const Outcome got = run(s);
        const std::string what = fmt::format("{} node(s), int{}, qwZ {} qgZ {}", nodes, bits, qw, qg);
        const double tol = bits == 8 ? 2e-2 : 1e-1;
        for (size_t i = 0; i < want.losses.size(); ++i)
          EXPECT_NEAR(got.losses[i], want.losses[i], tol * want.losses[i]) << what << " step " << i;
        EXPECT_NE(got.losses.back(), want.losses.back()) << what;
      }
}

// hpZ moves every gather after a step's first one inside the node and
// changes no value: with and without qwZ and qgZ, with 1 and 2
// micro-batches, f32 and bf16 parameters, the run equals the one without
// hpZ bit for bit. Per step the shard communicator gathers each unit once
// (forward of the first micro-batch) instead of 2 m times, the node
// gathers the secondary copies 2 m - 1 times, and the copies (Np / L per
// unit, in the dtype computed with) live from that first forward to
// after_step().
TEST(FullySharded, HierarchicalPartitionKeepsLaterGathersWithinTheNode) {
  struct Case {
    bool qw, qg;
    DType dtype;
  };
  for (const Case c : {Case{false, false, DType::f32}, {false, false, DType::bf16}, {true, false, DType::f32},
                       {false, true, DType::f32}, {true, true, DType::f32}})
    for (int m : {1, 2}) {
      RunSpec s;
      s.ranks = 4;
      s.steps = 3;
      s.micro_batches = m;
      s.zeropp_nodes = 2;
      s.options.param_dtype = c.dtype;
      s.options.reduce_dtype = DType::f32;
      s.options.quantize_weights = c.qw;
      s.options.quantize_gradients = c.qg;
      const Outcome flat = run(s);
      s.options.hierarchical_partition = true;
      const Outcome hp = run(s);
      const std::string what = fmt::format("qwZ {} qgZ {} {} m {}", c.qw, c.qg, dtype_name(c.dtype), m);
      EXPECT_EQ(hp.losses, flat.losses) << what;
      EXPECT_EQ(hp.params, flat.params) << what;
      EXPECT_EQ(hp.shard_gather_bytes * static_cast<uint64_t>(2 * m), flat.shard_gather_bytes) << what;
      EXPECT_EQ(flat.local_gather_bytes, 0u) << what;
      const int64_t es = c.qw ? 4 : static_cast<int64_t>(dtype_size(c.dtype));
      EXPECT_EQ(hp.secondary_bytes, hp.padded / 2 * es) << what;
      EXPECT_EQ(hp.local_gather_bytes, static_cast<uint64_t>(s.steps * (2 * m - 1) * hp.secondary_bytes)) << what;
      EXPECT_EQ(hp.secondary_peak, hp.secondary_bytes) << what;
      EXPECT_EQ(hp.secondary_after_step, 0) << what;
      EXPECT_EQ(flat.secondary_bytes, 0) << what;
    }
}

TEST(FullySharded, ZeroPlusPlusRefusesWhatItCannotDo) {
  comm::launch({.engine = comm::Engine::threads, .ranks = 4, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 mesh::DeviceMesh grid(world, {2, 2}, {"node", "fsdp"});
                 auto error = [&](FullyShardedOptions o) {
                   nn::MLP model(mlp_config());
                   try {
                     FullyShardedDataParallel f(model, world, nullptr, o);
                   } catch (const InvalidArgument& e) {
                     return std::string(e.what());
                   }
                   return std::string("no error");
                 };
                 FullyShardedOptions o = opts(ZeroStage::zero2);
                 o.quantize_weights = true;
                 EXPECT_THAT(error(o), HasSubstr("qwZ quantizes zero3's parameter all-gathers"));
                 o = opts(ZeroStage::zero1);
                 o.quantize_gradients = true;
                 EXPECT_THAT(error(o), HasSubstr("qgZ replaces the reduce-scatters of zero2 and zero3"));
                 o = opts(ZeroStage::zero3);
                 o.quantize_gradients = true;
                 o.node_local = &grid.comm("node");  // 2 of the shard's 4 ranks, no cross-node group
                 EXPECT_THAT(error(o), HasSubstr("node-major"));
                 o.node_local = nullptr;
                 o.cross_node = &grid.comm("node");
                 EXPECT_THAT(error(o), HasSubstr("cross_node without node_local"));
                 o = opts(ZeroStage::zero3);
                 o.hierarchical_partition = true;
                 EXPECT_THAT(error(o), HasSubstr("hpZ keeps a node-local copy"));  // no node_local
                 o = opts(ZeroStage::zero2);
                 o.hierarchical_partition = true;
                 o.node_local = &grid.comm("fsdp");
                 o.cross_node = &grid.comm("node");
                 EXPECT_THAT(error(o), HasSubstr("hpZ keeps a node-local copy"));
               });
}

}  // namespace
}  // namespace meshtrain::parallel
