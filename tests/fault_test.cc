// Fault tests on the threads engine: a rank that stalls, returns early, calls
// a different collective, or throws. The others must get a clear error naming
// it within 2x the deadline, and the process must never hang (ctest enforces a
// timeout on the whole binary as well).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"

namespace meshtrain::testing {
namespace {

using namespace std::chrono_literals;
using comm::Communicator;
using comm::ReduceOp;
using Clock = std::chrono::steady_clock;

constexpr auto kDeadline = 500ms;

struct Outcome {
  std::string what;
  std::vector<int> ranks;
  std::string kind;
  Clock::duration elapsed{};
};

// Runs fn on n ranks; records each rank's error (if any) and time to fail.
std::vector<Outcome> run(int n, const std::function<void(Communicator&)>& fn) {
  std::vector<Outcome> out(n);
  try {
    comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = kDeadline}, [&](Communicator& c) {
      const auto t0 = Clock::now();
      try {
        fn(c);
      } catch (const TimeoutError& e) {
        out[c.rank()] = {e.what(), e.ranks(), "timeout", Clock::now() - t0};
        throw;
      } catch (const MismatchError& e) {
        out[c.rank()] = {e.what(), e.ranks(), "mismatch", Clock::now() - t0};
        throw;
      } catch (const AbortedError& e) {
        out[c.rank()] = {e.what(), e.ranks(), "aborted", Clock::now() - t0};
        throw;
      } catch (const std::exception& e) {
        out[c.rank()] = {e.what(), {}, "other", Clock::now() - t0};
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  return out;
}

TEST(Fault, StalledRankTimesOutNamingIt) {
  auto out = run(4, [](Communicator& c) {
    float x = 1;
    c.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
    if (c.rank() == 2) std::this_thread::sleep_for(3 * kDeadline);  // stall past the deadline
    c.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
  });
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(out[r].kind, "timeout") << out[r].what;
    EXPECT_EQ(out[r].ranks, std::vector<int>{2}) << out[r].what;
    EXPECT_NE(out[r].what.find("all_reduce #2"), std::string::npos) << out[r].what;
    EXPECT_NE(out[r].what.find("rank 2 did not arrive"), std::string::npos) << out[r].what;
    EXPECT_LT(out[r].elapsed, 2 * kDeadline);
  }
  // The late rank learns it was late instead of touching buffers of ranks that left.
  EXPECT_EQ(out[2].kind, "aborted") << out[2].what;
  EXPECT_NE(out[2].what.find("arrived after its peers gave up"), std::string::npos) << out[2].what;
}

TEST(Fault, LargeMessageStallTimesOut) {
  auto out = run(2, [](Communicator& c) {
    std::vector<float> v(1 << 20, 1.0f);
    if (c.rank() == 1) std::this_thread::sleep_for(3 * kDeadline);
    c.all_reduce(v.data(), v.data(), v.size(), DType::f32, ReduceOp::sum);
  });
  EXPECT_EQ(out[0].kind, "timeout") << out[0].what;
  EXPECT_EQ(out[0].ranks, std::vector<int>{1});
  EXPECT_EQ(out[1].kind, "aborted") << out[1].what;
}

TEST(Fault, SkippedCollectiveAndReturnNamesTheRank) {
  auto out = run(3, [](Communicator& c) {
    float x = 1;
    if (c.rank() == 1) return;  // skips the collective and leaves
    c.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
  });
  for (int r : {0, 2}) {
    EXPECT_EQ(out[r].kind, "aborted") << out[r].what;
    EXPECT_EQ(out[r].ranks, std::vector<int>{1}) << out[r].what;
    EXPECT_NE(out[r].what.find("rank 1 already returned"), std::string::npos) << out[r].what;
    EXPECT_LT(out[r].elapsed, kDeadline);  // no need to wait out the deadline
  }
}

TEST(Fault, SkippedCollectiveThenNextOneIsAMismatch) {
  auto out = run(2, [](Communicator& c) {
    std::vector<float> v(10, 1.0f);
    if (c.rank() == 0) c.all_reduce(v.data(), v.data(), 10, DType::f32, ReduceOp::sum);
    c.broadcast(v.data(), 10, DType::f32, 0);
  });
  for (int r : {0, 1}) {
    EXPECT_EQ(out[r].kind, "mismatch") << out[r].what;
    EXPECT_NE(out[r].what.find("all_reduce #1 (f32 x 10, sum)"), std::string::npos) << out[r].what;
    EXPECT_NE(out[r].what.find("broadcast #1 (f32 x 10, root 0)"), std::string::npos) << out[r].what;
    EXPECT_LT(out[r].elapsed, kDeadline);
  }
}

TEST(Fault, MismatchedCountDtypeAndRootAreCaught) {
  struct Case {
    std::function<void(Communicator&, std::vector<float>&)> call;
    std::string needle;
  };
  std::vector<Case> cases = {
      {[](Communicator& c, auto& v) { c.all_reduce(v.data(), v.data(), c.rank() ? 9 : 10, DType::f32, ReduceOp::sum); },
       "f32 x 9"},
      {[](Communicator& c, auto& v) { c.all_reduce(v.data(), v.data(), 4, c.rank() ? DType::i32 : DType::f32, ReduceOp::sum); },
       "i32 x 4"},
      {[](Communicator& c, auto& v) { c.all_reduce(v.data(), v.data(), 4, DType::f32, c.rank() ? ReduceOp::max : ReduceOp::sum); },
       "max"},
      {[](Communicator& c, auto& v) { c.broadcast(v.data(), 4, DType::f32, c.rank()); }, "root 1"},
      {[](Communicator& c, auto& v) { c.all_reduce(v.data(), v.data(), c.rank() ? 20000 : 20001, DType::f32, ReduceOp::sum); },
       "f32 x 20000"},
  };
  for (auto& k : cases) {
    auto out = run(2, [&](Communicator& c) {
      std::vector<float> v(40000, 1.0f);
      k.call(c, v);
    });
    for (int r : {0, 1}) {
      EXPECT_EQ(out[r].kind, "mismatch") << out[r].what;
      EXPECT_NE(out[r].what.find(k.needle), std::string::npos) << out[r].what;
    }
  }
}

TEST(Fault, ThrowingRankAbortsPeersAndLaunchRethrowsTheCause) {
  std::vector<Outcome> out(4);
  std::string rethrown;
  const auto t0 = Clock::now();
  try {
    comm::launch({.engine = comm::Engine::threads, .ranks = 4, .timeout = kDeadline}, [&](Communicator& c) {
      float x = 1;
      if (c.rank() == 3) throw std::runtime_error("boom in user code");
      try {
        c.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
      } catch (const AbortedError& e) {
        out[c.rank()] = {e.what(), e.ranks(), "aborted", Clock::now() - t0};
        throw;
      }
    });
  } catch (const std::exception& e) {
    rethrown = e.what();
  }
  EXPECT_EQ(rethrown, "boom in user code");
  for (int r : {0, 1, 2}) {
    EXPECT_EQ(out[r].kind, "aborted") << out[r].what;
    EXPECT_EQ(out[r].ranks, std::vector<int>{3});
    EXPECT_NE(out[r].what.find("boom in user code"), std::string::npos) << out[r].what;
    EXPECT_LT(out[r].elapsed, kDeadline);
  }
}

TEST(Fault, CommunicatorIsUnusableAfterAnError) {
  auto out = run(2, [](Communicator& c) {
    float x = 1;
    try {
      c.all_reduce(&x, &x, 1, c.rank() ? DType::f32 : DType::i32, ReduceOp::sum);
    } catch (const MismatchError&) {
    }
    c.barrier();
  });
  for (int r : {0, 1}) {
    EXPECT_EQ(out[r].kind, "aborted") << out[r].what;
    EXPECT_NE(out[r].what.find("aborted earlier"), std::string::npos) << out[r].what;
  }
}

TEST(Fault, UnmatchedRecvTimesOutNamingThePeer) {
  auto out = run(2, [](Communicator& c) {
    float x = 0;
    if (c.rank() == 0) c.recv(&x, 1, DType::f32, 1, 5);
    else std::this_thread::sleep_for(2 * kDeadline);
  });
  EXPECT_EQ(out[0].kind, "timeout") << out[0].what;
  EXPECT_EQ(out[0].ranks, std::vector<int>{1});
  EXPECT_NE(out[0].what.find("recv from rank 1"), std::string::npos) << out[0].what;
  EXPECT_LT(out[0].elapsed, 2 * kDeadline);
}

TEST(Fault, SendRecvCountMismatch) {
  auto out = run(2, [](Communicator& c) {
    std::vector<float> v(8);
    if (c.rank() == 0) c.send(v.data(), 8, DType::f32, 1, 0);
    else c.recv(v.data(), 4, DType::f32, 0, 0);
  });
  for (int r : {0, 1}) EXPECT_EQ(out[r].kind, "mismatch") << out[r].what;
}

TEST(Fault, InvalidArgumentsAreRejectedBeforeAnyCommunication) {
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = kDeadline}, [](Communicator& c) {
    float x[4] = {};
    EXPECT_THROW(c.broadcast(x, 1, DType::f32, 2), InvalidArgument);
    EXPECT_THROW(c.send(x, 1, DType::f32, c.rank(), 0), InvalidArgument);
    EXPECT_THROW(c.send(x, 1, DType::f32, 1 - c.rank(), -1), InvalidArgument);
    EXPECT_THROW(c.all_to_all(x, x, 2, DType::f32), InvalidArgument);
    EXPECT_THROW(c.all_reduce(x, x + 1, 2, DType::f32, ReduceOp::sum), InvalidArgument);
    c.barrier();  // still usable
  });
}

}  // namespace
}  // namespace meshtrain::testing
