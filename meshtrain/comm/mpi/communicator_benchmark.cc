// Benchmarks of the MPI engine (not a test): native vs ring reduce-scatter,
// and the per-call cost of fingerprint checks on a small all_reduce.
//
//   mpirun --oversubscribe -np 2 build/release/meshtrain/comm/mpi/mpi_communicator_benchmark [MiB...]
//
// Reduce-scatter: f32 sum, send buffer of the given MiB (default 64 and 256),
// through the engine with ReduceScatterAlgorithm::native
// (MPI_Ireduce_scatter_block) and ::ring, and, for reference, OpenMPI's
// blocking MPI_Reduce_scatter_block called directly. Each call is timed alone
// between barriers, the slowest rank counts, and the median of 5 runs is
// reported with algbw = send bytes / time and busbw = algbw * (n-1)/n
// (nccl-tests conventions).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "meshtrain/comm/mpi/communicator.h"

namespace {

using meshtrain::DType;
using meshtrain::comm::Communicator;
using meshtrain::comm::ReduceOp;
namespace mpi = meshtrain::comm::mpi;
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of one call on the slowest rank, median over `runs`.
template <class F>
double time_calls(Communicator& sync, int runs, F&& call) {
  call();  // warm-up: first-touch of buffers, MPI connection setup
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    sync.barrier();
    const auto t0 = Clock::now();
    call();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    sync.all_reduce(&s, &s, 1, DType::f64, ReduceOp::max);
    times.push_back(s);
  }
  return median(times);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> mib;
  for (int i = 1; i < argc; ++i) mib.push_back(std::strtoull(argv[i], nullptr, 10));
  if (mib.empty()) mib = {64, 256};

  auto sync = mpi::create_world({.check_fingerprints = false});
  auto ring = mpi::create_world({.reduce_scatter = mpi::ReduceScatterAlgorithm::ring});
  auto native = mpi::create_world({.reduce_scatter = mpi::ReduceScatterAlgorithm::native});
  const int n = sync->size(), r = sync->rank();
  const size_t un = static_cast<size_t>(n);
  if (r == 0) std::printf("reduce_scatter f32 sum, %d ranks (median of 5, slowest rank)\n", n);
  if (r == 0)
    std::printf("%10s %8s %10s %12s %12s\n", "send MiB", "algo", "time ms", "algbw GB/s", "busbw GB/s");
  for (size_t m : mib) {
    const size_t count = m * (size_t{1} << 20) / sizeof(float) / un;
    std::vector<float> send(un * count, 1.0f), recv(count);
    const double blocking = time_calls(*sync, 5, [&] {
      MPI_Reduce_scatter_block(send.data(), recv.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                               MPI_COMM_WORLD);
    });
    if (r == 0)
      std::printf("%10zu %8s %10.2f %12.3f %12.3f\n", m, "blocking", blocking * 1e3,
                  double(un * count * sizeof(float)) / blocking / 1e9,
                  double(un * count * sizeof(float)) / blocking / 1e9 * double(n - 1) / n);
    for (auto* c : {native.get(), ring.get()}) {
      const double s = time_calls(*sync, 5, [&] {
        c->reduce_scatter(send.data(), recv.data(), count, DType::f32, ReduceOp::sum);
      });
      const double algbw = double(un * count * sizeof(float)) / s / 1e9;
      if (r == 0)
        std::printf("%10zu %8s %10.2f %12.3f %12.3f\n", m, c == ring.get() ? "ring" : "native", s * 1e3,
                    algbw, algbw * double(n - 1) / n);
    }
  }

  // Fingerprint cost: 4 KiB all_reduce, many calls per timing.
  auto checked = mpi::create_world({.check_fingerprints = true});
  auto unchecked = mpi::create_world({.check_fingerprints = false});
  std::vector<float> small(1024, 1.0f);
  const int calls = 2000;
  if (r == 0) std::printf("\nall_reduce f32 x 1024 (4 KiB), %d ranks, mean of %d calls (median of 5)\n", n, calls);
  double us[2] = {};
  for (int repeat = 0; repeat < 2; ++repeat) {  // interleave to spread machine noise over both
    for (auto* c : {unchecked.get(), checked.get()}) {
      const double s = time_calls(*sync, 5, [&] {
        for (int i = 0; i < calls; ++i)
          c->all_reduce(small.data(), small.data(), small.size(), DType::f32, ReduceOp::sum);
      });
      us[c == checked.get()] = s / calls * 1e6;
    }
  }
  if (r == 0)
    std::printf("  without checks %.2f us/call, with checks %.2f us/call (+%.2f us)\n", us[0], us[1],
                us[1] - us[0]);
  return 0;
}
