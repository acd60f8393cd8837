#include "meshtrain/train/model_parameters.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>

#include "meshtrain/core/error.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/train/internal/builtin_recipes.h"
#include "meshtrain/train/model_recipe.h"

namespace meshtrain::train {

nn::GPTConfig planned_gpt_config(const plan::GptShape& g) {
  return {.arch = g.arch,
          .kv_heads = g.kv_heads,
          .ffn_hidden = g.ffn_hidden,
          .vocab = g.vocab,
          .block_size = g.seq,
          .layers = g.layers,
          .heads = g.heads,
          .width = g.width,
          .defer_init = true,
          .tie_embeddings = g.tie_embeddings,
          .moe = g.moe};
}

plan::GptShape gpt_shape(const TrainConfig& tc) {
  return {.vocab = tc.vocab,
          .seq = tc.context,
          .layers = tc.layers,
          .heads = tc.heads,
          .width = tc.width,
          .arch = tc.arch,
          .kv_heads = tc.kv_heads,
          .ffn_hidden = tc.ffn_hidden,
          .moe = tc.moe,
          .tie_embeddings = tc.tie_embeddings};
}

std::shared_ptr<const plan::ModelDescription> describe_gpt(const plan::GptShape& g, int stages) {
  const nn::GPTConfig whole = planned_gpt_config(g);
  auto out = std::make_shared<plan::ModelDescription>();
  int s = 0;
  for (const nn::GPTConfig& part : internal::gpt_stage_configs(whole, stages)) {
    nn::GPT gpt(part);
    const std::vector<nn::Module*> units = gpt.fsdp_units();  // the recipe's (GptStage, GptModel)
    const std::vector<nn::Module*> blocks = gpt.blocks();
    plan::ModelDescription::Stage stage{.first_block = static_cast<int>(part.first_block),
                                        .last_block = static_cast<int>(part.last_block),
                                        .embed = part.embed,
                                        .head = part.head,
                                        .unit_block = {}};
    // model_parameters numbers the units in parallel::fsdp_units' order.
    for (const auto& [module, params] : parallel::fsdp_units(gpt, units)) {
      const auto b = std::find(blocks.begin(), blocks.end(), module);
      stage.unit_block.push_back(module == &gpt           ? plan::kRootUnit
                                 : b != blocks.end()       ? stage.first_block + static_cast<int>(b - blocks.begin())
                                                           : plan::kEmbeddingUnit);
    }
    out->stages.push_back(std::move(stage));
    for (layout::ModelParameter& p : parallel::model_parameters(gpt, units, s)) out->params.push_back(std::move(p));
    ++s;
  }
  return out;
}

plan::ModelSource gpt_model_source(const plan::GptShape& shape) {
  struct Cache {
    std::mutex mu;
    std::map<int, std::shared_ptr<const plan::ModelDescription>> by_stages;
  };
  auto cache = std::make_shared<Cache>();
  plan::GptShape sizes = shape;
  sizes.model = nullptr;
  return [cache, sizes](int stages) {
    std::lock_guard<std::mutex> lock(cache->mu);
    auto& d = cache->by_stages[stages];
    if (!d) d = describe_gpt(sizes, stages);
    return d;
  };
}

plan::GptShape with_gpt_model(plan::GptShape shape) {
  shape.model = gpt_model_source(shape);
  return shape;
}

std::vector<layout::ModelParameter> mlp_parameters(const std::vector<int64_t>& sizes, int tensor, int stages) {
  nn::MLPConfig whole;
  whole.sizes = sizes;
  whole.defer_init = true;
  const std::vector<nn::MLPConfig> parts =
      stages > 1 ? internal::mlp_stage_configs(whole, tensor, stages) : std::vector<nn::MLPConfig>{whole};
  std::vector<layout::ModelParameter> out;
  for (size_t s = 0; s < parts.size(); ++s) {
    nn::MLP mlp(parts[s]);
    for (layout::ModelParameter& p : parallel::model_parameters(mlp, {}, static_cast<int>(s)))
      out.push_back(std::move(p));
  }
  return out;
}

namespace {

constexpr layout::DecoderArch kLlama = layout::DecoderArch::llama;

// Llama 2 (Touvron et al. 2023, table 1 and the released configs), Mixtral
// 8x7B (Jiang et al. 2024) and DeepSeek-V3 (DeepSeek-AI 2024: 61 layers,
// the first 3 dense, 256 routed experts of 2048 features, top-8 by sigmoid
// scores, one shared expert).
constexpr std::array<GptPreset, 12> kGptPresets = {{
    {"124M", 12, 12, 768, 50257},
    {"350M", 24, 16, 1024, 50257},
    {"760M", 24, 16, 1536, 50257},
    {"1.3B", 24, 32, 2048, 50257},
    {"2.7B", 32, 32, 2560, 50257},
    {"6.7B", 32, 32, 4096, 50257},
    {"13B", 40, 40, 5120, 50257},
    {"175B", 96, 96, 12288, 50257},
    {"llama2-7B", 32, 32, 4096, 32000, kLlama, 32, 11008, {}, false},
    {"llama2-70B", 80, 64, 8192, 32000, kLlama, 8, 28672, {}, false},
    {"mixtral-8x7B", 32, 32, 4096, 32000, kLlama, 8, 14336, {.experts = 8, .top_k = 2}, false},
    {"deepseek-v3", 61, 128, 7168, 129280, kLlama, 128, 18432,
     {.experts = 256, .top_k = 8, .expert_hidden = 2048, .shared_experts = 1, .score = layout::RouterScore::sigmoid,
      .first_dense = 3},
     false},
}};

}  // namespace

std::span<const GptPreset> gpt_presets() { return kGptPresets; }

std::string gpt_preset_names() {
  std::string out;
  for (const GptPreset& p : kGptPresets) out += (out.empty() ? "" : ", ") + std::string(p.name);
  return out;
}

void PlanRequest::set_blocks(const TrainConfig& tc) {
  arch = tc.arch, kv_heads = tc.kv_heads, ffn_hidden = tc.ffn_hidden, moe = tc.moe,
  tie_embeddings = tc.tie_embeddings;
}

PlannedRun resolve_plan_request(const PlanRequest& r) {
  int64_t layers = r.layers, heads = r.heads, width = r.width, vocab = r.vocab;
  layout::DecoderArch arch = r.arch;
  int64_t kv_heads = r.kv_heads, ffn_hidden = r.ffn_hidden;
  layout::MoEOptions moe = r.moe;
  bool tie = r.tie_embeddings;
  if (!r.size.empty()) {
    const GptPreset* p = nullptr;
    for (const GptPreset& q : kGptPresets)
      if (r.size == q.name) p = &q;
    if (p == nullptr)
      throw InvalidArgument("meshtrain plan", fmt::format("--size {}: no such model", r.size),
                            fmt::format("use one of {}, or give --layers, --heads, --width and --vocab",
                                        gpt_preset_names()));
    layers = p->layers, heads = p->heads, width = p->width, vocab = p->vocab;
    arch = p->arch, kv_heads = p->kv_heads, ffn_hidden = p->ffn_hidden, moe = p->moe, tie = p->tie_embeddings;
  }
  const DType precision = layout::parse_precision(r.precision, "--precision");
  const mesh::NamedShape mesh = mesh::parse_mesh_spec(r.mesh);
  // The one layout value, as the trainer resolves it (an fsdp axis shards
  // fully unless told; mixed precision without a strategy runs as no_shard).
  layout::TrainingLayout run{.mesh = mesh,
                             .fsdp_min_weight_size = r.min_weight_size,
                             .param_dtype = precision,
                             .sequence_parallel = r.sequence_parallel,
                             .schedule = layout::parse_schedule_kind(r.schedule),
                             .virtual_stages = r.virtual_stages,
                             .micro_batches = r.micro_batches,
                             .cp_comm = layout::parse_context_comm(r.cp_comm, "--cp-comm")};
  try {
    run.fsdp = layout::resolve_fsdp_mode(r.fsdp, mesh, precision);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("--fsdp", e.detail(), e.hint());
  }
  // The gpt recipe's own start-up checks, naming train's flags.
  TrainConfig tc;
  tc.model = "gpt";
  tc.vocab = vocab, tc.context = r.seq, tc.layers = layers, tc.heads = heads, tc.width = width;
  tc.arch = arch, tc.kv_heads = kv_heads, tc.ffn_hidden = ffn_hidden, tc.moe = moe, tc.tie_embeddings = tie;
  tc.sequence_parallel = r.sequence_parallel;
  tc.dropout = 0;
  find_model_recipe("gpt").check(tc, run);
  PlannedRun out{.shape = with_gpt_model(gpt_shape(tc)),
                 .layout = {.expert_imbalance = r.expert_imbalance, .recompute = r.recompute, .batch = r.batch},
                 .fsdp = run.fsdp ? run.fsdp->name() : ""};
  out.layout.set_layout(run);
  return out;
}

}  // namespace meshtrain::train
