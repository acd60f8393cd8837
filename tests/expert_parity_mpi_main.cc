// Expert parallelism under mpirun: layouts of tests/expert_parity_test.cc
// (the run of tests/expert_parity.h) on the mpi engine, each process one
// rank, so the experts' all_to_all_v crosses processes. Rank 0 then trains
// one device on the threads engine and compares per-step losses and final
// parameters (1e-5 relative). Exit 0 only if all agree.
//   mpirun -np 4 expert_parity_mpi_test
#include <fmt/format.h>

#include <filesystem>
#include <vector>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/expert_parity.h"

using namespace meshtrain;

int main(int, char** argv) {
  meshtrain::prepare_libraries(argv);
  const config::DistributedConfig dc = config::DistributedConfig{}.with_env(config::read_launcher_env());
  const comm::Engine engine = dc.launcher == config::Launcher::mpirun ? comm::Engine::mpi : comm::Engine::gloo;
  if (dc.world_size != 4) {
    fmt::print(stderr, "expert_parity_mpi_test: run it with 4 processes, not {}\n", dc.world_size);
    return 2;
  }
  const std::vector<ExpertLayout> layouts = {{.mesh = "expert=4"},
                                             {.mesh = "data=2,expert=2", .capacity_factor = 1.0},
                                             {.mesh = "fsdp=2,expert=2", .fsdp = "zero3"},
                                             {.mesh = "expert=2,tensor=2", .clip_norm = 0.05}};
  std::vector<train::TrainResult> results;
  for (const ExpertLayout& l : layouts) {
    const train::TrainConfig tc = expert_config(l, fmt::format("mpi_{}", results.size()));
    config::DistributedConfig d = dc;
    d.backend = engine;
    d.set_mesh(mesh::parse_mesh_spec(l.mesh));
    results.push_back(
        train::run_training(tc, d, {.engine = engine, .ranks = 0, .timeout = std::chrono::seconds(120)}));
  }
  if (dc.rank != 0) return 0;
  int bad = 0;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const train::TrainConfig one = expert_config(layouts[i].reference(), fmt::format("mpi_one_{}", i));
    const train::TrainResult ref =
        train::run_training(one, config::DistributedConfig{}, {.engine = comm::Engine::threads, .ranks = 1});
    std::filesystem::remove_all(one.run_dir);
    const std::vector<std::string> problems = testing::run_differences(results[i], ref, 1e-5);
    for (const std::string& p : problems) fmt::print(stderr, "FAIL {}: {}\n", layouts[i].name(), p);
    fmt::print("{} {} (4 processes) vs 1 rank over {} steps: {}\n", comm::engine_name(engine), layouts[i].name(),
               kGptParitySteps,
               problems.empty() ? "PASS" : "FAIL");
    bad += problems.empty() ? 0 : 1;
  }
  return bad ? 1 : 0;
}
