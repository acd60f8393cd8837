// Small text helpers shared by the parsers of specs, sizes and configs.
//
//   trim("  data=2 ") == "data=2";   to_lower("7B") == "7b"
//   split("1,2,,4") == {"1", "2", "", "4"}
//
// Pure functions; thread-safe.
#pragma once

#include <cctype>
#include <string>
#include <string_view>
#include <vector>

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

// The pieces of s between separators, empty ones included (so a parser can
// reject "1,,2"); views into s. split("") == {""}.
inline std::vector<std::string_view> split(std::string_view s, char sep = ',') {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    if (end == std::string_view::npos) {
      out.push_back(s.substr(start));
      return out;
    }
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
}

}  // namespace meshtrain
