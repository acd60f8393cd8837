// Helpers for meshtrain's own tests (header-only; not part of the library's
// API).
//
//   EXPECT_THAT(testing::error_of([] { parse_dtype("f17"); }), HasSubstr("unknown dtype"));
#pragma once

#include <functional>
#include <string>

#include "meshtrain/core/error.h"

namespace meshtrain::testing {

// what() of the InvalidArgument `fn` throws, or "" if it throws none (other
// exceptions propagate, so a wrong error type fails the test).
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

}  // namespace meshtrain::testing
