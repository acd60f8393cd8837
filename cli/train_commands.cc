// meshtrain train: TOML config < launcher environment < command-line flags.
#include <fmt/format.h>

#include <map>
#include <memory>

#include "bench/train_bench.h"
#include "cli/command.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/error.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::cli {
namespace {

struct TrainFlags {
  std::string config;
  std::string engine;
  std::string devices;
  std::string mesh;
  double timeout_s = 300;
  std::map<std::string, std::string> values;  // train key -> flag text
  CLI::App* app = nullptr;
};

void set_distributed(config::DistributedConfig& dc, std::string_view key, const std::string& text,
                     std::string_view source) {
  for (const auto& f : config::distributed_config_fields())
    if (f.key == key) return f.parse(dc, text, source);
  throw Error("meshtrain train", fmt::format("no distributed field '{}'", key), "");
}

int run_train(TrainFlags& f) {
  train::TrainConfig tc = f.config.empty() ? train::TrainConfig{} : train::TrainConfig::from_toml_file(f.config);
  for (const auto& field : train::train_config_fields())
    if (f.app->get_option(std::string(field.flag))->count() > 0)
      tc.set(field.key, f.values[std::string(field.key)], field.flag);
  tc.validate();

  config::DistributedConfig dc =
      f.config.empty() ? config::DistributedConfig{} : config::DistributedConfig::from_toml_file(f.config);
  dc = dc.with_env(config::read_launcher_env());
  const bool mpirun = comm::started_by_mpirun();
  const std::string engine = !f.engine.empty() ? f.engine : mpirun ? "mpi" : std::string(comm::engine_name(dc.backend));
  set_distributed(dc, "backend", engine, f.engine.empty() ? "environment" : "--engine");
  if (!f.devices.empty()) {
    if (engine != "threads")
      throw InvalidArgument("--devices", "the mpi engine takes its ranks from mpirun", "use mpirun -np N instead");
    set_distributed(dc, "world_size", f.devices, "--devices");
    set_distributed(dc, "num_processes_per_node", f.devices, "--devices");
  }
  if (!f.mesh.empty()) set_distributed(dc, "mesh", f.mesh, "--mesh");
  dc.validate();

  const comm::LaunchOptions launch{.engine = dc.backend,
                                   .ranks = dc.backend == comm::Engine::threads ? dc.world_size : 0,
                                   .timeout = std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000))};
  const bool main = dc.rank == 0;
  if (main) {
    fmt::print("meshtrain train: engine {}, {} ranks, mesh {}\n", engine, dc.world_size, dc.mesh().to_spec());
    fmt::print("{}\n[distributed]\n# (resolved)\n{}\n\n", tc.to_toml(), dc.to_string());
    const plan::NamedShape m = dc.mesh();
    fmt::print("{}\n", mesh::render_mesh(m.shape, m.axis_names));
    std::fflush(stdout);
  }
  const train::TrainResult r = train::run_training(tc, dc, launch);
  if (main) {
    fmt::print("done: {} steps in {:.1f} s ({:.0f} samples/s), data-parallel communication hidden {:.0f}%\n", r.steps,
               r.seconds, r.samples_per_second, 100 * r.hidden_fraction);
    if (tc.model == "mlp")
      fmt::print("final test accuracy {:.2f}% (test loss {:.4f})\n", 100 * r.test_accuracy, r.test_loss);
    else
      fmt::print("final test ELBO loss {:.2f} nats per image\n", r.test_loss);
    fmt::print("run directory: {} (config.toml, metrics.jsonl, model.safetensors, loss.svg{})\n", r.run_dir,
               tc.model == "vae" ? ", reconstructions.png, samples.png" : "");
  }
  return 0;
}

}  // namespace

std::vector<Command> add_train_commands(CLI::App& app) {
  std::vector<Command> out;
  auto bo = std::make_shared<bench::TrainBenchOptions>();
  CLI::App* bench_cmd = app.get_subcommand("bench");
  auto* tb = bench_cmd->add_subcommand("train", "MLP step time, its GEMMs alone, data-parallel scaling 1 -> 2 ranks");
  tb->add_option("--steps", bo->steps, "timed steps")->capture_default_str();
  tb->add_option("--batch", bo->batch, "batch per rank")->capture_default_str();
  out.push_back({tb, [=] {
                   print_config("bench train", {{"steps", std::to_string(bo->steps)}, {"batch", std::to_string(bo->batch)}});
                   fmt::print("{}", bench::format_train_bench(bench::run_train_bench(*bo), *bo));
                   return 0;
                 }});

  auto f = std::make_shared<TrainFlags>();
  auto* cmd = app.add_subcommand("train", "train an MLP or a VAE on Fashion-MNIST, data parallel over the mesh");
  f->app = cmd;
  cmd->add_option("--config", f->config, "TOML file with [train] and [distributed] sections (examples/*.toml)");
  cmd->add_option("--engine", f->engine, "threads (default) | mpi (default under mpirun)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  cmd->add_option("--devices", f->devices, "simulated devices (threads engine)");
  cmd->add_option("--mesh", f->mesh, "device mesh, e.g. data=4");
  cmd->add_option("--timeout", f->timeout_s, "deadline of every wait, seconds")->capture_default_str();
  const train::TrainConfig defaults;
  for (const auto& field : train::train_config_fields()) {
    const std::string key(field.key);
    cmd->add_option(std::string(field.flag), f->values[key],
                    fmt::format("{} (default {})", field.help, field.format(defaults)));
  }
  out.push_back({cmd, [=] { return run_train(*f); }});
  return out;
}

}  // namespace meshtrain::cli
