// Small text helpers shared by the parsers of specs, sizes and configs.
//
//   trim("  data=2 ") == "data=2";   to_lower("7B") == "7b"
//   split("1,2,,4") == {"1", "2", "", "4"}
//   parse_int_in_range("64", "--ranks", 1, 1024) == 64   (see below)
//   escape_xml("a<b & \"c\"") == "a&lt;b &amp; &quot;c&quot;"   (text in SVG pictures)
//
// Pure functions; thread-safe.
#pragma once

#include <cctype>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
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

// s with &, <, > and " replaced by their XML entities, for text and
// attribute values of the SVG pictures (sharding's, the pipeline timeline's).
std::string escape_xml(std::string_view s);

// The step between axis ticks of the pictures: 1, 2 or 5 times a power of
// ten, the smallest such step that puts at most about `ticks` ticks on
// `span` (span > 0): nice_tick_step(3.3, 5) == 1, nice_tick_step(468, 5) == 100.
double nice_tick_step(double span, double ticks);

// The name of `known` closest to `name` by edit distance, when it is close
// enough to be a typo of it (at most max(2, |name| / 3) edits), else "":
// the "did you mean" of every unknown-key error.
std::string_view closest_name(std::string_view name, std::span<const std::string_view> known);

// ---- Range-checked numbers -----------------------------------------------------
//
// Every number a user or a file gives (a CLI flag, a TOML key, an environment
// variable, a file header) goes through these, so none is silently narrowed,
// wrapped or left non-finite. Errors are InvalidArgument(op, ...) whose
// detail names `what` (the flag or field), the text and the allowed range:
//
//   parse_int_in_range("4294967552", "--batch-size", 1, 1 << 20, "TrainConfig")
//     throws "TrainConfig: --batch-size: 4294967552 is outside [1, 1048576] (hint: ...)"
//   parse_double_in_range("nan", "--timeout", {.min = 0.001, .max = 604800}, "meshtrain check")
//     throws "meshtrain check: --timeout: 'nan' is not a finite number, allowed [0.001, 604800] ..."

// A closed or half-open interval of doubles; to_string() is "[0, 1)", "(0, inf)"...
struct NumberRange {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;  // min itself is not allowed
  bool max_open = false;
  bool contains(double v) const {
    return (min_open ? v > min : v >= min) && (max_open ? v < max : v <= max);
  }
  std::string to_string() const;
};

// A whole decimal integer (surrounding whitespace allowed) in [min, max].
int64_t parse_int_in_range(std::string_view text, std::string_view what, int64_t min, int64_t max,
                           std::string_view op = "parse_int");
// A finite decimal number (1.5, 3e-4; never nan or inf) inside range.
double parse_double_in_range(std::string_view text, std::string_view what, const NumberRange& range,
                             std::string_view op = "parse_double");
// Throws the same error as parse_int_in_range unless min <= v <= max (for
// numbers that arrive already parsed, e.g. a TOML integer or a CLI11 option).
void check_int_in_range(int64_t v, std::string_view what, int64_t min, int64_t max,
                        std::string_view op = "check_int");
// Throws unless v is finite and inside range.
void check_double_in_range(double v, std::string_view what, const NumberRange& range,
                           std::string_view op = "check_double");

// a * b, a + b, or nullopt when the exact result does not fit int64.
std::optional<int64_t> checked_mul(int64_t a, int64_t b);
std::optional<int64_t> checked_add(int64_t a, int64_t b);

}  // namespace meshtrain
