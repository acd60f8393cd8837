#include "cli/model_shard.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>

#include "cli/command.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/layout/placement_rule.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/vae.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/train/model_parameters.h"
#include "meshtrain/train/model_recipe.h"

namespace meshtrain::cli {
namespace {

// Fashion-MNIST's images and classes, what the mlp and vae recipes train on.
constexpr int64_t kPixels = 784, kClasses = 10;
// The most ranks shard --model adds up (about a second for the GPT).
constexpr int64_t kMaxModelRanks = 65536;

std::vector<int64_t> parse_hidden(const std::string& text) {
  return parse_int_list(text, "--hidden", 1, 65536, "512,512,256");
}

// The gpt's training config: its sizes and the train flags of its blocks.
train::TrainConfig gpt_train_config(const ModelShardFlags& f) {
  train::TrainConfig tc;
  tc.model = "gpt";
  tc.vocab = f.vocab, tc.context = f.context, tc.layers = f.layers, tc.heads = f.heads, tc.width = f.width;
  tc.dropout = 0;
  if (f.decoder) f.decoder->apply(tc);
  return tc;
}

// The model, built whole and without values (nothing allocated).
std::unique_ptr<nn::Module> build(const ModelShardFlags& f) {
  if (f.model == "gpt")
    return std::make_unique<nn::GPT>(train::planned_gpt_config(train::gpt_shape(gpt_train_config(f))));
  if (f.model == "mlp") {
    nn::MLPConfig c;
    c.sizes = {kPixels};
    for (int64_t h : parse_hidden(f.hidden)) c.sizes.push_back(h);
    c.sizes.push_back(kClasses);
    c.defer_init = true;
    return std::make_unique<nn::MLP>(c);
  }
  if (f.model == "vae") {
    nn::VAEConfig c;
    c.hidden = parse_hidden(f.hidden);
    c.latent = f.latent;
    c.defer_init = true;
    return std::make_unique<nn::VAE>(c);
  }
  throw InvalidArgument("--model", fmt::format("'{}' is not a built-in model", f.model), "use gpt, mlp or vae");
}

// Every parameter as the placement rule sees it, with the trainer's FSDP
// units and pipeline stages: the recipes' own cuts (train/model_parameters.h;
// the mlp's depends on the tensor axis), the vae whole (it has no pipeline).
std::vector<layout::ModelParameter> model_parameters(const ModelShardFlags& f, nn::Module& model,
                                                     const mesh::NamedShape& mesh, int stages) {
  if (f.model == "gpt") return train::describe_gpt(train::gpt_shape(gpt_train_config(f)), stages)->params;
  if (f.model == "mlp") {
    std::vector<int64_t> sizes{kPixels};
    for (int64_t h : parse_hidden(f.hidden)) sizes.push_back(h);
    sizes.push_back(kClasses);
    return train::mlp_parameters(sizes, mesh.size_of(mesh::kTensor), stages);
  }
  if (stages > 1)
    throw InvalidArgument("--mesh", fmt::format("a pipeline of {} stages with --model {}", stages, f.model),
                          "the vae trains without a pipeline axis (as meshtrain train): drop it");
  return parallel::model_parameters(model, {});
}

// The training layout of the flags: the mesh, and the fsdp mode (full by
// default when the fsdp axis is larger than 1, as training); the gpt's
// start-up checks as train's (heads, key/value heads, experts over the axes).
layout::TrainingLayout training_layout(const ModelShardFlags& f, const mesh::NamedShape& mesh) {
  if (const int expert = mesh.size_of(mesh::kExpert); expert > 1 && f.model != "gpt")
    throw InvalidArgument("--mesh", fmt::format("an expert axis of {} for --model {}, which has no experts", expert,
                                                f.model),
                          "the expert axis splits a mixture-of-experts model's experts (--model gpt --arch llama "
                          "--experts N); use a data axis here");
  layout::TrainingLayout out{.mesh = mesh, .fsdp_min_weight_size = f.fsdp_min_weight_size};
  if (f.virtual_stages > 1) {
    if (mesh.size_of(mesh::kPipeline) == 1)
      throw InvalidArgument("--virtual-stages", fmt::format("{} virtual stages without a pipeline axis",
                                                            f.virtual_stages),
                            "add a pipeline axis to --mesh, or drop --virtual-stages");
    out.schedule = layout::ScheduleKind::interleaved_1f1b;
    out.virtual_stages = f.virtual_stages;
  }
  try {
    out.fsdp = layout::resolve_fsdp_mode(f.fsdp, mesh, DType::f32);  // f32: what the rule places
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("--fsdp", e.detail(), e.hint());
  }
  if (f.model == "gpt") train::find_model_recipe("gpt").check(gpt_train_config(f), out);
  return out;
}

std::string mib(double bytes) { return fmt::format("{:.2f} MiB", bytes / (1 << 20)); }

}  // namespace

void ModelShardFlags::add(CLI::App* app) {
  app->add_option("--model", model, "place every parameter of a built-in model: gpt | mlp | vae (instead of --shape)");
  app->add_option("--vocab", vocab, "gpt: vocabulary")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  app->add_option("--context", context, "gpt: tokens per sample")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app->add_option("--layers", layers, "gpt: transformer blocks")->capture_default_str()->check(CLI::Range(0, 1024));
  app->add_option("--heads", heads, "gpt: attention heads")->capture_default_str()->check(CLI::Range(1, 1024));
  app->add_option("--width", width, "gpt: model width")->capture_default_str()->check(CLI::Range(1, 65536));
  app->add_option("--hidden", hidden, "mlp, vae: hidden widths")->capture_default_str();
  app->add_option("--latent", latent, "vae: latent size")->capture_default_str()->check(CLI::Range(1, 65536));
  app->add_option("--virtual-stages", virtual_stages,
                  "with a pipeline axis: model chunks per pipeline rank (the interleaved schedule's)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app->add_option("--fsdp-min-weight-size", fsdp_min_weight_size,
                  "fsdp axis: parameters with fewer elements stay replicated")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_option("--fsdp", fsdp,
                  "with --model: full | shard_grad_op | no_shard | zero1 | zero2 | zero3 | hybrid_full | "
                  "hybrid_shard_grad_op (default: full with an fsdp axis, as meshtrain train)");
  app->add_option("--rank", rank, "with --model: list what this rank holds")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_flag("--json", json, "with --model: the rank's holdings as JSON");
  app->add_option("--param", param, "with --model: that parameter's rank table and picture");
  decoder = std::make_shared<TrainFieldFlags>(app, train::kGptBlockKeys);
}

int run_shard_model(const ModelShardFlags& f, const std::string& mesh_spec, int width, const std::string& svg) {
  const mesh::NamedShape mesh = mesh::parse_mesh_spec(mesh_spec);
  // What every rank holds is added up rank by rank (a pass per rank over
  // the parameters): bounded before anything is built.
  int64_t num_ranks = 1;
  for (int s : mesh.shape) num_ranks *= s;
  if (num_ranks > kMaxModelRanks)
    throw InvalidArgument("--mesh", fmt::format("{} has {} ranks, more than shard --model lists ({})", mesh_spec,
                                                num_ranks, kMaxModelRanks),
                          "give a smaller mesh, or place one tensor on a mesh of any size with shard --shape");
  if (f.rank >= num_ranks)
    throw InvalidArgument("--rank", fmt::format("rank {} of mesh {} ({} ranks)", f.rank, mesh_spec, num_ranks),
                          fmt::format("pick a rank from 0 to {}", num_ranks - 1));
  mesh::validate_mesh_config(mesh, static_cast<int>(num_ranks), "--mesh");
  const layout::TrainingLayout rule = training_layout(f, mesh);
  std::unique_ptr<nn::Module> model = build(f);
  const sharding::MultiDimensionalStrategy md = layout::seed_strategies(rule);
  const int stages = mesh.size_of(mesh::kPipeline) * rule.virtual_stages;
  const std::vector<layout::ModelParameter> params = model_parameters(f, *model, mesh, stages);
  const std::vector<layout::HeldParameter> mine = layout::held_parameters(rule, params, f.rank);
  if (f.json) {
    nlohmann::json out{
        {"model", f.model}, {"mesh", mesh_spec}, {"rank", f.rank}, {"parameters", nlohmann::json::array()}};
    for (const layout::HeldParameter& h : mine) {
      const sharding::Placement& p = h.placement;
      out["parameters"].push_back({{"name", h.name}, {"stage", h.stage}, {"shape", p.shape}, {"view", p.view},
                                 {"offsets", p.box.offsets},
                                   {"sizes", p.box.sizes}, {"start", p.start}, {"count", p.count},
                                   {"placement", p.to_string()}});
    }
    fmt::print("{}\n", out.dump(1));
    return 0;
  }
  print_config("shard", {{"model", f.model}, {"mesh", mesh_spec}, {"virtual_stages", std::to_string(f.virtual_stages)},
                         {"fsdp", rule.fsdp ? rule.fsdp->name() : std::string("-")},
                         {"fsdp_min_weight_size", std::to_string(f.fsdp_min_weight_size)},
                         {"rank", std::to_string(f.rank)}, {"param", f.param.empty() ? "-" : f.param}});
  fmt::print("{} on {}; spec: {}\n", f.model, rule.describe(), md.name());
  double total = 0;  // f32 bytes of the model
  const std::vector<nn::Parameter*> ps = model->parameters();
  for (const nn::Parameter* p : ps) {
    if (p->name == f.param) {
      const sharding::PartitionSpec spec = md.combined_spec(p->info);
      fmt::print("\n{} ({}):\n{}\n\n", p->name, sharding::to_string(p->info.kind), md.explain(p->info));
      print_layout(sharding::Layout(mesh.shape, mesh.axis_names, spec, p->info.layout().shape), mesh, width, svg);
      return 0;
    }
    total += 4.0 * static_cast<double>(p->info.numel());
  }
  if (!f.param.empty())
    throw InvalidArgument("--param", fmt::format("'{}' is not a parameter of {}", f.param, f.model),
                          fmt::format("pick one of the names below, e.g. '{}'", ps.empty() ? "" : ps.front()->name));
  // The rank's parameters (under a pipeline, those of its stages only).
  std::vector<std::pair<std::string, std::string>> rows;  // (name, the table's other columns)
  for (const layout::HeldParameter& h : mine) {
    const auto p = std::find_if(ps.begin(), ps.end(), [&](const nn::Parameter* q) { return q->name == h.name; });
    if (p == ps.end())  // the stages' names are the whole model's
      throw Error("meshtrain shard --model", fmt::format("{} is not a parameter of the whole {}", h.name, f.model),
                  "report this: the stage cut renamed a parameter");
    const sharding::ParamInfo& info = (*p)->info;
    // A routed expert's rank holds a run of its layer's experts.
    std::string experts;
    if (const int e = mesh.size_of(mesh::kExpert); info.routed_expert() && e > 1) {
      const int local = info.experts / e, first = info.expert / local * local;
      experts = fmt::format(" (experts {}-{} of {})", first, first + local - 1, info.experts);
    }
    rows.emplace_back(h.name, fmt::format("{:<16} {:<22} {:<26} {}{}{}",
                                          sharding::shape_to_string(info.layout().shape),
                                          sharding::to_string(info.kind), md.combined_spec(info).to_string(),
                                          stages > 1 ? fmt::format("stage {}: ", h.stage) : "",
                                          h.placement.to_string(), experts));
  }
  const std::vector<std::pair<std::string, std::string>> folded = nn::fold_layer_rows(rows);
  size_t name_width = 28;
  for (const auto& row : folded) name_width = std::max(name_width, row.first.size());
  fmt::print("\n{:<{}} {:<16} {:<22} {:<26} {}\n", "parameter", name_width, "shape", "kind", "spec",
             fmt::format("rank {} holds", f.rank));
  for (const auto& [name, columns] : folded) fmt::print("{:<{}} {}\n", name, name_width, columns);
  double held = 0;  // the most f32 bytes a rank holds
  for (int r = 0; r < static_cast<int>(num_ranks); ++r) {
    double bytes = 0;
    for (const layout::HeldParameter& h : layout::held_parameters(rule, params, r)) bytes += 4.0 * h.placement.numel();
    held = std::max(held, bytes);
  }
  fmt::print("\nf32 parameters: {} in all, at most {} on a rank ({:.1f}%)\n", mib(total), mib(held),
             100.0 * held / std::max(total, 1.0));
  if (rule.fsdp)
    fmt::print("(fsdp holds each unit's sharded parameters as one flat vector cut into equal ranges: the spec is the "
               "seeds' per-dimension picture of the split, the last column what the rank really holds)\n");
  return 0;
}

}  // namespace meshtrain::cli
