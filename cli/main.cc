// The meshtrain command:
//   meshtrain demo                        mesh on 4 simulated devices, every collective checked, benchmark table
//   meshtrain check --engine E --ranks N  the collective self-test on an engine
//   meshtrain bench collectives ...       algbw/busbw table against the memory-traffic bound
//   meshtrain bench train ...             MLP step time, its GEMMs, data-parallel scaling
//   meshtrain bench memory ...            memory per rank of ZeRO-1/2/3 against the formulas
//   meshtrain bench gemm ...              a step's GEMMs on OpenBLAS/oneDNN, f32/bf16, against the FMA peak
//   meshtrain mesh ...                    print a mesh and its groups, or plan one for a model
//   meshtrain shard ...                   print (and draw) how a tensor is sharded on a mesh
//   meshtrain train ...                   train an MLP or a VAE on Fashion-MNIST (data parallel or fully sharded)
//   meshtrain tokenize ...                train/reuse the BPE tokenizer on a text corpus, write its token file
//   meshtrain launch ... -- CMD ...       start CMD's worker processes on this node, like torchrun (docs/launch.md)
//   meshtrain devices ...                 the detected hardware, its batch-size advice, a batch-size check
//   meshtrain plan ...                    memory per device of training the GPT under a mesh (docs/planner.md)
//   meshtrain --version                   "meshtrain 0.2.0" (meshtrain/version.h)
// Library errors become exit code 1 with the message on stderr; bad flags exit 2.
#include <fmt/format.h>

#include <cstdio>

#include "cli/command.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/version.h"

int main(int argc, char** argv) {
  using namespace meshtrain::cli;
  try {
    meshtrain::prepare_libraries(argv);  // OPENBLAS_CORETYPE, the GEMM threads' idle waits (a restart)
  } catch (const std::exception& e) {
    fmt::print(stderr, "meshtrain: error: {}\n", e.what());
    return 1;
  }
  CLI::App app{"meshtrain: distributed training on a device mesh"};
  app.footer("Environment: MESHTRAIN_CPU_ISA=sse41|avx2|avx512|avx512_bf16|amx|native runs kernels, oneDNN and "
             "OpenBLAS as on a CPU with at most that instruction set; "
             "MESHTRAIN_GEMM_BACKEND=auto|onednn|openblas|fixed picks the library of each matrix product (auto: the "
             "faster, measured per shape) and "
             "MESHTRAIN_GEMM_CACHE=FILE keeps the measured choices (docs/core.md).");
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("meshtrain ") + meshtrain::version_string);
  std::vector<Command> commands = add_comm_commands(app);
  for (auto& c : add_layout_commands(app)) commands.push_back(std::move(c));
  for (auto& c : add_train_commands(app)) commands.push_back(std::move(c));
  for (auto& c : add_data_commands(app)) commands.push_back(std::move(c));
  for (auto& c : add_launch_commands(app)) commands.push_back(std::move(c));
  for (auto& c : add_device_commands(app)) commands.push_back(std::move(c));
  for (auto& c : add_plan_commands(app)) commands.push_back(std::move(c));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (const auto& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "meshtrain: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
