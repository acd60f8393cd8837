// Redistribution under mpirun: `mpirun -np 4 redistribute_mpi_test`.
// The property test's checks (meshtrain/testing/redistribute.h) on
// the mpi engine, for fixed meshes (4), (2, 2), (2, 1, 2) and (1, 4) with 40
// seeded random case pairs each. Exit code 0 only if every rank passed.
#include <fmt/format.h>

#include <cstdio>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/testing/redistribute.h"

int main(int, char** argv) {
  meshtrain::prepare_libraries(argv);  // MESHTRAIN_CPU_ISA and the idle waits reach OpenBLAS and libgomp
  using namespace meshtrain;
  int status = 0;
  comm::launch({.engine = comm::Engine::mpi, .ranks = 0, .timeout = std::chrono::seconds(120)},
               [&](comm::Communicator& world) {
                 try {
                   if (world.size() != 4) {
                     if (world.rank() == 0) fmt::print(stderr, "run with mpirun -np 4 (got {})\n", world.size());
                     status = 1;
                     return;
                   }
                   std::mt19937_64 rng(20240611);
                   testing::Tally tally;
                   int total = 0;
                   for (const auto& [shape, names] : std::vector<std::pair<std::vector<int>, std::vector<std::string>>>{
                            {{4}, {"x"}}, {{2, 2}, {"x", "y"}}, {{2, 1, 2}, {"x", "y", "z"}}, {{1, 4}, {"x", "y"}}}) {
                     const testing::MeshCase m{shape, names, testing::generate_cases(rng, names, 4, 40)};
                     testing::check_world(world, m, tally);
                     total += static_cast<int>(m.cases.size());
                   }
                   for (const auto& f : tally.failures) fmt::print(stderr, "FAIL {}\n", f);
                   int32_t ok = tally.failures.empty() ? 1 : 0;
                   world.all_reduce(&ok, &ok, 1, DType::i32, comm::ReduceOp::min);
                   if (world.rank() == 0)
                     fmt::print("mpi redistribute: {} ranks, {} case pairs on 4 meshes, {}\n", world.size(), total,
                                ok ? "PASS" : "FAIL");
                   status = ok ? 0 : 1;
                 } catch (const std::exception& e) {
                   fmt::print(stderr, "FAIL: {}\n", e.what());
                   status = 1;
                 }
               });
  return status;
}
