// Which axes combine is decided at start-up: a walk over the matrix of
// mesh axes (every subset of data, node, fsdp, context, tensor and
// pipeline of up to three axes of size 2, and the strategies' options
// that apply: fsdp modes, sequence parallelism, all_to_all context
// attention, the pipeline's schedules; then sizes of 3, 4 and 5 that the
// model's blocks, heads, sequence or batch may not divide) on the small
// GPT of tests/gpt_parity.h. Each layout either is refused by the start-up checks
// (train::resolve_training: an error naming the flag and the fix) or
// trains a step on the threads engine; none fails after start-up. The
// same for the expert axis beside every other axis, on the GPT with
// mixture-of-experts layers.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

struct Variant {
  std::string mesh;
  std::string fsdp = "";  // the trainer's default
  bool sequence_parallel = false;
  std::string cp_comm = "ring";
  std::string schedule = "1f1b";
  int micro_batches = 0;  // 0: 2 with a pipeline, else 1
  std::string name() const {
    std::string s = mesh;
    if (!fsdp.empty()) s += " fsdp " + fsdp;
    if (sequence_parallel) s += " sp";
    if (cp_comm != "ring") s += " " + cp_comm;
    if (schedule != "1f1b") s += " " + schedule;
    if (micro_batches > 0) s += fmt::format(" m={}", micro_batches);
    return s;
  }
};

// Every subset of `axes` (in the mesh's order) with 1 to 3 axes of 2 that
// has the axis `needed` ("" for any).
std::vector<std::string> meshes(const std::vector<std::string>& axes, const std::string& needed = "") {
  std::vector<std::string> out;
  for (unsigned set = 1; set < (1u << axes.size()); ++set) {
    if (__builtin_popcount(set) > 3) continue;
    std::string m;
    for (size_t i = 0; i < axes.size(); ++i)
      if (set & (1u << i)) m += (m.empty() ? "" : ",") + axes[i] + "=2";
    if (needed.empty() || m.find(needed) != std::string::npos) out.push_back(m);
  }
  return out;
}

// The options that apply to each mesh.
std::vector<Variant> variants_of(const std::vector<std::string>& all) {
  std::vector<Variant> out;
  for (const std::string& m : all) {
    const auto has = [&](const char* a) { return m.find(a) != std::string::npos; };
    out.push_back({.mesh = m});
    if (has("fsdp") || has("data") || has("node")) {
      out.push_back({.mesh = m, .fsdp = "zero1"});
      out.push_back({.mesh = m, .fsdp = "zero3"});
    }
    if (has("data") && has("fsdp")) out.push_back({.mesh = m, .fsdp = "hybrid_full"});
    if (has("tensor")) out.push_back({.mesh = m, .sequence_parallel = true});
    if (has("context")) out.push_back({.mesh = m, .cp_comm = "all_to_all"});
    if (has("pipeline")) {
      out.push_back({.mesh = m, .schedule = "gpipe"});
      out.push_back({.mesh = m, .schedule = "zb"});
      out.push_back({.mesh = m, .schedule = "interleaved"});
    }
  }
  return out;
}

std::vector<Variant> variants() {
  std::vector<Variant> out = variants_of(meshes({"pipeline", "data", "node", "fsdp", "context", "tensor"}));
  // Other sizes, against the model's (4 blocks, 4 heads, 16-token windows,
  // batch 8), where some do not divide: the checks refuse those.
  for (const Variant& v : std::vector<Variant>{
           {.mesh = "tensor=3"},
           {.mesh = "tensor=4", .sequence_parallel = true},
           {.mesh = "tensor=3", .sequence_parallel = true},
           {.mesh = "context=3"},
           {.mesh = "context=4", .cp_comm = "all_to_all"},
           {.mesh = "context=2,tensor=4", .cp_comm = "all_to_all"},
           {.mesh = "context=2,tensor=3", .sequence_parallel = true},
           {.mesh = "pipeline=3"},
           {.mesh = "pipeline=5"},
           {.mesh = "pipeline=4", .schedule = "interleaved"},
           {.mesh = "pipeline=3,context=2", .schedule = "zb"},
           {.mesh = "data=3"},
           {.mesh = "fsdp=3", .fsdp = "zero3"},
           {.mesh = "fsdp=4", .fsdp = "zero3"},
           {.mesh = "data=2,pipeline=2", .micro_batches = 8},
           {.mesh = "pipeline=2,fsdp=2", .fsdp = "zero3", .micro_batches = 3},
       })
    out.push_back(v);
  return out;
}

// Each variant is refused at start-up with a hint, or trains a step.
// `model` adjusts the base configuration (the MoE matrix's experts).
void expect_refused_or_trains(const std::vector<Variant>& variants,
                              const std::function<void(train::TrainConfig&)>& model) {
  int trained = 0, refused = 0;
  std::vector<std::string> failed;
  for (const Variant& v : variants) {
    train::TrainConfig tc = gpt_parity_config("matrix");
    model(tc);
    tc.max_steps = 1;
    tc.layers = 4;  // pipeline=2 with 2 chunks each (interleaved)
    tc.micro_batches = v.micro_batches > 0 ? v.micro_batches : v.mesh.find("pipeline") != std::string::npos ? 2 : 1;
    tc.sequence_parallel = v.sequence_parallel;
    tc.set("fsdp", v.fsdp, "Variant.fsdp");
    tc.set("cp_comm", v.cp_comm, "Variant.cp_comm");
    tc.set("pipeline_schedule", v.schedule, "Variant.schedule");
    const config::DistributedConfig dc = testing::threads_mesh_config(v.mesh);
    std::optional<train::ResolvedTraining> resolved;
    try {
      resolved = train::resolve_training(tc, dc);
    } catch (const Error& e) {
      ++refused;
      fmt::print("{:<48} refused at start-up: {}\n", v.name(), e.what());
      EXPECT_FALSE(e.hint().empty()) << v.name() << ": a refusal says how to fix it";
      continue;
    }
    try {
      const train::TrainResult r =
          train::run_training(*resolved, dc,
                              {.engine = comm::Engine::threads, .ranks = dc.world_size,
                               .timeout = std::chrono::seconds(60)});
      EXPECT_EQ(r.step_losses.size(), 1u) << v.name();
      ++trained;
      fmt::print("{:<48} trains\n", v.name());
    } catch (const std::exception& e) {
      failed.push_back(fmt::format("{}: {}", v.name(), e.what()));
    }
    std::filesystem::remove_all(tc.run_dir);
  }
  fmt::print("{} layouts: {} train, {} refused at start-up, {} failed after it\n", trained + refused + failed.size(),
             trained, refused, failed.size());
  for (const std::string& f : failed) ADD_FAILURE() << "passed the start-up checks, then failed: " << f;
}

TEST(AxesMatrix, StartUpChecksAcceptExactlyWhatTrains) {
  expect_refused_or_trains(variants(), [](train::TrainConfig&) {});
}

// The expert axis with every other axis, on the GPT with Llama's blocks and
// 4 experts per MoE layer (top-2): what the checks refuse (a context axis,
// sequence parallelism, ZeRO++'s shapes) never starts; the rest trains.
TEST(AxesMatrix, ExpertAxisStartUpChecksAcceptExactlyWhatTrains) {
  std::vector<Variant> all = variants_of(meshes({"pipeline", "data", "fsdp", "expert", "context", "tensor"}, "expert"));
  all.push_back({.mesh = "expert=4"});
  all.push_back({.mesh = "expert=3"});  // 4 experts over 3 ranks: refused
  expect_refused_or_trains(all, [](train::TrainConfig& tc) {
    tc.arch = layout::DecoderArch::llama;
    tc.kv_heads = 2;
    tc.dropout = 0.0;
    tc.moe = {.experts = 4, .top_k = 2, .expert_hidden = 16, .aux_loss_coef = 0.01};
  });
}

}  // namespace
}  // namespace meshtrain
