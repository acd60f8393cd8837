// The collective suite under mpirun: `mpirun -np N mpi_collectives_test`.
// Exit code 0 only if every rank passed.
#include <fmt/format.h>

#include <cstdio>

#include "meshtrain/comm/selftest.h"
#include "meshtrain/comm/launch.h"

int main() {
  using namespace meshtrain;
  int status = 0;
  comm::launch({.engine = comm::Engine::mpi, .ranks = 0, .timeout = std::chrono::seconds(120)},
               [&](comm::Communicator& c) {
                 try {
                   const size_t checks = comm::run_collective_suite(c);
                   int32_t ok = 1;
                   c.all_reduce(&ok, &ok, 1, DType::i32, comm::ReduceOp::min);
                   if (c.rank() == 0) fmt::print("mpi collective suite: {} ranks, {} checks per rank, {}\n", c.size(), checks, ok ? "PASS" : "FAIL");
                   status = ok ? 0 : 1;
                 } catch (const std::exception& e) {
                   fmt::print(stderr, "FAIL: {}\n", e.what());
                   status = 1;
                 }
               });
  return status;
}
