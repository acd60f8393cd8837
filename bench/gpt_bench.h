// The GPT training step against the machine and against PyTorch: median time
// of one step (forward, cross-entropy, backward, AdamW) of a GPT-2 (default:
// the 124M shape, T = 64, batch 4) in fp32 and/or bf16 (as `meshtrain train
// --precision bf16 --reduce-precision fp32` runs it: fully sharded data
// parallelism's mixed precision, no_shard over the data axis: bf16
// parameters in the layers, written from the optimizer's f32 masters once
// per step; every Linear's and the head's GEMMs on bf16 operands with f32
// accumulation; f32 gradients, logits and attention; PyTorch: autocast) on
// one rank with `threads` BLAS
// threads and synthetic tokens; tokens/s; the model FLOPs it reaches against
// the cores' FMA peak measured in the same run (measure_fma_peak; bf16 rows
// against the bf16 dot product's where the CPU has one), and beside the sgemm
// rate on the step's own largest GEMM shape; the same model and step in PyTorch (bench/torch_gpt.py, run by the
// benchmark as a child process when python3 with torch is present); and
// where the step's time goes, per kernel (nn::functional's op profile over
// the timed steps; "other" is the rest: embedding bookkeeping, residual
// adds, copies, gradient zeroing).
//
//   bench::GptBenchOptions o;                      // 124M shape
//   fmt::print("{}", bench::format_gpt_bench(bench::run_gpt_bench(o), o));
//
// Meshes (options.meshes, `--mesh tensor=2 --mesh data=2`): the same step
// on several ranks of the threads engine, `threads` GEMM threads split
// over them. data=D splits the global batch of `batch` samples (a distinct
// part of the synthetic tokens per replica, DataParallel over the data
// axis: buckets all-reduced under backward, finish() waits for the rest);
// tensor=K splits the model (nn::GPTConfig::tensor, VocabParallelCrossEntropy,
// optionally sequence parallelism), every rank of a tensor group seeing the
// same tokens; context=N splits each sample's sequence (nn::GPTConfig::context:
// ring attention, or all_to_all with "+a2a"), gradients summed over data x
// context. Per mesh: rank 0's median step, the mesh's tokens/s, the time
// rank 0 spends in tensor-parallel collectives (the op profile's "tp ..."
// entries) and in DataParallel::finish() ("dp finish": gradient
// communication not hidden under backward) as shares of its mean step, and
// the parameter bytes each rank holds, its activations' peak (what context
// parallelism divides), and the time in context-parallel communication
// (the "cp ..." entries: waiting for the ring's next K/V block, all-to-alls). On the threads engine a collective's
// time includes waiting for the slowest rank to arrive.
//
// FLOPs per step: 6 N B T for the matrix products (N: the block matrices
// and the tied vocabulary projection) plus 12 L B T^2 C for attention
// (counted in full, as PaLM's MFU does; the causal kernel skips half).
// Thread-safety: call from one thread; it sets the process's BLAS threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/gemm_bench.h"
#include "meshtrain/core/dtype.h"
#include "meshtrain/core/matmul.h"

namespace meshtrain::bench {

// The ranks of one run: data-parallel replicas x tensor-parallel ranks.
struct GptBenchMesh {
  int data = 1, context = 1, tensor = 1;
  bool sequence_parallel = false;  // only with tensor > 1
  bool all_to_all = false;         // context attention by all_to_all (Ulysses), not ring
  bool overlap = false;            // tensor parallelism's communication overlap (nn::TensorParallelGroup)
  int ranks() const { return data * context * tensor; }
  // "none" (one rank), "data=2", "tensor=2", "data=2,tensor=2+sp", "tensor=2+sp+overlap", "context=2+a2a".
  std::string name() const;
};
// The --mesh syntax: "none" (one rank), or data, context and/or tensor axes
// in mesh::parse_mesh_spec's syntax ("tensor=2", "data=2,context=2"),
// optionally followed by "+sp" (sequence parallelism), "+overlap" (tensor
// parallelism's communication overlap) or "+a2a" (all_to_all context
// attention). InvalidArgument naming the spec for other axes, sizes below 1,
// "+sp" or "+overlap" without a tensor axis or "+a2a" without a context axis.
GptBenchMesh parse_gpt_bench_mesh(const std::string& spec);

struct GptBenchOptions {
  int64_t layers = 12, heads = 12, width = 768, vocab = 50257, context = 64, batch = 4;
  int steps = 10;
  int warmup = 2;
  int threads = 2;
  std::vector<DType> precisions = {DType::f32};  // f32 and/or bf16 (run_gpt_bench refuses others)
  // PyTorch peer: the script to run with /usr/bin/python3 ("" skips it;
  // run for one-rank meshes only).
  std::string torch_script;
  // Empty: one rank in the calling thread, no comparison table. Otherwise one
  // run per mesh and precision, in this order, and a table comparing them.
  std::vector<GptBenchMesh> meshes;
  // Empty: the process's GEMM policy (core/matmul.h). Otherwise one run per
  // policy (set_gemm_policy) for each mesh and precision, side by side.
  std::vector<GemmPolicy> gemm_policies;
  // Seconds the whole benchmark may take (0: no limit; default 10 minutes). A run that would
  // start past it is skipped, and PyTorch's peer is stopped at it (`timeout`
  // kills the script); the table says which.
  double time_budget_s = 600;
  // Also each fp32 run on a mesh of data axes alone in the deterministic
  // mode (docs/determinism.md), right after it: the mode's cost.
  bool deterministic = false;
};

struct GptBenchOp {
  std::string op;
  int64_t calls_per_step = 0;
  double ms_per_step = 0;
};

// One mesh's and precision's measurements (rank 0's times).
struct GptBenchRun {
  GptBenchMesh mesh;
  int threads_per_rank = 0;
  DType precision = DType::f32;
  std::string gemm;                 // "gemm auto" when the options name policies, else ""
  bool deterministic = false;       // the deterministic mode's run
  bool skipped = false;             // not run: the time budget was spent (see note)
  std::string note;                 // why it was skipped
  double step_ms = 0;               // median
  double mean_step_ms = 0;          // the profile's total per step
  double tokens_per_s = 0;          // the whole mesh's: batch x context per step
  double gflops = 0;                // flops_per_step / step
  double tp_ms = 0;                 // per step in "tp ..." profile entries (mean)
  double dp_finish_ms = 0;          // per step in DataParallel::finish() (mean)
  double cp_ms = 0;                 // per step in "cp ..." profile entries (mean)
  double activation_bytes = 0;      // rank 0's activation peak over the timed steps
  std::vector<double> tp_ms_per_rank;  // tp_ms of every rank, by world rank
  double parameter_bytes = 0;       // the parameter values rank 0 holds
  double torch_step_ms = 0;         // 0: not measured
  std::string torch_note;           // the version, or why it was not measured
  std::vector<GptBenchOp> profile;  // per step over the timed steps, largest first, then "other"
};

struct GptBenchResult {
  int64_t parameters = 0;
  double flops_per_step = 0;
  FmaPeak peak;                     // measured now on --threads threads: the rate columns' 100%
  double sgemm_gflops = 0;          // measured now: (B T, C) x (C, 4C) through core matmul, f32
  std::string sgemm_shape;
  std::vector<GptBenchRun> runs;    // one per mesh and precision, in the order asked
};

GptBenchResult run_gpt_bench(const GptBenchOptions& options);
std::string format_gpt_bench(const GptBenchResult& r, const GptBenchOptions& options);

}  // namespace meshtrain::bench
