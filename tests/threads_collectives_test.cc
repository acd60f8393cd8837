// The collective suite on the threads engine, 1..8 ranks.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

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

// split's barrier has the communicator's deadline, counted from the call:
// a split that is the first call of a communicator, or comes long after the
// last collective, waits for a late rank instead of timing out at once.
TEST(ThreadsSplit, WaitsForALateRankWithItsOwnDeadline) {
  std::atomic<int> sizes{0};
  comm::launch({.engine = comm::Engine::threads, .ranks = 3, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& c) {
                 if (c.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                 auto sub = c.split(0, c.rank());  // the first call: no earlier deadline exists
                 sizes += sub->size();
                 int v = 1;
                 c.all_reduce(&v, &v, 1, DType::i32, comm::ReduceOp::sum);
                 if (c.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                 auto again = c.split(c.rank() % 2, 0);  // long after the all_reduce's deadline began
                 sizes += again->size();
               });
  EXPECT_EQ(sizes.load(), 3 * 3 + (2 + 1 + 2));
}

}  // namespace
}  // namespace meshtrain::comm
