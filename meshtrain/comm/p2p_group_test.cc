// Grouped send/recv (Communicator::batch_isend_irecv) on the threads engine:
// ring exchanges on 1 to 8 ranks, pairwise swaps issued in opposite orders,
// and the errors. The mpi engine runs the same exchanges under mpirun
// (mpi/communicator_test.cc, test_p2p_group).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <numeric>

#include "meshtrain/comm/launch.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using meshtrain::testing::error_of;

void run(int n, const std::function<void(Communicator&)>& fn, std::chrono::milliseconds timeout = 30s) {
  launch({.engine = "threads", .ranks = n, .timeout = timeout}, fn);
}

// Rank r's value at index i: distinct for every (rank, index).
int64_t value(int r, size_t i) { return int64_t{r} * 1'000'003 + static_cast<int64_t>(i); }

TEST(P2PGroup, RingExchangeOnOneToEightRanks) {
  for (int n = 1; n <= 8; ++n) {
    std::atomic<int> checked{0};
    run(n, [&](Communicator& c) {
      const int r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
      // Two rounds of different sizes, to the next rank and back.
      for (size_t count : {size_t{1}, size_t{5000}}) {
        std::vector<int64_t> out(count), in(count, -1), back(count, -1);
        for (size_t i = 0; i < count; ++i) out[i] = value(r, i);
        Work w = c.batch_isend_irecv({P2POp::isend(out.data(), count, DType::i64, next),
                                      P2POp::irecv(in.data(), count, DType::i64, prev)});
        w.wait();
        EXPECT_TRUE(w.is_completed());
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(in[i], value(prev, i)) << "n " << n << " rank " << r << " i " << i;
        // The reverse ring, recv listed first.
        c.batch_isend_irecv({P2POp::irecv(back.data(), count, DType::i64, next, 7),
                             P2POp::isend(out.data(), count, DType::i64, prev, 7)})
            .wait();
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(back[i], value(next, i));
      }
      ++checked;
    });
    EXPECT_EQ(checked.load(), n);
  }
}

TEST(P2PGroup, PairwiseSwapInOppositeOrders) {
  // Two blocking sends would each wait for the other's recv; in a group the
  // order within each rank does not matter.
  run(2, [](Communicator& c) {
    const int r = c.rank(), peer = 1 - r;
    std::vector<float> out(300, static_cast<float>(r + 1)), in(300, 0);
    std::vector<P2POp> ops = {P2POp::isend(out.data(), out.size(), DType::f32, peer),
                              P2POp::irecv(in.data(), in.size(), DType::f32, peer)};
    if (r == 1) std::swap(ops[0], ops[1]);
    c.batch_isend_irecv(ops).wait();
    EXPECT_EQ(in, std::vector<float>(300, static_cast<float>(peer + 1)));
    // Several messages per pair, told apart by tag, posted in opposite tag
    // orders on the two sides.
    int32_t a = 10 * r + 1, b = 10 * r + 2, got_a = 0, got_b = 0;
    std::vector<P2POp> more = {P2POp::isend(&a, 1, DType::i32, peer, 1), P2POp::isend(&b, 1, DType::i32, peer, 2),
                               P2POp::irecv(&got_b, 1, DType::i32, peer, 2), P2POp::irecv(&got_a, 1, DType::i32, peer, 1)};
    if (r == 1) std::reverse(more.begin(), more.end());
    c.batch_isend_irecv(more).wait();
    EXPECT_EQ(got_a, 10 * peer + 1);
    EXPECT_EQ(got_b, 10 * peer + 2);
  });
}

TEST(P2PGroup, AllToAllPattern) {
  // Every rank exchanges with every rank, itself included, in one group: the
  // pattern of an all_to_all built from point-to-point messages.
  constexpr int n = 5;
  run(n, [](Communicator& c) {
    const int r = c.rank();
    std::vector<int64_t> out(n), in(n, -1);
    std::vector<P2POp> ops;
    for (int p = 0; p < n; ++p) {
      out[static_cast<size_t>(p)] = value(r, static_cast<size_t>(p));
      ops.push_back(P2POp::irecv(&in[static_cast<size_t>(p)], 1, DType::i64, p));
    }
    for (int p = n - 1; p >= 0; --p) ops.push_back(P2POp::isend(&out[static_cast<size_t>(p)], 1, DType::i64, p));
    c.batch_isend_irecv(ops).wait();
    for (int p = 0; p < n; ++p) EXPECT_EQ(in[static_cast<size_t>(p)], value(p, static_cast<size_t>(r)));
  });
}

TEST(P2PGroup, InvalidGroupsAreRefusedBeforeAnythingStarts) {
  run(2, [](Communicator& c) {
    float a[4], b[4];
    const std::string op = "Communicator::batch_isend_irecv";
    EXPECT_THAT(error_of([&] { (void)c.batch_isend_irecv({P2POp::isend(a, 4, DType::f32, 2)}); }),
                HasSubstr("op 0: peer 2 outside [0, 2)"));
    EXPECT_THAT(error_of([&] { (void)c.batch_isend_irecv({P2POp::irecv(b, 4, DType::f32, 0, -1)}); }),
                HasSubstr("tag -1 < 0"));
    EXPECT_THAT(error_of([&] {
                  (void)c.batch_isend_irecv(
                      {P2POp::isend(a, 4, DType::f32, 1 - c.rank()), P2POp::irecv(a + 2, 2, DType::f32, 1 - c.rank())});
                }),
                HasSubstr("op 1 (recv) overlaps op 0 (send)"));
    P2POp barrier = P2POp::isend(a, 1, DType::f32, 0);
    barrier.kind = CollectiveOp::barrier;
    EXPECT_THAT(error_of([&] { (void)c.batch_isend_irecv({barrier}); }), HasSubstr("is not send or recv"));
    EXPECT_TRUE(c.batch_isend_irecv({}).is_completed());
    // The communicator is still usable: nothing was started.
    int v = 1;
    c.all_reduce(&v, &v, 1, DType::i32, ReduceOp::sum);
    EXPECT_EQ(v, 2);
  });
}

TEST(P2PGroup, APeerThatNeverPostsTimesOutNamingIt) {
  std::atomic<int> timeouts{0};
  run(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) {
          std::this_thread::sleep_for(400ms);  // never posts; stays alive past rank 0's deadline
          return;
        }
        float out = 1, in = 0;
        const auto t0 = Clock::now();
        try {
          c.batch_isend_irecv({P2POp::isend(&out, 1, DType::f32, 1), P2POp::irecv(&in, 1, DType::f32, 1)}).wait();
        } catch (const TimeoutError& e) {
          EXPECT_THAT(e.what(), HasSubstr("rank 1 did not post the matching"));
          EXPECT_EQ(e.ranks(), std::vector<int>{1});
          ++timeouts;
        }
        // Both ops share the deadline: one timeout, not two in a row.
        EXPECT_LT(Clock::now() - t0, 350ms);
      },
      150ms);
  EXPECT_EQ(timeouts.load(), 1);
}

TEST(P2PGroup, DisagreeingCountsAreAMismatchOnBothSides) {
  std::atomic<int> mismatches{0};
  run(2, [&](Communicator& c) {
    float buf[8] = {};
    const int peer = 1 - c.rank();
    try {
      if (c.rank() == 0) c.batch_isend_irecv({P2POp::isend(buf, 8, DType::f32, peer)}).wait();
      else c.batch_isend_irecv({P2POp::irecv(buf, 4, DType::f32, peer)}).wait();
    } catch (const MismatchError& e) {
      EXPECT_THAT(e.what(), HasSubstr("disagree"));
      ++mismatches;
    }
  });
  EXPECT_EQ(mismatches.load(), 2);
}

// all_to_all_v on the threads engine (the collective suite checks its
// values on every engine): counts that disagree fail every rank with the
// same sentence before any data moves; bad arguments are refused up front.
TEST(AllToAllV, CountsThatDisagreeFailEveryRankNamingThePair) {
  std::atomic<int> failed{0};
  run(3, [&](Communicator& c) {
    std::vector<size_t> send(3, 2), recv(3, 2);
    if (c.rank() == 0) recv[1] = 3;
    std::vector<float> out(6, 1.0f), in(7);
    EXPECT_THAT(error_of<MismatchError>([&] { c.all_to_all_v(out.data(), send, in.data(), recv, DType::f32); }),
                HasSubstr("all_to_all_v #1 (f32, uneven): rank 1 sends 2 elements to rank 0, which expects 3"));
    ++failed;
  });
  EXPECT_EQ(failed.load(), 3);
  run(2, [](Communicator& c) {
    std::vector<float> buf(8);
    const std::vector<size_t> two = {1, 1}, three = {1, 1, 1}, self = {2, 1};
    EXPECT_THAT(error_of([&] { c.all_to_all_v(buf.data(), three, buf.data() + 4, two, DType::f32); }),
                HasSubstr("3 send counts and 2 recv counts for 2 ranks"));
    if (c.rank() == 0) {
      EXPECT_THAT(error_of([&] { c.all_to_all_v(buf.data(), self, buf.data() + 4, two, DType::f32); }),
                  HasSubstr("rank 0 sends itself 2 elements but expects 1"));
    }
    EXPECT_THAT(error_of([&] { c.all_to_all_v(buf.data(), two, buf.data() + 1, two, DType::f32); }),
                HasSubstr("send and recv overlap"));
    // Nothing was issued: a valid call still works (every count 0 included).
    const std::vector<size_t> none = {0, 0};
    c.all_to_all_v(nullptr, none, nullptr, none, DType::f32);
    std::vector<size_t> counts = all_to_all_counts(c, std::vector<size_t>{3, 5});
    EXPECT_EQ(counts, c.rank() == 0 ? (std::vector<size_t>{3, 3}) : (std::vector<size_t>{5, 5}));
  });
}

}  // namespace
}  // namespace meshtrain::comm
