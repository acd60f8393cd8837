#include "meshtrain/plan/device_placement.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "meshtrain/core/error.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/strings.h"

extern char** environ;

namespace meshtrain::plan {
namespace {

namespace fs = std::filesystem;

// ---- The table --------------------------------------------------------------

// The seeds' rows, values and notes as the seeds have them.
struct SeedRow {
  HardwareType type;
  int64_t min, optimal, critical;
  const char* notes;
};
constexpr SeedRow kSeedRows[] = {
    {HardwareType::tpu_v5e, 64, 256, 240, "Critical batch size for reaching roofline on TPU v5e."},
    {HardwareType::tpu_v5p, 128, 512, 480, "Higher throughput variant, benefits from larger batches."},
    {HardwareType::tpu_v4, 64, 256, 192, "Similar characteristics to TPU v5e but slightly lower critical batch."},
    {HardwareType::h100, 64, 320, 298, "Critical batch size for reaching roofline on H100."},
    {HardwareType::a100, 32, 256, 240, "A100 80GB variant. 40GB variant may need smaller batches."},
    {HardwareType::v100, 16, 128, 96, "Older generation, memory-limited on 16GB variant."},
    {HardwareType::cpu, 1, 32, 16, "CPU is memory-bandwidth bound, smaller batches often sufficient."},
    {HardwareType::unknown, 32, 128, 64, "Conservative defaults for unknown hardware."},
};

// The anchor of the derived rows: the seeds' H100 row and the H100 SXM's
// datasheet numbers.
constexpr int64_t kH100Critical = 298;
constexpr double kH100Flops = 989e12;       // dense bf16 tensor FLOP/s
constexpr double kH100Bandwidth = 3.35e12;  // HBM3 bytes/s
constexpr int64_t kDerivedMin = 64;         // the H100 row's minimum

// Datasheet numbers of the types the seeds lack (SXM / HGX parts; dense,
// not sparse, bf16).
struct DerivedSpec {
  HardwareType type;
  const char* model;
  double flops;      // dense bf16 tensor FLOP/s
  double bandwidth;  // memory bytes/s
  const char* memory;
};
constexpr DerivedSpec kDerivedSpecs[] = {
    {HardwareType::h200, "H200", 989e12, 4.8e12, "141 GB of HBM3e"},
    {HardwareType::b200, "B200", 2250e12, 8.0e12, "180 GB of HBM3e"},
    {HardwareType::l40s, "L40S", 362e12, 0.864e12, "48 GB of GDDR6"},
};

std::string compact(double v) { return fmt::format("{:g}", v); }

BatchSizeRecommendation derived_row(const DerivedSpec& s) {
  const int64_t critical = derived_critical_batch_size(s.flops, s.bandwidth);
  return {kDerivedMin, optimal_batch_size_for(critical), critical,
          fmt::format("Not in the seeds' table; derived from their H100 row: {} TFLOP/s dense bf16 and {} TB/s "
                      "({}): critical = 298 x ({} / 989) x (3.35 / {}) = {}; optimal = next multiple of 64; "
                      "min as for H100.",
                      compact(s.flops / 1e12), compact(s.bandwidth / 1e12), s.memory, compact(s.flops / 1e12),
                      compact(s.bandwidth / 1e12), critical)};
}

// ---- Names ------------------------------------------------------------------

// Lower-case runs of letters and digits.
std::vector<std::string> words(std::string_view name) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      cur += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!cur.empty()) {
      out.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

bool has_word(const std::vector<std::string>& w, std::string_view word) {
  return std::find(w.begin(), w.end(), word) != w.end();
}

// `word` followed by `next`.
bool has_pair(const std::vector<std::string>& w, std::string_view word, std::string_view next) {
  for (size_t i = 0; i + 1 < w.size(); ++i)
    if (w[i] == word && w[i + 1] == next) return true;
  return false;
}

std::string gib(int64_t bytes) { return fmt::format("{:.0f} GiB", static_cast<double>(bytes) / (1ull << 30)); }

// ---- Files and processes -----------------------------------------------------

std::optional<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The value after "key<spaces/tabs>:" on the first line that starts with key.
std::string field(std::string_view text, std::string_view key) {
  for (std::string_view line : split(text, '\n')) {
    if (line.substr(0, key.size()) != key) continue;
    const std::string_view rest = line.substr(key.size());
    const size_t colon = rest.find(':');
    if (colon == std::string_view::npos || !trim(rest.substr(0, colon)).empty()) continue;
    return std::string(trim(rest.substr(colon + 1)));
  }
  return "";
}

std::string squeeze_spaces(std::string_view s) {
  std::string out;
  for (char c : trim(s)) {
    const bool space = std::isspace(static_cast<unsigned char>(c));
    if (space && !out.empty() && out.back() == ' ') continue;
    out += space ? ' ' : c;
  }
  return out;
}

struct ProgramOutput {
  bool ran = false;      // started and exited 0 within the deadline
  bool missing = false;  // not installed (no note: the usual case without GPUs)
  std::string out;       // stdout
  std::string failure;   // why not, when !ran
};

// Runs argv (argv[0] looked up in PATH), its stdout captured, stdin and
// stderr on /dev/null. Past `timeout` the child is killed (SIGKILL) and
// reaped: a wedged driver cannot hang detection.
ProgramOutput run_program(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  ProgramOutput r;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    r.failure = fmt::format("pipe: {}", std::strerror(errno));
    return r;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // Its own process group, so a kill also reaches anything it started.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    r.missing = rc == ENOENT;
    r.failure = fmt::format("cannot run {}: {}", argv[0], std::strerror(rc));
    return r;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool timed_out = false;
  char buf[4096];
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    if (n == 0) continue;
    const ssize_t got = read(fds[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;  // EOF: the child closed stdout
    r.out.append(buf, static_cast<size_t>(got));
    if (r.out.size() > (1u << 20)) break;  // far more than any GPU list
  }
  close(fds[0]);
  if (timed_out) kill(-pid, SIGKILL);
  // The child has closed stdout (or was killed): it exits promptly; bound the
  // wait anyway.
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 2000; ++i) {
    done = waitpid(pid, &status, WNOHANG);
    if (done != 0) break;
    if (i == 1000) kill(-pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (done == 0) {
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  if (timed_out) {
    r.failure = fmt::format("{} gave no answer within {} ms and was killed", argv[0], timeout.count());
  } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    r.failure = WIFEXITED(status) ? fmt::format("{} exited with status {}", argv[0], WEXITSTATUS(status))
                                  : fmt::format("{} ended by signal {}", argv[0], WTERMSIG(status));
  } else {
    r.ran = true;
  }
  return r;
}

bool mixed(const std::vector<DetectedDevice>& devices) {
  return std::any_of(devices.begin(), devices.end(),
                     [&](const DetectedDevice& d) { return d.type != devices[0].type; });
}

HardwareType common_type(const std::vector<DetectedDevice>& devices) {
  return devices.empty() || mixed(devices) ? HardwareType::unknown : devices[0].type;
}

std::vector<DetectedDevice> gpus_from_proc(const fs::path& dir, std::vector<std::string>& notes) {
  std::vector<DetectedDevice> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;  // no NVIDIA driver: the usual case without GPUs
  std::vector<fs::path> buses;
  for (const auto& e : fs::directory_iterator(dir, ec)) buses.push_back(e.path());
  std::sort(buses.begin(), buses.end());  // PCI bus order, as nvidia-smi numbers them
  for (const auto& bus : buses) {
    const auto text = read_text(bus / "information");
    const std::string model = text ? parse_nvidia_proc_model(*text) : "";
    if (model.empty()) {
      notes.push_back(fmt::format("{} names no model", (bus / "information").string()));
      continue;
    }
    DetectedDevice d;
    d.index = static_cast<int>(out.size());
    d.platform = "cuda";
    d.name = model;
    d.type = classify_device_name(model);
    out.push_back(std::move(d));
  }
  return out;
}

DetectedDevice this_cpu(const fs::path& proc, std::vector<std::string>& notes) {
  DetectedDevice d;
  d.platform = "cpu";
  d.type = HardwareType::cpu;
  d.cpus = available_cores();
  if (const auto info = read_text(proc / "cpuinfo")) d.name = parse_cpu_model(*info);
  if (d.name.empty()) {
    utsname u{};
    d.name = uname(&u) == 0 ? std::string(u.machine) + " CPU" : "CPU";
    notes.push_back(fmt::format("{} names no CPU model; using the architecture", (proc / "cpuinfo").string()));
  }
  if (const auto mem = read_text(proc / "meminfo")) {
    const std::string kb = field(*mem, "MemTotal");  // "16318412 kB"
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(kb.data(), kb.data() + kb.size(), v);
    if (ec == std::errc() && v > 0 && v < (int64_t{1} << 50)) d.memory_bytes = v * 1024;
  }
  return d;
}

}  // namespace

// ---- Names and the table -------------------------------------------------------

std::string_view hardware_name(HardwareType type) {
  switch (type) {
    case HardwareType::tpu_v5e:
      return "tpu_v5e";
    case HardwareType::tpu_v5p:
      return "tpu_v5p";
    case HardwareType::tpu_v4:
      return "tpu_v4";
    case HardwareType::h100:
      return "h100";
    case HardwareType::a100:
      return "a100";
    case HardwareType::v100:
      return "v100";
    case HardwareType::cpu:
      return "cpu";
    case HardwareType::unknown:
      return "unknown";
    case HardwareType::h200:
      return "h200";
    case HardwareType::b200:
      return "b200";
    case HardwareType::l40s:
      return "l40s";
  }
  return "unknown";
}

std::optional<HardwareType> parse_hardware_type(std::string_view name) {
  const std::string lower = to_lower(trim(name));
  for (HardwareType t : kHardwareTypes)
    if (hardware_name(t) == lower) return t;
  return std::nullopt;
}

bool in_seed_table(HardwareType type) {
  return std::any_of(std::begin(kSeedRows), std::end(kSeedRows), [&](const SeedRow& r) { return r.type == type; });
}

BatchSizeRecommendation get_batch_size_recommendation(HardwareType type) {
  for (const SeedRow& r : kSeedRows)
    if (r.type == type) return {r.min, r.optimal, r.critical, r.notes};
  for (const DerivedSpec& s : kDerivedSpecs)
    if (s.type == type) return derived_row(s);
  throw InvalidArgument("get_batch_size_recommendation",
                        fmt::format("hardware type {} has no row", static_cast<int>(type)),
                        "pass one of kHardwareTypes");
}

int64_t derived_critical_batch_size(double dense_bf16_flops, double memory_bytes_per_s) {
  if (!(dense_bf16_flops > 0) || !(memory_bytes_per_s > 0) || !std::isfinite(dense_bf16_flops) ||
      !std::isfinite(memory_bytes_per_s))
    throw InvalidArgument("derived_critical_batch_size",
                          fmt::format("compute {} FLOP/s, bandwidth {} bytes/s", dense_bf16_flops, memory_bytes_per_s),
                          "pass the device's dense bf16 FLOP/s and memory bytes/s, both > 0");
  return std::llround(static_cast<double>(kH100Critical) * (dense_bf16_flops / kH100Flops) *
                      (kH100Bandwidth / memory_bytes_per_s));
}

int64_t optimal_batch_size_for(int64_t critical) { return (std::max<int64_t>(critical, 0) / 64 + 1) * 64; }

BatchSizeCheck validate_batch_size(int64_t batch_size, HardwareType type, bool warn_suboptimal) {
  if (batch_size < 1)
    throw InvalidArgument("validate_batch_size", fmt::format("batch size {} is not positive", batch_size),
                          "pass the batch size per device, at least 1");
  const BatchSizeRecommendation rec = get_batch_size_recommendation(type);
  const std::string_view hw = hardware_name(type);
  if (batch_size < rec.min_batch_size)
    return {false, fmt::format("Batch size {} is below minimum recommended {} for {}. Performance will be "
                               "significantly degraded.",
                               batch_size, rec.min_batch_size, hw)};
  if (batch_size < rec.critical_batch_size && warn_suboptimal)
    return {true, fmt::format("Batch size {} is below critical size {} for {}. Consider increasing for optimal "
                              "throughput.",
                              batch_size, rec.critical_batch_size, hw)};
  if (batch_size >= rec.optimal_batch_size)
    return {true, fmt::format("Batch size {} is optimal for {}.", batch_size, hw)};
  return {true, fmt::format("Batch size {} is acceptable for {}.", batch_size, hw)};
}

BatchSizeCheck validate_batch_size(int64_t batch_size, bool warn_suboptimal) {
  return validate_batch_size(batch_size, detect_devices().type, warn_suboptimal);
}

HardwareType classify_device_name(std::string_view name) {
  const std::vector<std::string> w = words(name);
  if (has_word(w, "tpu")) {
    if (has_word(w, "v5e") || has_pair(w, "v5", "lite") || has_word(w, "v5lite") || has_word(w, "v5litepod"))
      return HardwareType::tpu_v5e;
    if (has_word(w, "v5p")) return HardwareType::tpu_v5p;
    if (has_word(w, "v4") && !has_pair(w, "v4", "lite")) return HardwareType::tpu_v4;
    return HardwareType::unknown;
  }
  constexpr std::pair<std::string_view, HardwareType> kGpuWords[] = {
      {"h100", HardwareType::h100}, {"h200", HardwareType::h200}, {"b200", HardwareType::b200},
      {"l40s", HardwareType::l40s}, {"a100", HardwareType::a100}, {"v100", HardwareType::v100},
      {"v100s", HardwareType::v100}};
  std::optional<HardwareType> found;
  for (const auto& [word, type] : kGpuWords) {
    if (!has_word(w, word)) continue;
    if (found && *found != type) return HardwareType::unknown;  // two models in one name: do not guess
    found = type;
  }
  return found.value_or(HardwareType::unknown);
}

// ---- Parsers ---------------------------------------------------------------------

std::vector<DetectedDevice> parse_nvidia_smi_csv(std::string_view text) {
  std::vector<DetectedDevice> out;
  for (std::string_view raw : split(text, '\n')) {
    const std::string_view line = trim(raw);
    if (line.empty()) continue;
    const std::vector<std::string_view> parts = split(line, ',');
    if (parts.size() < 3)
      throw InvalidArgument("parse_nvidia_smi_csv", fmt::format("line '{}' has {} fields", line, parts.size()),
                            "expect 'index, name, memory MiB' (--query-gpu=index,name,memory.total "
                            "--format=csv,noheader,nounits)");
    DetectedDevice d;
    d.platform = "cuda";
    d.index =
        static_cast<int>(parse_int_in_range(trim(parts.front()), "GPU index", 0, 1 << 20, "parse_nvidia_smi_csv"));
    // A name with commas keeps them: everything between the first and last field.
    const size_t first = line.find(','), last = line.rfind(',');
    d.name = std::string(trim(line.substr(first + 1, last - first - 1)));
    const std::string_view mem = trim(parts.back());
    if (!mem.empty() &&
        std::all_of(mem.begin(), mem.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
      d.memory_bytes = parse_int_in_range(mem, "GPU memory (MiB)", 0, int64_t{1} << 40, "parse_nvidia_smi_csv") << 20;
    d.type = classify_device_name(d.name);
    out.push_back(std::move(d));
  }
  return out;
}

std::string parse_nvidia_proc_model(std::string_view text) { return squeeze_spaces(field(text, "Model")); }

std::string parse_cpu_model(std::string_view cpuinfo) {
  for (std::string_view key : {"model name", "Model", "Hardware", "cpu"}) {
    const std::string v = squeeze_spaces(field(cpuinfo, key));
    if (!v.empty()) return v;
  }
  return "";
}

// ---- Detection -----------------------------------------------------------------------

std::vector<std::string> DeviceInfo::platforms() const {
  std::vector<std::string> out;
  for (const auto& d : devices)
    if (std::find(out.begin(), out.end(), d.platform) == out.end()) out.push_back(d.platform);
  return out;
}

std::string DeviceInfo::to_string() const {
  std::string out = fmt::format("{} device{}, hardware type {} (from {})\n", num_devices(),
                                num_devices() == 1 ? "" : "s", hardware_name(type), source);
  for (const auto& d : devices) {
    std::string what = d.platform == "cpu" ? fmt::format("{} logical CPUs", d.cpus) : "";
    if (d.memory_bytes > 0) what += (what.empty() ? "" : ", ") + gib(d.memory_bytes);
    out += fmt::format("  {}:{}  {}  {}{}\n", d.platform, d.index, d.name, hardware_name(d.type),
                       what.empty() ? "" : "  " + what);
  }
  if (!devices.empty() && mixed(devices)) out += "  (mixed hardware: the recommendation is the one for unknown)\n";
  for (const auto& n : notes) out += fmt::format("  note: {}\n", n);
  return out;
}

DeviceInfo detect_devices(const DetectOptions& options) {
  DeviceInfo info;
  const fs::path proc(options.proc_root);
  if (!options.nvidia_smi.empty()) {
    const ProgramOutput smi = run_program(
        {options.nvidia_smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"}, options.timeout);
    if (smi.ran) {
      try {
        info.devices = parse_nvidia_smi_csv(smi.out);
        if (info.devices.empty()) info.notes.push_back(options.nvidia_smi + " lists no GPU");
      } catch (const InvalidArgument& e) {
        info.notes.push_back(fmt::format("{}'s output was not understood: {}", options.nvidia_smi, e.what()));
      }
      if (!info.devices.empty()) info.source = "nvidia-smi";
    } else if (!smi.missing) {
      info.notes.push_back(smi.failure);
    }
  }
  if (info.devices.empty()) {
    info.devices = gpus_from_proc(proc / "driver" / "nvidia" / "gpus", info.notes);
    if (!info.devices.empty()) info.source = (proc / "driver" / "nvidia" / "gpus").string();
  }
  if (info.devices.empty()) {
    info.devices.push_back(this_cpu(proc, info.notes));
    info.source = (proc / "cpuinfo").string();
  }
  info.type = common_type(info.devices);
  return info;
}

}  // namespace meshtrain::plan
