// The collective suite on the threads engine, 1..8 ranks.
#include <gtest/gtest.h>

#include <atomic>

#include "meshtrain/comm/selftest.h"
#include "meshtrain/comm/launch.h"

namespace meshtrain::comm {
namespace {

class ThreadsCollectives : public ::testing::TestWithParam<int> {};

TEST_P(ThreadsCollectives, SuitePasses) {
  const int n = GetParam();
  std::atomic<size_t> checks{0};
  comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(60)},
               [&](comm::Communicator& c) { checks += comm::run_collective_suite(c); });
  EXPECT_GT(checks.load(), 100u * n);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ThreadsCollectives, ::testing::Range(1, 9),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// Results are bit-identical across runs (fixed reduction order) even for
// values whose sum depends on the order.
TEST(ThreadsDeterminism, SameBitsEveryRun) {
  constexpr size_t kCount = 300'000;
  std::vector<std::vector<float>> results;
  for (int run = 0; run < 3; ++run) {
    std::vector<float> out0;
    comm::launch({.engine = comm::Engine::threads, .ranks = 3}, [&](comm::Communicator& c) {
      std::vector<float> v(kCount);
      for (size_t i = 0; i < kCount; ++i) v[i] = 1.0f / static_cast<float>(i + 1 + c.rank() * 7919);
      c.all_reduce(v.data(), v.data(), kCount, DType::f32, comm::ReduceOp::sum);
      if (c.rank() == 0) out0 = v;
    });
    results.push_back(out0);
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
  // Rank order: ((a0 + a1) + a2), exactly.
  for (size_t i : {size_t{0}, size_t{12345}, kCount - 1}) {
    float a0 = 1.0f / static_cast<float>(i + 1), a1 = 1.0f / static_cast<float>(i + 1 + 7919),
          a2 = 1.0f / static_cast<float>(i + 1 + 2 * 7919);
    EXPECT_EQ(results[0][i], (a0 + a1) + a2) << i;
  }
}

}  // namespace
}  // namespace meshtrain::comm
