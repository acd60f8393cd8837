// ZeRO++ against ZeRO-3: the bytes each rank receives per training step
// from other nodes and from its own node, hpZ's secondary copies and the
// step time, for f32 and bf16 ZeRO-3, every combination of qwZ, qgZ and
// hpZ, and the paper's setting (int4 gradients), beside the paper's formula.
//
//   bench::ZeroppBenchOptions o;  // 2 nodes x 2 ranks, MLP 784 -> 1024 x 2 -> 10
//   fmt::print("{}", bench::format_zeropp_bench(bench::run_zeropp_bench(o), o));
//
// Each configuration trains the MLP with FullyShardedDataParallel (zero3,
// f32 unless named bf16, AdamW) on nodes x ranks_per_node ranks of the threads engine (a
// node x fsdp mesh: simulated nodes); after one warm-up step, `steps`
// steps are measured. Bytes come from the communicators' own counters
// (Communicator::traffic: per operation, the block each rank contributes)
// and are turned into bytes received per rank with the least any algorithm
// moves, split by where the peers are: an all-gather or reduce-scatter of
// b bytes over the n = K L shard ranks receives b from each of the n - L
// ranks on other nodes and the L - 1 on this one; an all-to-all block of b
// over the K-rank cross-node group b from each of K - 1 other nodes, over
// the L-rank node group b from each of L - 1 local peers; an all-reduce of
// b about 2 b (n - 1) / n (a ring), split in the same proportion.
// The formula (per rank, per step, P sharded elements of e bytes): ZeRO-3's
// forward and backward all-gathers and its reduce-scatter each receive
// e P (n - L) / n bytes from other nodes; qwZ's gathers (P + 4 P / block)
// (n - L) / n at 8 bits; hpZ takes backward's gather off the count (it
// runs within the node); qgZ's cross-node all-to-all (P b / 8 + 4 P /
// block) (K - 1) / n at b bits. The measured column counts every real operation (padding,
// replicated biases' all-reduces); the formula only the sharded elements.
// Thread-safety: call from one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::bench {

struct ZeroppBenchOptions {
  int nodes = 2, ranks_per_node = 2;
  std::vector<int64_t> hidden = {1024, 1024};  // 784 -> hidden -> 10
  int batch = 64;  // samples per rank per step
  int steps = 3;
  int bits = 8;
  int64_t block = 256;
};

struct ZeroppBenchRow {
  std::string config;             // "ZeRO-3", "ZeRO-3 bf16", "qwZ", ..., "qwZ+qgZ+hpZ"
  double cross_node_bytes = 0;    // per rank per step, received from other nodes (measured)
  double within_node_bytes = 0;   // per rank per step, from its own node
  double formula_cross_bytes = 0; // the paper's count for the same configuration
  double step_ms = 0;             // median over the measured steps (rank 0)
  double secondary_bytes = 0;     // hpZ: the node-local parameter copies each rank holds
};

struct ZeroppBenchResult {
  int64_t sharded_elements = 0;
  std::vector<ZeroppBenchRow> rows;
};

ZeroppBenchResult run_zeropp_bench(const ZeroppBenchOptions& options);
std::string format_zeropp_bench(const ZeroppBenchResult& r, const ZeroppBenchOptions& options);

}  // namespace meshtrain::bench
