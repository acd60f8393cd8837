#include "meshtrain/train/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace meshtrain::train {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(std::lround(s));
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

ProgressBar::ProgressBar(int64_t total, bool enabled, std::string label, std::FILE* out)
    : total_(std::max<int64_t>(total, 1)),
      enabled_(enabled),
      label_(std::move(label)),
      out_(out),
      tty_(isatty(fileno(out)) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_ - std::chrono::seconds(1)) {}

std::string ProgressBar::render(int64_t done, const std::vector<std::pair<std::string, double>>& values,
                                double rate) const {
  constexpr int kWidth = 24;
  const double frac = std::clamp(static_cast<double>(done) / total_, 0.0, 1.0);
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(filled, '#');
  bar.append(kWidth - filled, '.');
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // The rate of the steps this bar saw: a resumed run's first update is
  // one step after where it resumed.
  const int64_t seen = done - first_done_ + 1;
  const double eta = seen > 0 ? elapsed * static_cast<double>(total_ - done) / static_cast<double>(seen) : NAN;
  std::string s = fmt::format("{} [{}] {:>3.0f}% {}/{}", label_, bar, 100 * frac, done, total_);
  for (const auto& [k, v] : values) s += fmt::format("  {} {:.4f}", k, v);
  s += fmt::format("  {:.0f}{}/s  elapsed {}  ETA {}", rate, rate_unit_.empty() ? "" : " " + rate_unit_,
                   format_duration(elapsed), format_duration(eta));
  return s;
}

ProgressBar::~ProgressBar() {
  if (open_line_) {
    fmt::print(out_, "\n");
    std::fflush(out_);
  }
}

ProgressBar::ProgressBar(ProgressBar&& other) noexcept
    : total_(other.total_),
      enabled_(other.enabled_),
      label_(std::move(other.label_)),
      rate_unit_(std::move(other.rate_unit_)),
      out_(other.out_),
      tty_(other.tty_),
      start_(other.start_),
      last_draw_(other.last_draw_),
      last_tenth_(other.last_tenth_),
      first_done_(other.first_done_),
      open_line_(other.open_line_) {
  other.open_line_ = false;
}

ProgressBar& ProgressBar::operator=(ProgressBar&& other) noexcept {
  if (this != &other) {
    if (open_line_) fmt::print(out_, "\n");
    total_ = other.total_;
    enabled_ = other.enabled_;
    label_ = std::move(other.label_);
    rate_unit_ = std::move(other.rate_unit_);
    out_ = other.out_;
    tty_ = other.tty_;
    start_ = other.start_;
    last_draw_ = other.last_draw_;
    last_tenth_ = other.last_tenth_;
    first_done_ = other.first_done_;
    open_line_ = other.open_line_;
    other.open_line_ = false;
  }
  return *this;
}

void ProgressBar::update(int64_t done, const std::vector<std::pair<std::string, double>>& values,
                         double items_per_second) {
  if (!enabled_) return;
  if (first_done_ < 0) first_done_ = done;
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    if (now - last_draw_ < std::chrono::milliseconds(100) && done < total_) return;
    last_draw_ = now;
    fmt::print(out_, "\r{}\033[K", render(done, values, items_per_second));
    open_line_ = true;
  } else {
    const int64_t tenth = done * 10 / total_;
    if (tenth == last_tenth_) return;
    last_tenth_ = tenth;
    fmt::print(out_, "{}\n", render(done, values, items_per_second));
  }
  std::fflush(out_);
}

void ProgressBar::note(const std::string& line) {
  if (!enabled_) return;
  fmt::print(out_, "{}{}\n", tty_ ? "\r\033[K" : "", line);
  open_line_ = false;
  last_draw_ = {};  // redraw at the next update
  std::fflush(out_);
}

void ProgressBar::finish() {
  if (enabled_ && tty_) fmt::print(out_, "\n");
  open_line_ = false;
  if (enabled_) std::fflush(out_);
}

}  // namespace meshtrain::train
