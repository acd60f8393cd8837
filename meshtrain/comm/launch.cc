#include "meshtrain/comm/launch.h"

#include <fmt/format.h>

#include <pthread.h>
#include <sched.h>

#include <cstdlib>
#include <mutex>
#include <thread>

#include "meshtrain/comm/threads/communicator.h"
#include "meshtrain/core/error.h"
#ifdef MESHTRAIN_HAVE_MPI
#include "meshtrain/comm/mpi/communicator.h"
#endif

namespace meshtrain::comm {
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

void launch_threads(const LaunchOptions& options, const std::function<void(Communicator&)>& fn) {
  auto comms = threads::create_world(options.ranks, {.timeout = options.timeout});
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
        threads::mark_exited(comm, r);
      } catch (const std::exception& e) {
        {
          std::lock_guard l(mu);
          failures.push_back({r, std::current_exception(), dynamic_cast<const AbortedError*>(&e) != nullptr});
        }
        threads::mark_failed(comm, r, e.what());
      } catch (...) {
        {
          std::lock_guard l(mu);
          failures.push_back({r, std::current_exception(), false});
        }
        threads::mark_failed(comm, r, "unknown exception");
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

bool started_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr;
}

void launch(const LaunchOptions& options, const std::function<void(Communicator&)>& fn) {
  if (options.timeout < kMinTimeout || options.timeout > kMaxTimeout)
    throw InvalidArgument("comm::launch", fmt::format("timeout {} ms is outside [{}, {}] ms", options.timeout.count(),
                                                      kMinTimeout.count(), kMaxTimeout.count()),
                          "give every wait a deadline between 1 ms and 7 days");
  switch (options.engine) {
    case Engine::threads:
      if (options.ranks < 1 || options.ranks > kMaxThreadsRanks)
        throw InvalidArgument("comm::launch", fmt::format("ranks {} is outside [1, {}]", options.ranks, kMaxThreadsRanks),
                              fmt::format("the threads engine runs 1 to {} ranks in one process; use the mpi engine "
                                          "for more",
                                          kMaxThreadsRanks));
      return launch_threads(options, fn);
    case Engine::mpi: {
#ifdef MESHTRAIN_HAVE_MPI
      mpi::initialize();
      mpi::Options mo{.check_fingerprints = options.check_fingerprints};
      if (options.abort_on_error) mo.on_error = mpi::report_and_abort;
      auto world = mpi::create_world(mo);
      world->set_timeout(options.timeout);
      if (options.ranks != 0 && options.ranks != world->size())
        throw InvalidArgument("comm::launch",
                              fmt::format("asked for {} ranks but mpirun started {}", options.ranks, world->size()),
                              "pass the same count to mpirun -np and --ranks, or --ranks 0");
      if (!options.abort_on_error || world->size() == 1) return fn(*world);
      try {
        fn(*world);
      } catch (const std::exception& e) {
        mpi::report_and_abort(e, world->rank());
      }
      return;
#else
      throw Unsupported("comm::launch", "this build has no OpenMPI engine",
                        "install libopenmpi-dev (scripts/install-deps.sh) and reconfigure");
#endif
    }
    case Engine::gloo:
    case Engine::nccl:
      throw Unsupported("comm::launch", fmt::format("engine '{}' is not built yet", engine_name(options.engine)),
                        "use --engine threads or --engine mpi");
  }
}

}  // namespace meshtrain::comm
