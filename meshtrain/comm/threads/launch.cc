// The threads engine's entry in the engine registry: launch() runs one
// thread per rank (comm/launch.h describes the contract).
#include <fmt/format.h>
#include <pthread.h>
#include <sched.h>

#include <mutex>
#include <thread>

#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/comm/threads/communicator.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::threads {
namespace {

// The cores this process may run on, in order.
std::vector<int> allowed_cores() {
  cpu_set_t set;
  std::vector<int> cores;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cores;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cores.push_back(c);
  return cores;
}

// Binds the calling thread to one core (as mpirun binds ranks to cores):
// a rank that migrates loses its caches and its memory-bandwidth share.
void bind_to_core(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

void launch_threads(const LaunchOptions& options, const SpmdFunction& fn) {
  if (options.ranks < 1 || options.ranks > kMaxThreadsRanks)
    throw InvalidArgument("comm::launch", fmt::format("ranks {} is outside [1, {}]", options.ranks, kMaxThreadsRanks),
                          fmt::format("the threads engine runs 1 to {} ranks in one process; use the mpi engine "
                                      "for more",
                                      kMaxThreadsRanks));
  auto comms = create_world(options.ranks, {.timeout = options.timeout});
  struct Failure {
    int rank;
    std::exception_ptr error;
    bool echo;  // an AbortedError: a consequence of another failure
  };
  std::mutex mu;
  std::vector<Failure> failures;  // in the order they happened
  std::vector<std::thread> threads;
  threads.reserve(comms.size());
  const std::vector<int> cores = allowed_cores();
  const bool bind = options.bind_to_cores && options.ranks <= static_cast<int>(cores.size());
  for (int r = 0; r < options.ranks; ++r) {
    threads.emplace_back([&, r] {
      if (bind) bind_to_core(cores[r]);
      Communicator& comm = *comms[r];
      try {
        fn(comm);
        mark_exited(comm, r);
      } catch (const std::exception& e) {
        {
          std::lock_guard l(mu);
          failures.push_back({r, std::current_exception(), dynamic_cast<const AbortedError*>(&e) != nullptr});
        }
        mark_failed(comm, r, e.what());
      } catch (...) {
        {
          std::lock_guard l(mu);
          failures.push_back({r, std::current_exception(), false});
        }
        mark_failed(comm, r, "unknown exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failures.empty()) return;
  for (const auto& f : failures)
    if (!f.echo) std::rethrow_exception(f.error);
  std::rethrow_exception(failures.front().error);
}

}  // namespace

void register_engine(EngineRegistry& registry) {
  registry.add({.name = "threads",
                .description = "N simulated devices: ranks are threads of this process (the default)",
                .ranks_in_process = true,
                .launch = launch_threads});
}

}  // namespace meshtrain::comm::threads
