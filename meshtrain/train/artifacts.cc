#include "meshtrain/train/artifacts.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb/stb_image_write.h>

namespace meshtrain::train {

MetricsLog::MetricsLog(std::string path, std::optional<int64_t> keep_through) : path_(std::move(path)) {
  if (keep_through) {  // a resumed run: the lines of the steps it has not redone
    dropped_through_ = *keep_through;
    std::ifstream in(path_);
    std::string line, kept;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object() || !j.contains("step") || !j["step"].is_number()) continue;
      const double step = j["step"].get<double>();
      if (step <= *keep_through)
        kept += line + "\n";
      else
        dropped_through_ = std::max(dropped_through_, static_cast<int64_t>(step));
    }
    write_file_atomic(path_, kept);
  }
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | (keep_through ? 0 : O_TRUNC) | O_APPEND | O_CLOEXEC, 0666);
  if (fd_ < 0)
    throw IoError("MetricsLog", fmt::format("cannot open '{}': {}", path_, std::strerror(errno)),
                  "check the run directory");
}

MetricsLog::~MetricsLog() {
  try {
    close();
  } catch (const std::exception&) {  // a destructor must not throw; close() reports it when called
  }
}

void MetricsLog::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  int err = 0;
  if (::fsync(fd) != 0 && errno != EINVAL) err = errno;  // EINVAL: a file system without fsync
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0)
    throw IoError("MetricsLog", fmt::format("fsync/close '{}': {}", path_, std::strerror(err)),
                  "check free disk space");
}

void MetricsLog::write(const std::vector<std::pair<std::string, double>>& numbers,
                       const std::vector<std::pair<std::string, std::string>>& strings) {
  if (fd_ < 0) throw IoError("MetricsLog", fmt::format("'{}' is closed", path_), "write before close()");
  nlohmann::ordered_json j;
  for (const auto& [k, v] : strings) j[k] = v;
  for (const auto& [k, v] : numbers) {
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) j[k] = static_cast<int64_t>(v);
    else if (std::isfinite(v)) j[k] = v;
    else j[k] = nullptr;  // JSON has no NaN/inf
  }
  const std::string line = j.dump() + '\n';
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw IoError("MetricsLog", fmt::format("write '{}': {}", path_, n < 0 ? std::strerror(errno) : "no progress"),
                    "check free disk space");
    done += static_cast<size_t>(n);
  }
}

void read_curves(const std::string& metrics_path, Series& train, Series& test) {
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step") || !j.contains("loss") || !j["loss"].is_number()) continue;
    Series* s = j.value("split", "") == "train" ? &train : j.value("split", "") == "test" ? &test : nullptr;
    if (s == nullptr) continue;
    s->x.push_back(j["step"].get<double>());
    s->y.push_back(j["loss"].get<double>());
  }
}

std::string parameters_checksum(const std::vector<std::pair<std::string, Tensor>>& params) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, 64 bits
  auto mix = [&h](const void* data, size_t n) {
    const auto* b = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  };
  for (const auto& [name, value] : params) {
    mix(name.data(), name.size() + 1);  // with its terminating 0: names do not run together
    for (int64_t d : value.shape()) mix(&d, sizeof d);
    const Tensor t = value.dtype() == DType::f32 ? value.contiguous() : value.to(DType::f32);
    mix(t.data_ptr(), static_cast<size_t>(t.numel()) * sizeof(float));
  }
  return fmt::format("{:016x}", h);
}

std::vector<std::pair<int64_t, std::string>> read_checksums(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  if (!in)
    throw IoError("read_checksums", fmt::format("cannot read '{}'", metrics_path),
                  "name a run directory (or its metrics.jsonl)");
  std::vector<std::pair<int64_t, std::string>> out;
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("checksum") || !j["checksum"].is_string() || !j.contains("step") ||
        !j["step"].is_number())
      continue;
    out.emplace_back(j["step"].get<int64_t>(), j["checksum"].get<std::string>());
  }
  return out;
}

ChecksumComparison compare_checksums(const std::vector<std::pair<int64_t, std::string>>& a,
                                     const std::vector<std::pair<int64_t, std::string>>& b) {
  // The last line of a step wins (a resumed run may log a step again).
  std::map<int64_t, std::string> ma, mb;
  for (const auto& [step, sum] : a) ma[step] = sum;
  for (const auto& [step, sum] : b) mb[step] = sum;
  ChecksumComparison out;
  for (const auto& [step, sum] : ma) {
    const auto it = mb.find(step);
    if (it == mb.end()) continue;
    if (out.compared++ == 0) out.first_step = step;
    out.last_step = step;
    if (sum != it->second) {
      out.first_difference = step;
      out.a = sum;
      out.b = it->second;
      break;
    }
  }
  return out;
}

std::string line_chart_svg(const std::string& title, const std::string& x_label, const std::vector<Series>& series) {
  constexpr double W = 640, H = 400, L = 64, R = 16, T = 36, B = 48;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, s.x[i]), x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, s.y[i]), y1 = std::max(y1, s.y[i]);
    }
  if (!(x1 > x0)) x1 = x0 + 1;
  if (!(y1 > y0)) y1 = y0 + 1;
  // Round ticks (1, 2 or 5 x 10^k); the axes end on ticks.
  const double xs = nice_tick_step(x1 - x0, 5), ys = nice_tick_step(y1 - y0, 5);
  x0 = std::floor(x0 / xs) * xs, x1 = std::ceil(x1 / xs) * xs;
  y0 = std::floor(y0 / ys) * ys, y1 = std::ceil(y1 / ys) * ys;
  auto decimals = [](double step) { return std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9))); };
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  std::ostringstream s;
  s << fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">)", W, H)
    << '\n' << fmt::format(R"(<rect width="{}" height="{}" fill="white"/>)", W, H) << '\n'
    << fmt::format(R"(<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>)", W / 2, title) << '\n'
    << fmt::format(R"(<text x="{}" y="{}" text-anchor="middle">{}</text>)", (L + W - R) / 2, H - 10, x_label) << '\n';
  for (int64_t k = std::llround(y0 / ys); k <= std::llround(y1 / ys); ++k) {
    const double yv = static_cast<double>(k) * ys + 0.0;  // never "-0"
    s << fmt::format(R"(<line x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="#dddddd"/>)", L, py(yv), W - R, py(yv))
      << fmt::format(R"(<text x="{}" y="{:.1f}" text-anchor="end">{:.{}f}</text>)", L - 6, py(yv) + 4, yv,
                     decimals(ys)) << '\n';
  }
  for (int64_t k = std::llround(x0 / xs); k <= std::llround(x1 / xs); ++k) {
    const double xv = static_cast<double>(k) * xs + 0.0;
    s << fmt::format(R"(<text x="{:.1f}" y="{}" text-anchor="middle">{:.{}f}</text>)", px(xv), H - B + 16, xv,
                     decimals(xs)) << '\n';
  }
  s << fmt::format(R"(<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#333333"/>)", L, T, W - L - R,
                   H - T - B) << '\n';
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& ser = series[k];
    std::string pts;
    for (size_t i = 0; i < ser.x.size() && i < ser.y.size(); ++i)
      if (std::isfinite(ser.y[i])) pts += fmt::format("{:.1f},{:.1f} ", px(ser.x[i]), py(ser.y[i]));
    const char* c = colors[k % 6];
    s << fmt::format(R"(<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>)", c, pts) << '\n'
      << fmt::format(R"(<text x="{}" y="{}" fill="{}">{}</text>)", W - R - 150, T + 18 + 16 * k, c, ser.name) << '\n';
  }
  s << "</svg>\n";
  return s.str();
}

void write_image_grid_png(const std::string& path, const std::vector<std::vector<float>>& images, int h, int w,
                          int columns, int scale) {
  if (images.empty() || h <= 0 || w <= 0 || columns <= 0 || scale <= 0)
    throw InvalidArgument("write_image_grid_png", fmt::format("{} images of {}x{}, {} columns", images.size(), h, w,
                                                              columns),
                          "pass at least one image and positive sizes");
  const int rows = static_cast<int>((images.size() + columns - 1) / columns), pad = 2;
  const int W = columns * (w * scale + pad) + pad, H = rows * (h * scale + pad) + pad;
  std::vector<unsigned char> pixels(static_cast<size_t>(W) * H, 96);  // gray gutters
  for (size_t k = 0; k < images.size(); ++k) {
    if (images[k].size() != static_cast<size_t>(h) * w)
      throw InvalidArgument("write_image_grid_png", fmt::format("image {} has {} values, not {}", k, images[k].size(),
                                                                h * w), "");
    const int ox = pad + static_cast<int>(k % columns) * (w * scale + pad);
    const int oy = pad + static_cast<int>(k / columns) * (h * scale + pad);
    for (int y = 0; y < h * scale; ++y)
      for (int x = 0; x < w * scale; ++x) {
        const float v = std::clamp(images[k][(y / scale) * w + x / scale], 0.0f, 1.0f);
        pixels[static_cast<size_t>(oy + y) * W + ox + x] = static_cast<unsigned char>(std::lround(v * 255));
      }
  }
  // stb encodes into memory; the file goes through write_file_atomic like every artifact.
  std::string png;
  const auto append = [](void* context, void* data, int size) {
    static_cast<std::string*>(context)->append(static_cast<const char*>(data), static_cast<size_t>(size));
  };
  if (!stbi_write_png_to_func(append, &png, W, H, 1, pixels.data(), W))
    throw IoError("write_image_grid_png", fmt::format("cannot encode '{}'", path), "");
  write_file_atomic(path, png);
}

}  // namespace meshtrain::train
