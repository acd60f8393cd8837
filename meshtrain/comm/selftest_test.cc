// The self-test's expected values against the engines' reduction kernel, for
// rank counts far beyond what a test can launch (issue 9: 17..64 ranks
// overflowed a fixed array, 128 overflowed the expected product).
#include "meshtrain/comm/selftest.h"

#include <gtest/gtest.h>

#include <cstring>
#include <mutex>

#include "meshtrain/comm/internal/reduce.h"
#include "meshtrain/comm/launch.h"

namespace meshtrain::comm {
namespace {

TEST(SelfTestExpectations, MatchTheReductionKernelForAnyRankCount) {
  constexpr size_t kCount = 20;  // two periods of the input pattern
  for (int n : {1, 2, 3, 8, 17, 64, 127, 128, 129, 255, 256, 300, 1024}) {
    for (DType t : kAllDTypes) {
      for (ReduceOp op : kAllReduceOps) {
        std::vector<std::vector<std::byte>> inputs;
        std::vector<const void*> ins;
        for (int r = 0; r < n; ++r) inputs.push_back(internal::suite_input(t, op, r, kCount));
        for (const auto& in : inputs) ins.push_back(in.data());
        std::vector<std::byte> got(kCount * dtype_size(t));
        void* outs[] = {got.data()};
        comm::internal::reduce(outs, 1, ins.data(), n, kCount, t, op, n);
        const auto want = internal::suite_expected(t, op, n, kCount);
        ASSERT_EQ(got, want) << n << " ranks, " << dtype_name(t) << " " << reduce_op_name(op);
      }
    }
  }
}

// A world of more than 16 ranks splits into halves of more than 8 (the
// split check gathered into an 8-element array).
TEST(SelfTest, SeventeenRanksPass) {
  size_t checks = 0;
  std::mutex mu;
  launch({.engine = Engine::threads, .ranks = 17, .timeout = std::chrono::seconds(60)}, [&](Communicator& c) {
    const size_t n = run_collective_suite(c, {.sizes = {0, 3}});
    std::lock_guard l(mu);
    checks += n;
  });
  EXPECT_GT(checks, 0u);
}

}  // namespace
}  // namespace meshtrain::comm
