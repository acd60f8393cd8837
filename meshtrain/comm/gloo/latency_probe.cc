// Where a small collective's time goes on the gloo engine (not a test): the
// same exchange timed layer by layer, from plain sockets up to the engine.
//
//   P=build/release/meshtrain/comm/gloo/gloo_latency_probe
//   for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29613 $P [--only text] [bytes...] & done; wait
//
// Rows, for each size (default 4096 and 65536 bytes, f32; every rank sends
// `bytes` to every peer and receives theirs, as the engine's direct
// all_reduce does below 64 KiB):
//   tcp exchange          plain sockets (native.h's tcp peer, all_to_all)
//   gloo bound buffers    Gloo's legacy pair buffers, registered once:
//                         data goes out without waiting for the receiver
//   unbound, recv first   Gloo's UnboundBuffer recv + send per peer, posted
//                         and waited on by the calling thread (what the
//                         engine's transfers are): a send moves its data
//                         only after the receiver's "recv ready" notice
//   unbound, send first   the same, the sends posted before the receives
//   recv first + worker   recv first (send first), run by a worker thread
//   send first + worker   that a condition variable wakes, the caller
//                         waiting on another (the engine's structure)
//   engine all_reduce     Communicator::all_reduce, sum (also reduces)
//   engine reduce_scatter Communicator::reduce_scatter, `bytes` per peer
//   gloo-hd all_reduce    Gloo's AllreduceHalvingDoubling (native.h)
//   gloo-bcube all_reduce gloo::allreduce, BCUBE (native.h)
//   engine broadcast, gloo-tree broadcast
// `--only <text>` runs only the rows whose name contains it (--only
// all_reduce: the engine's and Gloo's).
// Each row: the slowest rank's mean over `calls` calls, median of 7 rounds;
// this process's voluntary context switches per call (all threads: each is
// a thread that went to sleep waiting); CPU time per call, every rank's
// process summed (user + system; on fewer cores than ranks it bounds the
// call's time: CPU us / cores); single calls' median, 99th
// percentile, maximum and share above 1 ms (the largest over ranks): a
// mean far above the median is a few long stalls.
#include <fmt/format.h>
#include <gloo/transport/unbound_buffer.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm/gloo/communicator.h"
#include "meshtrain/comm/gloo/internal/channel.h"
#include "meshtrain/comm/gloo/native.h"

namespace {

using meshtrain::DType;
using meshtrain::comm::CollectiveOp;
using meshtrain::comm::Communicator;
using meshtrain::comm::ReduceOp;
namespace mtg = meshtrain::comm::gloo;
using Clock = std::chrono::steady_clock;
using Buffer = ::gloo::transport::UnboundBuffer;

long switches() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_nvcsw;
}

// This process's CPU time so far (user + system, every thread), seconds.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

struct Timing {
  double us = 0;        // mean per call
  double switches = 0;  // voluntary context switches per call
  double cpu = 0;       // CPU time per call, every rank's summed (us)
  double p50 = 0, p99 = 0, max = 0;  // single calls, over every round
  double slow = 0;                   // share of single calls above 1 ms
};

// The slowest rank's mean per call over `calls` calls, median of 7 rounds;
// the single calls' percentiles (each rank's, the largest over ranks).
Timing time_calls(Communicator& sync, int calls, const std::function<void()>& call) {
  call();  // warm-up
  std::vector<Timing> rounds;
  std::vector<double> each;
  for (int i = 0; i < 7; ++i) {
    sync.barrier();
    const long s0 = switches();
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    auto last = t0;
    for (int k = 0; k < calls; ++k) {
      call();
      const auto now = Clock::now();
      each.push_back(std::chrono::duration<double>(now - last).count() * 1e6);
      last = now;
    }
    double t = std::chrono::duration<double>(last - t0).count() / calls * 1e6;
    const double sw = static_cast<double>(switches() - s0) / calls;
    double cpu = (cpu_seconds() - c0) / calls * 1e6;
    sync.all_reduce(&t, &t, 1, DType::f64, ReduceOp::max);
    sync.all_reduce(&cpu, &cpu, 1, DType::f64, ReduceOp::sum);
    rounds.push_back({.us = t, .switches = sw, .cpu = cpu});
  }
  std::sort(rounds.begin(), rounds.end(), [](const Timing& a, const Timing& b) { return a.us < b.us; });
  Timing out = rounds[rounds.size() / 2];
  std::sort(each.begin(), each.end());
  const double slow = static_cast<double>(each.end() - std::upper_bound(each.begin(), each.end(), 1000.0));
  double q[4] = {each[each.size() / 2], each[each.size() * 99 / 100], each.back(), slow / each.size()};
  sync.all_reduce(q, q, 4, DType::f64, ReduceOp::max);
  out.p50 = q[0];
  out.p99 = q[1];
  out.max = q[2];
  out.slow = q[3];
  return out;
}

// Every rank sends `out` to every peer and receives each peer's into `in`,
// with Gloo's unbound buffers on `ctx` (new buffers per call, as the
// engine), each peer's receive posted before the send to it (as the
// engine's direct all_reduce, all_gather and all_to_all post them) or every
// send first (as its reduce_scatter).
void unbound_exchange(::gloo::Context& ctx, float* out, float* in, size_t count, bool send_first = false) {
  const int n = ctx.size, r = ctx.rank;
  const size_t bytes = count * sizeof(float);
  std::vector<std::unique_ptr<Buffer>> recvs;
  auto send = ctx.createUnboundBuffer(out, bytes);
  for (int p = 0; p < n && send_first; ++p)
    if (p != r) send->send(p, 1);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    recvs.push_back(ctx.createUnboundBuffer(in + static_cast<size_t>(p) * count, bytes));
    recvs.back()->recv(p, 1);
    if (!send_first) send->send(p, 1);
  }
  for (auto& b : recvs) b->waitRecv();
  for (int p = 1; p < n; ++p) send->waitSend();
}

// The same with Gloo's legacy pair buffers, registered once.
class BoundExchange {
 public:
  BoundExchange(::gloo::Context& ctx, float* out, float* in, size_t count) : n_(ctx.size), r_(ctx.rank) {
    const size_t bytes = count * sizeof(float);
    for (int p = 0; p < n_; ++p) {
      if (p == r_) continue;
      // Slot of the pair (sender, receiver): the same on both sides.
      auto& pair = ctx.getPair(p);
      sends_.push_back(pair->createSendBuffer(static_cast<int>(r_ * n_ + p), out, bytes));
      recvs_.push_back(pair->createRecvBuffer(static_cast<int>(p * n_ + r_), in + static_cast<size_t>(p) * count,
                                              bytes));
    }
  }
  void run() {
    for (auto& s : sends_) s->send();
    for (auto& r : recvs_) r->waitRecv();
    for (auto& s : sends_) s->waitSend();
  }

 private:
  int n_, r_;
  std::vector<std::unique_ptr<::gloo::transport::Buffer>> sends_, recvs_;
};

// A worker thread that runs a job when woken, as the engine's channel does.
class Worker {
 public:
  explicit Worker(std::function<void()> job) : job_(std::move(job)), thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void run() {
    std::unique_lock l(mu_);
    ++issued_;
    cv_.notify_all();
    cv_.wait(l, [&] { return done_ == issued_; });
  }

 private:
  void loop() {
    std::unique_lock l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || issued_ > done_; });
      if (stop_) return;
      l.unlock();
      job_();
      l.lock();
      ++done_;
      cv_.notify_all();
    }
  }
  std::function<void()> job_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t issued_ = 0, done_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--only" && i + 1 < argc) only = argv[++i];
    else sizes.push_back(std::strtoull(argv[i], nullptr, 10));
  }
  if (sizes.empty()) sizes = {4096, 65536};
  auto world = mtg::create_world(mtg::Rendezvous::from_env(), {.check_fingerprints = false});
  const int n = world->size(), r = world->rank();
  auto* channel = mtg::internal::channel_of(*world);
  auto ctx = mtg::internal::connect(*channel->world(), "probe", r, n, world->timeout());
  auto peers = mtg::native_peers(*world);
  meshtrain::comm::PeerCollectives* tcp = nullptr;
  meshtrain::comm::PeerCollectives* hd = nullptr;
  meshtrain::comm::PeerCollectives* tree = nullptr;
  meshtrain::comm::PeerCollectives* bcube = nullptr;
  for (auto& p : peers) {
    if (p->label() == "tcp") tcp = p.get();
    if (p->label() == "gloo-hd") hd = p.get();
    if (p->label() == "gloo-tree") tree = p.get();
    if (p->label() == "gloo-bcube") bcube = p.get();
  }
  if (r == 0) fmt::print("gloo latency probe: {} ranks; per call: slowest rank's mean, median of 7 rounds\n", n);
  for (size_t bytes : sizes) {
    const size_t count = std::max<size_t>(1, bytes / sizeof(float));
    const size_t un = static_cast<size_t>(n);
    std::vector<float> out(count * un, 1.0f), in(count * un, 0.0f);
    const int calls = static_cast<int>(std::clamp<size_t>((size_t{400} << 20) / (bytes * un * 64), 50, 2000));
    BoundExchange bound(*ctx, out.data(), in.data(), count);
    Worker worker([&] { unbound_exchange(*ctx, out.data(), in.data(), count); });
    Worker worker_send_first([&] { unbound_exchange(*ctx, out.data(), in.data(), count, true); });
    std::vector<std::pair<std::string, std::function<void()>>> rows = {
        {"tcp exchange", [&] { tcp->run(CollectiveOp::all_to_all, out.data(), in.data(), count, DType::f32); }},
        {"gloo bound buffers", [&] { bound.run(); }},
        {"unbound, recv first", [&] { unbound_exchange(*ctx, out.data(), in.data(), count); }},
        {"unbound, send first", [&] { unbound_exchange(*ctx, out.data(), in.data(), count, true); }},
        {"recv first + worker", [&] { worker.run(); }},
        {"send first + worker", [&] { worker_send_first.run(); }},
        {"engine all_reduce",
         [&] { world->all_reduce(out.data(), in.data(), count, DType::f32, ReduceOp::sum); }},
        {"engine reduce_scatter",
         [&] { world->reduce_scatter(out.data(), in.data(), count, DType::f32, ReduceOp::sum); }},
        {"gloo-hd all_reduce", [&] { hd->run(CollectiveOp::all_reduce, out.data(), in.data(), count, DType::f32); }},
        {"gloo-bcube all_reduce",
         [&] { bcube->run(CollectiveOp::all_reduce, out.data(), in.data(), count, DType::f32); }},
        {"engine broadcast", [&] { world->broadcast(in.data(), count, DType::f32, 0); }},
        {"gloo-tree broadcast",
         [&] { tree->run(CollectiveOp::broadcast, out.data(), in.data(), count, DType::f32); }},
    };
    if (r == 0)
      fmt::print("\n{} bytes per peer, {} calls per round\n{:<22} {:>10} {:>18} {:>12} {:>10} {:>10} {:>10} {:>10}\n",
                 bytes, calls, "", "us/call", "ctx switches/call", "CPU us/call", "p50 us", "p99 us", "max us",
                 "> 1 ms");
    for (auto& [name, fn] : rows) {
      if (name.find(only) == std::string::npos) continue;
      const Timing t = time_calls(*world, calls, fn);
      if (r == 0)
        fmt::print("{:<22} {:>10.1f} {:>18.1f} {:>12.1f} {:>10.1f} {:>10.1f} {:>10.1f} {:>9.1f}%\n", name, t.us,
                   t.switches, t.cpu, t.p50, t.p99, t.max, 100 * t.slow);
    }
  }
  world->barrier();
  return 0;
}
