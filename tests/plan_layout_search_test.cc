// plan::search_layouts: what fits is decided against the device less the
// stated reserve, the picks are sorted by predicted time, and bad options
// are refused.
#include "meshtrain/plan/layout_search.h"

#include <gtest/gtest.h>

#include "meshtrain/core/error.h"
#include "meshtrain/train/model_parameters.h"

namespace meshtrain::plan {
namespace {

const GptShape kShape =  // 1.3B
    train::with_gpt_model({.vocab = 50257, .seq = 2048, .layers = 24, .heads = 16, .width = 2048});

TEST(LayoutSearch, FitsWithinTheDeviceLessTheReserve) {
  const Hardware hw = hardware_preset("H100");
  SearchOptions o{.devices = 8, .batch = 64, .device_memory = 80e9, .keep = 5};
  const SearchResult loose = search_layouts(kShape, {.devices = 8, .batch = 64, .reserve = 0.0, .keep = 5}, hw);
  ASSERT_FALSE(loose.fitting.empty());
  // A reserve that leaves less than the loose pick needs moves it out.
  o.reserve = 1 - 0.99 * loose.fitting[0].memory / o.device_memory;
  EXPECT_LT(o.usable(), loose.fitting[0].memory);
  const SearchResult tight = search_layouts(kShape, o, hw);
  ASSERT_FALSE(tight.fitting.empty());
  for (const Candidate& c : tight.fitting) {
    EXPECT_LE(c.memory, o.usable()) << c.label;
    EXPECT_NE(c.label, loose.fitting[0].label);
  }
  for (size_t i = 1; i < tight.fitting.size(); ++i)
    EXPECT_LE(tight.fitting[i - 1].step, tight.fitting[i].step * 1.001) << tight.fitting[i].label;
  // The layout evaluated alone agrees.
  EXPECT_FALSE(evaluate_layout(kShape, loose.fitting[0].layout, o, hw).fits);
  EXPECT_TRUE(evaluate_layout(kShape, tight.fitting[0].layout, o, hw).fits);
}

TEST(LayoutSearch, RefusesBadOptions) {
  const Hardware hw = hardware_preset("A100");
  EXPECT_THROW(search_layouts(kShape, {.devices = 8, .batch = 64, .reserve = 1.0}, hw), InvalidArgument);
  EXPECT_THROW(search_layouts(kShape, {.devices = 8, .batch = 64, .reserve = -0.1}, hw), InvalidArgument);
  EXPECT_THROW(search_layouts(kShape, {.devices = 0, .batch = 64}, hw), InvalidArgument);
  EXPECT_THROW(search_layouts(kShape, {.devices = 8, .batch = 0}, hw), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::plan
