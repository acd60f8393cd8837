// meshtrain mesh and meshtrain shard: pure computations over a mesh shape, no
// ranks started, so they work for any device count (shard --model:
// model_shard.cc).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <memory>

#include "cli/command.h"
#include "cli/model_shard.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/sharding/layout.h"
#include "meshtrain/sharding/visualize.h"

namespace meshtrain::cli {
namespace {

struct MeshFlags {
  int devices = 0;
  std::string mesh;
  std::string model_size;
  int64_t seq = 2048;
  std::string device_memory = "80GB";
  int devices_per_node = 8;
  int dims = 2;
};

int run_mesh(const MeshFlags& f) {
  print_config("mesh", {{"devices", std::to_string(f.devices)},
                        {"mesh", f.mesh.empty() ? "-" : f.mesh},
                        {"model_size", f.model_size.empty() ? "-" : f.model_size},
                        {"seq", std::to_string(f.seq)},
                        {"device_memory", f.device_memory},
                        {"devices_per_node", std::to_string(f.devices_per_node)}});
  if (!f.mesh.empty()) {
    const mesh::NamedShape named = mesh::parse_mesh_spec(f.mesh);
    mesh::validate_mesh_config(named, f.devices);
    fmt::print("{}", mesh::render_mesh(named.shape, named.axis_names));
    return 0;
  }
  if (!f.model_size.empty()) {
    (void)plan::parse_model_size(f.model_size, "--model-size");  // errors name the flags
    (void)plan::parse_memory_size(f.device_memory, "--device-memory");
    const plan::MeshPlan p =
        plan::optimize_for_transformer(f.devices, f.model_size, f.seq, f.device_memory, f.devices_per_node);
    fmt::print("suggested mesh for a {} model, sequence {}, on {} devices of {}: {}{}\n", f.model_size, f.seq,
               f.devices, f.device_memory, p.to_spec(), p.fits ? "" : "  (does NOT fit: see below)");
    fmt::print("why:\n");
    for (const auto& r : p.reasons) fmt::print("  - {}\n", r);
    if (!p.shape.empty()) fmt::print("\n{}", mesh::render_mesh(p.shape, p.axis_names));
    return 0;
  }
  const std::vector<int> shape = mesh::get_optimal_mesh_shape(f.devices, f.dims);
  std::vector<std::string> names;
  for (int d = 0; d < f.dims; ++d) names.push_back(fmt::format("axis{}", d));
  fmt::print("most balanced {}-axis shape using all {} devices: ({})\n", f.dims, f.devices, fmt::join(shape, ", "));
  fmt::print("{}", mesh::render_mesh(shape, names));
  return 0;
}

// The rank table lists at most this many ranks, so the output stays bounded.
constexpr int kMaxTableRanks = 1024;

struct ShardFlags {
  ModelShardFlags model;
  std::string shape;
  std::string spec;
  std::string mesh;
  std::string partial;
  std::string svg;
  bool strict = false;
  int width = 48;
};

std::vector<int64_t> parse_shape(const std::string& text) {
  return parse_int_list(text, "--shape", 0, std::numeric_limits<int64_t>::max(), "128,4096");
}

}  // namespace

// The rank table and (for 1-D and 2-D layouts of at most kMaxPictureRanks
// ranks) the picture of `layout`, also as SVG to `svg` unless empty.
void print_layout(const sharding::Layout& layout, const mesh::NamedShape& named, int width, const std::string& svg) {
  fmt::print("{}\n\n", layout.to_string());
  fmt::print("{:>5}  {:<16} {:<24} {}\n", "rank", "coords", "global block", "local shape");
  const int listed = std::min(layout.num_ranks(), kMaxTableRanks);
  for (int r = 0; r < listed; ++r) {
    const std::vector<int> coords = mesh::unravel(r, named.shape);
    std::vector<std::string> c;
    for (size_t a = 0; a < coords.size(); ++a) c.push_back(fmt::format("{}={}", named.axis_names[a], coords[a]));
    fmt::print("{:>5}  {:<16} {:<24} ({})\n", r, fmt::format("{}", fmt::join(c, ",")), layout.local_box(r).to_string(),
               fmt::join(layout.local_shape(r), ", "));
  }
  if (listed < layout.num_ranks())
    fmt::print("... {} more ranks not listed (the table lists the first {})\n", layout.num_ranks() - listed,
               kMaxTableRanks);
  if ((layout.ndim() == 1 || layout.ndim() == 2) && layout.num_ranks() > sharding::kMaxPictureRanks) {
    fmt::print("\n(no picture: more than {} ranks)\n", sharding::kMaxPictureRanks);
    if (!svg.empty()) throw InvalidArgument("shard --svg", "no picture drawn", "draw meshes of at most 4096 ranks");
  } else if (layout.ndim() == 1 || layout.ndim() == 2) {
    fmt::print("\n{}", sharding::visualize_sharding(layout, {.width = width}));
    if (!svg.empty()) {
      std::ofstream out(svg);
      if (!out) throw IoError("shard --svg", fmt::format("cannot write '{}'", svg), "check the directory exists");
      out << sharding::visualize_sharding_svg(layout, {.width = width});
      fmt::print("wrote {}\n", svg);
    }
  }
}

namespace {

int run_shard(const ShardFlags& f) {
  if (!f.model.model.empty()) return run_shard_model(f.model, f.mesh, f.width, f.svg);
  if (f.shape.empty() || f.spec.empty())
    throw InvalidArgument("meshtrain shard", "neither --model nor --shape and --spec given",
                          "pass --shape and --spec for one tensor, or --model gpt|mlp|vae for a model's parameters");
  print_config("shard", {{"shape", f.shape}, {"spec", f.spec}, {"mesh", f.mesh},
                         {"partial", f.partial.empty() ? "-" : f.partial}, {"strict", f.strict ? "on" : "off"}});
  const mesh::NamedShape named = mesh::parse_mesh_spec(f.mesh);
  sharding::LayoutOptions options;
  options.strict = f.strict;
  if (!f.partial.empty()) options.partial[f.partial] = comm::ReduceOp::sum;
  print_layout(sharding::Layout(named.shape, named.axis_names, sharding::PartitionSpec::parse(f.spec),
                                parse_shape(f.shape), options),
               named, f.width, f.svg);
  return 0;
}

}  // namespace

std::vector<Command> add_layout_commands(CLI::App& app) {
  std::vector<Command> out;

  auto mf = std::make_shared<MeshFlags>();
  auto* mesh_cmd = app.add_subcommand(
      "mesh", "print a mesh and its groups (--mesh), suggest one for a model (--model-size), or a balanced shape");
  mesh_cmd->add_option("--devices", mf->devices,
                       "number of devices, 1 to 2147483647 (pictures and group lists up to 4096)")
      ->required()
      ->check(CLI::PositiveNumber);
  mesh_cmd->add_option("--mesh", mf->mesh, "axes and sizes, e.g. data=4,tensor=2");
  mesh_cmd->add_option("--model-size", mf->model_size, "parameters, e.g. 350M, 7B, 1.5T");
  mesh_cmd->add_option("--seq", mf->seq, "sequence length (with --model-size)")->capture_default_str();
  mesh_cmd->add_option("--device-memory", mf->device_memory, "memory per device, e.g. 80GB, 24GiB")
      ->capture_default_str();
  mesh_cmd->add_option("--devices-per-node", mf->devices_per_node, "tensor parallelism stays within a node")
      ->capture_default_str();
  mesh_cmd->add_option("--dims", mf->dims, "axes of the balanced shape (without --mesh/--model-size)")
      ->capture_default_str()
      ->check(CLI::Range(1, 8));
  out.push_back({mesh_cmd, [=] { return run_mesh(*mf); }});

  auto sf = std::make_shared<ShardFlags>();
  auto* shard_cmd = app.add_subcommand(
      "shard", "print which ranks hold which block of a tensor, or of every parameter of a model (and draw it)");
  shard_cmd->add_option("--shape", sf->shape, "global shape, e.g. 128,4096 (at most 2^63-1 elements)");
  shard_cmd->add_option("--spec", sf->spec, "partition spec, e.g. data,tensor or (data,fsdp),None");
  shard_cmd->add_option("--mesh", sf->mesh, "axes and sizes, e.g. data=4,tensor=2")->required();
  shard_cmd->add_option("--partial", sf->partial, "a mesh axis holding partial sums");
  shard_cmd->add_option("--svg", sf->svg, "also write the picture as SVG to this file");
  shard_cmd->add_option("--picture-width", sf->width,
                        fmt::format("columns of the text picture (1 to {})", sharding::kMaxPictureWidth))
      ->capture_default_str()
      ->check(CLI::Range(1, sharding::kMaxPictureWidth));
  shard_cmd->add_flag("--strict", sf->strict, "reject dimensions that do not divide evenly");
  sf->model.add(shard_cmd);
  out.push_back({shard_cmd, [=] { return run_shard(*sf); }});
  return out;
}

}  // namespace meshtrain::cli
