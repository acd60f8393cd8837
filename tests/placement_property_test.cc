// The placement rule (layout/placement_rule.h) against what training really
// holds: for the MLP, the VAE and the GPT on a matrix of meshes (each axis
// alone, pairs, data x fsdp x tensor x pipeline, fsdp x tensor x context,
// node x fsdp, hybrid, no_shard, zero1), and the GPT with experts on an
// expert axis beside data, fsdp, tensor and a pipeline, one step through the trainer on
// the threads engine; for every rank and parameter, the placement the
// runtime holds (TrainResult::placements_by_rank, Parallelism::
// parameter_shards) equals held_parameters' for the model the recipe
// builds (train/model_parameters.h's lists, the recipes' own), and what
// `meshtrain shard --model ... --rank R --json` prints; for the GPT, the
// planner's per-parameter element counts (plan::device_parameters, what
// its memory, traffic and time models count) equal the blocks training
// holds. Sizes are odd where they can be (uneven tensor chunks, fsdp
// ranges that cross parameters and padding).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "meshtrain/layout/placement_rule.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/model_recipe.h"
#include "meshtrain/train/model_parameters.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

struct Case {
  std::string model;  // mlp | vae | gpt | moe (the GPT with Llama's blocks and experts)
  std::string mesh;
  std::string fsdp = "";
  std::string extra = "";  // "sp": sequence parallelism; "v2": two virtual stages per pipeline rank
  std::string name() const { return fmt::format("{} {} {} {}", model, mesh, fsdp, extra); }
  bool gpt() const { return model == "gpt" || model == "moe"; }
};

train::TrainConfig config_of(const Case& c) {
  const std::string tag = fmt::format("placement_{}_{}", static_cast<long>(::getpid()),
                                      std::hash<std::string>{}(c.name()));
  train::TrainConfig tc;
  if (c.gpt()) {
    tc = gpt_parity_config(tag, "adamw");
    tc.vocab = 509;   // odd: uneven vocabulary shards
    tc.layers = 4;    // pipeline=2 with 2 virtual stages
    tc.heads = 6;     // tensor=2 and 3
    tc.width = 36;
    tc.dropout = 0;
    if (c.model == "moe") {  // 4 experts of 22 features (uneven over 3 and 6 ranks) and a shared one in blocks 1-3
      tc.arch = layout::DecoderArch::llama;
      tc.kv_heads = 3;  // over tensor=3
      tc.moe = {.experts = 4, .top_k = 2, .expert_hidden = 22, .shared_experts = 1, .first_dense = 1};
      tc.tie_embeddings = false;  // lm_head: the last stage's own
    }
  } else {
    tc.model = c.model;
    tc.hidden = c.model == "mlp" ? std::vector<int>{45, 31} : std::vector<int>{37};
    tc.latent = 5;
    tc.epochs = 1;
    tc.threads_per_rank = 1;
    tc.fsdp_min_weight_size = 100;  // biases stay replicated, matrices are sharded
    tc.run_dir = (std::filesystem::temp_directory_path() / ("meshtrain_" + tag)).string();
    tc.overwrite = true;
  }
  tc.max_steps = 1;
  tc.batch_size = 48;  // over 2, 3 or 4 data-parallel ranks and 4 micro-batches
  tc.sequence_parallel = c.extra == "sp";
  if (c.mesh.find("pipeline") != std::string::npos) tc.micro_batches = 4;
  if (c.extra == "v2") {
    tc.set("pipeline_schedule", "interleaved", "Case.extra");
    tc.virtual_stages = 2;
  }
  tc.set("fsdp", c.fsdp, "Case.fsdp");
  return tc;
}

// Every parameter of the recipe's model, built whole (no tensor or context
// group, values deferred), stage by stage under a pipeline.
std::vector<layout::ModelParameter> rule_parameters(const train::TrainConfig& tc, int stages) {
  const std::unique_ptr<train::ModelRecipe> recipe = train::make_model_recipe(tc);
  train::ModelOptions o{.seed = tc.seed, .defer_init = true, .pipeline_stages = stages};
  for (int s = 0; s < stages && stages > 1; ++s) o.stages.push_back(s);
  const std::unique_ptr<train::RecipeModel> model = recipe->build(o);
  if (stages == 1) return parallel::model_parameters(model->module(), model->fsdp_units());
  std::vector<layout::ModelParameter> out;
  int stage = 0;
  for (train::RecipeStage* s : model->stages()) {
    const auto part = parallel::model_parameters(s->module(), s->fsdp_units(), stage++);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

// What `meshtrain shard --model` says `rank` holds, for the case's model and sizes.
std::vector<parallel::ParamShard> shard_command(const Case& c, const train::TrainConfig& tc, const std::string& fsdp,
                                                int rank) {
  std::string cmd = fmt::format("{} shard --model {} --mesh {} --rank {} --json --fsdp-min-weight-size {}",
                                MESHTRAIN_CLI, c.gpt() ? "gpt" : c.model, c.mesh, rank, tc.fsdp_min_weight_size);
  if (!fsdp.empty()) cmd += " --fsdp " + fsdp;
  if (c.gpt())
    cmd += fmt::format(" --vocab {} --context {} --layers {} --heads {} --width {} --virtual-stages {}", tc.vocab,
                       tc.context, tc.layers, tc.heads, tc.width, tc.virtual_stages);
  if (c.model == "moe")
    cmd += fmt::format(" --arch llama --tie-embeddings false --kv-heads {} --experts {} --top-k {} --expert-hidden {} "
                       "--shared-experts {} --first-dense {}",
                       tc.kv_heads, tc.moe.experts, tc.moe.top_k, tc.moe.expert_hidden, tc.moe.shared_experts,
                       tc.moe.first_dense);
  else if (!c.gpt())
    cmd += fmt::format(" --hidden {} --latent {}", fmt::join(tc.hidden, ","), tc.latent);
  std::string text;
  FILE* out = ::popen(cmd.c_str(), "r");
  if (out == nullptr) throw std::runtime_error("cannot run " + cmd);
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, out)) > 0;) text.append(buf, n);
  if (::pclose(out) != 0) throw std::runtime_error(fmt::format("{} failed:\n{}", cmd, text));
  std::vector<parallel::ParamShard> held;
  const nlohmann::json printed = nlohmann::json::parse(text);
  for (const nlohmann::json& p : printed.at("parameters"))
    held.push_back({p.at("name"), {p.at("shape"), p.at("view"), {p.at("offsets"), p.at("sizes")}, p.at("start"),
                                   p.at("count")}, false});
  return held;
}

// The mesh coordinate of `rank` on `axis` (0 without that axis).
int coordinate(const mesh::NamedShape& m, int rank, std::string_view axis) {
  const std::vector<int> c = mesh::unravel(rank, m.shape);
  for (size_t i = 0; i < m.axis_names.size(); ++i)
    if (m.axis_names[i] == axis) return c[i];
  return 0;
}

// The planner's view of each device against the runtime's blocks.
void check_planner(const train::TrainConfig& tc, const layout::TrainingLayout& pl, const train::TrainResult& r) {
  plan::TrainingLayout l;
  l.set_layout(pl);
  const plan::GptShape g = train::with_gpt_model(train::gpt_shape(tc));
  for (int rank = 0; rank < static_cast<int>(r.placements_by_rank.size()); ++rank) {
    const std::vector<plan::ParamElements> want = plan::device_parameters(
        g, l, coordinate(pl.mesh, rank, mesh::kPipeline), coordinate(pl.mesh, rank, mesh::kTensor));
    const std::vector<parallel::ParamShard>& got = r.placements_by_rank[static_cast<size_t>(rank)];
    ASSERT_EQ(want.size(), got.size()) << "rank " << rank;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(want[i].numel, got[i].placement.block_numel()) << "rank " << rank << " " << got[i].name;
      if (l.tensor > 1) {
        EXPECT_EQ(want[i].replicated, !got[i].placement.is_block()) << "rank " << rank << " " << got[i].name;
      }
    }
  }
}

void check(const Case& c) {
  SCOPED_TRACE(c.name());
  const train::TrainConfig tc = config_of(c);
  const config::DistributedConfig dc = testing::threads_mesh_config(c.mesh);
  const train::TrainResult r = train::run_training(
      tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size, .timeout = std::chrono::seconds(120)});
  std::filesystem::remove_all(tc.run_dir);

  // The layout as the trainer resolved it (its fsdp default, its mesh).
  const layout::TrainingLayout pl = train::resolve_training(tc, dc).layout;
  ASSERT_EQ(pl.fsdp.has_value(), !r.fsdp.empty());
  const int stages = pl.mesh.size_of(mesh::kPipeline) * tc.virtual_stages;
  const int tensor = pl.mesh.size_of(mesh::kTensor);
  // The parameters the rule places: train/model_parameters.h's lists (what
  // the planner and shard --model place; the mlp's cut depends on the
  // tensor axis), the vae's as its recipe builds it.
  std::vector<layout::ModelParameter> params;
  if (c.gpt())
    params = train::describe_gpt(train::gpt_shape(tc), stages)->params;
  else if (c.model == "mlp")
    params = train::mlp_parameters({784, tc.hidden[0], tc.hidden[1], 10}, tensor, stages);
  else
    params = rule_parameters(tc, stages);
  if (c.gpt() || tensor == 1) {  // the lists are the recipe's own (built without a tensor group)
    const std::vector<layout::ModelParameter> recipe = rule_parameters(tc, stages);
    ASSERT_EQ(params.size(), recipe.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const layout::ModelParameter &a = params[i], &b = recipe[i];
      EXPECT_TRUE(a.info.name == b.info.name && a.info.shape == b.info.shape && a.unit == b.unit &&
                  a.stage == b.stage)
          << "#" << i << ": listed " << a.info.name << " unit " << a.unit << " stage " << a.stage << ", recipe "
          << b.info.name << " unit " << b.unit << " stage " << b.stage;
    }
  }
  ASSERT_EQ(static_cast<int>(r.placements_by_rank.size()), dc.world_size);
  int checked = 0, flat = 0, blocks = 0;
  for (int rank = 0; rank < dc.world_size; ++rank) {
    const std::vector<layout::HeldParameter> want = layout::held_parameters(pl, params, rank);
    const std::vector<parallel::ParamShard>& got = r.placements_by_rank[static_cast<size_t>(rank)];
    const std::vector<parallel::ParamShard> printed = shard_command(c, tc, r.fsdp, rank);
    ASSERT_EQ(got.size(), want.size()) << "rank " << rank;
    ASSERT_EQ(printed.size(), want.size()) << "rank " << rank;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].name, want[i].name) << "rank " << rank << " #" << i;
      EXPECT_EQ(got[i].placement, want[i].placement)
          << "rank " << rank << " " << got[i].name << ": runtime " << got[i].placement.to_string() << ", rule "
          << want[i].placement.to_string();
      ASSERT_EQ(printed[i].name, want[i].name) << "rank " << rank << " #" << i;
      EXPECT_EQ(printed[i].placement, got[i].placement)
          << "rank " << rank << " " << got[i].name << ": shard --model " << printed[i].placement.to_string()
          << ", runtime " << got[i].placement.to_string();
      ++checked;
      flat += got[i].placement.is_flat();
      blocks += got[i].placement.is_block();
    }
  }
  const bool planned = c.gpt() && !pl.mesh.has(mesh::kNode);  // the planner has no node axis
  if (planned) check_planner(tc, pl, r);
  // The case exercises what its mesh asks for.
  if (pl.fsdp) {
    EXPECT_GT(flat, 0);
  }
  if (pl.mesh.size_of(mesh::kTensor) > 1) {
    EXPECT_GT(blocks, 0);
  }
  fmt::print("{:<44} {} ranks, {} placements ({} flat ranges, {} blocks): runtime = rule = shard --model{}\n",
             c.name(), dc.world_size, checked, flat, blocks, planned ? ", planner's elements equal" : "");
}

TEST(PlacementRule, Mlp) {
  for (const Case& c : {Case{"mlp", "data=2"}, Case{"mlp", "fsdp=2", "full"}, Case{"mlp", "fsdp=3", "zero1"},
                        Case{"mlp", "tensor=2"}, Case{"mlp", "pipeline=2"}, Case{"mlp", "pipeline=2,tensor=2"},
                        Case{"mlp", "data=2,fsdp=2", "hybrid_full"},
                        Case{"mlp", "node=2,fsdp=2", "zero3"}, Case{"mlp", "node=2", "zero3"},
                        Case{"mlp", "fsdp=2,tensor=2", "full"},
                        Case{"mlp", "fsdp=2", "no_shard"}})
    check(c);
}

TEST(PlacementRule, Vae) {
  for (const Case& c : {Case{"vae", "fsdp=2", "full"}, Case{"vae", "tensor=3"}, Case{"vae", "data=2,fsdp=2", "zero2"}})
    check(c);
}

TEST(PlacementRule, Gpt) {
  for (const Case& c :
       {Case{"gpt", "tensor=3"}, Case{"gpt", "fsdp=3", "full"}, Case{"gpt", "context=2"},
        Case{"gpt", "pipeline=2"}, Case{"gpt", "pipeline=2", "", "v2"}, Case{"gpt", "fsdp=2,tensor=2", "full", "sp"},
        Case{"gpt", "pipeline=2,fsdp=2", "zero2"}, Case{"gpt", "pipeline=2,fsdp=2", "zero3"},
        Case{"gpt", "data=2,fsdp=2,tensor=2", "full"},
        Case{"gpt", "pipeline=2,data=2,fsdp=2,tensor=2", "zero2"}, Case{"gpt", "fsdp=2,context=2,tensor=2", "full"},
        Case{"gpt", "node=2,fsdp=2", "zero3"}, Case{"gpt", "pipeline=2,context=2"},
        Case{"gpt", "context=2,tensor=2", "", "sp"}})
    check(c);
}

// The expert axis: each rank holds its experts of every MoE layer (with
// fsdp, sharded over the ranks holding the same experts), beside data,
// fsdp, tensor and a pipeline; and Llama's key/value heads replicated
// over a tensor axis larger than their number.
TEST(PlacementRule, MixtureOfExperts) {
  for (const Case& c : {Case{"moe", "expert=2"}, Case{"moe", "expert=4"}, Case{"moe", "data=2,expert=2"},
                        Case{"moe", "fsdp=2,expert=2", "full"}, Case{"moe", "expert=2,tensor=3"},
                        Case{"moe", "tensor=6"},  // 3 key/value heads, each on 2 tensor ranks
                        Case{"moe", "pipeline=2,expert=2", "", "v2"},
                        Case{"moe", "pipeline=2,fsdp=2,expert=2", "zero3"}})
    check(c);
}

}  // namespace
}  // namespace meshtrain
