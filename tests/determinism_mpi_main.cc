// The deterministic mode under mpirun or meshtrain launch: every process
// trains the MLP and then a small GPT 20 steps with --deterministic on the
// mpi or gloo engine (data axis = all processes); rank 0 then trains the
// same on one threads-engine rank and compares model.safetensors byte for
// byte and the per-step losses exactly. Exit 0 only if they are identical.
//   mpirun -np 4 determinism_mpi_test
//   meshtrain launch --nproc-per-node 2 -- determinism_mpi_test
#include <fmt/format.h>

#include <filesystem>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/train/trainer.h"
#include "tests/determinism.h"

using namespace meshtrain;

int main(int, char** argv) {
  meshtrain::prepare_libraries(argv);
  const auto env = config::read_launcher_env();
  config::DistributedConfig dc = config::DistributedConfig{}.with_env(env);
  const comm::Engine engine = dc.launcher == config::Launcher::mpirun ? comm::Engine::mpi : comm::Engine::gloo;
  dc.backend = engine;
  dc.mesh_shape = {dc.world_size};
  dc.mesh_axis_names = {"data"};
  int bad = 0;
  for (train::TrainConfig tc : {testing::deterministic_mlp("mlp"), testing::deterministic_gpt("gpt")}) {
    const auto tmp = std::filesystem::temp_directory_path();
    tc.run_dir = (tmp / ("meshtrain_determinism_engine_" + tc.model)).string();
    tc.overwrite = true;
    const auto got = train::run_training(tc, dc, {.engine = engine, .ranks = 0, .timeout = std::chrono::seconds(120)});
    if (dc.rank != 0) continue;
    train::TrainConfig one = tc;
    one.run_dir = (tmp / ("meshtrain_determinism_one_" + tc.model)).string();
    const auto ref =
        train::run_training(one, config::DistributedConfig{}, {.engine = comm::Engine::threads, .ranks = 1});
    int wrong = 0;
    if (got.step_losses != ref.step_losses || got.step_losses.size() != 20) {
      ++wrong;
      fmt::print(stderr, "FAIL: {}: the per-step losses differ ({} and {} steps)\n", tc.model, got.step_losses.size(),
                 ref.step_losses.size());
    }
    const std::string a = testing::read_bytes(tc.run_dir + "/model.safetensors");
    if (a.empty() || a != testing::read_bytes(one.run_dir + "/model.safetensors"))
      ++wrong, fmt::print(stderr, "FAIL: {}: model.safetensors differs from one device's\n", tc.model);
    fmt::print("{}: {} data parallel ({} ranks) vs 1 rank, deterministic, 20 steps: {}\n", tc.model,
               comm::engine_name(engine), dc.world_size, wrong ? "FAIL" : "PASS (identical bytes)");
    bad += wrong;
  }
  return bad ? 1 : 0;
}
