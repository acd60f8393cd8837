// Tensor-parallel building blocks on the threads engine (1 to 4 ranks,
// sizes that do not divide): the shard rule; a column-parallel layer
// (plain and as a fused q|k|v projection of 3 parts), GELU and a
// row-parallel layer equal the unsharded MLP (output, dX, every rank's
// block of every gradient within 1e-5; initial values bit for bit the
// blocks of the unsharded ones); and the
// vocabulary-parallel cross-entropy against CrossEntropyLoss on the whole
// logits: loss and every rank's gradient slice within 1e-6, with each row's
// maximum placed on a different rank, while each rank keeps 1/k of the
// plain loss's probabilities (MemoryTracker).
#include "meshtrain/nn/parallel/tensor_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <mutex>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/random.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/parallel/parity_test_util.h"
#include "meshtrain/nn/sequential.h"
#include "meshtrain/sharding/layout.h"
#include "meshtrain/sharding/multi_dimensional.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::nn {
namespace {

using parity_test::block_of;
using parity_test::expect_near;
using parity_test::randn;

TEST(ShardRange, FollowsTorchChunk) {
  EXPECT_EQ(shard_range(5, 0, 4).size(), 2);
  EXPECT_EQ(shard_range(5, 2, 4).begin, 4);
  EXPECT_EQ(shard_range(5, 2, 4).size(), 1);
  EXPECT_EQ(shard_range(5, 3, 4).size(), 0);
  EXPECT_EQ(shard_range(50257, 1, 2).begin, 25129);
  EXPECT_EQ(shard_range(50257, 1, 2).end, 50257);
  EXPECT_THAT(testing::error_of([] { shard_range(4, 2, 2); }), ::testing::HasSubstr("rank 2 of 2"));
}

// Column-parallel 6 -> 15, GELU, row-parallel 15 -> 4 on (2, 3, 6) inputs.
TEST(TensorParallelLinear, ColumnThenRowEqualsTheUnshardedLayers) {
  for (int k : {1, 2, 3}) {
      const int64_t in = 6, hidden = 15, out = 4;
      const LinearOptions col{.role = sharding::LinearRole::column, .init_std = 0.5};
      const LinearOptions row{.role = sharding::LinearRole::row, .init_std = 0.3};
      Sequential ref;
      ref.add(std::make_unique<Linear>(in, hidden, "fc1", 5, col));
      ref.add(std::make_unique<GELU>(GeluApproximation::tanh));
      ref.add(std::make_unique<Linear>(hidden, out, "fc2", 5, row));
      for (Parameter* p : ref.parameters())  // other values than the init, biases nonzero too
        fill_normal(p->value, 4, key_from_name(p->name + ".b"), 0.0, 0.1);
      const Tensor x = randn({2, 3, in}, "x"), dy = randn({2, 3, out}, "dy");
      // The reference biases are random; the TP layers get the same values below.
      const Tensor y_ref = ref.forward(x).contiguous();
      const std::vector<double> want_y = y_ref.to_vector(), want_dx = ref.backward(dy).to_vector();
      std::vector<Parameter*> rp = ref.parameters();
      comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                   [&](comm::Communicator& world) {
                     const TensorParallelGroup g{&world};
                     Sequential tp;
                     tp.add(std::make_unique<ColumnParallelLinear>(in, hidden, "fc1", 5, col, g));
                     tp.add(std::make_unique<GELU>(GeluApproximation::tanh));
                     tp.add(std::make_unique<RowParallelLinear>(hidden, out, "fc2", 5, row, g));
                     std::vector<Parameter*> ps = tp.parameters();
                     ASSERT_EQ(ps.size(), rp.size());
                     for (size_t i = 0; i < ps.size(); ++i) {
                       ASSERT_EQ(ps[i]->name, rp[i]->name);
                       const Placement& pl = ps[i]->placement;
                       // Initialized as the unsharded layer would be (before the test's random biases).
                       Parameter fresh = *rp[i];
                       std::vector<float> whole(static_cast<size_t>(rp[i]->value.numel()));
                       fresh.init(0, static_cast<int64_t>(whole.size()), whole.data());
                       const Tensor wt = Tensor::from_vector(std::vector<double>(whole.begin(), whole.end()),
                                                             rp[i]->info.shape);
                       const std::vector<double> mine = ps[i]->value.to_vector();
                       if (pl.is_block())
                         EXPECT_EQ(mine, block_of(wt, pl)) << ps[i]->name;
                       else
                         EXPECT_EQ(mine, wt.to_vector()) << ps[i]->name;
                       // Then the reference's values, so biases match too.
                       const Tensor ref_value = rp[i]->value;
                       const std::vector<double> v = pl.is_block()
                                                         ? block_of(ref_value, pl)
                                                         : ref_value.to_vector();
                       ps[i]->value.copy_from(Tensor::from_vector(v, ps[i]->value.shape()));
                     }
                     const std::string what = fmt::format("k {} rank {}", k, world.rank());
                     expect_near(tp.forward(x).contiguous().to_vector(), want_y, 1e-5, what + " y");
                     expect_near(tp.backward(dy).to_vector(), want_dx, 1e-5, what + " dx");
                     for (size_t i = 0; i < ps.size(); ++i) {
                       const Placement& pl = ps[i]->placement;
                       expect_near(ps[i]->grad.to_vector(),
                                   pl.is_block() ? block_of(rp[i]->grad, pl)
                                                                    : rp[i]->grad.to_vector(),
                                   1e-5, what + " " + ps[i]->name + " grad");
                     }
                   });
    }
}

// Megatron's pairs along a Linear chain; an odd chain leaves its lighter end whole.
TEST(TensorParallelChain, PairsLayersAndLeavesTheLighterEndWhole) {
  using R = ChainRole;
  EXPECT_EQ(chain_roles({784, 512, 512, 256, 10}), (std::vector<R>{R::column, R::row, R::column, R::row}));
  EXPECT_EQ(chain_roles({784, 512, 512, 10}), (std::vector<R>{R::column, R::row, R::whole}));
  EXPECT_EQ(chain_roles({20, 512, 512, 784}), (std::vector<R>{R::whole, R::column, R::row}));
  EXPECT_EQ(chain_roles({784, 10}), (std::vector<R>{R::whole}));
  // One rank: plain Linears carrying the role for the strategies.
  MLPConfig c;
  c.sizes = {784, 512, 10};
  MLP one(c);
  EXPECT_EQ(one.parameters()[0]->info.role, sharding::LinearRole::column);
  EXPECT_EQ(one.parameters()[2]->info.role, sharding::LinearRole::row);
}

// MLPs (even and odd chains, the whole layer at either end; hidden widths
// 3 and 4 ranks do not divide; dropout on: each rank draws its columns of
// the one-device masks) split over 1 to 4 ranks equal the unsharded ones:
// logits, every gradient block.
TEST(TensorParallelChain, MlpEqualsTheUnshardedModel) {
  for (const std::vector<int64_t>& sizes : {std::vector<int64_t>{12, 10, 7, 7, 3}, std::vector<int64_t>{12, 10, 6, 3},
                                            std::vector<int64_t>{3, 6, 10, 12}}) {
    MLPConfig base;
    base.sizes = sizes;
    base.dropout = 0.25;
    base.seed = 11;
    MLP ref(base);
    ref.set_batch_context(2, 4);
    const Tensor x = randn({5, sizes[0]}, "mlp x"), dy = randn({5, sizes.back()}, "mlp dy");
    const std::vector<double> want = ref.forward(x).to_vector();
    ref.backward(dy);
    std::vector<Parameter*> rp = ref.parameters();
    for (int k : {1, 2, 3, 4})
      comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                   [&](comm::Communicator& world) {
                     MLPConfig c = base;
                     c.tensor = TensorParallelGroup{&world};
                     MLP tp(c);
                     tp.set_batch_context(2, 4);
                     const std::string what = fmt::format("{} layers, k {} rank {}", sizes.size() - 1, k, world.rank());
                     expect_near(tp.forward(x).to_vector(), want, 1e-5, what + " logits");
                     tp.backward(dy);
                     std::vector<Parameter*> ps = tp.parameters();
                     ASSERT_EQ(ps.size(), rp.size());
                     for (size_t i = 0; i < ps.size(); ++i) {
                       const Placement& pl = ps[i]->placement;
                       expect_near(ps[i]->grad.to_vector(), block_of(rp[i]->grad, pl), 1e-5,
                                   what + " " + ps[i]->name + " grad");
                     }
                   });
  }
}

// A fused q|k|v projection 6 -> 3 x 6 split by heads: rank r's output is
// its columns of each part, dX is the whole input gradient.
TEST(TensorParallelLinear, FusedProjectionTakesItsColumnsOfEachPart) {
  const int64_t in = 6, block = 6;
  const LinearOptions col{.role = sharding::LinearRole::column, .init_std = 0.5};
  Linear ref(in, 3 * block, "c_attn", 5, col);
  fill_normal(ref.bias().value, 4, key_from_name("bias"), 0.0, 0.1);
  const Tensor x = randn({4, in}, "x"), dy = randn({4, 3 * block}, "dy");
  const std::vector<double> want_y = ref.forward(x).to_vector(), want_dx = ref.backward(dy).to_vector();
  for (int k : {1, 2, 3}) {
    comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                 [&](comm::Communicator& world) {
                   ColumnParallelLinear tp(in, 3 * block, "c_attn", 5, col, TensorParallelGroup{&world}, 3);
                   const ShardRange s = shard_range(block, world.rank(), k);
                   EXPECT_EQ(tp.local_out_features(), 3 * s.size());
                   Parameter& w = *tp.parameters()[0];
                   Parameter& b = *tp.parameters()[1];
                   EXPECT_EQ(w.placement.to_string(),
                             k == 1 ? "whole" : fmt::format("[0:6, 0:3, {}:{}] of [6, 3, 6]", s.begin, s.end));
                   b.value.copy_from(Tensor::from_vector(block_of(ref.bias().value, b.placement),
                                                         b.value.shape()));
                   // Columns p * block + [s.begin, s.end) of the reference, p = q, k, v.
                   const Tensor y = tp.forward(x);
                   const Tensor dyl = Tensor::empty({4, 3 * s.size()}, DType::f32);
                   for (int64_t p = 0; p < 3; ++p) {
                     dyl.narrow(1, p * s.size(), s.size()).copy_from(dy.narrow(1, p * block + s.begin, s.size()));
                     const std::vector<double> got = y.narrow(1, p * s.size(), s.size()).contiguous().to_vector();
                     const Tensor want = Tensor::from_vector(want_y, {4, 3 * block}).narrow(1, p * block + s.begin, s.size());
                     expect_near(got, want.contiguous().to_vector(), 1e-5, fmt::format("k {} part {} y", k, p));
                   }
                   expect_near(tp.backward(dyl).to_vector(), want_dx, 1e-5, fmt::format("k {} dx", k));
                   expect_near(w.grad.to_vector(), block_of(ref.weight().grad, w.placement),
                               1e-5, fmt::format("k {} weight grad", k));
                 });
  }
}

// A GPT (4 heads, vocabulary 13: uneven shards) split over 1, 2 and 4
// tensor-parallel ranks equals the unsharded one, without and with
// sequence parallelism (dropout 0.1 on: each rank draws its time steps of
// the one-device masks): the loss through VocabParallelCrossEntropy, and
// every parameter's gradient block, within 1e-5 (the sequence-parallel
// ones once summed over the ranks by reduce_sequence_parallel_grads);
// initial values bit for bit.
// A GPT split over `world` (step 3's dropout masks) with its vocabulary-parallel loss.
struct SplitGpt {
  SplitGpt(const GPTConfig& base, comm::Communicator& world, bool sp, bool overlap = false)
      : gpt(with_group(base, world, sp, overlap)), vce(gpt.config().tensor, base.vocab) {
    gpt.set_batch_context(3, 0);
  }
  static GPTConfig with_group(GPTConfig c, comm::Communicator& world, bool sp, bool overlap) {
    c.tensor = TensorParallelGroup{.comm = &world, .sequence_parallel = sp, .overlap = overlap};
    return c;
  }
  GPT gpt;
  VocabParallelCrossEntropy vce;
};

// Context parallelism (alone and with tensor parallelism): each rank holds
// its zig-zag chunks of the sequence; the loss of its tokens (normalized by
// the whole batch's) summed over the context axis, and every gradient
// summed over it, equal the unsharded model's within 1e-5, with dropout
// (each rank draws its pieces of the one-device masks), for ring and
// all_to_all attention, load-balanced and in order.
TEST(ContextParallelGpt, EqualsTheUnshardedModel) {
  const GPTConfig base{.vocab = 13, .block_size = 16, .layers = 2, .heads = 4, .width = 16, .seed = 7, .dropout = 0.1};
  constexpr int64_t kT = 16;
  std::vector<int64_t> ids(2 * kT), next(2 * kT);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<int64_t>(i * 5 % 13), next[i] = static_cast<int64_t>((i * 7 + 3) % 13);
  const Tensor x = Tensor::from_vector(ids, {2, kT}), y = Tensor::from_vector(next, {2, kT});
  GPT ref(base);
  ref.set_batch_context(3, 0);
  CrossEntropyLoss ce;
  const double want = ce.forward(ref.forward(x), y.view({2 * kT}));
  ref.backward(ce.backward());
  const std::vector<Parameter*> rp = ref.parameters();
  struct Case {
    int cp, tp;
    ContextComm kind;
    bool lb;
  };
  for (const Case cs : {Case{2, 1, ContextComm::ring, true}, Case{4, 1, ContextComm::ring, true},
                        Case{2, 1, ContextComm::ring, false}, Case{2, 1, ContextComm::all_to_all, true},
                        Case{4, 1, ContextComm::all_to_all, false}, Case{2, 2, ContextComm::ring, true},
                        Case{2, 2, ContextComm::all_to_all, true}}) {
    const std::string what = fmt::format("context {} tensor {} {}{}", cs.cp, cs.tp, context_comm_name(cs.kind),
                                         cs.lb ? "" : " in order");
    comm::launch({.engine = comm::Engine::threads, .ranks = cs.cp * cs.tp, .timeout = std::chrono::seconds(60)},
                 [&](comm::Communicator& world) {
                   mesh::DeviceMesh grid(world, {cs.cp, cs.tp}, {"context", "tensor"});
                   GPTConfig c = base;
                   c.tensor = TensorParallelGroup{&grid.comm("tensor")};
                   c.context = ContextParallelGroup{&grid.comm("context"), cs.kind, cs.lb};
                   GPT gpt(c);
                   gpt.set_batch_context(3, 0);
                   VocabParallelCrossEntropy vce(c.tensor, base.vocab);
                   const Tensor mine = shard_sequence(y, c.context, 1);
                   double got = vce.forward(gpt.forward(x), mine.view({mine.numel()}), 2.0 * kT);
                   gpt.backward(vce.backward());
                   comm::Communicator& cpc = grid.comm("context");
                   cpc.all_reduce(&got, &got, 1, DType::f64, comm::ReduceOp::sum);
                   EXPECT_NEAR(got, want, 1e-5 * want) << what;
                   const std::vector<Parameter*> ps = gpt.parameters();
                   ASSERT_EQ(ps.size(), rp.size());
                   for (size_t i = 0; i < ps.size(); ++i) {
                     Tensor g = ps[i]->grad;
                     cpc.all_reduce(g.data<float>(), g.data<float>(), static_cast<size_t>(g.numel()), DType::f32,
                                    comm::ReduceOp::sum);
                     const Placement& pl = ps[i]->placement;
                     expect_near(g.to_vector(), block_of(rp[i]->grad, pl), 1e-5,
                                 fmt::format("{}: {} grad", what, ps[i]->name));
                   }
                 });
  }
}

TEST(TensorParallelGpt, EqualsTheUnshardedModel) {
  const GPTConfig base{.vocab = 13, .block_size = 8, .layers = 2, .heads = 4, .width = 16, .seed = 7, .dropout = 0.1};
  std::vector<int64_t> ids(2 * 8), next(2 * 8);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i * 5 % 13), next[i] = static_cast<int64_t>((i * 7 + 3) % 13);
  const Tensor x = Tensor::from_vector(ids, {2, 8}), y = Tensor::from_vector(next, {16});
  GPT ref(base);
  ref.set_batch_context(3, 0);
  CrossEntropyLoss ce;
  const double want = ce.forward(ref.forward(x), y);
  ref.backward(ce.backward());
  std::vector<Parameter*> rp = ref.parameters();
  // Communication overlap (with sequence parallelism: the rings), with the
  // fused and the split backward (zero-bubble pipelines' backward_input
  // then backward_weight).
  struct Mode {
    bool sp, overlap, split_backward;
  };
  for (const Mode mode : {Mode{false, false, false}, Mode{false, true, false}, Mode{false, true, true},
                          Mode{true, false, false}, Mode{true, true, false}, Mode{true, true, true}})
    for (int k : {1, 2, 4}) {
      const bool sp = mode.sp;
      comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                   [&](comm::Communicator& world) {
                     SplitGpt split(base, world, sp, mode.overlap);
                     GPT& tp = split.gpt;
                     VocabParallelCrossEntropy& vce = split.vce;
                     const TensorParallelGroup& group = tp.config().tensor;
                     ASSERT_EQ(tp.vocab_shard().begin, vce.shard().begin);
                     const double got = vce.forward(tp.forward(x), y);
                     if (mode.split_backward) {
                       tp.backward_input(vce.backward(), tp.own_saved());
                       tp.backward_weight(tp.own_saved());
                     } else {
                       tp.backward(vce.backward());
                     }
                     EXPECT_NEAR(got, want, 1e-5 * want)
                         << "k " << k << " sp " << sp << " overlap " << mode.overlap << " split " << mode.split_backward;
                     std::vector<Parameter*> ps = tp.parameters();
                     std::vector<std::string> partial;
                     for (const Parameter* p : ps)
                       if (p->sequence_parallel) partial.push_back(p->name);
                     // LayerNorms (2 per block and ln_f), the row-parallel biases, wpe.
                     EXPECT_EQ(partial.size(), sp && k > 1 ? 4u * base.layers + 2 * base.layers + 2 + 1 : 0u);
                     reduce_sequence_parallel_grads(ps, partial, group);
                     ASSERT_EQ(ps.size(), rp.size());
                     for (size_t i = 0; i < ps.size(); ++i) {
                       ASSERT_EQ(ps[i]->name, rp[i]->name);
                       const Placement& pl = ps[i]->placement;
                       std::vector<float> init(static_cast<size_t>(rp[i]->value.numel()));
                       rp[i]->init(0, static_cast<int64_t>(init.size()), init.data());
                       const Tensor whole = Tensor::from_vector(std::vector<double>(init.begin(), init.end()), rp[i]->info.shape);
                       ASSERT_EQ(ps[i]->value.to_vector(), block_of(whole, pl)) << ps[i]->name << " k " << k;
                       expect_near(ps[i]->grad.to_vector(), block_of(rp[i]->grad, pl), 1e-5,
                                   fmt::format("k {} sp {} overlap {} split {} {} grad", k, sp, mode.overlap,
                                               mode.split_backward, ps[i]->name));
                     }
                   });
    }
  // Communication of one step on 2 ranks, counted by the communicator:
  // Megatron's 4 all-reduces of N x C floats per layer (forward: both
  // row-parallel outputs; backward: both column-parallel input gradients),
  // one more each for the vocabulary-parallel embedding (forward) and the
  // tied head's input gradient (backward), and the loss's row maxima (N
  // floats) and sums (2N doubles). With sequence parallelism each of those
  // N x C all-reduces becomes a reduce-scatter and an all-gather sits at the
  // other end of its region (4 + 4 per layer, one more each for the
  // embedding and the head), each of N x C / k floats per rank: the same
  // bytes on the wire (a ring all-reduce sends 2 (k-1)/k N C per rank).
  // With overlap, the blocks' rings carry the same bytes point to point
  // (k = 2: one step of N x C / 2 floats each way per boundary), but for
  // the embedding's and the head's collectives.
  for (const bool overlap : {false, true})
    comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
                 [&](comm::Communicator& world) {
                   SplitGpt split(base, world, true, overlap);
                   GPT& tp = split.gpt;
                   VocabParallelCrossEntropy& vce = split.vce;
                   world.reset_traffic();
                   vce.forward(tp.forward(x), y);
                   tp.backward(vce.backward());
                   const uint64_t n = 16, width = 16, layers = 2, regions = 4 * layers + 2;
                   const comm::TrafficCounter& ag = world.traffic(comm::CollectiveOp::all_gather);
                   const comm::TrafficCounter& rs = world.traffic(comm::CollectiveOp::reduce_scatter);
                   const comm::TrafficCounter& send = world.traffic(comm::CollectiveOp::send);
                   EXPECT_EQ(ag.bytes + rs.bytes + send.bytes, 2 * regions * n * width * 4 / 2);
                   EXPECT_EQ(ag.calls + rs.calls, overlap ? 4u : 2 * regions);
                   EXPECT_EQ(send.calls, overlap ? 2 * regions - 4 : 0u);
                 });
  for (bool sp : {false, true})
    comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
                 [&](comm::Communicator& world) {
                   SplitGpt split(base, world, sp);
                   GPT& tp = split.gpt;
                   VocabParallelCrossEntropy& vce = split.vce;
                   world.reset_traffic();
                   vce.forward(tp.forward(x), y);
                   tp.backward(vce.backward());
                   const uint64_t n = 16, width = 16, layers = 2, regions = 4 * layers + 2;
                   const comm::TrafficCounter& ar = world.traffic(comm::CollectiveOp::all_reduce);
                   const comm::TrafficCounter& ag = world.traffic(comm::CollectiveOp::all_gather);
                   const comm::TrafficCounter& rs = world.traffic(comm::CollectiveOp::reduce_scatter);
                   const uint64_t loss_bytes = n * 4 + 2 * n * 8;
                   if (!sp) {
                     EXPECT_EQ(ar.calls, regions + 2);
                     EXPECT_EQ(ar.bytes, regions * n * width * 4 + loss_bytes);
                     EXPECT_EQ(ag.calls + rs.calls, 0u);
                   } else {
                     EXPECT_EQ(ar.calls, 2u);
                     EXPECT_EQ(ar.bytes, loss_bytes);
                     EXPECT_EQ(ag.calls, regions);
                     EXPECT_EQ(rs.calls, regions);
                     EXPECT_EQ(ag.bytes, regions * n * width * 4 / 2);
                     EXPECT_EQ(rs.bytes, regions * n * width * 4 / 2);
                   }
                 });
  // Sequence parallelism pads a length the axis does not divide (T = 7
  // over 2 ranks) to 8: the same logits in evaluation, and in training
  // with dropout (the masks are numbered by the real length, so each rank
  // draws one device's masks for its real steps).
  const Tensor x7 = x.narrow(1, 0, 7).contiguous();
  ref.set_batch_context(3, 0);
  const std::vector<double> want7_train = ref.forward(x7).to_vector();
  ref.set_training(false);
  const std::vector<double> want7 = ref.forward(x7).to_vector();
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 GPTConfig c = base;
                 c.tensor = TensorParallelGroup{&world, true};
                 GPT tp(c);
                 tp.set_batch_context(3, 0);
                 const ShardRange v = tp.vocab_shard();
                 const auto mine = [&](const std::vector<double>& all) {
                   return Tensor::from_vector(all, {14, 13}).narrow(1, v.begin, v.size()).contiguous().to_vector();
                 };
                 expect_near(tp.forward(x7).to_vector(), mine(want7_train), 1e-5, "padded T = 7, dropout");
                 tp.set_training(false);
                 const Tensor z = tp.forward(x7);  // (14, this rank's vocabulary columns)
                 expect_near(z.to_vector(), mine(want7), 1e-5, "padded T = 7");
               });
  comm::launch({.engine = comm::Engine::threads, .ranks = 3, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 GPTConfig c = base;
                 c.tensor = TensorParallelGroup{&world};
                 EXPECT_THAT(testing::error_of([&] { GPT bad(c); }),
                             ::testing::HasSubstr("4 heads over a tensor-parallel axis of 3 ranks"));
               });
}

// The seeds' API describes the runtime: for every parameter of a GPT split
// over 2 and 4 ranks (vocabulary 13: uneven), MultiDimensionalStrategy's
// spec for the unsharded parameter, laid out over the tensor axis
// (sharding::Layout), gives exactly the block each rank's Parameter holds.
TEST(TensorParallelGpt, StrategyLayoutsAreWhatTheRanksHold) {
  const GPTConfig base{.vocab = 13, .block_size = 8, .layers = 1, .heads = 4, .width = 16, .seed = 7, .defer_init = true};
  GPT whole(base);
  const std::vector<Parameter*> wp = whole.parameters();
  for (int k : {2, 4}) {
    const sharding::MultiDimensionalStrategy md(
        {std::make_shared<sharding::TensorParallelStrategy>("tensor", k, /*uneven=*/true)}, {"tensor"});
    comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                 [&](comm::Communicator& world) {
                   GPTConfig c = base;
                   c.tensor = TensorParallelGroup{&world};
                   GPT tp(c);
                   const std::vector<Parameter*> ps = tp.parameters();
                   ASSERT_EQ(ps.size(), wp.size());
                   int split = 0;
                   for (size_t i = 0; i < ps.size(); ++i) {
                     const sharding::ParamInfo info = wp[i]->info.layout();
                     const sharding::Layout layout({k}, {"tensor"}, md.combined_spec(wp[i]->info), info.shape);
                     const sharding::Box want = layout.local_box(world.rank());
                     const Placement& pl = ps[i]->placement;
                     if (!pl.is_block()) {
                       EXPECT_EQ(want.sizes, info.shape) << ps[i]->name;  // replicated: the whole view
                     } else {
                       ++split;
                       EXPECT_EQ(pl.box.to_string(), want.to_string()) << ps[i]->name << " rank " << world.rank();
                       EXPECT_EQ(pl.view_shape(), info.shape) << ps[i]->name;
                     }
                   }
                   EXPECT_EQ(split, 7);  // wte; c_attn, mlp.c_fc (weights, biases); both c_proj weights
                 });
  }
}

// nn::functional's op profile times every tensor-parallel collective of a
// GPT step (`meshtrain bench gpt --mesh tensor=2`'s communication share):
// one "tp ..." call per collective the communicator counts, by the formula
// of the traffic test above; the sequence-parallel gradient sum as its own
// entry; nothing on a group of one rank.
TEST(TensorParallelGpt, ProfileTimesEveryCollective) {
  const GPTConfig base{.vocab = 13, .block_size = 8, .layers = 3, .heads = 4, .width = 16, .seed = 7};
  std::vector<int64_t> ids(2 * 8), next(2 * 8);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i * 5 % 13), next[i] = static_cast<int64_t>((i * 7 + 3) % 13);
  const Tensor x = Tensor::from_vector(ids, {2, 8}), y = Tensor::from_vector(next, {16});
  const auto calls = [](const std::vector<functional::OpTime>& profile, const std::string& op) {
    for (const functional::OpTime& t : profile)
      if (t.op == op) return t.calls;
    return int64_t{0};
  };
  for (bool sp : {false, true})
    for (int k : {1, 2}) {
      comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                   [&](comm::Communicator& world) {
                     GPTConfig c = base;
                     c.tensor = TensorParallelGroup{&world, sp};
                     GPT tp(c);
                     VocabParallelCrossEntropy vce(c.tensor, c.vocab);
                     std::vector<std::string> partial;
                     for (const Parameter* p : tp.parameters())
                       if (p->sequence_parallel) partial.push_back(p->name);
                     world.reset_traffic();
                     functional::reset_op_profile();
                     functional::set_op_profiling(true);
                     vce.forward(tp.forward(x), y);
                     tp.backward(vce.backward());
                     reduce_sequence_parallel_grads(tp.parameters(), partial, c.tensor);
                     functional::set_op_profiling(false);
                     const std::vector<functional::OpTime> profile = functional::op_profile();
                     functional::reset_op_profile();
                     const std::string what = fmt::format("k {} sp {} rank {}", k, sp, world.rank());
                     const int64_t regions = 4 * base.layers + 2;  // 4 per layer, the embedding, the head
                     const int64_t ar = calls(profile, "tp all_reduce"), ag = calls(profile, "tp all_gather"),
                                   rs = calls(profile, "tp reduce_scatter"),
                                   grads = calls(profile, "tp grad all_reduce");
                     if (k == 1) {
                       for (const functional::OpTime& t : profile)
                         EXPECT_NE(t.op.rfind("tp ", 0), 0u) << what << ": " << t.op;
                       return;
                     }
                     // The loss's two all-reduces (row maxima, sums) in both modes.
                     EXPECT_EQ(ar, sp ? 2 : regions + 2) << what;
                     EXPECT_EQ(ag, sp ? regions : 0) << what;
                     EXPECT_EQ(rs, sp ? regions : 0) << what;
                     EXPECT_EQ(grads, sp ? 1 : 0) << what;
                     EXPECT_EQ(static_cast<uint64_t>(ar + grads), world.traffic(comm::CollectiveOp::all_reduce).calls)
                         << what;
                     EXPECT_EQ(static_cast<uint64_t>(ag), world.traffic(comm::CollectiveOp::all_gather).calls) << what;
                     EXPECT_EQ(static_cast<uint64_t>(rs), world.traffic(comm::CollectiveOp::reduce_scatter).calls)
                         << what;
                   });
    }
}

// Logits (N, V): N(0, 3) with row i's maximum (+20) at column (i * 7919) % V,
// so the maxima fall on every rank's shard.
Tensor logits(int64_t n, int64_t v) {
  Tensor z = Tensor::empty({n, v}, DType::f32);
  fill_normal(z, 3, key_from_name("vp.logits"), 0.0, 3.0);
  for (int64_t i = 0; i < n; ++i) z.data<float>()[i * v + (i * 7919) % v] = 20.0f;
  return z;
}

Tensor labels(int64_t n, int64_t v) {
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = (i * 31 + 5) % v;
  return Tensor::from_vector(y, {n});
}

TEST(VocabParallelCrossEntropy, EqualsThePlainLossOnAnySplit) {
  for (int64_t v : {int64_t{13}, int64_t{100}, int64_t{1001}})
    for (int k : {1, 2, 3, 4}) {
      const int64_t n = 37;
      const Tensor z = logits(n, v), y = labels(n, v);
      MemoryTracker plain_mem;
      CrossEntropyLoss ce;
      const double want = ce.forward(z, y, /*normalizer=*/50.0);
      const std::vector<double> want_grad = ce.backward(2.0).to_vector();
      std::mutex mu;
      std::vector<double> losses(static_cast<size_t>(k));
      std::vector<uint64_t> kept(static_cast<size_t>(k));
      comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
                   [&](comm::Communicator& world) {
                     MemoryTracker mem;
                     VocabParallelCrossEntropy vp(TensorParallelGroup{&world}, v, &mem);
                     const ShardRange s = vp.shard();
                     const Tensor local = z.narrow(1, s.begin, s.size()).contiguous();
                     const double got = vp.forward(local, y, 50.0);
                     const std::vector<double> g = vp.backward(2.0).to_vector();
                     std::lock_guard lock(mu);
                     losses[static_cast<size_t>(world.rank())] = got;
                     kept[static_cast<size_t>(world.rank())] = mem.in_use(MemoryCategory::activations);
                     for (int64_t i = 0; i < n; ++i)
                       for (int64_t c = 0; c < s.size(); ++c)
                         ASSERT_NEAR(g[static_cast<size_t>(i * s.size() + c)],
                                     want_grad[static_cast<size_t>(i * v + s.begin + c)], 1e-6)
                             << "V " << v << " k " << k << " row " << i << " column " << s.begin + c;
                   });
      for (int r = 0; r < k; ++r) {
        EXPECT_NEAR(losses[static_cast<size_t>(r)], want, 1e-6 * std::fabs(want)) << "V " << v << " k " << k;
        // probabilities and gradient: 2 x N x shard floats, a k-th of 2 x N x V
        const ShardRange s = shard_range(v, r, k);
        EXPECT_EQ(kept[static_cast<size_t>(r)], static_cast<uint64_t>(2 * n * s.size() * 4)) << "rank " << r;
      }
    }
}

TEST(VocabParallelCrossEntropy, RefusesLogitsOfAnotherShardAndBadLabels) {
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 VocabParallelCrossEntropy vp(TensorParallelGroup{&world}, 11, nullptr);
                 // Rank 0 holds ids [0, 6), rank 1 [6, 11).
                 EXPECT_THAT(testing::error_of([&] { vp.forward(Tensor::zeros({3, 11}, DType::f32), labels(3, 11)); }),
                             ::testing::HasSubstr(world.rank() == 0 ? "whose vocabulary shard is ids [0, 6) of 11"
                                                                    : "whose vocabulary shard is ids [6, 11) of 11"));
                 const int64_t w = vp.shard().size();
                 EXPECT_THAT(testing::error_of([&] {
                               vp.forward(Tensor::zeros({1, w}, DType::f32), Tensor::from_vector(std::vector<int64_t>{11}, {1}));
                             }),
                             ::testing::HasSubstr("label 11 of row 0 is outside [0, 11)"));
               });
}

}  // namespace
}  // namespace meshtrain::nn
