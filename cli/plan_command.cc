// meshtrain plan: the memory each device needs to train the GPT under a
// layout, before any job runs (meshtrain/plan/memory_model.h,
// docs/planner.md). Pure arithmetic: no ranks start.
//
//   meshtrain plan --size 6.7B --seq 2048 --batch 512 --mesh pipeline=4,data=16,tensor=8 --micro-batches 16
//   meshtrain plan --layers 4 --width 256 --heads 4 --vocab 8192 --seq 64 --batch 32 --mesh fsdp=4 --fsdp full
//   meshtrain plan ... --json                  one JSON object instead of the table
//   meshtrain plan ... --svg memory.svg        also a stacked bar per device, by category
//   meshtrain plan ... --mesh-svg mesh.svg     also the mesh over nodes (cli/plan_pictures.h)
//   meshtrain plan --devices 64 --hardware H100 ... --svg mesh.svg   the search's pick's mesh
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <fstream>
#include <memory>
#include <optional>
#include <vector>

#include "cli/command.h"
#include "cli/plan_check.h"
#include "cli/plan_pictures.h"
#include "cli/plan_search.h"
#include "cli/train_field_flags.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/train/model_parameters.h"

namespace meshtrain::cli {
namespace {

// GPT-3's shapes (Brown et al. 2020, table 2.1, with heads that divide the
// width) and Llama-2's 7B and 70B dimensions, all as meshtrain's GPT-2 block
// (a 4C MLP, full multi-head attention, tied head).
// The model and layout (train::PlanRequest, resolved by the library as
// meshtrain.plan resolves it) and what only the command does.
struct PlanFlags : train::PlanRequest {
  bool json = false;
  std::string svg;       // write the per-device memory picture here (--devices: the pick's mesh)
  std::string mesh_svg;  // write the mesh picture here
  std::string hardware;   // price the step on it: a preset or a --calibrate file
  std::string calibrate;  // measure this machine, write its rates here
  bool check = false;     // train the check's layouts here, predicted against measured
  int devices = 0;        // search the layouts for this many devices (needs --hardware)
  std::string device_memory = "80GB";
  double memory_reserve = 0.1;
  int keep = 5;
  bool published = false;
  CheckOptions check_options;
  std::shared_ptr<TrainFieldFlags> blocks;  // --arch, --kv-heads, --experts, ... (train's)
};

// The time table: per device (folded as the memory table is not: times
// differ by stage), seconds per step by part.
void print_time(const plan::TimePrediction& t, const plan::Hardware& hw, const plan::TrainingLayout& l) {
  fmt::print("\nstep time on {} ({}), ms per step:\n", hw.name, hw.source);
  fmt::print("{:<14} {:>10} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "device", "gemm", "attention",
             "elementwise", "optimizer", "comm", "exposed", "bubble", "step");
  // Tensor ranks of a stage with the same times share a row.
  const auto same = [](const plan::DeviceTime& a, const plan::DeviceTime& b) {
    return a.stage == b.stage && a.gemm == b.gemm && a.attention == b.attention && a.elementwise == b.elementwise &&
           a.optimizer == b.optimizer && a.comm == b.comm && a.step == b.step;
  };
  for (size_t i = 0; i < t.devices.size();) {
    size_t j = i + 1;
    while (j < t.devices.size() && same(t.devices[j], t.devices[i])) ++j;
    const plan::DeviceTime& d = t.devices[i];
    const int last = t.devices[j - 1].tensor_rank;
    fmt::print("{:<14} {:>10.3f} {:>10.3f} {:>12.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f}\n",
               last == d.tensor_rank ? fmt::format("stage {} tp {}", d.stage, d.tensor_rank)
                                     : fmt::format("stage {} tp {}-{}", d.stage, d.tensor_rank, last),
               d.gemm * 1e3, d.attention * 1e3, d.elementwise * 1e3, d.optimizer * 1e3, d.comm * 1e3,
               d.comm_exposed * 1e3, d.bubble * 1e3, d.step * 1e3);
    i = j;
  }
  const double per_device = t.model_flops / l.devices() / t.step;
  fmt::print("step {:.3f} ms: {}", t.step * 1e3,
             per_device >= 1e12 ? fmt::format("{:.1f} model TFLOP/s per device", per_device / 1e12)
                                : fmt::format("{:.1f} model GFLOP/s per device", per_device / 1e9));
  const double peak = l.param_dtype != DType::f32 && hw.gemm_flops_bf16 > 0 ? hw.gemm_flops_bf16 : hw.gemm_flops;
  fmt::print(" ({:.0f}% of the sustained GEMM rate)\n", 100 * per_device / peak);
  for (const auto& [group, s] : t.slowest().comm_by_group)
    fmt::print("  {:<14} {:.3f} ms of communication per step\n", group, s * 1e3);
}

// The unit of the table and the picture: the largest of GiB, MiB, KiB
// that the largest device's total reaches.
struct Unit {
  const char* name;
  double bytes;
  double of(double b) const { return b / bytes; }
};
Unit unit_for(const plan::MemoryPrediction& m) {
  const double most = m.worst().total();
  if (most >= double(uint64_t{1} << 30)) return {"GiB", double(uint64_t{1} << 30)};
  if (most >= double(uint64_t{1} << 20)) return {"MiB", double(uint64_t{1} << 20)};
  return {"KiB", 1024.0};
}

constexpr std::array<const char*, 6> kCategories = {"parameters", "gradients", "optimizer",
                                                    "working",    "activations", "comm_buffers"};

std::array<double, 6> categories(const plan::DeviceMemory& d) {
  return {d.parameters, d.gradients, d.optimizer, d.working, d.activations, d.comm_buffers};
}

// Devices of a stage that need the same bytes, as one row: [first, last).
std::vector<std::pair<size_t, size_t>> folded_rows(const plan::MemoryPrediction& m) {
  std::vector<std::pair<size_t, size_t>> rows;
  for (size_t i = 0; i < m.devices.size();) {
    size_t j = i + 1;
    while (j < m.devices.size() && m.devices[j].stage == m.devices[i].stage &&
           categories(m.devices[j]) == categories(m.devices[i]))
      ++j;
    rows.emplace_back(i, j);
    i = j;
  }
  return rows;
}

std::string row_name(const plan::MemoryPrediction& m, std::pair<size_t, size_t> r) {
  const plan::DeviceMemory& d = m.devices[r.first];
  const int last = m.devices[r.second - 1].tensor_rank;
  return last == d.tensor_rank ? fmt::format("stage {} tp {}", d.stage, d.tensor_rank)
                               : fmt::format("stage {} tp {}-{}", d.stage, d.tensor_rank, last);
}

// One stacked bar per row of the table, by category, with a legend.
std::string memory_svg(const plan::MemoryPrediction& m, const std::string& title) {
  static constexpr std::array<const char*, 6> kColors = {"#4e79a7", "#f28e2b", "#e15759",
                                                         "#76b7b2", "#59a14f", "#b07aa1"};
  const auto rows = folded_rows(m);
  const double bar = 36, gap = 14, left = 70, top = 40, height = 260;
  const double width = std::max(left + static_cast<double>(rows.size()) * (bar + gap) + 170,
                                left + 7.5 * static_cast<double>(title.size()));  // the title fits
  double most = 0;
  const Unit u = unit_for(m);
  for (const plan::DeviceMemory& d : m.devices) most = std::max(most, u.of(d.total()));
  const double scale = most > 0 ? height / most : 0;
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"11\">\n<text x=\"{:.0f}\" y=\"20\" font-size=\"13\">{}</text>\n",
      width, top + height + 90, left, title);
  for (int t = 0; t <= 4; ++t) {  // the axis: 0 .. most
    const double y = top + height - height * t / 4;
    s += fmt::format("<line x1=\"{:.0f}\" x2=\"{:.0f}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>"
                     "<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g} {}</text>\n",
                     left, width - 170, y, y, left - 6, y + 4, most * t / 4, u.name);
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    const double x = left + gap / 2 + static_cast<double>(r) * (bar + gap);
    double y = top + height;
    const auto v = categories(m.devices[rows[r].first]);
    for (size_t c = 0; c < v.size(); ++c) {
      const double h = u.of(v[c]) * scale;
      y -= h;
      if (h > 0)
        s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.0f}\" height=\"{:.2f}\" fill=\"{}\">"
                         "<title>{}: {:.3f} {}</title></rect>\n",
                         x, y, bar, h, kColors[c], kCategories[c], u.of(v[c]), u.name);
    }
    s += fmt::format("<text transform=\"translate({:.1f},{:.0f}) rotate(45)\">{}</text>\n", x + 4,
                     top + height + 12, row_name(m, rows[r]));
  }
  for (size_t c = 0; c < kCategories.size(); ++c)
    s += fmt::format("<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"12\" height=\"12\" fill=\"{}\"/>"
                     "<text x=\"{:.0f}\" y=\"{:.0f}\">{}</text>\n",
                     width - 150, top + 18 * static_cast<double>(c), kColors[c], width - 132,
                     top + 10 + 18 * static_cast<double>(c), kCategories[c]);
  return s + "</svg>\n";
}

// "gpt2", or "llama kv_heads=8 ffn_hidden=14336 experts=8 top_k=2 ..." for
// the config line.
std::string blocks_of(const plan::GptShape& g) {
  if (!g.llama()) return "gpt2";
  std::string out = fmt::format("llama kv_heads={} ffn_hidden={}", g.key_value_heads(), g.mlp_hidden());
  if (g.moe.active())
    out += fmt::format(" experts={} top_k={} expert_hidden={} shared_experts={} first_dense={}", g.moe.experts,
                       g.moe.top_k, g.expert_hidden(), g.moe.shared_experts, g.moe.first_dense);
  return out;
}

int run_plan(PlanFlags f) {
  train::TrainConfig blocks;
  f.blocks->apply(blocks);
  f.set_blocks(blocks);
  const train::PlannedRun planned = train::resolve_plan_request(f);
  const plan::GptShape& g = planned.shape;
  const plan::TrainingLayout& l = planned.layout;
  const std::string& fsdp = planned.fsdp;
  const DType precision = l.param_dtype;
  const layout::ContextComm cp_comm = l.cp_comm;
  if (f.published) return run_published_runs();
  if (f.devices > 0) {
    if (f.hardware.empty())
      throw InvalidArgument("meshtrain plan", fmt::format("--devices {} without --hardware", f.devices),
                            "say what the devices are: --hardware H100 (or A100, or a --calibrate file)");
    const plan::SearchOptions o{.devices = f.devices, .batch = f.batch,
                                .device_memory = plan::parse_memory_size(f.device_memory, "--device-memory"),
                                .reserve = f.memory_reserve,
                                .precision = precision == DType::f32 ? DType::f32 : DType::bf16, .keep = f.keep,
                                .cp_comm = cp_comm, .expert_imbalance = f.expert_imbalance};
    std::vector<PictureFile> pictures;
    if (!f.svg.empty()) pictures.push_back({.flag = "--svg", .path = f.svg});
    if (!f.mesh_svg.empty()) pictures.push_back({.flag = "--mesh-svg", .path = f.mesh_svg});
    return run_plan_search(g, o, load_hardware(f.hardware), f.size.empty() ? "the GPT" : "GPT " + f.size, pictures);
  }
  if (f.check || !f.calibrate.empty()) {
    CheckOptions o = f.check_options;
    o.shape = g;
    o.batch = f.batch;
    if (f.check) return run_plan_check(o);
    const plan::Hardware hw = calibrate_this_machine(o);
    std::ofstream out(f.calibrate);
    out << hardware_json(hw) << "\n";
    if (!out) throw IoError("meshtrain plan", fmt::format("--calibrate {}: cannot write it", f.calibrate), "check the path");
    fmt::print("wrote {} (use it with --hardware {})\n", f.calibrate, f.calibrate);
    return 0;
  }
  const plan::MemoryPrediction m = plan::predict_memory(g, l);
  const std::optional<plan::Hardware> hw =
      f.hardware.empty() ? std::nullopt : std::optional<plan::Hardware>(load_hardware(f.hardware));
  const std::optional<plan::TimePrediction> time =
      hw ? std::optional<plan::TimePrediction>(plan::predict_time(g, l, *hw)) : std::nullopt;
  const plan::DeviceMemory& worst = m.worst();
  if (!f.svg.empty()) {
    std::ofstream out(f.svg);
    out << memory_svg(m, escape_xml(fmt::format("memory per device: GPT {} layers, width {}, mesh {}", g.layers,
                                                g.width, f.mesh)));
    if (!out) throw IoError("meshtrain plan", fmt::format("--svg {}: cannot write it", f.svg), "check the path");
  }
  if (!f.mesh_svg.empty()) {
    // Ranks as the runtime numbers them: in the order --mesh lists the axes.
    const std::string options = plan::describe_layout(l);  // the mesh in the planner's order, then the options
    const size_t space = options.find(' ');
    MeshPictureOptions o{.devices_per_node = hw ? hw->devices_per_node : 8,
                         .title = fmt::format("{}{}: {}{}",
                                              f.size.empty() ? fmt::format("GPT {} layers, width {}", g.layers, g.width)
                                                             : fmt::format("GPT {}", f.size),
                                              hw ? fmt::format(" on {} x {}", l.devices(), hw->name) : "", f.mesh,
                                              space == std::string::npos ? "" : options.substr(space))};
    if (!hw) o.note = "8 devices per node assumed (--hardware gives the node size)";
    write_picture({.flag = "--mesh-svg", .path = f.mesh_svg}, mesh_svg(l, o));
  }
  if (f.json) {
    nlohmann::json j;
    j["model"] = {{"layers", g.layers}, {"heads", g.heads}, {"width", g.width}, {"vocab", g.vocab}, {"seq", f.seq}};
    j["mesh"] = f.mesh;
    j["fsdp"] = fsdp;
    j["precision"] = f.precision;
    j["batch"] = f.batch;
    j["micro_batches"] = f.micro_batches;
    for (const plan::DeviceMemory& d : m.devices) {
      nlohmann::json dj = {{"stage", d.stage}, {"tensor_rank", d.tensor_rank}, {"total", d.total()},
                           {"in_flight", d.in_flight}, {"peak_at", d.peak_at}};
      const auto v = categories(d);
      for (size_t i = 0; i < v.size(); ++i) dj[kCategories[i]] = v[i];
      j["devices"].push_back(dj);
    }
    if (time) {
      j["hardware"] = hw->name;
      j["step_seconds"] = time->step;
      for (const plan::DeviceTime& d : time->devices)
        j["time"].push_back({{"stage", d.stage}, {"tensor_rank", d.tensor_rank}, {"gemm", d.gemm},
                             {"attention", d.attention}, {"elementwise", d.elementwise}, {"optimizer", d.optimizer},
                             {"comm", d.comm}, {"comm_exposed", d.comm_exposed}, {"bubble", d.bubble},
                             {"step", d.step}});
    }
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  print_config("plan", {{"model", f.size.empty() ? "gpt" : "gpt " + f.size},
                        {"layers", std::to_string(g.layers)},
                        {"heads", std::to_string(g.heads)},
                        {"width", std::to_string(g.width)},
                        {"vocab", std::to_string(g.vocab)},
                        {"blocks", blocks_of(g)},
                        {"seq", std::to_string(f.seq)},
                        {"batch", std::to_string(f.batch)},
                        {"mesh", f.mesh},
                        {"fsdp", fsdp.empty() ? "-" : fsdp},
                        {"precision", f.precision},
                        {"micro_batches", std::to_string(f.micro_batches)}});
  const Unit u = unit_for(m);
  fmt::print("memory per device, {} (by pipeline stage and tensor rank; {} devices in all):\n", u.name, l.devices());
  fmt::print("{:<14}", "device");
  for (const char* n : kCategories) fmt::print(" {:>12}", n);
  fmt::print(" {:>12}\n", "total");
  // Tensor ranks of a stage that need the same bytes share a row.
  for (const auto& r : folded_rows(m)) {
    const plan::DeviceMemory& d = m.devices[r.first];
    fmt::print("{:<14}", row_name(m, r));
    for (double v : categories(d)) fmt::print(" {:>12.3f}", u.of(v));
    fmt::print(" {:>12.3f}\n", u.of(d.total()));
  }
  fmt::print("largest: stage {} tensor rank {}, {:.3f} {}{}\n", worst.stage, worst.tensor_rank, u.of(worst.total()), u.name,
             worst.peak_at.empty() ? "" : fmt::format(" (peak at {})", worst.peak_at));
  fmt::print("(the trainer's tracked bytes: docs/planner.md says what they leave out)\n");
  if (!f.svg.empty()) fmt::print("picture: {}\n", f.svg);
  if (!f.mesh_svg.empty()) fmt::print("mesh picture: {}\n", f.mesh_svg);
  if (time) print_time(*time, *hw, l);
  return 0;
}

}  // namespace

std::vector<Command> add_plan_commands(CLI::App& app) {
  auto f = std::make_shared<PlanFlags>();
  auto* cmd = app.add_subcommand("plan", "memory per device of training the GPT under a mesh, before any job runs");
  cmd->add_option("--size", f->size, fmt::format("a preset model: {}", train::gpt_preset_names()));
  cmd->add_option("--layers", f->layers, "GPT blocks")->capture_default_str()->check(CLI::Range(1, 4096));
  cmd->add_option("--heads", f->heads, "attention heads")->capture_default_str()->check(CLI::Range(1, 4096));
  cmd->add_option("--width", f->width, "model width")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--vocab", f->vocab, "vocabulary")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  f->blocks = std::make_shared<TrainFieldFlags>(cmd, train::kGptBlockKeys);
  cmd->add_option("--seq", f->seq, "tokens per sample")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--batch", f->batch, "global batch (samples per optimizer step)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--mesh", f->mesh,
                  "data, fsdp, tensor, pipeline, context and expert axes, e.g. data=2,tensor=4 (expert: a model with "
                  "--experts)")
      ->capture_default_str();
  cmd->add_option("--fsdp", f->fsdp, "full | shard_grad_op | no_shard | zero1 | zero2 | zero3 | hybrid_full | "
                                     "hybrid_shard_grad_op (\"\": plain data parallelism)");
  cmd->add_option("--precision", f->precision, "fp32 | bf16 | fp16")
      ->capture_default_str()
      ->check(one_of(layout::kPrecisionNames));
  cmd->add_option("--micro-batches", f->micro_batches, "micro-batches per step")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--pipeline-schedule", f->schedule, "gpipe | 1f1b | interleaved | zb")
      ->capture_default_str()
      ->check(one_of(layout::kScheduleNames));
  cmd->add_option("--virtual-stages", f->virtual_stages, "model chunks per pipeline rank")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--cp-comm", f->cp_comm, "ring | all_to_all")
      ->capture_default_str()
      ->check(one_of(layout::kContextCommNames));
  cmd->add_option("--fsdp-min-weight-size", f->min_weight_size, "smaller parameters stay replicated")
      ->capture_default_str();
  cmd->add_flag("--sequence-parallel", f->sequence_parallel, "sequence parallelism with the tensor axis");
  cmd->add_flag("--recompute", f->recompute, "recompute every block's activations in backward");
  cmd->add_option("--expert-imbalance", f->expert_imbalance,
                  "with an expert axis: the rows the fullest rank's experts run over the even share (the trainer's "
                  "progress line and metrics.jsonl report it as the imbalance, max / mean tokens per expert)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  cmd->add_flag("--json", f->json, "print one JSON object instead of the table");
  cmd->add_option("--hardware", f->hardware,
                  "also predict the step time on this hardware: A100, H100, or a file --calibrate wrote");
  cmd->add_option("--calibrate", f->calibrate,
                  "measure this machine's GEMM, attention, elementwise and all_reduce rates and write them to "
                  "this file (JSON)");
  cmd->add_option("--devices", f->devices,
                  "search the layouts for this many devices, ranked by predicted step time (with --hardware)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--device-memory", f->device_memory, "--devices: memory per device, e.g. 80GB or 24GiB")
      ->capture_default_str();
  cmd->add_option("--memory-reserve", f->memory_reserve,
                  "--devices: share of the device memory kept free for what the model does not count (allocator "
                  "fragmentation, the runtime's context and buffers)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.9));
  cmd->add_option("--keep", f->keep, "--devices: fitting layouts to list")->capture_default_str()->check(
      CLI::Range(1, 100));
  cmd->add_flag("--published", f->published,
                "price published runs' layouts (GPT-3 175B on 1024 A100, 70B on 64 H100, 7B on 8 H100) beside "
                "their measured throughput and the search's pick");
  cmd->add_flag("--check", f->check,
                "train a set of small layouts here (threads engine) and print predicted against measured "
                "memory and step time (the model flags set the GPT)");
  cmd->add_option("--check-steps", f->check_options.steps, "--check: steps per layout (the first two not timed)")
      ->capture_default_str()
      ->check(CLI::Range(3, 1000));
  cmd->add_option("--only", f->check_options.only, "--check: only layouts whose name contains this");
  cmd->add_option("--tolerance", f->check_options.tolerance,
                  "--check: exit 1 when a predicted step time misses the measured one by more (a fraction)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--corpus", f->check_options.corpus, "--check: the text to train on")->capture_default_str();
  cmd->add_option("--text-cache", f->check_options.text_cache, "--check: tokenizer and token-file cache")
      ->capture_default_str();
  cmd->add_option("--svg", f->svg,
                  "also write a picture (SVG) to this file: with --mesh the memory per device by category; with "
                  "--devices the search pick's mesh over nodes (as --mesh-svg)");
  cmd->add_option("--mesh-svg", f->mesh_svg,
                  "also write a picture (SVG) of the mesh over nodes to this file: ranks, pipeline stages and "
                  "tensor-parallel groups (with --devices: the search's pick); nodes of --hardware's devices per "
                  "node, else of 8");
  return {{cmd, [=] { return run_plan(*f); }}};
}

}  // namespace meshtrain::cli
