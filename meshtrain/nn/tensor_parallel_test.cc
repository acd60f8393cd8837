// Tensor-parallel building blocks on the threads engine (1 to 4 ranks,
// vocabularies that do not divide): the shard rule, and the
// vocabulary-parallel cross-entropy against CrossEntropyLoss on the whole
// logits: loss and every rank's gradient slice within 1e-6, with each row's
// maximum placed on a different rank, while each rank keeps 1/k of the
// plain loss's probabilities (MemoryTracker).
#include "meshtrain/nn/tensor_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::nn {
namespace {

TEST(ShardRange, FollowsTorchChunk) {
  EXPECT_EQ(shard_range(5, 0, 4).size(), 2);
  EXPECT_EQ(shard_range(5, 2, 4).begin, 4);
  EXPECT_EQ(shard_range(5, 2, 4).size(), 1);
  EXPECT_EQ(shard_range(5, 3, 4).size(), 0);
  EXPECT_EQ(shard_range(50257, 1, 2).begin, 25129);
  EXPECT_EQ(shard_range(50257, 1, 2).end, 50257);
  EXPECT_THAT(testing::error_of([] { shard_range(4, 2, 2); }), ::testing::HasSubstr("rank 2 of 2"));
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
