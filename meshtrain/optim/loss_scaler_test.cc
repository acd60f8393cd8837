#include "meshtrain/optim/loss_scaler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::optim {
namespace {

using ::testing::HasSubstr;
using meshtrain::testing::error_of;

using State = DynamicLossScaler::State;

TEST(DynamicLossScalerTest, DefaultsArePyTorchsWithTheDocumentedBounds) {
  const DynamicLossScalerConfig c;
  EXPECT_EQ(c.initial_scale, 32768.0);
  EXPECT_EQ(c.growth_factor, 2.0);
  EXPECT_EQ(c.backoff_factor, 0.5);
  EXPECT_EQ(c.growth_interval, 2000);
  EXPECT_EQ(c.min_scale, 1.0);
  EXPECT_EQ(c.max_scale, 16777216.0);
  EXPECT_NO_THROW(c.validate());
  const DynamicLossScaler scaler;
  EXPECT_EQ(scaler.scale(), 32768.0);
  EXPECT_EQ(scaler.good_steps(), 0);
  EXPECT_EQ(scaler.skipped_steps(), 0);
  EXPECT_EQ(scaler.state(), (State{32768.0, 0, 0}));
}

TEST(DynamicLossScalerTest, OverflowBacksOffSkipsTheStepAndResetsTheGoodSteps) {
  DynamicLossScaler scaler({.initial_scale = 1024.0, .growth_interval = 10});
  EXPECT_TRUE(scaler.update(false));
  EXPECT_TRUE(scaler.update(false));
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.good_steps(), 3);
  EXPECT_FALSE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.good_steps(), 0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  EXPECT_FALSE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 256.0);
  EXPECT_EQ(scaler.skipped_steps(), 2);
  // The interval counts again from the overflow: 9 good steps do not grow.
  for (int i = 0; i < 9; ++i) EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 256.0);
  EXPECT_EQ(scaler.good_steps(), 9);
  EXPECT_EQ(scaler.skipped_steps(), 2);
}

TEST(DynamicLossScalerTest, GrowsExactlyAtTheInterval) {
  DynamicLossScaler scaler({.initial_scale = 8.0, .growth_factor = 4.0, .growth_interval = 3});
  EXPECT_TRUE(scaler.update(false));
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 8.0);
  EXPECT_EQ(scaler.good_steps(), 2);
  EXPECT_TRUE(scaler.update(false));  // the 3rd good step
  EXPECT_EQ(scaler.scale(), 32.0);
  EXPECT_EQ(scaler.good_steps(), 0);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 32.0);
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 128.0);
  EXPECT_EQ(scaler.skipped_steps(), 0);

  DynamicLossScaler every_step({.initial_scale = 1.0, .growth_interval = 1});
  EXPECT_TRUE(every_step.update(false));
  EXPECT_EQ(every_step.scale(), 2.0);
  EXPECT_TRUE(every_step.update(false));
  EXPECT_EQ(every_step.scale(), 4.0);
  EXPECT_EQ(every_step.good_steps(), 0);
}

TEST(DynamicLossScalerTest, ClampsAtMinAndMaxScale) {
  DynamicLossScaler scaler({.initial_scale = 6.0, .backoff_factor = 0.25, .growth_interval = 1,
                            .min_scale = 2.0, .max_scale = 20.0});
  EXPECT_FALSE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 2.0);  // 1.5 clamped to min_scale
  EXPECT_FALSE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 2.0);  // stays at the floor; the step is still skipped
  EXPECT_EQ(scaler.skipped_steps(), 2);
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 4.0);
  EXPECT_TRUE(scaler.update(false));
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 16.0);
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 20.0);  // 32 clamped to max_scale
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 20.0);

  // Default bounds: 2^24 at most, 1 at least.
  DynamicLossScaler def({.initial_scale = 16777216.0, .growth_interval = 1});
  EXPECT_TRUE(def.update(false));
  EXPECT_EQ(def.scale(), 16777216.0);
  DynamicLossScaler low({.initial_scale = 1.0});
  EXPECT_FALSE(low.update(true));
  EXPECT_EQ(low.scale(), 1.0);
}

TEST(DynamicLossScalerTest, DefaultScheduleOverALongRun) {
  // 2^15, an overflow -> 2^14, 2000 good steps -> 2^15, 1999 more -> still 2^15.
  DynamicLossScaler scaler;
  EXPECT_FALSE(scaler.update(true));
  for (int i = 0; i < 1999; ++i) ASSERT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 16384.0);
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 32768.0);
  for (int i = 0; i < 1999; ++i) ASSERT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.state(), (State{32768.0, 1999, 1}));
}

TEST(DynamicLossScalerTest, StateRoundTripsAndLoadStateValidates) {
  DynamicLossScaler a({.growth_interval = 5});
  a.update(true);
  a.update(false);
  a.update(false);
  const State saved = a.state();
  EXPECT_EQ(saved, (State{16384.0, 2, 1}));

  DynamicLossScaler b({.growth_interval = 5});
  b.load_state(saved);
  EXPECT_EQ(b.state(), saved);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a.update(false), b.update(false));
    EXPECT_EQ(a.state(), b.state());
  }
  EXPECT_EQ(b.scale(), 32768.0);

  const State good = b.state();
  const auto load = [&](State s) { return error_of([&] { b.load_state(s); }); };
  EXPECT_THAT(load({0.5, 0, 0}), HasSubstr("DynamicLossScaler::load_state: scale 0.5 is not a finite value "
                                           "in [min_scale, max_scale] = [1, 16777216]"));
  EXPECT_THAT(load({33554432.0, 0, 0}), HasSubstr("scale 33554432 is not a finite value"));
  EXPECT_THAT(load({HUGE_VAL, 0, 0}), HasSubstr("scale inf is not a finite value"));
  EXPECT_THAT(load({NAN, 0, 0}), HasSubstr("scale nan is not a finite value"));
  EXPECT_THAT(load({1024.0, -1, 0}), HasSubstr("counts must be >= 0 (got good_steps -1, skipped_steps 0)"));
  EXPECT_THAT(load({1024.0, 0, -3}), HasSubstr("counts must be >= 0 (got good_steps 0, skipped_steps -3)"));
  EXPECT_EQ(b.state(), good);  // unchanged by the failed loads

  // A count past the interval (saved under a longer one) grows at the next good step.
  b.load_state({64.0, 7, 0});
  EXPECT_TRUE(b.update(false));
  EXPECT_EQ(b.state(), (State{128.0, 0, 0}));
}

TEST(DynamicLossScalerTest, ConfigValidationNamesTheBadValue) {
  const auto error = [](DynamicLossScalerConfig c) {
    std::string ctor = error_of([&] { DynamicLossScaler s(c); });
    std::string direct = error_of([&] { c.validate(); });
    EXPECT_EQ(ctor, direct);
    return direct;
  };
  EXPECT_EQ(error({.initial_scale = NAN}),
            "DynamicLossScalerConfig: initial_scale = nan is not finite (hint: use a finite initial_scale)");
  EXPECT_THAT(error({.growth_factor = HUGE_VAL}), HasSubstr("growth_factor = inf is not finite"));
  EXPECT_THAT(error({.backoff_factor = NAN}), HasSubstr("backoff_factor = nan is not finite"));
  EXPECT_THAT(error({.min_scale = -HUGE_VAL}), HasSubstr("min_scale = -inf is not finite"));
  EXPECT_THAT(error({.max_scale = HUGE_VAL}), HasSubstr("max_scale = inf is not finite"));
  EXPECT_EQ(error({.initial_scale = 0.5, .min_scale = 0.0}),
            "DynamicLossScalerConfig: min_scale = 0 must be > 0 (hint: a typical min_scale is 1)");
  EXPECT_THAT(error({.min_scale = -1.0}), HasSubstr("min_scale = -1 must be > 0"));
  EXPECT_THAT(error({.initial_scale = 8.0, .min_scale = 8.0, .max_scale = 4.0}),
              HasSubstr("min_scale = 8 > max_scale = 4"));
  EXPECT_THAT(error({.initial_scale = 0.5}),
              HasSubstr("initial_scale = 0.5 is outside [min_scale, max_scale] = [1, 16777216]"));
  EXPECT_THAT(error({.initial_scale = 33554432.0}), HasSubstr("initial_scale = 33554432 is outside"));
  EXPECT_THAT(error({.growth_factor = 1.0}), HasSubstr("growth_factor = 1 must be > 1"));
  EXPECT_THAT(error({.growth_factor = 0.5}), HasSubstr("growth_factor = 0.5 must be > 1"));
  EXPECT_THAT(error({.backoff_factor = 1.0}), HasSubstr("backoff_factor = 1 must be in (0, 1)"));
  EXPECT_THAT(error({.backoff_factor = 0.0}), HasSubstr("backoff_factor = 0 must be in (0, 1)"));
  EXPECT_THAT(error({.growth_interval = 0}), HasSubstr("growth_interval = 0 must be >= 1"));
  EXPECT_THAT(error({.growth_interval = -5}), HasSubstr("growth_interval = -5 must be >= 1"));
  // Boundary values that are valid.
  EXPECT_EQ(error({.initial_scale = 1.0, .min_scale = 1.0, .max_scale = 1.0}), "");
  EXPECT_EQ(error({.growth_factor = 1.0000001, .backoff_factor = 0.999, .growth_interval = 1}), "");
}

}  // namespace
}  // namespace meshtrain::optim
