// A progress bar for long loops, drawn by rank 0 only:
//
//   ProgressBar bar(total_steps, /*enabled=*/rank == 0);
//   bar.update(step, {{"loss", loss}}, samples_per_second);
//   bar.finish();   // ends the line (before an epoch's summary, say) ...
//   bar.update(step + 1, ...);  // ... and the bar goes on below it
//
// On a terminal it redraws one line (at most 10 times a second); into a file
// or pipe it prints a line every ~10% so logs stay readable. Elapsed time
// and ETA cover the bar's whole life, across finish() calls; the ETA is
// from the rate of the steps since the first update (a resumed run's too).
// Thread-safety: one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::train {

class ProgressBar {
 public:
  ProgressBar(int64_t total, bool enabled, std::string label = "train", std::FILE* out = stderr);
  // Ends a line left open on a terminal (a run that stopped with an error),
  // so what is printed next starts on a line of its own.
  ~ProgressBar();
  ProgressBar(ProgressBar&& other) noexcept;
  ProgressBar& operator=(ProgressBar&& other) noexcept;
  // `done` steps of `total`; values are shown as "name value".
  void update(int64_t done, const std::vector<std::pair<std::string, double>>& values, double items_per_second);
  // Ends the line; a later update() draws on a new one, keeping the start
  // time and which tenths were printed.
  void finish();
  // Prints one line of its own (e.g. "step 37: skipped ...") without mangling
  // the bar: on a terminal the bar's line is cleared first and redrawn by the
  // next update().
  void note(const std::string& line);
  // The unit of the rate update() gets ("tokens" prints "1234 tokens/s");
  // "" (the default) prints "1234/s".
  void set_rate_unit(std::string unit) { rate_unit_ = std::move(unit); }

 private:
  std::string render(int64_t done, const std::vector<std::pair<std::string, double>>& values, double rate) const;

  int64_t total_;
  bool enabled_;
  std::string label_;
  std::string rate_unit_;
  std::FILE* out_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  int64_t last_tenth_ = -1;
  int64_t first_done_ = -1;  // `done` at the first update
  bool open_line_ = false;  // a terminal line was drawn and not ended
};

// "1h02m", "3m07s", "12s"
std::string format_duration(double seconds);

}  // namespace meshtrain::train
