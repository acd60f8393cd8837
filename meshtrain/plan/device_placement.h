// Device placement advice: which hardware this process runs on, the batch
// size per device that keeps it busy, and a check of a chosen batch size.
//
//   get_batch_size_recommendation(HardwareType::h100);  // {64, 320, 298, "..."}
//   classify_device_name("NVIDIA H200");                 // HardwareType::h200
//   classify_device_name("NVIDIA GeForce RTX 4090");     // HardwareType::unknown
//   validate_batch_size(128, HardwareType::h100);
//     // {true, "Batch size 128 is below critical size 298 for h100. Consider increasing ..."}
//   DeviceInfo info = detect_devices();  // the GPUs nvidia-smi lists, else this CPU
//   fmt::print("{}", info.to_string());
//
// The table (docs/device-placement.md) holds the seeds' eight rows exactly
// and rows for newer GPUs derived by one stated rule from the H100 row
// (derived_critical_batch_size); a device whose name matches no row is
// reported as unknown, with its name, never as another model.
//
// Detection touches no device and links no CUDA: it reads `nvidia-smi`'s CSV
// output (bounded by a deadline; the child is killed past it), else
// /proc/driver/nvidia/gpus/*/information, else describes the CPU from
// /proc/cpuinfo and /proc/meminfo. It lists what the driver sees;
// CUDA_VISIBLE_DEVICES is not applied.
//
// Thread-safety: every function may be called from any thread. All but
// detect_devices (and the validate_batch_size overload that calls it) are
// pure functions of their arguments.
// Errors: InvalidArgument with the operation, the values and what to change.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::plan {

// The seeds' types first (their values, "tpu_v5e" ... "unknown", are the
// names hardware_name returns), then meshtrain's additions (h200, b200,
// l40s), whose rows are derived (docs/device-placement.md).
enum class HardwareType : uint8_t {
  tpu_v5e,
  tpu_v5p,
  tpu_v4,
  h100,
  a100,
  v100,
  cpu,
  unknown,
  h200,
  b200,
  l40s,
};

// Every type, in declaration order.
inline constexpr std::array<HardwareType, 11> kHardwareTypes = {
    HardwareType::tpu_v5e, HardwareType::tpu_v5p, HardwareType::tpu_v4, HardwareType::h100,
    HardwareType::a100,    HardwareType::v100,    HardwareType::cpu,    HardwareType::unknown,
    HardwareType::h200,    HardwareType::b200,    HardwareType::l40s};

// "tpu_v5e", "tpu_v5p", "tpu_v4", "h100", "a100", "v100", "cpu", "unknown",
// "h200", "b200", "l40s".
std::string_view hardware_name(HardwareType type);
// The type named `name` (hardware_name's spelling, any case); nullopt for
// any other text.
std::optional<HardwareType> parse_hardware_type(std::string_view name);
// True for the eight types of the seeds' table; false for meshtrain's additions.
bool in_seed_table(HardwareType type);

struct BatchSizeRecommendation {
  int64_t min_batch_size = 0;       // below it the device is mostly idle
  int64_t optimal_batch_size = 0;   // at or above it: peak throughput
  int64_t critical_batch_size = 0;  // compute-bound from here on (the roofline)
  std::string notes;                // where the numbers come from
  bool operator==(const BatchSizeRecommendation&) const = default;
};

// The batch size per device for `type` (the table in docs/device-placement.md).
BatchSizeRecommendation get_batch_size_recommendation(HardwareType type);

// The rule for rows the seeds lack, anchored on their H100 row (critical 298
// at 989 TFLOP/s dense bf16 and 3.35 TB/s of HBM): the critical batch size
// grows with compute and shrinks with memory bandwidth,
//   critical = round(298 * (flops / 989e12) * (3.35e12 / bytes_per_s)).
// Requires both arguments > 0 (else InvalidArgument).
int64_t derived_critical_batch_size(double dense_bf16_flops, double memory_bytes_per_s);
// The smallest multiple of 64 above `critical` (strictly): the seeds' optimal
// size for each of their accelerator rows (298 -> 320, 240 -> 256, 192 -> 256,
// 480 -> 512, 96 -> 128, 64 -> 128); used for the derived rows.
int64_t optimal_batch_size_for(int64_t critical);

struct BatchSizeCheck {
  bool ok = false;
  std::string message;
};

// Checks a per-device batch size against type's row, with the seeds' rules
// and messages (hw = hardware_name(type)):
//   batch < min                          -> not ok, "Batch size B is below minimum recommended M for hw.
//                                           Performance will be significantly degraded."
//   batch < critical and warn_suboptimal -> ok, "Batch size B is below critical size C for hw.
//                                           Consider increasing for optimal throughput."
//   batch >= optimal                     -> ok, "Batch size B is optimal for hw."
//   otherwise                            -> ok, "Batch size B is acceptable for hw."
// Requires batch_size >= 1 (else InvalidArgument).
BatchSizeCheck validate_batch_size(int64_t batch_size, HardwareType type, bool warn_suboptimal = true);

// ---- Detection --------------------------------------------------------------

// The type of an accelerator's name, from whole words of it (letters and
// digits, any case), so a longer model number never matches a shorter one:
//   TPU names (a word "tpu"): "v5e", "v5 lite" or "v5litepod" -> tpu_v5e,
//     "v5p" -> tpu_v5p, "v4" (not "v4 lite") -> tpu_v4; others -> unknown.
//   Other names: "h100", "h200", "b200", "l40s", "a100", "v100" or "v100s"
//     -> that type ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB");
//     "GH200", "GB200", "H20", "H800", "RTX 4090", ... -> unknown.
// Never returns cpu: a CPU is known by where it was found, not its name.
HardwareType classify_device_name(std::string_view name);

struct DetectedDevice {
  int index = 0;         // 0, 1, ... in the driver's (PCI bus) order
  std::string platform;  // "cuda" or "cpu"
  std::string name;      // "NVIDIA H100 80GB HBM3", "AMD EPYC 7B13"
  HardwareType type = HardwareType::unknown;
  int64_t memory_bytes = 0;  // 0 when not known
  int cpus = 0;              // cpu: logical CPUs this process may run on
};

struct DeviceInfo {
  std::vector<DetectedDevice> devices;  // the GPUs when any, else one cpu device
  // devices[0].type when every device has it, else unknown (mixed hardware).
  HardwareType type = HardwareType::unknown;
  std::string source;              // "nvidia-smi", "/proc/driver/nvidia/gpus", "/proc/cpuinfo"
  std::vector<std::string> notes;  // what detection tried and why it moved on

  int num_devices() const { return static_cast<int>(devices.size()); }
  // "cuda" and/or "cpu", each once.
  std::vector<std::string> platforms() const;
  // Several lines: the count, type and source, then one line per device
  // ("cuda:0  NVIDIA H200  h200  141 GiB"), unknown ones with their name.
  std::string to_string() const;
};

struct DetectOptions {
  // Program run for GPU names (looked up in PATH unless it holds a '/');
  // "" skips it.
  std::string nvidia_smi = "nvidia-smi";
  // Where cpuinfo, meminfo and driver/nvidia/gpus are read (tests point it
  // at a fake tree).
  std::string proc_root = "/proc";
  // nvidia-smi is killed past this deadline and the /proc files are used.
  std::chrono::milliseconds timeout{10000};
};

// This machine's devices (see the header comment for the order of sources).
DeviceInfo detect_devices(const DetectOptions& options = {});

// The same check for the detected hardware (runs detect_devices()).
BatchSizeCheck validate_batch_size(int64_t batch_size, bool warn_suboptimal = true);

// Parsers behind detect_devices, pure:
// Lines "0, NVIDIA H100 80GB HBM3, 81559" of
//   nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits
// (memory in MiB; "[N/A]" gives 0). Throws InvalidArgument naming a line
// that does not have that form.
std::vector<DetectedDevice> parse_nvidia_smi_csv(std::string_view text);
// The "Model:" value of a /proc/driver/nvidia/gpus/<bus>/information file;
// "" when there is none.
std::string parse_nvidia_proc_model(std::string_view text);
// The CPU's name from /proc/cpuinfo: "model name", else "Model", "Hardware"
// or "cpu" (other architectures); "" when none is present. Runs of spaces
// become one.
std::string parse_cpu_model(std::string_view cpuinfo);

}  // namespace meshtrain::plan
