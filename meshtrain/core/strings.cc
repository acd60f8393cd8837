#include "meshtrain/core/strings.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "meshtrain/core/error.h"

namespace meshtrain {
namespace {

std::string int_range(int64_t min, int64_t max) { return fmt::format("[{}, {}]", min, max); }

[[noreturn]] void out_of_range(std::string_view op, std::string_view what, std::string_view value,
                               const std::string& range) {
  throw InvalidArgument(std::string(op), fmt::format("{}: {} is outside {}", what, value, range),
                        fmt::format("use a value in {}", range));
}

}  // namespace

double nice_tick_step(double span, double ticks) {
  const double raw = span / ticks;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * p >= raw * (1 - 1e-9)) return m * p;
  return 10 * p;
}

std::string escape_xml(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string_view closest_name(std::string_view name, std::span<const std::string_view> known) {
  std::string_view best;
  size_t best_distance = std::max<size_t>(2, name.size() / 3) + 1;
  for (std::string_view k : known) {
    const size_t d = edit_distance(name, k);
    if (d < best_distance) best = k, best_distance = d;
  }
  return best;
}

std::string NumberRange::to_string() const {
  auto bound = [](double v) { return std::isinf(v) ? std::string(v < 0 ? "-inf" : "inf") : fmt::format("{}", v); };
  // An infinite bound is never included, whatever the flag says.
  return fmt::format("{}{}, {}{}", min_open || std::isinf(min) ? '(' : '[', bound(min), bound(max),
                     max_open || std::isinf(max) ? ')' : ']');
}

int64_t parse_int_in_range(std::string_view text, std::string_view what, int64_t min, int64_t max,
                           std::string_view op) {
  const std::string_view t = trim(text);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec == std::errc::result_out_of_range && end == t.data() + t.size()) out_of_range(op, what, t, int_range(min, max));
  if (t.empty() || ec != std::errc() || end != t.data() + t.size())
    throw InvalidArgument(std::string(op), fmt::format("{}: '{}' is not an integer", what, text),
                          fmt::format("use a whole number in {}", int_range(min, max)));
  check_int_in_range(v, what, min, max, op);
  return v;
}

double parse_double_in_range(std::string_view text, std::string_view what, const NumberRange& range,
                             std::string_view op) {
  const std::string_view t = trim(text);
  double v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  // from_chars reports overflow (1e999) as out of range: a value past any bound.
  if (ec == std::errc::result_out_of_range && end == t.data() + t.size()) out_of_range(op, what, t, range.to_string());
  if (t.empty() || ec != std::errc() || end != t.data() + t.size())
    throw InvalidArgument(std::string(op), fmt::format("{}: '{}' is not a number", what, text),
                          fmt::format("use a number in {}", range.to_string()));
  check_double_in_range(v, what, range, op);
  return v;
}

void check_int_in_range(int64_t v, std::string_view what, int64_t min, int64_t max, std::string_view op) {
  if (v < min || v > max) out_of_range(op, what, fmt::to_string(v), int_range(min, max));
}

void check_double_in_range(double v, std::string_view what, const NumberRange& range, std::string_view op) {
  if (!std::isfinite(v))
    throw InvalidArgument(std::string(op), fmt::format("{}: '{}' is not a finite number", what, v),
                          fmt::format("use a number in {}", range.to_string()));
  if (!range.contains(v)) out_of_range(op, what, fmt::format("{}", v), range.to_string());
}

std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

}  // namespace meshtrain
