// Data-parallel training under mpirun or meshtrain launch equals one device: every process trains
// 50 steps on the mpi or gloo engine (data axis = all processes); rank 0 then trains
// the same on one threads-engine rank and compares per-step losses and final
// parameters (1e-5 relative). Exit 0 only if they agree.
//   mpirun -np 2 dp_parity_mpi_test
//   meshtrain launch --nproc-per-node 2 -- dp_parity_mpi_test
#include <fmt/format.h>

#include <cmath>
#include <filesystem>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/train/trainer.h"

using namespace meshtrain;

int main(int, char** argv) {
  meshtrain::prepare_libraries(argv);  // MESHTRAIN_CPU_ISA and the idle waits reach OpenBLAS and libgomp
  const auto env = config::read_launcher_env();
  config::DistributedConfig dc = config::DistributedConfig{}.with_env(env);
  // mpi under mpirun, gloo under meshtrain launch (or torchrun).
  const comm::Engine engine = dc.launcher == config::Launcher::mpirun ? comm::Engine::mpi : comm::Engine::gloo;
  dc.backend = engine;
  dc.mesh_shape = {dc.world_size};
  dc.mesh_axis_names = {"data"};
  train::TrainConfig tc;
  tc.hidden = {64, 32};
  // SGD with momentum: see tests/dp_parity_test.cc (AdamW amplifies last-bit
  // summation-order differences where a gradient nearly cancels).
  tc.optimizer = "sgd";
  tc.lr = 0.05;
  tc.dropout = 0.1;
  tc.batch_size = 64;
  tc.max_steps = 50;
  tc.lr_decay_steps = 50;  // the cosine decays within the run, as these parity bounds were set for
  tc.epochs = 1;
  tc.log_every = 1000;
  tc.threads_per_rank = 1;
  const auto tmp = std::filesystem::temp_directory_path();
  tc.run_dir = (tmp / "meshtrain_dp_parity_mpi").string();
  tc.overwrite = true;  // the previous test run's directory
  const auto mpi = train::run_training(tc, dc, {.engine = engine, .ranks = 0,
                                                .timeout = std::chrono::seconds(120)});
  if (dc.rank != 0) return 0;
  train::TrainConfig one = tc;
  one.run_dir = (tmp / "meshtrain_dp_parity_one").string();
  config::DistributedConfig single;
  const auto ref = train::run_training(one, single, {.engine = comm::Engine::threads, .ranks = 1});
  int bad = 0;
  if (mpi.step_losses.size() != 50 || ref.step_losses.size() != 50) {
    fmt::print(stderr, "FAIL: {} and {} steps\n", mpi.step_losses.size(), ref.step_losses.size());
    return 1;
  }
  for (size_t s = 0; s < 50; ++s) {
    const double r = std::fabs(mpi.step_losses[s] - ref.step_losses[s]) / std::fabs(ref.step_losses[s]);
    if (r > 1e-5) ++bad, fmt::print(stderr, "FAIL: step {} loss {} vs {}\n", s, mpi.step_losses[s], ref.step_losses[s]);
  }
  const auto a = checkpoint::load_safetensors(tc.run_dir + "/model.safetensors");
  const auto b = checkpoint::load_safetensors(one.run_dir + "/model.safetensors");
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const auto va = a[i].second.to_vector(), vb = b[i].second.to_vector();
    double diff = 0, scale = 1e-30;
    for (size_t k = 0; k < va.size(); ++k) diff = std::max(diff, std::fabs(va[k] - vb[k])), scale = std::max(scale, std::fabs(vb[k]));
    if (diff / scale > 1e-5) ++bad, fmt::print(stderr, "FAIL: {} differs by {:.2e}\n", a[i].first, diff / scale);
  }
  fmt::print("{} data parallel ({} ranks) vs 1 rank over 50 steps: {}\n", comm::engine_name(engine), dc.world_size,
             bad ? "FAIL" : "PASS");
  return bad ? 1 : 0;
}
