// Collective benchmark: time, algorithm bandwidth and bus bandwidth per size,
// with nccl-tests' definitions, beside this machine's memory-traffic bound.
//
//   auto rows = bench::run_collectives(comm, {.min_bytes = 4096, .max_bytes = 1 << 28});
//   if (comm.rank() == 0) fmt::print("{}", bench::format_table(rows, comm.size()));
//
// Definitions (S = the op's size in bytes, t = time per call, n = ranks):
//   algbw = S / t. busbw = algbw * factor: all_reduce 2(n-1)/n; all_gather,
//   reduce_scatter and all_to_all (n-1)/n; broadcast 1. S is the all_reduce
//   and broadcast buffer, the all_gather output, the reduce_scatter input and
//   the all_to_all send buffer (per rank), as nccl-tests counts it.
// Memory-traffic bound: every rank copies S bytes at the same time as the
// others, with the faster of glibc's memcpy and a streaming (non-temporal)
// copy; the slowest rank's time t_memcpy gives the machine's copy throughput
// under the same contention: 2nS bytes of traffic in t_memcpy. A collective
// whose ranks must, in total, read and write T bytes cannot beat
// t_memcpy * T / 2nS:
//   all_reduce, all_to_all: every rank reads S, writes S  -> t >= t_memcpy
//   broadcast: n-1 ranks read S, write S                   -> t >= t_memcpy (n-1)/n
//   reduce_scatter: read S, write S/n per rank; all_gather: read S/n, write S
//                                                          -> t >= t_memcpy (n+1)/2n
// (the threads engine moves exactly these bytes: docs/comm.md). The bound's
// busbw is S / t_min * factor. Write-allocate traffic is ignored on both
// sides. Sizes that fit the last-level cache can beat it.
// Op and memcpy are timed in 5 alternating rounds (memory bandwidth of a
// shared machine drifts); each round's time is the slowest rank's mean, and
// a row shows the median round of each. Peers (what the engine is compared
// with) are timed in the same rounds, size by size, each round starting
// with a different one, so every row of a size saw the same conditions.

#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::bench {

struct CollectiveOptions {
  size_t min_bytes = 4096;
  size_t max_bytes = size_t{256} << 20;
  size_t step = 4;  // size multiplier between rows
  std::vector<comm::CollectiveOp> ops = {comm::CollectiveOp::all_reduce, comm::CollectiveOp::reduce_scatter,
                                         comm::CollectiveOp::all_gather, comm::CollectiveOp::broadcast,
                                         comm::CollectiveOp::all_to_all};
  DType dtype = DType::f32;
  double seconds_per_size = 0.2;  // timing budget per (op, size)
  std::string label;              // e.g. "threads" or "mpi-native", printed per row
  // When set, runs each timed call instead of the communicator (e.g.
  // OpenMPI's own collectives, as the peer); the communicator still
  // synchronizes and reduces the timings. Arguments: op, send buffer,
  // receive buffer (distinct), count per call, dtype.
  using Call = std::function<void(comm::CollectiveOp, std::byte*, std::byte*, size_t, DType)>;
  Call call;
  // Also timed, in the same rounds as the row above (e.g. Gloo's own
  // algorithms): each gives rows of its own label for the ops it supports.
  struct Peer {
    std::string label;
    std::function<bool(comm::CollectiveOp)> supports;
    Call call;
  };
  std::vector<Peer> peers;
};

struct CollectiveRow {
  std::string label;
  comm::CollectiveOp op;
  size_t bytes = 0;
  double time_us = 0;
  double algbw_gbs = 0;
  double busbw_gbs = 0;
  double bound_busbw_gbs = 0;  // memory-traffic bound (see above)
  double memcpy_gbs = 0;       // per-rank concurrent memcpy bandwidth at this size
};

// Limits of the options: sizes 1 byte to 4 GiB, step 2 to 1024, seconds per
// size in (0, 60].
inline constexpr size_t kMaxCollectiveBytes = size_t{4} << 30;
inline constexpr size_t kMaxCollectiveStep = 1024;
inline constexpr double kMaxSecondsPerSize = 60;

// Throws InvalidArgument naming the flag (--min, --max, --step, --seconds)
// unless 0 < min <= max <= kMaxCollectiveBytes, 2 <= step <=
// kMaxCollectiveStep and 0 < seconds_per_size <= kMaxSecondsPerSize (finite),
// or when `ranks_in_process` ranks' four buffers of max_bytes each would not
// fit this machine's physical memory.
void validate_collective_options(const CollectiveOptions& options, int ranks_in_process = 1);

// Collective: every rank of comm calls it (validates first). Rows are valid on every rank.
std::vector<CollectiveRow> run_collectives(comm::Communicator& comm, const CollectiveOptions& options);

double bus_factor(comm::CollectiveOp op, int n);

// "4K", "256M", "1G" -> bytes (K, M, G are powers of 1024), 1 to
// kMaxCollectiveBytes; throws InvalidArgument naming `what` (the flag).
size_t parse_size(const std::string& text, std::string_view what = "size");
std::string format_size(size_t bytes);

std::string format_table(const std::vector<CollectiveRow>& rows, int ranks);
// One JSON object per row (for docs and plots).
std::string format_jsonl(const std::vector<CollectiveRow>& rows, int ranks);

}  // namespace meshtrain::bench
