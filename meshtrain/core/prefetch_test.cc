// prefetch_to_device tests: order and end, real overlap of producer and
// consumer, the bound on items ahead, exceptions delivered in place,
// destruction while the producer waits for room or is inside the source,
// the timeout, placement on the prefetch thread, and move-only items.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/testing/testing.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "meshtrain/core/error.h"
#include "meshtrain/core/prefetch.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Waits up to a second for pred() (the producer runs on another thread of a
// possibly busy machine).
template <class Pred>
bool eventually(Pred pred) {
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

// A source of 0, 1, ..., n-1 that counts its calls.
struct Counter {
  int n;
  std::atomic<int> calls{0};
  milliseconds delay{0};
  std::optional<int> operator()() {
    const int i = calls.fetch_add(1);
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (i >= n) return std::nullopt;
    return i;
  }
};

TEST(Prefetch, DeliversEveryItemInOrderThenTheEnd) {
  for (int buffer : {1, 2, 5}) {
    Counter c{.n = 10};
    auto items = prefetch_to_device([&] { return c(); }, {.buffer_size = buffer});
    for (int i = 0; i < 10; ++i) EXPECT_EQ(items.next(), i);
    EXPECT_EQ(items.next(), std::nullopt);
    EXPECT_EQ(items.next(), std::nullopt);  // and on every later call
    EXPECT_EQ(c.calls.load(), 11);          // ten items and the end; never called again
  }
  auto empty = prefetch_to_device([]() -> std::optional<int> { return std::nullopt; });
  EXPECT_EQ(empty.next(), std::nullopt);
}

TEST(Prefetch, ProducerAndConsumerOverlap) {
  // Each side sleeps 20 ms per item: 400 ms one after the other, about 220 ms overlapped.
  Counter c{.n = 10, .delay = milliseconds(20)};
  const auto start = Clock::now();
  auto items = prefetch_to_device([&] { return c(); });
  int got = 0;
  while (std::optional<int> v = items.next()) {
    EXPECT_EQ(*v, got++);
    std::this_thread::sleep_for(milliseconds(20));  // the "training step"
  }
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  EXPECT_EQ(got, 10);
  EXPECT_LT(took.count(), 330) << "no overlap: " << took.count() << " ms for 10 items";
  EXPECT_GE(took.count(), 200);
}

TEST(Prefetch, NeverMoreThanBufferSizeAhead) {
  for (int buffer : {1, 2, 3}) {
    Counter c{.n = 20};
    auto items = prefetch_to_device([&] { return c(); }, {.buffer_size = buffer});
    for (int taken = 0; taken < 20; ++taken) {
      // The producer fills the buffer (counting the end call near the end)...
      const int full = std::min(buffer, 21 - taken);
      EXPECT_TRUE(eventually([&] { return c.calls.load() - taken >= full; })) << "buffer " << buffer;
      // ... and goes no further, however long the consumer takes.
      std::this_thread::sleep_for(milliseconds(5));
      EXPECT_LE(c.calls.load() - taken, buffer) << "buffer " << buffer << " after " << taken << " items";
      EXPECT_LE(items.buffered(), buffer);
      ASSERT_EQ(items.next(), taken);
    }
  }
}

TEST(Prefetch, SourceExceptionArrivesInPlaceOfItsItem) {
  std::atomic<int> calls{0};
  auto items = prefetch_to_device([&]() -> std::optional<int> {
    const int i = calls++;
    if (i == 3) throw IoError("read_batch", "batch 3 is corrupt", "re-download");
    return i;
  });
  for (int i = 0; i < 3; ++i) EXPECT_EQ(items.next(), i);
  EXPECT_THAT(testing::error_of<IoError>([&] { items.next(); }), HasSubstr("batch 3 is corrupt"));
  EXPECT_THAT(testing::error_of<IoError>([&] { items.next(); }), HasSubstr("batch 3 is corrupt"));
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(calls.load(), 4);  // not called after it threw
}

TEST(Prefetch, DestructionStopsAProducerWaitingForRoom) {
  std::atomic<int> calls{0};
  auto endless = [&]() -> std::optional<int> { return calls++; };
  const auto start = Clock::now();
  {
    auto items = prefetch_to_device(endless, {.buffer_size = 2});
    EXPECT_EQ(items.next(), 0);
    // The producer fills the buffer again (items 1, 2) and blocks.
    EXPECT_TRUE(eventually([&] { return calls.load() == 3 && items.buffered() == 2; }));
  }
  EXPECT_LT(Clock::now() - start, milliseconds(500));
  EXPECT_EQ(calls.load(), 3);
  // Destroyed before anything was taken, too.
  { auto items = prefetch_to_device(endless, {.buffer_size = 1}); }
}

TEST(Prefetch, DestructionWaitsOnlyForTheSourceCallInProgress) {
  std::atomic<int> calls{0};
  const auto start = Clock::now();
  {
    auto items = prefetch_to_device([&]() -> std::optional<int> {
      const int i = calls++;
      std::this_thread::sleep_for(milliseconds(100));
      return i;
    });
    std::this_thread::sleep_for(milliseconds(10));  // inside the first call
  }
  const auto took = Clock::now() - start;
  EXPECT_GE(took, milliseconds(100));
  EXPECT_LT(took, milliseconds(500));
  EXPECT_EQ(calls.load(), 1);
}

TEST(Prefetch, TimeoutNamesTheItem) {
  auto items = prefetch_to_device(
      []() -> std::optional<int> {
        std::this_thread::sleep_for(milliseconds(200));
        return 1;
      },
      {.buffer_size = 1, .timeout = milliseconds(20)});
  EXPECT_THAT(testing::error_of<TimeoutError>([&] { items.next(); }), HasSubstr("no item within 20 ms (item 0"));
}

TEST(Prefetch, PlaceRunsOnThePrefetchThread) {
  const std::thread::id consumer = std::this_thread::get_id();
  std::atomic<bool> on_consumer{false};
  int i = 0;
  auto items = prefetch_to_device(
      [&]() -> std::optional<Tensor> {
        if (i == 3) return std::nullopt;
        return Tensor::full({2, 2}, static_cast<double>(i++), DType::f32);
      },
      {},
      [&](Tensor t) {
        if (std::this_thread::get_id() == consumer) on_consumer = true;
        return t.to(DType::bf16);
      });
  for (int k = 0; k < 3; ++k) {
    std::optional<Tensor> t = items.next();
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->dtype(), DType::bf16);
    EXPECT_EQ(t->item({1, 1}), static_cast<double>(k));
  }
  EXPECT_FALSE(items.next().has_value());
  EXPECT_FALSE(on_consumer.load());
}

TEST(Prefetch, MoveOnlyItemsAndMovedPrefetchers) {
  int i = 0;
  Prefetcher<std::unique_ptr<int>> items([&]() -> std::optional<std::unique_ptr<int>> {
    if (i == 2) return std::nullopt;
    return std::make_unique<int>(i++);
  });
  Prefetcher<std::unique_ptr<int>> moved = std::move(items);
  EXPECT_EQ(**moved.next(), 0);
  EXPECT_EQ(**moved.next(), 1);
  EXPECT_FALSE(moved.next().has_value());
}

TEST(Prefetch, RejectsBadOptions) {
  auto src = []() -> std::optional<int> { return std::nullopt; };
  EXPECT_THAT(testing::error_of([&] { (void)prefetch_to_device(src, {.buffer_size = 0}); }),
              HasSubstr("buffer_size 0 < 1"));
  EXPECT_THAT(testing::error_of([&] { (void)prefetch_to_device(src, {.timeout = milliseconds(-1)}); }),
              HasSubstr("timeout -1 ms is negative"));
  EXPECT_THAT(testing::error_of([] { Prefetcher<int> p{Prefetcher<int>::Source()}; }),
              HasSubstr("the source is empty"));
}

}  // namespace
}  // namespace meshtrain
