// meshtrain devices: the hardware this process sees and its batch-size
// advice (meshtrain/plan/device_placement.h, docs/device-placement.md).
//
//   meshtrain devices                          detected devices, their type's row
//   meshtrain devices --batch-size 128         ... and the check of 128 per device
//   meshtrain devices --hardware h200 --batch-size 128   advice for another machine
//   meshtrain devices --table                  every type's row
// Exit status 1 when --batch-size is below the minimum for the hardware.
#include <fmt/format.h>

#include <memory>

#include "cli/command.h"
#include "meshtrain/core/error.h"
#include "meshtrain/plan/device_placement.h"

namespace meshtrain::cli {
namespace {

struct DeviceFlags {
  int64_t batch_size = 0;  // 0: no check
  std::string hardware;    // "": the detected type
  bool no_warn_suboptimal = false;
  bool table = false;
};

std::string type_names() {
  std::string out;
  for (plan::HardwareType t : plan::kHardwareTypes)
    out += (out.empty() ? "" : ", ") + std::string(plan::hardware_name(t));
  return out;
}

void print_row(plan::HardwareType t) {
  const plan::BatchSizeRecommendation r = plan::get_batch_size_recommendation(t);
  fmt::print("batch size per device for {} ({}): min {}, critical {}, optimal {}\n  {}\n", plan::hardware_name(t),
             plan::in_seed_table(t) ? "the seeds' table" : "derived", r.min_batch_size, r.critical_batch_size,
             r.optimal_batch_size, r.notes);
}

int run_devices(const DeviceFlags& f) {
  print_config("devices", {{"hardware", f.table              ? "-"
                                        : f.hardware.empty() ? "detected"
                                                             : f.hardware},
                           {"batch_size", f.batch_size > 0 ? std::to_string(f.batch_size) : "-"},
                           {"warn_suboptimal", f.no_warn_suboptimal ? "false" : "true"}});
  if (f.table) {
    fmt::print("{:<8} {:>5} {:>9} {:>8}  {}\n", "type", "min", "critical", "optimal", "source");
    for (plan::HardwareType t : plan::kHardwareTypes) {
      const plan::BatchSizeRecommendation r = plan::get_batch_size_recommendation(t);
      fmt::print("{:<8} {:>5} {:>9} {:>8}  {}\n", plan::hardware_name(t), r.min_batch_size, r.critical_batch_size,
                 r.optimal_batch_size, plan::in_seed_table(t) ? "seeds" : "derived from h100 (see notes)");
    }
    return 0;
  }
  plan::HardwareType type;
  if (f.hardware.empty()) {
    const plan::DeviceInfo info = plan::detect_devices();
    fmt::print("{}", info.to_string());
    type = info.type;
  } else {
    const auto parsed = plan::parse_hardware_type(f.hardware);
    if (!parsed)
      throw InvalidArgument("meshtrain devices", fmt::format("--hardware: unknown type '{}'", f.hardware),
                            fmt::format("use one of {}", type_names()));
    type = *parsed;
  }
  print_row(type);
  if (f.batch_size > 0) {
    const plan::BatchSizeCheck check = plan::validate_batch_size(f.batch_size, type, !f.no_warn_suboptimal);
    fmt::print("{}\n", check.message);
    return check.ok ? 0 : 1;
  }
  return 0;
}

}  // namespace

std::vector<Command> add_device_commands(CLI::App& app) {
  auto f = std::make_shared<DeviceFlags>();
  auto* cmd = app.add_subcommand(
      "devices", "print the detected hardware and its batch-size advice; check a batch size (--batch-size)");
  cmd->add_option("--batch-size", f->batch_size, "batch size per device to check against the advice")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--hardware", f->hardware,
                  fmt::format("advise for this type instead of the detected one: {}", type_names()));
  cmd->add_flag("--no-warn-suboptimal", f->no_warn_suboptimal,
                "call a size between the minimum and the critical one acceptable, without the warning");
  cmd->add_flag("--table", f->table, "print every hardware type's row and exit");
  return {{cmd, [=] { return run_devices(*f); }}};
}

}  // namespace meshtrain::cli
