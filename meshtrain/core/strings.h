// Small text helpers shared by the parsers of specs, sizes and configs.
//
//   trim("  data=2 ") == "data=2";   to_lower("7B") == "7b"
//
// Pure functions; thread-safe.
#pragma once

#include <cctype>
#include <string>
#include <string_view>

namespace meshtrain {

// s without leading and trailing whitespace (a view into s).
inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// ASCII lower case.
inline std::string to_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace meshtrain
