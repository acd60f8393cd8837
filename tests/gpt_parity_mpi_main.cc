// The GPT under mpirun or meshtrain launch equals one device: every process trains the run of
// tests/gpt_parity.h on the mpi or gloo engine with data parallelism and
// zero1/zero2/zero3 over all processes, tensor parallelism (tensor=2 with
// 2 processes, data=2 x tensor=2 and zero3 on fsdp=2 x tensor=2 with 4;
// tensor=2 and data=2 x tensor=2 also with sequence parallelism),
// and hybrid_full on data=2,fsdp=2 with 4; pipeline parallelism of the
// model made 8 blocks deep (batch 16, 4 micro-batches): pipeline=2 with 1F1B
// and interleaved with 2, pipeline=4 with 1F1B and data=2 x pipeline=2
// interleaved with 4. Rank 0 then trains each model on one threads-engine
// rank and compares per-step losses and final parameters (1e-5 relative).
// Exit 0 only if all agree.
//   mpirun -np 2 gpt_parity_mpi_test
//   meshtrain launch --nproc-per-node 2 -- gpt_parity_mpi_test
#include <fmt/format.h>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

using namespace meshtrain;

int main(int, char** argv) {
  meshtrain::prepare_libraries(argv);  // MESHTRAIN_CPU_ISA and the idle waits reach OpenBLAS and libgomp
  const config::DistributedConfig dc =
      config::DistributedConfig{}.with_env(config::read_launcher_env());
  // mpi under mpirun, gloo under meshtrain launch (or torchrun).
  const comm::Engine engine = dc.launcher == config::Launcher::mpirun ? comm::Engine::mpi : comm::Engine::gloo;
  const int n = dc.world_size;
  struct Case {
    std::string fsdp;  // "" = data parallelism
    std::vector<int> shape;
    std::vector<std::string> axes;
    bool sequence_parallel = false;
    std::string pipeline_schedule = {};  // "": no pipeline axis
    std::string cp_comm = "ring";        // with a context axis
  };
  std::vector<Case> cases = {{"", {n}, {"data"}},
                             {"zero1", {n}, {"fsdp"}},
                             {"zero2", {n}, {"fsdp"}},
                             {"zero3", {n}, {"fsdp"}}};
  if (n == 2) {
    cases.push_back({"", {2}, {"tensor"}});
    cases.push_back({"", {2}, {"tensor"}, true});
    cases.push_back({"", {2}, {"pipeline"}, false, "1f1b"});
    cases.push_back({"", {2}, {"pipeline"}, false, "interleaved"});
    cases.push_back({"", {2}, {"context"}});
    cases.push_back({"", {2}, {"context"}, false, "", "all_to_all"});
  }
  if (n == 4) {
    cases.push_back({"hybrid_full", {2, 2}, {"data", "fsdp"}});
    cases.push_back({"", {2, 2}, {"data", "tensor"}});
    cases.push_back({"", {2, 2}, {"data", "tensor"}, true});
    cases.push_back({"zero3", {2, 2}, {"fsdp", "tensor"}});
    cases.push_back({"", {4}, {"pipeline"}, false, "1f1b"});
    cases.push_back({"", {2, 2}, {"data", "pipeline"}, false, "interleaved"});
    cases.push_back({"", {2, 2}, {"data", "context"}});
    cases.push_back({"", {2, 2}, {"context", "tensor"}});
  }
  // The pipeline cases' model: 8 blocks (4 stages x 2 chunks at most), 4
  // micro-batches of 2 rows per data-parallel rank.
  const auto deep = [](train::TrainConfig tc) {
    tc.layers = 8;
    tc.batch_size = 16;
    tc.micro_batches = 4;
    return tc;
  };

  std::vector<train::TrainResult> results;
  for (const Case& c : cases) {
    const mesh::NamedShape shape{c.shape, c.axes};
    train::TrainConfig tc = gpt_parity_config("mpi_" + (c.fsdp.empty() ? std::string("dp") : c.fsdp) + "_" +
                                              shape.to_spec() + (c.sequence_parallel ? "_sp" : "") +
                                              c.pipeline_schedule + (c.cp_comm == "ring" ? "" : c.cp_comm));
    if (!c.pipeline_schedule.empty()) {
      tc = deep(tc);
      tc.set("pipeline_schedule", c.pipeline_schedule, "case.pipeline_schedule");
    }
    tc.set("fsdp", c.fsdp, "case");
    tc.sequence_parallel = c.sequence_parallel;
    tc.set("cp_comm", c.cp_comm, "case.cp_comm");
    config::DistributedConfig d = dc;
    d.backend = engine;
    d.set_mesh(shape);
    results.push_back(
        train::run_training(tc, d, {.engine = engine, .ranks = 0, .timeout = std::chrono::seconds(120)}));
  }
  if (dc.rank != 0) return 0;
  const auto ref = train::run_training(gpt_parity_config("mpi_one"), config::DistributedConfig{},
                                       {.engine = comm::Engine::threads, .ranks = 1});
  const auto ref_deep = train::run_training(deep(gpt_parity_config("mpi_one_deep")), config::DistributedConfig{},
                                            {.engine = comm::Engine::threads, .ranks = 1});
  int bad = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string what = fmt::format(
        "gpt {} on mesh {}{}{}{} ({} processes)", cases[i].fsdp.empty() ? "data parallel" : cases[i].fsdp,
        mesh::NamedShape{cases[i].shape, cases[i].axes}.to_spec(),
        cases[i].sequence_parallel ? " with sequence parallelism" : "",
        cases[i].pipeline_schedule.empty() ? "" : ", schedule " + cases[i].pipeline_schedule,
        cases[i].cp_comm == "ring" ? "" : ", " + cases[i].cp_comm, n);
    const auto problems =
        testing::run_differences(results[i], cases[i].pipeline_schedule.empty() ? ref : ref_deep, 1e-5);
    for (const auto& p : problems) fmt::print(stderr, "FAIL {}: {}\n", what, p);
    fmt::print("{} {} vs 1 rank over {} steps: {}\n", comm::engine_name(engine), what, kGptParitySteps, problems.empty() ? "PASS" : "FAIL");
    bad += problems.empty() ? 0 : 1;
  }
  return bad ? 1 : 0;
}
