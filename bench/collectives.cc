#include "bench/collectives.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <memory>

#include "meshtrain/comm/internal/reduce.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::bench {
namespace {

using comm::CollectiveOp;
using Clock = std::chrono::steady_clock;

// Page-aligned, pre-faulted buffer.
struct Buffer {
  std::unique_ptr<std::byte, decltype(&std::free)> p{nullptr, &std::free};
  explicit Buffer(size_t bytes) {
    if (bytes > kMaxCollectiveBytes)  // also keeps the rounding below from wrapping
      throw InvalidArgument("bench::Buffer", fmt::format("{} bytes", bytes), "sizes up to 4G");
    const size_t rounded = std::max<size_t>(4096, (bytes + 4095) / 4096 * 4096);
    p.reset(static_cast<std::byte*>(std::aligned_alloc(4096, rounded)));
    if (!p) throw Error("bench::Buffer", fmt::format("cannot allocate {} bytes", rounded), "lower --max");
    std::memset(p.get(), 1, rounded);
  }
  std::byte* get() const { return p.get(); }
};

// Traffic of one call relative to a memcpy of S bytes (see the header).
double traffic_vs_memcpy(CollectiveOp op, int n) {
  switch (op) {
    case CollectiveOp::reduce_scatter:
    case CollectiveOp::all_gather: return (n + 1.0) / (2.0 * n);
    case CollectiveOp::broadcast: return (n - 1.0) / n;  // the root copies nothing
    default: return 1.0;
  }
}

// Element count per call for an op whose nccl-tests size is `bytes`.
size_t count_for(CollectiveOp op, size_t bytes, int n, DType t) {
  const size_t elems = bytes / dtype_size(t);
  switch (op) {
    case CollectiveOp::all_gather:
    case CollectiveOp::reduce_scatter:
    case CollectiveOp::all_to_all: return elems / n;
    default: return elems;
  }
}

void call(comm::Communicator& c, CollectiveOp op, std::byte* a, std::byte* b, size_t count, DType t) {
  const size_t es = dtype_size(t);
  switch (op) {
    case CollectiveOp::all_reduce: return c.all_reduce(a, b, count, t, comm::ReduceOp::sum);
    case CollectiveOp::reduce_scatter: return c.reduce_scatter(a, b, count, t, comm::ReduceOp::sum);
    case CollectiveOp::all_gather: return c.all_gather(a + c.rank() * count * es, b, count, t);
    case CollectiveOp::broadcast: return c.broadcast(a, count, t, 0);
    case CollectiveOp::all_to_all: return c.all_to_all(a, b, count, t);
    default: throw InvalidArgument("bench::run_collectives", "op not benchmarked", "");
  }
}

// Runs fn `iters` times between barriers; returns the slowest rank's mean
// seconds per call.
template <typename Fn>
double timed(comm::Communicator& c, int iters, Fn&& fn) {
  c.barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  double dt = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  c.all_reduce(&dt, &dt, 1, DType::f64, comm::ReduceOp::max);
  return dt;
}

// Picks an iteration count from a short probe, agreed by all ranks.
template <typename Fn>
int iterations(comm::Communicator& c, double budget, Fn&& fn) {
  const double probe = timed(c, 2, fn);
  int32_t iters = static_cast<int32_t>(std::clamp(budget / std::max(probe, 1e-9), 1.0, 20000.0));
  c.broadcast(&iters, 1, DType::i32, 0);
  return iters;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times every contestant and memcpy in alternating rounds so all see the
// same memory conditions (on a shared VM, bandwidth drifts by 2x within
// seconds), each round starting with the next contestant; returns the
// medians of the per-round means: one per contestant, then memcpy's.
template <typename Copy>
std::vector<double> timed_rounds(comm::Communicator& c, double budget, const std::vector<std::function<void()>>& ops,
                                 Copy&& copy) {
  constexpr int kRounds = 5;
  const size_t k = ops.size();
  std::vector<int> iters;
  for (const auto& op : ops) iters.push_back(std::max(1, iterations(c, budget / kRounds, op)));
  const int copy_iters = std::max(1, iterations(c, budget / kRounds / 2, copy));
  std::vector<std::vector<double>> t(k + 1);
  for (int r = 0; r < kRounds; ++r) {
    t[k].push_back(timed(c, copy_iters, copy));
    for (size_t j = 0; j < k; ++j) {
      const size_t i = (j + static_cast<size_t>(r)) % k;
      t[i].push_back(timed(c, iters[i], ops[i]));
    }
  }
  std::vector<double> medians;
  for (auto& v : t) medians.push_back(median(std::move(v)));
  return medians;
}

}  // namespace

double bus_factor(CollectiveOp op, int n) {
  switch (op) {
    case CollectiveOp::all_reduce: return 2.0 * (n - 1) / n;
    case CollectiveOp::all_gather:
    case CollectiveOp::reduce_scatter:
    case CollectiveOp::all_to_all: return static_cast<double>(n - 1) / n;
    default: return 1.0;
  }
}

void validate_collective_options(const CollectiveOptions& o, int ranks_in_process) {
  const char* op = "bench collectives";
  const std::string range = fmt::format("[1, {}]", format_size(kMaxCollectiveBytes));
  if (o.min_bytes == 0 || o.min_bytes > kMaxCollectiveBytes)
    throw InvalidArgument(op, fmt::format("--min: {} bytes is outside {}", o.min_bytes, range), "use e.g. --min 4K");
  if (o.max_bytes == 0 || o.max_bytes > kMaxCollectiveBytes)
    throw InvalidArgument(op, fmt::format("--max: {} bytes is outside {}", o.max_bytes, range), "use e.g. --max 256M");
  if (o.min_bytes > o.max_bytes)
    throw InvalidArgument(op, fmt::format("--min {} is above --max {}", format_size(o.min_bytes), format_size(o.max_bytes)),
                          "give --min <= --max");
  check_int_in_range(static_cast<int64_t>(std::min<size_t>(o.step, INT64_MAX)), "--step", 2, kMaxCollectiveStep, op);
  check_double_in_range(o.seconds_per_size, "--seconds", {.min = 0, .max = kMaxSecondsPerSize, .min_open = true}, op);
  // Four buffers of max_bytes per rank (send, receive and the memcpy pair).
  const double have = static_cast<double>(physical_memory_bytes());
  const double need = 4.0 * static_cast<double>(o.max_bytes) * std::max(ranks_in_process, 1);
  if (have > 0 && need > have)
    throw InvalidArgument(op,
                          fmt::format("{} rank{} x 4 buffers of --max {} need {:.1f} GiB, more than this machine's "
                                      "{:.1f} GiB",
                                      ranks_in_process, ranks_in_process == 1 ? "" : "s", format_size(o.max_bytes),
                                      need / (1 << 30), have / (1 << 30)),
                          "lower --max or --ranks");
}

std::vector<CollectiveRow> run_collectives(comm::Communicator& c, const CollectiveOptions& o) {
  validate_collective_options(o);
  const int n = c.size();
  // The largest op buffer is max_bytes (send) and max_bytes (recv).
  Buffer a(o.max_bytes), b(o.max_bytes), copy_src(o.max_bytes), copy_dst(o.max_bytes);
  std::vector<CollectiveRow> rows;
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.step) {
    // A copy on every rank at once: the contended copy bandwidth at this
    // size. The reference is the faster of glibc's memcpy and a streaming
    // (non-temporal) copy, so the bound never flatters the engine.
    auto memcpy_plain = [&] { std::memcpy(copy_dst.get(), copy_src.get(), bytes); };
    auto memcpy_stream = [&] { comm::internal::copy(copy_dst.get(), copy_src.get(), bytes, true); };
    const bool stream_faster =
        timed(c, 3, memcpy_stream) < timed(c, 3, memcpy_plain);  // all ranks agree: max over ranks
    auto copy = [&] { stream_faster ? memcpy_stream() : memcpy_plain(); };
    for (CollectiveOp op : o.ops) {
      const size_t count = count_for(op, bytes, n, o.dtype);
      if (count == 0) continue;
      const size_t real_bytes = (op == CollectiveOp::all_reduce || op == CollectiveOp::broadcast)
                                    ? count * dtype_size(o.dtype)
                                    : count * n * dtype_size(o.dtype);
      std::vector<std::string> labels = {o.label};
      std::vector<std::function<void()>> runs = {[&] {
        if (o.call) return o.call(op, a.get(), b.get(), count, o.dtype);
        call(c, op, a.get(), b.get(), count, o.dtype);
      }};
      for (const auto& peer : o.peers) {
        if (!peer.supports(op)) continue;
        labels.push_back(peer.label);
        runs.push_back([&] { peer.call(op, a.get(), b.get(), count, o.dtype); });
      }
      const std::vector<double> t = timed_rounds(c, o.seconds_per_size, runs, copy);
      const double t_copy = t.back();
      for (size_t i = 0; i < runs.size(); ++i) {
        CollectiveRow row;
        row.label = labels[i];
        row.op = op;
        row.bytes = real_bytes;
        row.time_us = t[i] * 1e6;
        row.algbw_gbs = real_bytes / t[i] / 1e9;
        row.busbw_gbs = row.algbw_gbs * bus_factor(op, n);
        row.memcpy_gbs = bytes / t_copy / 1e9;
        const double t_min = t_copy * traffic_vs_memcpy(op, n) * (static_cast<double>(real_bytes) / bytes);
        row.bound_busbw_gbs = n > 1 ? real_bytes / t_min / 1e9 * bus_factor(op, n) : 0.0;
        rows.push_back(row);
      }
    }
  }
  return rows;
}

size_t parse_size(const std::string& text, std::string_view what) {
  const std::string range = fmt::format("[1, {}]", format_size(kMaxCollectiveBytes));
  const std::string_view t = trim(text);
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);  // no sign: "-1" fails
  if (t.empty() || end == t.data() || (ec != std::errc() && ec != std::errc::result_out_of_range))
    throw InvalidArgument("bench::parse_size", fmt::format("{}: '{}' is not a size", what, text),
                          fmt::format("use e.g. 4K, 64M, 1G, in {}", range));
  std::string unit(end, t.data() + t.size());
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  int shift = -1;
  if (unit.empty()) shift = 0;
  else if (unit == "K" || unit == "k" || unit == "Ki") shift = 10;
  else if (unit == "M" || unit == "m" || unit == "Mi") shift = 20;
  else if (unit == "G" || unit == "g" || unit == "Gi") shift = 30;
  if (shift < 0)
    throw InvalidArgument("bench::parse_size", fmt::format("{}: unknown unit in '{}'", what, text),
                          "use K, M or G (powers of 1024)");
  // Checked before shifting, so nothing wraps.
  if (ec == std::errc::result_out_of_range || v == 0 || v > (kMaxCollectiveBytes >> shift))
    throw InvalidArgument("bench::parse_size", fmt::format("{}: {} is outside {}", what, t, range),
                          fmt::format("give {} a size in {}", what, range));
  return static_cast<size_t>(v) << shift;
}

std::string format_size(size_t b) {
  if (b >= (size_t{1} << 30) && b % (size_t{1} << 30) == 0) return fmt::format("{}G", b >> 30);
  if (b >= (size_t{1} << 20) && b % (size_t{1} << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b >= (size_t{1} << 10) && b % (size_t{1} << 10) == 0) return fmt::format("{}K", b >> 10);
  return fmt::format("{}", b);
}

std::string format_table(const std::vector<CollectiveRow>& rows, int ranks) {
  std::string s = fmt::format("{:<14} {:<15} {:>8} {:>11} {:>11} {:>11} {:>12} {:>8} {:>11}\n", "engine", "op",
                              "size", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "bound(GB/s)", "%bound",
                              "memcpy(GB/s)");
  for (const auto& r : rows) {
    // One rank moves nothing between ranks: no bus bandwidth, no bound.
    const std::string pct =
        r.bound_busbw_gbs > 0 ? fmt::format("{:>7.0f}%", 100.0 * r.busbw_gbs / r.bound_busbw_gbs) : "       -";
    s += fmt::format("{:<14} {:<15} {:>8} {:>11.2f} {:>11.2f} {:>11.2f} {:>12.2f} {} {:>11.2f}\n", r.label,
                     comm::collective_op_name(r.op), format_size(r.bytes), r.time_us, r.algbw_gbs, r.busbw_gbs,
                     r.bound_busbw_gbs, pct, r.memcpy_gbs);
  }
  s += fmt::format("({} ranks; busbw factor all_reduce 2(n-1)/n, gather/scatter/all_to_all (n-1)/n; bound = "
                   "memory-traffic bound from the concurrent memcpy rate)\n",
                   ranks);
  return s;
}

std::string format_jsonl(const std::vector<CollectiveRow>& rows, int ranks) {
  std::string s;
  for (const auto& r : rows)
    s += fmt::format(
        "{{\"engine\":\"{}\",\"op\":\"{}\",\"ranks\":{},\"bytes\":{},\"time_us\":{:.3f},\"algbw_gbs\":{:.4f},"
        "\"busbw_gbs\":{:.4f},\"bound_busbw_gbs\":{:.4f},\"memcpy_gbs\":{:.4f}}}\n",
        r.label, comm::collective_op_name(r.op), ranks, r.bytes, r.time_us, r.algbw_gbs, r.busbw_gbs,
        r.bound_busbw_gbs, r.memcpy_gbs);
  return s;
}

}  // namespace meshtrain::bench
