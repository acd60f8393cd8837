#include "meshtrain/core/strings.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain {
namespace {

using Views = std::vector<std::string_view>;

TEST(Strings, SplitKeepsEmptyPieces) {
  EXPECT_EQ(split("1,2,,4"), (Views{"1", "2", "", "4"}));
  EXPECT_EQ(split(""), (Views{""}));
  EXPECT_EQ(split(","), (Views{"", ""}));
  EXPECT_EQ(split("data=2"), (Views{"data=2"}));
  EXPECT_EQ(split("a:b", ':'), (Views{"a", "b"}));
}

TEST(Strings, TrimAndLower) {
  EXPECT_EQ(trim("  data=2 \t"), "data=2");
  EXPECT_EQ(trim("   "), "");
  EXPECT_EQ(to_lower("7B Model"), "7b model");
}

using ::testing::HasSubstr;

TEST(Strings, EscapeXml) {
  EXPECT_EQ(escape_xml("a<b & \"c\" > d"), "a&lt;b &amp; &quot;c&quot; &gt; d");
  EXPECT_EQ(escape_xml("F3@s1 rank 0"), "F3@s1 rank 0");
  EXPECT_EQ(escape_xml(""), "");
}

TEST(Strings, NiceTickStepsAreOneTwoOrFiveTimesAPowerOfTen) {
  EXPECT_DOUBLE_EQ(nice_tick_step(3.3, 5), 1.0);
  EXPECT_DOUBLE_EQ(nice_tick_step(468.8, 5), 100.0);
  EXPECT_DOUBLE_EQ(nice_tick_step(1.733, 5), 0.5);
  EXPECT_DOUBLE_EQ(nice_tick_step(0.04, 8), 0.005);
  EXPECT_DOUBLE_EQ(nice_tick_step(10, 5), 2.0);  // exactly span / ticks
  EXPECT_DOUBLE_EQ(nice_tick_step(9.9, 1), 10.0);
}

TEST(Strings, ParseIntInRangeRefusesWhatWouldNarrowOrWrap) {
  EXPECT_EQ(parse_int_in_range(" 64 ", "--ranks", 1, 1024), 64);
  EXPECT_EQ(parse_int_in_range("-9223372036854775808", "x", INT64_MIN, 0), INT64_MIN);
  // 2^32 + 256 would narrow to 256 as an int.
  EXPECT_THAT(testing::error_of([] { parse_int_in_range("4294967552", "--batch-size", 1, 1 << 20, "TrainConfig"); }),
              HasSubstr("TrainConfig: --batch-size: 4294967552 is outside [1, 1048576]"));
  EXPECT_THAT(testing::error_of([] { parse_int_in_range("99999999999999999999", "--epochs", 1, 10); }),
              HasSubstr("--epochs: 99999999999999999999 is outside [1, 10]"));
  EXPECT_THAT(testing::error_of([] { parse_int_in_range("-1", "--hidden", 1, 10); }), HasSubstr("--hidden: -1 is outside [1, 10]"));
  for (const char* bad : {"", "1.5", "0x10", "12a", "+", "nan"})
    EXPECT_THAT(testing::error_of([&] { parse_int_in_range(bad, "--seed", 0, 10); }), HasSubstr("is not an integer")) << bad;
}

TEST(Strings, ParseDoubleInRangeRefusesNonFiniteAndOutOfRange) {
  const NumberRange timeout{.min = 0.001, .max = 604800};
  EXPECT_DOUBLE_EQ(parse_double_in_range("2.5", "--timeout", timeout), 2.5);
  EXPECT_DOUBLE_EQ(parse_double_in_range("3e-4", "--lr", {.min = 0, .min_open = true}), 3e-4);
  for (const char* bad : {"nan", "inf", "-inf", "NaN"})
    EXPECT_THAT(testing::error_of([&] { parse_double_in_range(bad, "--timeout", timeout); }),
                HasSubstr("--timeout: '")) << bad;
  EXPECT_THAT(testing::error_of([&] { parse_double_in_range("nan", "--timeout", timeout); }),
              HasSubstr("is not a finite number"));
  EXPECT_THAT(testing::error_of([&] { parse_double_in_range("-1", "--timeout", timeout); }),
              HasSubstr("--timeout: -1 is outside [0.001, 604800]"));
  EXPECT_THAT(testing::error_of([&] { parse_double_in_range("1e10", "--timeout", timeout); }),
              HasSubstr("--timeout: 10000000000 is outside [0.001, 604800]"));
  EXPECT_THAT(testing::error_of([&] { parse_double_in_range("1e999", "--timeout", timeout); }),
              HasSubstr("--timeout: 1e999 is outside"));
  EXPECT_THAT(testing::error_of([] { parse_double_in_range("0", "--lr", {.min = 0, .min_open = true}); }),
              HasSubstr("--lr: 0 is outside (0, inf)"));
  EXPECT_THAT(testing::error_of([] { parse_double_in_range("fast", "--lr", {}); }), HasSubstr("--lr: 'fast' is not a number"));
  EXPECT_EQ((NumberRange{.min = 0, .max = 1, .max_open = true}).to_string(), "[0, 1)");
}

TEST(Strings, CheckedArithmetic) {
  EXPECT_EQ(checked_mul(1 << 20, 1 << 20), int64_t{1} << 40);
  EXPECT_FALSE(checked_mul(INT64_MAX, 2));
  EXPECT_FALSE(checked_add(INT64_MAX, 1));
  EXPECT_EQ(checked_add(-5, 3), -2);
}

}  // namespace
}  // namespace meshtrain
