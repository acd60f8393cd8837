#include "meshtrain/core/strings.h"

#include <gtest/gtest.h>

#include <string_view>
#include <vector>

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

}  // namespace
}  // namespace meshtrain
