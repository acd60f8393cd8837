// What a training run leaves in its run directory, written by rank 0:
//   config.toml     the resolved configuration (every key, defaults included)
//   metrics.jsonl   one JSON object per logged step / evaluation
//   model.safetensors  the final parameters (f32), loadable by PyTorch/HF
//                   (checkpoint/safetensors.h)
//   loss.svg        the loss curve(s)
//   *.png           image grids (the VAE's reconstructions and samples)
//
//   MetricsLog log("runs/mlp/metrics.jsonl");
//   log.write({{"step", 10}, {"loss", 0.53}}, {{"split", "train"}});
//
// Files are written through write_file_atomic (core/atomic_file.h: a
// temporary name in the same directory, fsync, rename, fsync of the
// directory), so a crash never leaves a half-written file under the final
// name. The trainer writes them into a RunDirectory's staging directory
// (run_dir.h). Thread-safety: one writer per object; the free functions are
// reentrant.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/checkpoint/safetensors.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::train {

// model.safetensors is written and read by the checkpoint layer's functions.
using checkpoint::load_safetensors;
using checkpoint::save_safetensors;

// JSON lines, one write(2) per line (a reader never sees half a line);
// numbers as numbers (non-finite ones as null), strings as strings. The
// constructor creates or truncates `path`: one log holds one run; a resumed
// run (keep_through = the step it resumes from) keeps the lines of steps up
// to that one and appends; dropped_through() is then the last step of the
// lines it dropped (the steps the run redoes), or keep_through when none.
// close() (or the destructor) fsyncs the file. Throws IoError naming the
// path.
class MetricsLog {
 public:
  explicit MetricsLog(std::string path, std::optional<int64_t> keep_through = std::nullopt);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const std::vector<std::pair<std::string, double>>& numbers,
             const std::vector<std::pair<std::string, std::string>>& strings = {});
  // fsync and close; later writes throw. Idempotent.
  void close();
  int64_t dropped_through() const { return dropped_through_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t dropped_through_ = 0;
};

// One line per series over a shared x axis, with axes, ticks and a legend.
struct Series {
  std::string name;
  std::vector<double> x, y;
};
std::string line_chart_svg(const std::string& title, const std::string& x_label, const std::vector<Series>& series);

// The loss curves a metrics.jsonl holds (its train and test lines' "loss"
// by "step"), appended to `train` and `test`: a resumed run's earlier part.
void read_curves(const std::string& metrics_path, Series& train, Series& test);

// The checksum of a whole model (--checksum-every, docs/determinism.md):
// 16 hex digits of a 64-bit FNV-1a hash over every parameter's name, shape
// and f32 bits, in the order model.safetensors holds them, so two runs
// whose model files are byte-identical have equal checksums.
std::string parameters_checksum(const std::vector<std::pair<std::string, Tensor>>& params);
// The checksum lines of a metrics.jsonl ({"step": s, "checksum": "..."}),
// in file order: (step, checksum).
std::vector<std::pair<int64_t, std::string>> read_checksums(const std::string& metrics_path);
// Two runs' checksums side by side (`meshtrain checksums A B`): the steps
// both logged, compared in step order, up to the first that differs.
struct ChecksumComparison {
  int64_t compared = 0;                      // steps both logged, up to and with the first difference
  int64_t first_step = -1, last_step = -1;   // of those
  std::optional<int64_t> first_difference;   // the first step whose checksums differ
  std::string a, b;                          // there: each run's checksum
};
ChecksumComparison compare_checksums(const std::vector<std::pair<int64_t, std::string>>& a,
                                     const std::vector<std::pair<int64_t, std::string>>& b);

// A grid of grayscale images (each h x w, values in [0, 1]) written as PNG.
void write_image_grid_png(const std::string& path, const std::vector<std::vector<float>>& images, int h, int w,
                          int columns, int scale = 2);

}  // namespace meshtrain::train
