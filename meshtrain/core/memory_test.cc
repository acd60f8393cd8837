#include "meshtrain/core/memory.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "meshtrain/core/error.h"

namespace meshtrain {
namespace {

using C = MemoryCategory;

TEST(MemoryTrackerTest, StartsEmpty) {
  MemoryTracker t;
  for (MemoryCategory c : kAllMemoryCategories) {
    EXPECT_EQ(t.in_use(c), 0u);
    EXPECT_EQ(t.peak(c), 0u);
  }
  EXPECT_EQ(t.total_in_use(), 0u);
  EXPECT_EQ(t.total_peak(), 0u);
}

TEST(MemoryTrackerTest, TracksInUseAndPeakPerCategory) {
  MemoryTracker t;
  t.allocate(C::parameters, 100);
  t.allocate(C::parameters, 50);
  t.allocate(C::gradients, 30);
  EXPECT_EQ(t.in_use(C::parameters), 150u);
  EXPECT_EQ(t.in_use(C::gradients), 30u);
  EXPECT_EQ(t.in_use(C::optimizer), 0u);
  t.release(C::parameters, 120);
  EXPECT_EQ(t.in_use(C::parameters), 30u);
  EXPECT_EQ(t.peak(C::parameters), 150u);
  EXPECT_EQ(t.total_in_use(), 60u);
  EXPECT_EQ(t.total_peak(), 180u);
}

// Categories that peak at different times: the total's peak is the largest
// simultaneous sum (150), not the sum of the peaks (100 + 100).
TEST(MemoryTrackerTest, TotalPeakIsPeakOfTotalNotSumOfPeaks) {
  MemoryTracker t;
  t.allocate(C::activations, 100);
  t.allocate(C::comm_buffers, 50);
  t.release(C::activations, 100);
  t.allocate(C::comm_buffers, 50);
  EXPECT_EQ(t.peak(C::activations), 100u);
  EXPECT_EQ(t.peak(C::comm_buffers), 100u);
  EXPECT_EQ(t.total_peak(), 150u);
  EXPECT_EQ(t.total_in_use(), 100u);
}

TEST(MemoryTrackerTest, AtTotalPeakIsThePeaksComposition) {
  MemoryTracker t;
  t.allocate(MemoryCategory::working, 300);     // working's own peak: 300, alone
  t.release(MemoryCategory::working, 300);
  t.allocate(MemoryCategory::activations, 200);
  t.allocate(MemoryCategory::working, 150);     // total 350: the peak
  t.release(MemoryCategory::working, 150);
  t.allocate(MemoryCategory::activations, 100);  // total 300: below it
  EXPECT_EQ(t.total_peak(), 350u);
  EXPECT_EQ(t.at_total_peak(MemoryCategory::activations), 200u);
  EXPECT_EQ(t.at_total_peak(MemoryCategory::working), 150u);
  EXPECT_EQ(t.peak(MemoryCategory::working), 300u);
  t.reset_peak();
  EXPECT_EQ(t.at_total_peak(MemoryCategory::activations), 300u);
  EXPECT_EQ(t.at_total_peak(MemoryCategory::working), 0u);
}

TEST(MemoryTrackerTest, ResetPeakSetsPeaksToCurrentUse) {
  MemoryTracker t;
  t.allocate(C::optimizer, 1000);
  t.allocate(C::other, 10);
  t.release(C::optimizer, 600);
  t.reset_peak();
  EXPECT_EQ(t.peak(C::optimizer), 400u);
  EXPECT_EQ(t.peak(C::other), 10u);
  EXPECT_EQ(t.total_peak(), 410u);
  t.allocate(C::optimizer, 5);
  EXPECT_EQ(t.peak(C::optimizer), 405u);
  EXPECT_EQ(t.total_peak(), 415u);
}

TEST(MemoryTrackerTest, OverReleaseThrowsAndChangesNothing) {
  MemoryTracker t;
  t.allocate(C::gradients, 64);
  try {
    t.release(C::gradients, 65);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), "MemoryTracker::release");
    EXPECT_NE(e.detail().find("65"), std::string::npos);
    EXPECT_NE(e.detail().find("gradients"), std::string::npos);
    EXPECT_FALSE(e.hint().empty());
  }
  EXPECT_THROW(t.release(C::parameters, 1), InvalidArgument);  // wrong category
  EXPECT_EQ(t.in_use(C::gradients), 64u);
  EXPECT_EQ(t.total_in_use(), 64u);
}

TEST(MemoryTrackerTest, ConcurrentAllocateAndReleaseBalance) {
  MemoryTracker t;
  constexpr int kThreads = 8, kIters = 20000;
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&t, k] {
      const auto c = kAllMemoryCategories[static_cast<size_t>(k) % kNumMemoryCategories];
      for (int i = 0; i < kIters; ++i) {
        t.allocate(c, 16);
        t.release(c, 16);
      }
      t.allocate(c, 8);  // left in use
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(t.total_in_use(), 8u * kThreads);
  // Every thread holds at most 16 + 8 bytes at once.
  EXPECT_LE(t.total_peak(), 24u * kThreads);
  EXPECT_GE(t.total_peak(), 16u);
  uint64_t sum = 0;
  for (MemoryCategory c : kAllMemoryCategories) sum += t.in_use(c);
  EXPECT_EQ(sum, t.total_in_use());
  EXPECT_EQ(t.in_use(C::parameters), 16u);  // threads 0 and 6
  EXPECT_EQ(t.in_use(C::other), 8u);        // thread 5
}

TEST(MemoryTrackerTest, ToStringListsEveryCategoryWithUnits) {
  MemoryTracker t;
  t.allocate(C::parameters, 3 * 1024 * 1024 / 2);  // 1.50 MiB
  t.allocate(C::activations, 512);
  const std::string s = t.to_string();
  for (MemoryCategory c : kAllMemoryCategories)
    EXPECT_NE(s.find(memory_category_name(c)), std::string::npos) << s;
  EXPECT_NE(s.find("1.50 MiB"), std::string::npos) << s;
  EXPECT_NE(s.find("512 B"), std::string::npos) << s;
  EXPECT_NE(s.find("total"), std::string::npos) << s;
}

TEST(FormatBytesTest, BinaryUnits) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(uint64_t{5} << 30), "5.00 GiB");
}

}  // namespace
}  // namespace meshtrain
