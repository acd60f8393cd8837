#include "cli/plan_search.h"

#include <fmt/format.h>

#include <array>
#include <chrono>

#include "meshtrain/train/model_parameters.h"

namespace meshtrain::cli {
namespace {

constexpr double kGiB = double(uint64_t{1} << 30);

void print_candidate(const plan::Candidate& c, bool reasons) {
  fmt::print("  {:<58} {:>9.3f} s {:>9.0f} tokens/s/device {:>7.1f} GiB\n", c.label, c.step,
             c.tokens_per_second_per_device, c.memory / kGiB);
  if (reasons)
    for (const std::string& why : c.reasons) fmt::print("      - {}\n", why);
}

// A published run: its model (meshtrain's GPT block with the run's sizes),
// layout and measured throughput.
struct Published {
  const char* name;
  const char* source;
  plan::GptShape shape;
  const char* hardware;
  double device_memory;
  plan::TrainingLayout layout;
  double tokens_per_second_per_device;
  const char* note;
};

}  // namespace

int run_plan_search(const plan::GptShape& g, const plan::SearchOptions& o, const plan::Hardware& hw,
                    const std::string& model_name, const std::vector<PictureFile>& pictures) {
  const auto t0 = std::chrono::steady_clock::now();
  const plan::SearchResult r = plan::search_layouts(g, o, hw);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("layouts for {} ({} layers, width {}, {} heads, vocabulary {}, {} tokens), batch {}, on {} x {} "
             "({:.1f} GiB each, {:.0f}% kept free: {:.1f} GiB usable): {} priced in {:.1f} s\n",
             model_name, g.layers, g.width, g.heads, g.vocab, g.seq, o.batch, o.devices, hw.name,
             o.device_memory / kGiB, 100 * o.reserve, o.usable() / kGiB, r.considered, seconds);
  if (r.fitting.empty()) {
    fmt::print("none fits in {:.1f} usable GiB per device; the fastest that do not:\n", o.usable() / kGiB);
  } else {
    fmt::print("\nrecommended (fastest predicted step that fits):\n");
    print_candidate(r.fitting[0], true);
    if (r.fitting.size() > 1) fmt::print("\nnext:\n");
    for (size_t i = 1; i < r.fitting.size(); ++i) print_candidate(r.fitting[i], false);
  }
  if (!r.not_fitting.empty()) {
    fmt::print("\nfaster but over {:.1f} usable GiB per device:\n", o.usable() / kGiB);
    for (const plan::Candidate& c : r.not_fitting)
      fmt::print("  {:<58} {:>9.3f} s  needs {:.1f} GiB, {:.1f} over: {}\n", c.label, c.step, c.memory / kGiB,
                 (c.memory - o.usable()) / kGiB, c.reasons.empty() ? "" : c.reasons[0]);
  }
  if (!pictures.empty()) fmt::print("\n");
  for (const PictureFile& p : pictures) {
    if (r.fitting.empty()) {
      fmt::print("no layout fits: {} {} not written\n", p.flag, p.path);
      continue;
    }
    const plan::Candidate& pick = r.fitting[0];
    write_picture(p, mesh_svg(pick.layout, {.devices_per_node = hw.devices_per_node,
                                            .title = fmt::format("{} on {} x {}: {}", model_name, o.devices, hw.name,
                                                                 pick.label)}));
    fmt::print("picture: {}\n", p.path);
  }
  return r.fitting.empty() ? 1 : 0;
}

int run_published_runs() {
  using enum layout::ZeroStage;
  // Sources and numbers: docs/planner.md, "Beside published runs".
  constexpr layout::DecoderArch kLlama = layout::DecoderArch::llama;
  const std::array<Published, 5> runs = {{
      {"GPT-3 175B, Megatron-LM", "Narayanan et al. 2021; Megatron-LM README (138 TFLOP/s per GPU)",
       {.vocab = 51200, .seq = 2048, .layers = 96, .heads = 96, .width = 12288}, "A100", 80e9,
       {.data = 8, .tensor = 8, .pipeline = 16, .sharding = zero1, .micro_batches = 192, .recompute = true,
        .param_dtype = DType::bf16, .reduce_dtype = DType::bf16, .batch = 1536},
       96, "fp16; full recompute; 32 s per step"},
      {"Llama-2 70B, NeMo 24.07", "NVIDIA NeMo performance summary (FP8)",
       {.vocab = 32000, .seq = 4096, .layers = 80, .heads = 64, .width = 8192, .arch = kLlama, .kv_heads = 8,
        .ffn_hidden = 28672, .tie_embeddings = false},
       "H100", 80e9,
       {.data = 4, .tensor = 4, .pipeline = 4, .sharding = zero1, .sequence_parallel = true,
        .schedule = layout::ScheduleKind::interleaved_1f1b, .virtual_stages = 20, .micro_batches = 32,
        .param_dtype = DType::bf16, .reduce_dtype = DType::bf16, .batch = 128},
       1728, "FP8 GEMMs (bf16 predicted here)"},
      {"MPT-70B, llm-foundry", "MosaicML llm-foundry benchmarks (BF16)",
       {.vocab = 50432, .seq = 2048, .layers = 80, .heads = 64, .width = 8192}, "H100", 80e9,
       {.fsdp = 64, .sharding = zero3, .micro_batches = 4, .recompute = true, .param_dtype = DType::bf16,
        .reduce_dtype = DType::bf16, .batch = 2048},
       1039, "FSDP full shard, micro-batch 8 x 4 accumulation, activation checkpointing"},
      {"MPT-7B, llm-foundry", "MosaicML llm-foundry benchmarks (BF16)",
       {.vocab = 50432, .seq = 4096, .layers = 32, .heads = 32, .width = 4096}, "H100", 80e9,
       {.fsdp = 8, .sharding = zero3, .micro_batches = 2, .recompute = true, .param_dtype = DType::bf16,
        .reduce_dtype = DType::bf16, .batch = 256},
       8611, "FSDP full shard, micro-batch 16 x 2 accumulation, activation checkpointing"},
      {"DeepSeek-V3 671B", "DeepSeek-AI 2024, arXiv 2412.19437 (180K H800 GPU hours per trillion tokens)",
       {.vocab = 129280, .seq = 4096, .layers = 61, .heads = 128, .width = 7168, .arch = kLlama, .kv_heads = 128,
        .ffn_hidden = 18432,
        .moe = {.experts = 256, .top_k = 8, .expert_hidden = 2048, .shared_experts = 1,
                .score = layout::RouterScore::sigmoid, .first_dense = 3},
        .tie_embeddings = false},
       "H100", 80e9,
       {.data = 2, .pipeline = 16, .expert = 64, .sharding = zero1, .micro_batches = 120, .recompute = true,
        .param_dtype = DType::bf16, .reduce_dtype = DType::bf16, .batch = 15360},
       1543,
       "H800 priced as H100; FP8 GEMMs, DualPipe (1F1B here), multi-head latent attention (plain multi-head here), "
       "recompute of norms and up-projections only (all blocks here)"},
  }};
  fmt::print("{:<30} {:>7} {:<52} {:>10} {:>10} {:>7}   {:<52} {:>10}\n", "run", "devices", "published layout",
             "published", "predicted", "fits", "search's pick", "predicted");
  for (const Published& p : runs) {
    const plan::Hardware hw = plan::hardware_preset(p.hardware);
    const int devices = p.layout.devices();
    const plan::SearchOptions o{.devices = devices, .batch = p.layout.batch, .device_memory = p.device_memory,
                                .precision = DType::bf16, .keep = 3};
    const plan::GptShape shape = train::with_gpt_model(p.shape);
    const plan::Candidate given = plan::evaluate_layout(shape, p.layout, o, hw);
    const plan::SearchResult r = plan::search_layouts(shape, o, hw);
    const std::string pick = r.fitting.empty() ? "none fits" : r.fitting[0].label;
    fmt::print("{:<30} {:>7} {:<52} {:>10.0f} {:>10.0f} {:>7}   {:<52} {:>10.0f}\n", p.name,
               fmt::format("{} {}", devices, p.hardware), given.label, p.tokens_per_second_per_device,
               given.tokens_per_second_per_device, given.fits ? "yes" : fmt::format("{:.0f}G", given.memory / kGiB),
               pick, r.fitting.empty() ? 0.0 : r.fitting[0].tokens_per_second_per_device);
    fmt::print("    ({}; {}; tokens/s per device)\n", p.source, p.note);
    if (!r.fitting.empty())
      for (const std::string& why : r.fitting[0].reasons) fmt::print("      - {}\n", why);
  }
  return 0;
}

}  // namespace meshtrain::cli
