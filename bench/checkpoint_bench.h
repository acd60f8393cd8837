// Save and load throughput of a sharded checkpoint (checkpoint/checkpoint.h)
// beside the disk's own sequential rates, measured in the same run.
//
//   bench::CheckpointBenchOptions o;     // GPT-2 124M, zero3 over 4 ranks, AdamW
//   fmt::print("{}", bench::format_checkpoint_bench(bench::run_checkpoint_bench(o), o));
//
// Each rank of the threads engine builds its zero3 shard of the GPT
// (FullyShardedDataParallel, blocks as units) and an AdamW; a save writes
// every rank's f32 masters and both moments (12 bytes per parameter), with
// fsync and read-back checks (checkpoint.h); a load reads every rank's part
// back into the masters and the optimizer (TrainingCheckpoint::resume).
// The disk: one stream writing a file of the checkpoint's size in 8 MiB
// writes then fsync, the same over `ranks` streams at once, and one stream
// reading the file back. With drop_caches (root only) the page cache is
// dropped before the disk's read and each load, so loads read the disk;
// otherwise they read memory.
// Thread-safety: call from one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::bench {

struct CheckpointBenchOptions {
  int ranks = 4;
  int64_t layers = 12, width = 768, heads = 12, vocab = 50257, context = 1024;  // GPT-2 124M
  std::string dir = "/tmp/meshtrain_bench_checkpoint";
  int reps = 2;
  bool drop_caches = false;
};

struct CheckpointBenchResult {
  int64_t parameters = 0;
  uint64_t bytes = 0;                   // of one checkpoint
  std::vector<double> save_s, load_s;   // per repetition
  // The last save's phases (checkpoint.h's CheckpointSaveStats: each the
  // slowest rank's).
  double exchange_s = 0, write_s = 0, sync_s = 0, verify_s = 0, commit_s = 0;
  double disk_write_1 = 0, disk_write_n = 0, disk_read_1 = 0;  // bytes per second
  bool caches_dropped = false;
};

CheckpointBenchResult run_checkpoint_bench(const CheckpointBenchOptions& options);
std::string format_checkpoint_bench(const CheckpointBenchResult& r, const CheckpointBenchOptions& options);

}  // namespace meshtrain::bench
