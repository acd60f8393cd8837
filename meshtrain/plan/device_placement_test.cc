// Device-placement tests: the seeds' batch-size table row by row, the rule
// behind the derived rows, device-name classification (newer and unknown
// GPUs and TPUs never reported as another model), the validation messages
// at every boundary, the detection parsers, detection from a fake /proc
// tree and a fake nvidia-smi, and detection on this machine.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/testing/testing.h"

#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/device_placement.h"

namespace meshtrain::plan {
namespace {

using meshtrain::testing::error_of;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// ---- The table -----------------------------------------------------------------

TEST(BatchSizeTable, ReproducesTheSeedsTableExactly) {
  struct Row {
    HardwareType type;
    const char* name;
    int64_t min, optimal, critical;
  };
  // The seeds' table (HardwareType values and BatchSizeRecommendation rows).
  const Row seeds[] = {
      {HardwareType::tpu_v5e, "tpu_v5e", 64, 256, 240},
      {HardwareType::tpu_v5p, "tpu_v5p", 128, 512, 480},
      {HardwareType::tpu_v4, "tpu_v4", 64, 256, 192},
      {HardwareType::h100, "h100", 64, 320, 298},
      {HardwareType::a100, "a100", 32, 256, 240},
      {HardwareType::v100, "v100", 16, 128, 96},
      {HardwareType::cpu, "cpu", 1, 32, 16},
      {HardwareType::unknown, "unknown", 32, 128, 64},
  };
  for (const Row& r : seeds) {
    const BatchSizeRecommendation rec = get_batch_size_recommendation(r.type);
    EXPECT_EQ(hardware_name(r.type), r.name);
    EXPECT_EQ(rec.min_batch_size, r.min) << r.name;
    EXPECT_EQ(rec.optimal_batch_size, r.optimal) << r.name;
    EXPECT_EQ(rec.critical_batch_size, r.critical) << r.name;
    EXPECT_FALSE(rec.notes.empty()) << r.name;
    EXPECT_TRUE(in_seed_table(r.type)) << r.name;
  }
  EXPECT_EQ(get_batch_size_recommendation(HardwareType::h100).notes,
            "Critical batch size for reaching roofline on H100.");
  EXPECT_EQ(get_batch_size_recommendation(HardwareType::unknown).notes, "Conservative defaults for unknown hardware.");
}

TEST(BatchSizeTable, OptimalRuleReproducesEverySeedAcceleratorRow) {
  for (HardwareType t : kHardwareTypes) {
    if (t == HardwareType::cpu) continue;  // the one row the rule does not give (16 -> 32, not 64)
    const BatchSizeRecommendation rec = get_batch_size_recommendation(t);
    EXPECT_EQ(optimal_batch_size_for(rec.critical_batch_size), rec.optimal_batch_size) << hardware_name(t);
    EXPECT_LT(rec.min_batch_size, rec.critical_batch_size) << hardware_name(t);
    EXPECT_LT(rec.critical_batch_size, rec.optimal_batch_size) << hardware_name(t);
  }
  EXPECT_EQ(optimal_batch_size_for(0), 64);
  EXPECT_EQ(optimal_batch_size_for(63), 64);
  EXPECT_EQ(optimal_batch_size_for(64), 128);
}

TEST(BatchSizeTable, DerivedRowsFollowTheStatedRuleFromTheH100Row) {
  // The anchor: H100's datasheet numbers give the seeds' 298.
  EXPECT_EQ(derived_critical_batch_size(989e12, 3.35e12), 298);
  // H200: H100's compute, 4.8 TB/s: 298 x 3.35 / 4.8 = 207.98.
  EXPECT_EQ(get_batch_size_recommendation(HardwareType::h200),
            (BatchSizeRecommendation{64, 256, 208, get_batch_size_recommendation(HardwareType::h200).notes}));
  // B200: 2250 TFLOP/s, 8 TB/s: 298 x 2250 / 989 x 3.35 / 8 = 283.9.
  const BatchSizeRecommendation b200 = get_batch_size_recommendation(HardwareType::b200);
  EXPECT_EQ(b200.min_batch_size, 64);
  EXPECT_EQ(b200.critical_batch_size, 284);
  EXPECT_EQ(b200.optimal_batch_size, 320);
  // L40S: 362 TFLOP/s, 0.864 TB/s: 298 x 362 / 989 x 3.35 / 0.864 = 422.9.
  const BatchSizeRecommendation l40s = get_batch_size_recommendation(HardwareType::l40s);
  EXPECT_EQ(l40s.critical_batch_size, 423);
  EXPECT_EQ(l40s.optimal_batch_size, 448);
  for (HardwareType t : {HardwareType::h200, HardwareType::b200, HardwareType::l40s}) {
    EXPECT_FALSE(in_seed_table(t));
    EXPECT_THAT(get_batch_size_recommendation(t).notes, HasSubstr("Not in the seeds' table; derived from"));
    // A derived row is its own, never a copy of another model's.
    for (HardwareType s : kHardwareTypes)
      if (s != t && in_seed_table(s)) {
        EXPECT_NE(get_batch_size_recommendation(t).critical_batch_size,
                  get_batch_size_recommendation(s).critical_batch_size)
            << hardware_name(t) << " vs " << hardware_name(s);
      }
  }
  EXPECT_THAT(get_batch_size_recommendation(HardwareType::b200).notes,
              HasSubstr("critical = 298 x (2250 / 989) x (3.35 / 8) = 284"));
  EXPECT_THAT(error_of([] { derived_critical_batch_size(0, 1e12); }), HasSubstr("both > 0"));
}

TEST(HardwareNames, RoundTripAndRejectOthers) {
  for (HardwareType t : kHardwareTypes) EXPECT_EQ(parse_hardware_type(hardware_name(t)), t);
  EXPECT_EQ(parse_hardware_type(" H200 "), HardwareType::h200);
  EXPECT_EQ(parse_hardware_type("TPU_V5E"), HardwareType::tpu_v5e);
  EXPECT_EQ(parse_hardware_type("rtx4090"), std::nullopt);
  EXPECT_EQ(parse_hardware_type(""), std::nullopt);
}

// ---- Classification ---------------------------------------------------------------

TEST(ClassifyDeviceName, KnownGpusByWholeWords) {
  EXPECT_EQ(classify_device_name("NVIDIA H100 80GB HBM3"), HardwareType::h100);
  EXPECT_EQ(classify_device_name("NVIDIA H100 PCIe"), HardwareType::h100);
  EXPECT_EQ(classify_device_name("NVIDIA A100-SXM4-80GB"), HardwareType::a100);
  EXPECT_EQ(classify_device_name("NVIDIA A100-PCIE-40GB"), HardwareType::a100);
  EXPECT_EQ(classify_device_name("Tesla V100-SXM2-16GB"), HardwareType::v100);
  EXPECT_EQ(classify_device_name("Tesla V100S-PCIE-32GB"), HardwareType::v100);
  EXPECT_EQ(classify_device_name("NVIDIA L40S"), HardwareType::l40s);
}

TEST(ClassifyDeviceName, NewerGpusAreThemselvesNeverA100OrH100) {
  // The seeds reported every GPU they did not list as A100.
  EXPECT_EQ(classify_device_name("NVIDIA H200"), HardwareType::h200);
  EXPECT_EQ(classify_device_name("NVIDIA H200 NVL"), HardwareType::h200);
  EXPECT_EQ(classify_device_name("NVIDIA B200"), HardwareType::b200);
  EXPECT_EQ(classify_device_name("nvidia b200"), HardwareType::b200);
  for (const char* name : {"NVIDIA H200", "NVIDIA B200", "NVIDIA GH200 480GB", "NVIDIA GB200"}) {
    EXPECT_NE(classify_device_name(name), HardwareType::a100) << name;
    EXPECT_NE(classify_device_name(name), HardwareType::h100) << name;
  }
}

TEST(ClassifyDeviceName, UnknownGpusAndTpusAreUnknown) {
  // Other models whose names contain a listed one as a substring, and models not in the table.
  for (const char* name : {"NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "NVIDIA GB200", "NVIDIA H20", "NVIDIA H800",
                           "NVIDIA A800-SXM4-80GB", "NVIDIA A10", "NVIDIA L40", "NVIDIA RTX A6000", "Tesla T4",
                           "AMD Instinct MI300X", "", "H100 A100"})
    EXPECT_EQ(classify_device_name(name), HardwareType::unknown) << name;
  // The seeds reported every TPU they did not list as v4.
  for (const char* name : {"TPU v3", "TPU v6 lite", "TPU v5", "TPU v4 lite", "TPU v2", "TPU7x"})
    EXPECT_EQ(classify_device_name(name), HardwareType::unknown) << name;
}

TEST(ClassifyDeviceName, TpuKinds) {
  EXPECT_EQ(classify_device_name("TPU v5 lite"), HardwareType::tpu_v5e);
  EXPECT_EQ(classify_device_name("TPU v5e"), HardwareType::tpu_v5e);
  EXPECT_EQ(classify_device_name("TPU v5litepod"), HardwareType::tpu_v5e);
  EXPECT_EQ(classify_device_name("TPU v5p"), HardwareType::tpu_v5p);
  EXPECT_EQ(classify_device_name("TPU v4"), HardwareType::tpu_v4);
  // TPU words only count on TPU names.
  EXPECT_EQ(classify_device_name("Some v4 accelerator"), HardwareType::unknown);
}

// ---- Validation ---------------------------------------------------------------------

TEST(ValidateBatchSize, SeedMessagesAtEveryBoundary) {
  // H100: min 64, critical 298, optimal 320.
  const auto h = HardwareType::h100;
  EXPECT_FALSE(validate_batch_size(63, h).ok);
  EXPECT_EQ(validate_batch_size(63, h).message,
            "Batch size 63 is below minimum recommended 64 for h100. Performance will be significantly degraded.");
  EXPECT_TRUE(validate_batch_size(64, h).ok);
  EXPECT_EQ(validate_batch_size(64, h).message,
            "Batch size 64 is below critical size 298 for h100. Consider increasing for optimal throughput.");
  EXPECT_EQ(validate_batch_size(297, h).message,
            "Batch size 297 is below critical size 298 for h100. Consider increasing for optimal throughput.");
  EXPECT_EQ(validate_batch_size(298, h).message, "Batch size 298 is acceptable for h100.");
  EXPECT_EQ(validate_batch_size(319, h).message, "Batch size 319 is acceptable for h100.");
  EXPECT_EQ(validate_batch_size(320, h).message, "Batch size 320 is optimal for h100.");
  EXPECT_EQ(validate_batch_size(4096, h).message, "Batch size 4096 is optimal for h100.");
  // Without the warning, [min, critical) is acceptable; below min is still refused.
  EXPECT_EQ(validate_batch_size(64, h, false).message, "Batch size 64 is acceptable for h100.");
  EXPECT_TRUE(validate_batch_size(64, h, false).ok);
  EXPECT_FALSE(validate_batch_size(63, h, false).ok);
  // Every row, every boundary.
  for (HardwareType t : kHardwareTypes) {
    const BatchSizeRecommendation r = get_batch_size_recommendation(t);
    const std::string hw(hardware_name(t));
    if (r.min_batch_size > 1) {
      EXPECT_FALSE(validate_batch_size(r.min_batch_size - 1, t).ok) << hw;
    }
    EXPECT_THAT(validate_batch_size(r.min_batch_size, t).message, HasSubstr("Consider increasing")) << hw;
    EXPECT_THAT(validate_batch_size(r.critical_batch_size, t).message, HasSubstr("acceptable for " + hw)) << hw;
    EXPECT_THAT(validate_batch_size(r.optimal_batch_size, t).message, HasSubstr("optimal for " + hw)) << hw;
  }
  EXPECT_EQ(validate_batch_size(1, HardwareType::cpu).message,
            "Batch size 1 is below critical size 16 for cpu. Consider increasing for optimal throughput.");
  EXPECT_EQ(validate_batch_size(16, HardwareType::unknown).message,
            "Batch size 16 is below minimum recommended 32 for unknown. Performance will be significantly "
            "degraded.");
  EXPECT_THAT(error_of([] { validate_batch_size(0, HardwareType::cpu); }), HasSubstr("batch size 0 is not positive"));
}

// ---- Parsers ----------------------------------------------------------------------------

TEST(DetectionParsers, NvidiaSmiCsv) {
  const auto d =
      parse_nvidia_smi_csv("0, NVIDIA H200, 143771\n1, NVIDIA GeForce RTX 4090, 24564\n2, NVIDIA B200, [N/A]\n\n");
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].name, "NVIDIA H200");
  EXPECT_EQ(d[0].type, HardwareType::h200);
  EXPECT_EQ(d[0].memory_bytes, int64_t{143771} << 20);
  EXPECT_EQ(d[0].platform, "cuda");
  EXPECT_EQ(d[1].index, 1);
  EXPECT_EQ(d[1].type, HardwareType::unknown);
  EXPECT_EQ(d[1].name, "NVIDIA GeForce RTX 4090");
  EXPECT_EQ(d[2].type, HardwareType::b200);
  EXPECT_EQ(d[2].memory_bytes, 0);
  EXPECT_TRUE(parse_nvidia_smi_csv("").empty());
  EXPECT_THAT(error_of([] { parse_nvidia_smi_csv("No devices were found"); }), HasSubstr("has 1 fields"));
}

TEST(DetectionParsers, ProcFiles) {
  EXPECT_EQ(parse_nvidia_proc_model("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 35\n"), "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(parse_nvidia_proc_model("IRQ: 35\n"), "");
  EXPECT_EQ(parse_cpu_model("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 85\n"
                            "model name\t: Intel(R) Xeon(R)  CPU @ 2.20GHz\n"),
            "Intel(R) Xeon(R) CPU @ 2.20GHz");
  EXPECT_EQ(parse_cpu_model("processor : 0\nBogoMIPS : 50.00\nModel : Raspberry Pi 4 Model B\n"),
            "Raspberry Pi 4 Model B");
  EXPECT_EQ(parse_cpu_model("processor\t: 0\ncpu\t\t: POWER9 (raw), altivec supported\n"),
            "POWER9 (raw), altivec supported");
  EXPECT_EQ(parse_cpu_model("processor\t: 0\n"), "");
}

// ---- Detection ---------------------------------------------------------------------------

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

TEST(DetectDevices, ThisMachineWithoutGpusIsItsCpu) {
  DetectOptions o;
  o.nvidia_smi = "";  // this test is about the CPU path, GPUs or not
  o.proc_root = testing::fresh_dir("meshtrain_detect_no_gpu").string();
  write(fs::path(o.proc_root) / "cpuinfo", testing::read_file("/proc/cpuinfo"));
  write(fs::path(o.proc_root) / "meminfo", "MemTotal:       16318412 kB\n");
  const DeviceInfo info = detect_devices(o);
  ASSERT_EQ(info.num_devices(), 1);
  EXPECT_EQ(info.type, HardwareType::cpu);
  EXPECT_EQ(info.devices[0].platform, "cpu");
  EXPECT_FALSE(info.devices[0].name.empty());
  EXPECT_GE(info.devices[0].cpus, 1);
  EXPECT_EQ(info.devices[0].memory_bytes, int64_t{16318412} * 1024);
  EXPECT_EQ(info.platforms(), std::vector<std::string>{"cpu"});
  EXPECT_THAT(info.to_string(), HasSubstr("1 device, hardware type cpu"));
  // No cpuinfo at all: still a named CPU.
  fs::remove(fs::path(o.proc_root) / "cpuinfo");
  EXPECT_THAT(detect_devices(o).devices[0].name, HasSubstr("CPU"));
}

TEST(DetectDevices, DefaultDetectionOnThisMachine) {
  const DeviceInfo info = detect_devices();
  ASSERT_GE(info.num_devices(), 1);
  for (const auto& d : info.devices) EXPECT_FALSE(d.name.empty());
  if (info.devices[0].platform == "cpu") {
    // The build machine has no GPU: the CPU, with its name.
    EXPECT_EQ(info.type, HardwareType::cpu);
    EXPECT_EQ(info.source, "/proc/cpuinfo");
    EXPECT_GE(info.devices[0].cpus, 1);
  } else {
    EXPECT_EQ(info.devices[0].platform, "cuda");
  }
  fmt::print("{}", info.to_string());
  const BatchSizeCheck check = validate_batch_size(get_batch_size_recommendation(info.type).optimal_batch_size);
  EXPECT_TRUE(check.ok);
  EXPECT_THAT(check.message, HasSubstr("is optimal for " + std::string(hardware_name(info.type))));
}

TEST(DetectDevices, GpusFromProcDriverFilesInBusOrder) {
  DetectOptions o;
  o.nvidia_smi = "";
  o.proc_root = testing::fresh_dir("meshtrain_detect_proc_gpus").string();
  const fs::path gpus = fs::path(o.proc_root) / "driver" / "nvidia" / "gpus";
  write(gpus / "0000:9a:00.0" / "information", "Model: \t\t NVIDIA GeForce RTX 4090\nIRQ: \t\t 40\n");
  write(gpus / "0000:18:00.0" / "information", "Model: \t\t NVIDIA H200\nIRQ: \t\t 39\n");
  const DeviceInfo info = detect_devices(o);
  ASSERT_EQ(info.num_devices(), 2);
  EXPECT_EQ(info.devices[0].name, "NVIDIA H200");
  EXPECT_EQ(info.devices[0].type, HardwareType::h200);
  EXPECT_EQ(info.devices[1].name, "NVIDIA GeForce RTX 4090");
  EXPECT_EQ(info.devices[1].type, HardwareType::unknown);
  EXPECT_EQ(info.devices[1].index, 1);
  // Mixed hardware: no single row applies, so the conservative one.
  EXPECT_EQ(info.type, HardwareType::unknown);
  const std::string text = info.to_string();
  EXPECT_THAT(text, HasSubstr("cuda:1  NVIDIA GeForce RTX 4090  unknown"));
  EXPECT_THAT(text, HasSubstr("mixed hardware"));
}

// A fake nvidia-smi: a shell script printing `out` (after `delay` seconds).
std::string fake_smi(const std::string& name, const std::string& out, double delay = 0) {
  const fs::path dir = testing::fresh_dir(name);
  const fs::path script = dir / "nvidia-smi";
  std::ofstream(script) << fmt::format("#!/bin/sh\nsleep {}\nprintf '{}'\n", delay, out);
  chmod(script.c_str(), 0755);
  return script.string();
}

TEST(DetectDevices, GpusFromNvidiaSmi) {
  DetectOptions o;
  o.proc_root = testing::fresh_dir("meshtrain_detect_smi_proc").string();
  o.nvidia_smi = fake_smi("meshtrain_detect_smi", "0, NVIDIA B200, 183359\\n1, NVIDIA B200, 183359\\n");
  const DeviceInfo info = detect_devices(o);
  ASSERT_EQ(info.num_devices(), 2);
  EXPECT_EQ(info.source, "nvidia-smi");
  EXPECT_EQ(info.type, HardwareType::b200);
  EXPECT_EQ(info.platforms(), std::vector<std::string>{"cuda"});
  EXPECT_THAT(info.to_string(), HasSubstr("2 devices, hardware type b200 (from nvidia-smi)"));
  EXPECT_THAT(info.to_string(), HasSubstr("cuda:0  NVIDIA B200  b200  179 GiB"));
}

TEST(DetectDevices, HungNvidiaSmiIsKilledAtTheDeadline) {
  DetectOptions o;
  o.proc_root = testing::fresh_dir("meshtrain_detect_hung_proc").string();
  o.nvidia_smi = fake_smi("meshtrain_detect_hung", "0, NVIDIA H100 80GB HBM3, 81559\\n", /*delay=*/30);
  o.timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  const DeviceInfo info = detect_devices(o);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, std::chrono::seconds(5));
  EXPECT_EQ(info.type, HardwareType::cpu);  // fell back to /proc, which has no GPUs
  ASSERT_FALSE(info.notes.empty());
  EXPECT_THAT(info.notes[0], HasSubstr("gave no answer within 300 ms and was killed"));
}

TEST(DetectDevices, MissingNvidiaSmiIsNotAnError) {
  DetectOptions o;
  o.proc_root = testing::fresh_dir("meshtrain_detect_missing_proc").string();
  o.nvidia_smi = "meshtrain-no-such-program";
  const DeviceInfo info = detect_devices(o);
  EXPECT_EQ(info.type, HardwareType::cpu);
  // The only note is about the fake tree's missing cpuinfo, none about the program.
  EXPECT_THAT(info.notes, ::testing::Each(::testing::Not(HasSubstr("meshtrain-no-such-program"))));
}

}  // namespace
}  // namespace meshtrain::plan
