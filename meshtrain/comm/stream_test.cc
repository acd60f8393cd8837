// Stream and Event on a CPU engine (threads): the host stream is the calling
// thread, so ordering a Work on it is waiting for it, and a Work's event
// completes with the Work, carrying its error.
#include "meshtrain/comm/stream.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/comm/work.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

TEST(Stream, HostStreamBasics) {
  const Stream host = Stream::host();
  EXPECT_TRUE(host.is_host());
  EXPECT_EQ(host.device(), Device::cpu());
  EXPECT_EQ(host.native_handle(), nullptr);
  EXPECT_TRUE(host.record().query());  // everything issued on the host so far has run
  host.synchronize();
  EXPECT_TRUE(Event{}.query());
  Event{}.synchronize();
  Work done;
  EXPECT_TRUE(done.event().query());
  done.wait(host);
  const Stream gpu(Device::cuda(0), nullptr);
  EXPECT_THAT(meshtrain::testing::error_of<Unsupported>([&] { gpu.wait(Event{}); }), HasSubstr("cuda:0"));
}

TEST(Stream, WaitingOnTheHostStreamWaitsForTheWork) {
  std::atomic<int> looked{0};
  launch({.engine = "threads", .ranks = 3, .timeout = 30s}, [&](Communicator& c) {
    EXPECT_FALSE(c.capabilities().stream_ordered);
    // Rank 0 joins only after the others looked at their events, which
    // cannot be complete before it joined.
    if (c.rank() == 0)
      while (looked.load() < 2) std::this_thread::sleep_for(1ms);
    std::vector<float> buf(100'000, static_cast<float>(c.rank() + 1));
    Work w = c.all_reduce_async(buf.data(), buf.data(), buf.size(), DType::f32, ReduceOp::sum);
    Event e = w.event();
    if (c.rank() != 0) {
      EXPECT_FALSE(e.query());
      ++looked;
    }
    w.wait(Stream::host());  // returns only once the result is there
    EXPECT_TRUE(e.query());
    EXPECT_TRUE(w.is_completed());
    EXPECT_EQ(buf.front(), 6.0f);
    EXPECT_EQ(buf.back(), 6.0f);
    e.synchronize();  // complete, no error: returns at once, as often as called
    e.synchronize();
    EXPECT_TRUE(w.event().query());  // an event taken after the wait
  });
}

TEST(Stream, AnEventCanBeWaitedForOnAnotherThread) {
  launch({.engine = "threads", .ranks = 2, .timeout = 30s}, [](Communicator& c) {
    ASSERT_TRUE(c.capabilities().wait_from_any_thread);
    int v = c.rank() + 1;
    Work w = c.all_reduce_async(&v, &v, 1, DType::i32, ReduceOp::sum);
    const Event e = w.event();
    std::atomic<bool> seen{false};
    std::thread consumer([&] {
      Stream::host().wait(e);  // the consumer's "stream" is its own thread
      seen = v == 3;
    });
    consumer.join();
    EXPECT_TRUE(seen.load());
    w.wait();  // already complete through the event
  });
}

TEST(Stream, TheEventCarriesTheOperationsError) {
  std::atomic<int> checked{0};
  launch({.engine = "threads", .ranks = 2, .timeout = 100ms}, [&](Communicator& c) {
    if (c.rank() == 1) {
      std::this_thread::sleep_for(300ms);  // never posts the matching send
      return;
    }
    float x = 0;
    Work w = c.recv_async(&x, 1, DType::f32, 1, 0);
    Event e = w.event();
    const Event copy = e;  // copies share the completion
    EXPECT_THROW(Stream::host().wait(e), TimeoutError);
    EXPECT_TRUE(copy.query());
    EXPECT_THROW(copy.synchronize(), TimeoutError);  // every time
    EXPECT_THROW(w.wait(), TimeoutError);            // and the Work too
    ++checked;
  });
  EXPECT_EQ(checked.load(), 1);
}

}  // namespace
}  // namespace meshtrain::comm
