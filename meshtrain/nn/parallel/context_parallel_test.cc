#include "meshtrain/nn/parallel/context_parallel.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <string>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/testing/grad_check.h"

namespace meshtrain::nn {
namespace {

namespace F = functional;
using ::testing::HasSubstr;
using meshtrain::testing::random_tensor;

double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

constexpr int64_t kB = 2, kD = 8;

// (B, H, T, D) <-> the chunk-major (P, B, H, c, D) a rank computes on.
Tensor to_chunk_major(const Tensor& local, int64_t p) {  // local (B, H, P c, D)
  const int64_t c = local.size(2) / p;
  Tensor out = Tensor::empty({p, local.size(0), local.size(1), c, local.size(3)}, DType::f32);
  for (int64_t i = 0; i < p; ++i) out.select(0, i).copy_from(local.narrow(2, i * c, c));
  return out;
}
Tensor from_chunk_major(const Tensor& x) {  // (P, B, H, c, D) -> (B, H, P c, D)
  const int64_t p = x.size(0), c = x.size(3);
  Tensor out = Tensor::empty({x.size(1), x.size(2), p * c, x.size(4)}, DType::f32);
  for (int64_t i = 0; i < p; ++i) out.narrow(2, i * c, c).copy_from(x.select(0, i));
  return out;
}

struct Case {
  int ranks;
  bool causal, load_balance;
  ContextComm kind;
  int64_t t;
  int64_t heads = 4;
  std::string name() const {
    return fmt::format("n={} {} {} {} T={} heads={}", ranks, causal ? "causal" : "full",
                       load_balance ? "zig-zag" : "in order", context_comm_name(kind), t, heads);
  }
};

// Every rank computes its chunks' attention and gradients; gathered back
// into sequence order they equal one device's over the whole sequence.
void expect_equals_one_device(const Case& cs) {
  SCOPED_TRACE(cs.name());
  const int64_t t = cs.t, kH = cs.heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  const Tensor q = random_tensor({kB, kH, t, kD}, 1), k = random_tensor({kB, kH, t, kD}, 2),
               v = random_tensor({kB, kH, t, kD}, 3), dout = random_tensor({kB, kH, t, kD}, 4);
  // One device.
  const int64_t rows = kB * kH;
  auto v3 = [&](const Tensor& x) { return x.view({rows, t, kD}); };
  Tensor out = Tensor::empty(q.shape(), DType::f32), lse = Tensor::empty({rows, t}, DType::f32);
  F::attention_forward(v3(q), v3(k), v3(v), cs.causal, scale, v3(out), lse);
  Tensor dq = Tensor::empty(q.shape(), DType::f32), dk = Tensor::empty(q.shape(), DType::f32),
         dv = Tensor::empty(q.shape(), DType::f32);
  F::attention_backward(v3(q), v3(k), v3(v), v3(out), lse, v3(dout), cs.causal, scale, v3(dq), v3(dk), v3(dv));

  std::mutex mu;
  Tensor got_out, got_dq, got_dk, got_dv;
  comm::launch({.engine = comm::Engine::threads, .ranks = cs.ranks, .timeout = std::chrono::seconds(60)},
               [&](comm::Communicator& world) {
                 const ContextParallelGroup g{&world, cs.kind, cs.load_balance};
                 const int64_t p = g.local_chunks();
                 auto mine = [&](const Tensor& x) { return to_chunk_major(shard_sequence(x, g, 2), p); };
                 ContextAttentionSaved saved;
                 const Tensor lo = context_attention_forward(g, mine(q), mine(k), mine(v), cs.causal, scale, saved);
                 const Tensor ldout = mine(dout);
                 Tensor ldq = Tensor::empty(ldout.shape(), DType::f32), ldk = Tensor::empty(ldout.shape(), DType::f32),
                        ldv = Tensor::empty(ldout.shape(), DType::f32);
                 context_attention_backward(g, ldout, cs.causal, scale, saved, ldq, ldk, ldv);
                 auto whole = [&](const Tensor& x) { return unshard_sequence(from_chunk_major(x), g, 2); };
                 Tensor o = whole(lo), a = whole(ldq), b = whole(ldk), c = whole(ldv);
                 if (world.rank() == 0) {
                   std::lock_guard lock(mu);
                   got_out = o, got_dq = a, got_dk = b, got_dv = c;
                 }
               });
  EXPECT_LT(max_abs_diff(got_out, out), 1e-5);
  EXPECT_LT(max_abs_diff(got_dq, dq), 1e-5);
  EXPECT_LT(max_abs_diff(got_dk, dk), 1e-5);
  EXPECT_LT(max_abs_diff(got_dv, dv), 1e-5);
}

TEST(ContextAttention, RingEqualsOneDeviceForwardAndBackward) {
  for (int n : {2, 4, 8})
    for (bool causal : {true, false})
      for (bool lb : {true, false})
        expect_equals_one_device({n, causal, lb, ContextComm::ring, 2 * n * 9});  // chunks of 9 (or 18) steps
}

TEST(ContextAttention, AllToAllEqualsOneDeviceForwardAndBackward) {
  for (int n : {2, 4, 8})  // n heads: one per rank
    for (bool causal : {true, false})
      for (bool lb : {true, false})
        expect_equals_one_device({n, causal, lb, ContextComm::all_to_all, 2 * n * 9, /*heads=*/n});
}

TEST(ContextAttention, LongChunksCrossTheKernelsTileEdges) {
  expect_equals_one_device({2, true, true, ContextComm::ring, 4 * 70});  // 70-step chunks: past a 64-row tile
}

TEST(ContextAttention, ZigZagBalancesTheCausalWork) {
  // Chunk pairs attended per rank under the causal mask (a diagonal pair is
  // half a block): with zig-zag every rank does the same; in order the last
  // rank does 2n - 1 times the first.
  const int n = 4;
  comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 if (world.rank() != 0) return;
                 for (bool lb : {true, false}) {
                   const ContextParallelGroup g{&world, ContextComm::ring, lb};
                   std::vector<double> work;
                   for (int r = 0; r < n; ++r) {
                     double w = 0;
                     for (int64_t qa : g.chunk_ids(r))
                       for (int src = 0; src < n; ++src)
                         for (int64_t kb : g.chunk_ids(src)) w += kb < qa ? 1.0 : kb == qa ? 0.5 : 0.0;
                     work.push_back(w);
                   }
                   if (lb)
                     for (double w : work) EXPECT_EQ(w, work[0]);
                   else
                     EXPECT_EQ(work.back() / work.front(), 2.0 * n - 1);
                 }
               });
}

TEST(ContextAttention, ShardingLayoutPositionsAndErrors) {
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 const ContextParallelGroup g{&world};
                 EXPECT_EQ(g.chunks(), 4);
                 EXPECT_EQ(g.chunk_ids(world.rank()),
                           (world.rank() == 0 ? std::vector<int64_t>{0, 3} : std::vector<int64_t>{1, 2}));
                 // (1, 8) tokens 0..7: rank 0 holds chunks 0 and 3 (steps 0 1 6 7), rank 1 steps 2 3 4 5.
                 std::vector<float> ids;
                 for (int i = 0; i < 8; ++i) ids.push_back(static_cast<float>(i));
                 const Tensor x = Tensor::from_vector(ids, {1, 8});
                 const Tensor mine = shard_sequence(x, g);
                 const std::vector<double> want =
                     world.rank() == 0 ? std::vector<double>{0, 1, 6, 7} : std::vector<double>{2, 3, 4, 5};
                 EXPECT_EQ(mine.to_vector(), want);
                 const std::vector<int64_t> pos = sequence_positions(g, 8);
                 for (size_t i = 0; i < pos.size(); ++i) EXPECT_EQ(static_cast<double>(pos[i]), want[i]);
                 EXPECT_EQ(unshard_sequence(mine, g).to_vector(), x.to_vector());
                 // 10 steps do not cut into 4 chunks.
                 EXPECT_THAT([&] { g.check_length(10, "--seq-len"); },
                             ::testing::ThrowsMessage<InvalidArgument>(
                                 AllOf(HasSubstr("--seq-len"), HasSubstr("sequence length 10 is not divisible by 4"))));
                 // Ulysses needs whole heads per rank: 3 heads over 2 ranks.
                 const ContextParallelGroup u{&world, ContextComm::all_to_all};
                 const Tensor q = Tensor::zeros({2, 1, 3, 2, 4}, DType::f32);
                 ContextAttentionSaved saved;
                 EXPECT_THAT([&] { context_attention_forward(u, q, q, q, true, 1.0, saved); },
                             ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("3 heads on this rank do not split")));
               });
  EXPECT_EQ(parse_context_comm("all_to_all"), ContextComm::all_to_all);
  EXPECT_THAT([] { parse_context_comm("tree"); },
              ::testing::ThrowsMessage<InvalidArgument>(AllOf(HasSubstr("--cp-comm"), HasSubstr("'tree'"))));
}

TEST(ContextAttention, RingTrafficIsTheKeyValueBlocksAroundTheRing) {
  // Forward: n - 1 shifts of this rank's k and v; backward: n - 1 more,
  // plus n dK/dV shifts (the last hands each to its owner).
  const int n = 4;
  const int64_t t = 2 * n * 5;
  comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 const ContextParallelGroup g{&world};
                 const Tensor q = to_chunk_major(shard_sequence(random_tensor({kB, 4, t, kD}, 7), g, 2), 2);
                 const double before = static_cast<double>(world.traffic(comm::CollectiveOp::send).bytes);
                 ContextAttentionSaved saved;
                 const Tensor out = context_attention_forward(g, q, q, q, true, 0.5, saved);
                 const double block = 2.0 * static_cast<double>(q.numel()) * sizeof(float);  // k and v
                 EXPECT_EQ(static_cast<double>(world.traffic(comm::CollectiveOp::send).bytes) - before, (n - 1) * block);
                 Tensor d = Tensor::empty(q.shape(), DType::f32);
                 context_attention_backward(g, out, true, 0.5, saved, d, d.clone(), d.clone());
                 EXPECT_EQ(static_cast<double>(world.traffic(comm::CollectiveOp::send).bytes) - before,
                           (n - 1) * block + (n - 1) * block + n * block);
               });
}

}  // namespace
}  // namespace meshtrain::nn
