#include "meshtrain/optim/schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <string>

#include "meshtrain/core/error.h"
#include "meshtrain/optim/sgd.h"

namespace meshtrain::optim {
namespace {

TEST(LrScheduleTest, ConstantIsConstant) {
  const LrSchedule s = LrSchedule::constant(0.125);
  for (int64_t step : {0, 1, 999, 1000000}) EXPECT_EQ(s.lr(step), 0.125);
  EXPECT_EQ(s.kind(), LrScheduleKind::constant);
}

TEST(LrScheduleTest, CosineWithWarmupAtKnownSteps) {
  // base 3e-4, W = 100, T = 1000, r = 0.1 (the header's example).
  const LrSchedule s = LrSchedule::cosine_with_warmup(3e-4, 100, 1000, 0.1);
  EXPECT_EQ(s.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr(1), 3e-6);
  EXPECT_DOUBLE_EQ(s.lr(50), 1.5e-4);
  EXPECT_DOUBLE_EQ(s.lr(99), 2.97e-4);
  EXPECT_DOUBLE_EQ(s.lr(100), 3e-4);
  EXPECT_DOUBLE_EQ(s.lr(550), 1.65e-4);  // progress 1/2: r + (1 - r) / 2
  // progress 1/4: cosine = 0.5 * (1 + cos(pi / 4))
  EXPECT_DOUBLE_EQ(s.lr(325), 3e-4 * (0.1 + 0.9 * 0.5 * (1 + std::numbers::sqrt2 / 2)));
  EXPECT_DOUBLE_EQ(s.lr(1000), 3e-5);
  EXPECT_DOUBLE_EQ(s.lr(1001), 3e-5);   // stays at the minimum (transformers would rise again)
  EXPECT_DOUBLE_EQ(s.lr(5000), 3e-5);
  for (int64_t step = 101; step <= 1000; ++step) EXPECT_LE(s.lr(step), s.lr(step - 1)) << step;
}

TEST(LrScheduleTest, TransformersDefaultsWithoutWarmupOrMinimum) {
  // min_lr_ratio 0 is get_cosine_schedule_with_warmup: 0.5 * (1 + cos(pi * step / T)).
  const LrSchedule s = LrSchedule::cosine_with_warmup(1.0, 0, 10);
  EXPECT_EQ(s.lr(0), 1.0);
  for (int64_t step = 0; step <= 10; ++step)
    EXPECT_NEAR(s.lr(step), 0.5 * (1 + std::cos(std::numbers::pi * static_cast<double>(step) / 10.0)), 1e-15)
        << step;
  EXPECT_NEAR(s.lr(10), 0.0, 1e-15);
  // W == T: warmup, the peak at step W, then the minimum (progress (s - W) / max(1, 0)).
  const LrSchedule w = LrSchedule::cosine_with_warmup(2.0, 4, 4, 0.5);
  EXPECT_EQ(w.lr(2), 1.0);
  EXPECT_EQ(w.lr(4), 2.0);
  EXPECT_EQ(w.lr(5), 1.0);
  EXPECT_EQ(w.lr(9), 1.0);
}

TEST(LrScheduleTest, RejectsBadArguments) {
  EXPECT_THROW(LrSchedule::constant(-1.0), InvalidArgument);
  EXPECT_THROW(LrSchedule::cosine_with_warmup(1e-3, -1, 10), InvalidArgument);
  EXPECT_THROW(LrSchedule::cosine_with_warmup(1e-3, 11, 10), InvalidArgument);
  EXPECT_THROW(LrSchedule::cosine_with_warmup(1e-3, 1, 10, 1.5), InvalidArgument);
  try {
    (void)LrSchedule::constant(1.0).lr(-3);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "LrSchedule::lr: step -3 < 0 (hint: steps count from 0)");
  }
}

TEST(LrSchedulerTest, DrivesTheOptimizerLikeATorchScheduler) {
  nn::Parameter w;
  w.name = "w";
  w.value = Tensor::full({1}, 0.0, DType::f32);
  w.grad = Tensor::full({1}, -1.0, DType::f32);  // each SGD step adds lr to w
  SGD opt({&w}, 123.0);
  LrScheduler sched(opt, LrSchedule::cosine_with_warmup(1.0, 2, 4));
  EXPECT_EQ(opt.lr(), 0.0);  // set by the constructor: update 0 uses lr(0)
  double expected = 0.0;
  for (int64_t step = 0; step < 6; ++step) {
    EXPECT_EQ(sched.next_step(), step);
    EXPECT_EQ(opt.lr(), sched.schedule().lr(step));
    EXPECT_EQ(sched.current_lr(), opt.lr());
    expected += opt.lr();
    opt.step();
    sched.step();
  }
  // lr: 0, 0.5, 1, 0.5, 0, 0
  EXPECT_FLOAT_EQ(w.value.item({0}), 2.0f);
  EXPECT_NEAR(expected, 2.0, 1e-15);
  LrScheduler resumed(opt, LrSchedule::cosine_with_warmup(1.0, 2, 4), 3);
  EXPECT_DOUBLE_EQ(opt.lr(), 0.5);
  EXPECT_THROW(LrScheduler(opt, LrSchedule::constant(1.0), -1), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::optim
