// Issue 39's parity matrix under mpirun: the 4- and 8-process layouts of
// tests/axes_parity_test.cc (the run of tests/axes_parity.h) on the mpi
// engine, each process one rank. Rank 0 then trains one device on the
// threads engine and compares per-step losses and final parameters (1e-5
// relative). Exit 0 only if all agree.
//   mpirun -np 4 axes_parity_mpi_test
//   mpirun -np 8 axes_parity_mpi_test
#include <fmt/format.h>

#include <filesystem>
#include <vector>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/axes_parity.h"

using namespace meshtrain;

int main(int, char** argv) {
  meshtrain::prepare_libraries(argv);
  const config::DistributedConfig dc = config::DistributedConfig{}.with_env(config::read_launcher_env());
  const comm::Engine engine = dc.launcher == config::Launcher::mpirun ? comm::Engine::mpi : comm::Engine::gloo;
  std::vector<AxesLayout> layouts;
  if (dc.world_size == 4)
    layouts = {{.mesh = "fsdp=2,pipeline=2", .fsdp = "zero3", .schedule = "1f1b"},
               {.mesh = "fsdp=2,pipeline=2", .fsdp = "zero3", .schedule = "zb"},
               {.mesh = "pipeline=2,context=2", .schedule = "interleaved"},
               {.mesh = "pipeline=2,context=2", .schedule = "gpipe", .cp_comm = "all_to_all"},
               {.mesh = "context=2,tensor=2", .sequence_parallel = true}};
  if (dc.world_size == 8)
    layouts = {{.mesh = "data=2,fsdp=2,pipeline=2", .fsdp = "hybrid_full"},
               {.mesh = "pipeline=2,data=2,context=2"},
               {.mesh = "pipeline=2,context=2,tensor=2", .sequence_parallel = true, .schedule = "zb"}};
  if (layouts.empty()) {
    fmt::print(stderr, "axes_parity_mpi_test: run it with 4 or 8 processes, not {}\n", dc.world_size);
    return 2;
  }
  std::vector<train::TrainResult> results;
  for (const AxesLayout& l : layouts) {
    const train::TrainConfig tc = axes_config(l, fmt::format("mpi{}_{}", dc.world_size, results.size()));
    config::DistributedConfig d = dc;
    d.backend = engine;
    d.set_mesh(mesh::parse_mesh_spec(l.mesh));
    results.push_back(
        train::run_training(tc, d, {.engine = engine, .ranks = 0, .timeout = std::chrono::seconds(120)}));
  }
  if (dc.rank != 0) return 0;
  const train::TrainConfig one = axes_config({}, fmt::format("mpi{}_one", dc.world_size));
  const train::TrainResult ref = train::run_training(one, config::DistributedConfig{},
                                                     {.engine = comm::Engine::threads, .ranks = 1});
  std::filesystem::remove_all(one.run_dir);
  int bad = 0;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const std::vector<std::string> problems = testing::run_differences(results[i], ref, 1e-5);
    for (const std::string& p : problems) fmt::print(stderr, "FAIL {}: {}\n", layouts[i].name(), p);
    fmt::print("{} {} ({} processes) vs 1 rank over {} steps: {}\n", comm::engine_name(engine), layouts[i].name(),
               dc.world_size, kAxesSteps, problems.empty() ? "PASS" : "FAIL");
    bad += problems.empty() ? 0 : 1;
  }
  return bad ? 1 : 0;
}
