// A training run of the parity GPT (tests/gpt_parity.h: AdamW, 2 steps, no
// dropout) through the trainer on the threads engine, and the
// plan::TrainingLayout and GptShape that describe it: what the planner's
// tests (memory_model_test, traffic_model_test) check predictions against.
#pragma once

#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>

#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/model_parameters.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {

struct PlanCase {
  std::string mesh = "";  // "" = one device
  std::string fsdp = "";
  bool sequence_parallel = false;
  int micro_batches = 1;
  std::string schedule = "1f1b";  // a pipeline's (TrainConfig::pipeline_schedule)
  int virtual_stages = 1;
  bool recompute = false;
  std::string cp_comm = "ring";  // context parallelism: ring or all_to_all
  DType precision = DType::f32;
  // Fully sharded scheduling (the trainer's defaults).
  layout::BackwardPrefetch backward_prefetch = layout::BackwardPrefetch::pre;
  bool forward_prefetch = false;
  bool reshard_after_forward = true;
  double bucket_mb = 25;
  int64_t layers = 2;
  // The blocks: "" (GPT-2's), "llama" (2 key/value heads of 4), "moe"
  // (Llama's with 4 experts of 16 features, top-2, a shared expert, from
  // block 1 on, and an untied head).
  std::string blocks = "";
  std::string tag = "";  // tells cases with the same settings apart
  // The peak comes while gradient reductions may or may not have finished
  // (thread timing; memory_model_test): checked between the prediction with
  // every reduction done at once (TrainingLayout::eager_reductions) and the
  // bound.
  bool timing_dependent = false;

  // "pipeline=2,fsdp=2 zero2 bf16 m=4 ..." (one device: "one device").
  std::string name() const {
    std::string s = (mesh.empty() ? "one device" : mesh) + (fsdp.empty() ? "" : " " + fsdp);
    if (precision == DType::bf16) s += " bf16";
    if (sequence_parallel) s += " sp";
    if (micro_batches > 1) s += fmt::format(" m={}", micro_batches);
    if (mesh.find("pipeline") != std::string::npos) s += " " + schedule;
    if (virtual_stages > 1) s += fmt::format(" v={}", virtual_stages);
    if (recompute) s += " recompute";
    if (cp_comm != "ring") s += " " + cp_comm;
    if (!reshard_after_forward) s += " no-reshard";
    if (bucket_mb != 25) s += fmt::format(" bucket {} MiB", bucket_mb);
    if (layers != 2) s += fmt::format(" {} layers", layers);
    if (!blocks.empty()) s += " " + blocks;
    return s + (tag.empty() ? "" : " " + tag);
  }
};

struct PlanRun {
  train::TrainResult result;
  plan::TrainingLayout layout;
  plan::GptShape shape;
  mesh::NamedShape mesh;
};

// Trains the case (every wait's deadline 120 s) and describes it.
inline PlanRun run_plan_case(const PlanCase& c) {
  // The process id too: memory_model_test and traffic_model_test run the
  // same cases, possibly at once (ctest -j), each in a run directory of its own.
  train::TrainConfig tc = gpt_parity_config(
      fmt::format("plan_{}_{}", static_cast<long>(::getpid()), std::hash<std::string>{}(c.name())), "adamw");
  tc.max_steps = 2;
  tc.dropout = 0;
  tc.layers = static_cast<int>(c.layers);
  tc.sequence_parallel = c.sequence_parallel;
  tc.micro_batches = c.micro_batches;
  tc.set("pipeline_schedule", c.schedule, "PlanCase.schedule");
  tc.virtual_stages = c.virtual_stages;
  tc.recompute = c.recompute;
  tc.set("cp_comm", c.cp_comm, "PlanCase.cp_comm");
  tc.backward_prefetch = c.backward_prefetch;
  tc.forward_prefetch = c.forward_prefetch;
  tc.reshard_after_forward = c.reshard_after_forward;
  tc.bucket_mb = c.bucket_mb;
  tc.set("fsdp", c.fsdp, "PlanCase.fsdp");
  if (!c.blocks.empty()) {
    tc.arch = layout::DecoderArch::llama;
    tc.kv_heads = 2;
    if (c.blocks == "moe") {
      tc.moe = {.experts = 4, .top_k = 2, .expert_hidden = 16, .shared_experts = 1, .first_dense = 1};
      tc.tie_embeddings = false;
    }
  }
  config::DistributedConfig dc = testing::threads_mesh_config(c.mesh);
  dc.mixed_precision = c.precision;
  PlanRun run;
  // Resolved once: the run and the planner read the same layout.
  const train::ResolvedTraining resolved = train::resolve_training(tc, dc);
  run.result = train::run_training(resolved, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                                  .timeout = std::chrono::seconds(120)});
  std::filesystem::remove_all(tc.run_dir);  // named by the process: nothing reuses it
  run.mesh = resolved.layout.mesh;
  run.layout = {.recompute = c.recompute,
                .forward_prefetch = c.forward_prefetch,
                .backward_prefetch = c.backward_prefetch,
                .reshard_after_forward = c.reshard_after_forward,
                .batch = tc.batch_size,
                .bucket_bytes = c.bucket_mb * (1 << 20)};
  run.layout.set_layout(resolved.layout);
  run.shape = train::with_gpt_model(train::gpt_shape(tc));
  return run;
}

}  // namespace meshtrain
