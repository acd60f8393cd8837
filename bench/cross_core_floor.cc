// The floor of a 4 KiB all_reduce between two cores of this machine, without
// any engine: two threads pinned to cores 0 and 1 write their 4 KiB input,
// meet at a barrier of two atomics, and each sums both inputs (the data the
// peer just wrote must cross between the cores' caches). Compare with
// `meshtrain bench collectives --engine threads --ranks 2 --min 4K --max 4K`.
//
//   build/release/bench/cross_core_floor
//
// Prints the barrier's round trip alone, the exchange with fresh inputs (as a
// gradient bucket is: written just before its all-reduce) and with inputs
// that stay unchanged (as the benchmark's send buffer does), each the median
// of 7 runs of 200,000 iterations.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kFloats = 1024;  // 4 KiB
constexpr long kIters = 200'000;

struct alignas(64) Flag {
  std::atomic<long> v{0};
};
Flag flag[2];
alignas(64) float input[2][kFloats];
alignas(64) float scratch[2][2][kFloats];  // [iteration parity][rank]
alignas(64) float output[2][kFloats];

void pin(int core) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(core, &s);
  pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
}

void barrier(int r, long v) {
  flag[r].v.store(v, std::memory_order_release);
  while (flag[1 - r].v.load(std::memory_order_acquire) < v) {
  }
}

template <typename Fn>
double median_ns(Fn&& body) {
  std::vector<double> runs;
  for (int run = 0; run < 7; ++run) {
    flag[0].v = flag[1].v = 0;
    const auto t0 = std::chrono::steady_clock::now();
    std::thread peer([&] { body(1); });
    body(0);
    peer.join();
    runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kIters * 1e9);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

// One barrier per iteration; scratch is double-buffered by parity, as the
// threads engine's small path is.
void exchange(int r, bool fresh) {
  pin(r);
  for (long i = 1; i <= kIters; ++i) {
    if (fresh)
      for (int k = 0; k < kFloats; ++k) input[r][k] = static_cast<float>(k + i);
    std::memcpy(scratch[i & 1][r], input[r], sizeof(input[r]));
    barrier(r, i);
    for (int k = 0; k < kFloats; ++k) output[r][k] = scratch[i & 1][0][k] + scratch[i & 1][1][k];
  }
}

}  // namespace

int main() {
  if (std::thread::hardware_concurrency() < 2) {
    std::printf("needs 2 cores\n");
    return 1;
  }
  const double rt = median_ns([](int r) {
    pin(r);
    for (long i = 1; i <= kIters; ++i) barrier(r, i);
  });
  const double fresh = median_ns([](int r) { exchange(r, true); });
  const double cached = median_ns([](int r) { exchange(r, false); });
  std::printf("barrier round trip between cores 0 and 1:        %6.0f ns\n", rt);
  std::printf("4 KiB exchange + sum, inputs rewritten each time: %6.0f ns (the floor for gradients)\n", fresh);
  std::printf("4 KiB exchange + sum, inputs unchanged:           %6.0f ns (the floor for a benchmark loop)\n", cached);
  return 0;
}
