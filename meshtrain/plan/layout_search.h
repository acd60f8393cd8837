// The layout search: for a GPT, a number of devices and hardware, every mesh
// of data, fsdp, tensor, pipeline and context axes (with ZeRO stage,
// micro-batches, sequence parallelism, recompute and the pipeline schedule)
// that the trainer would accept, ranked by plan::predict_time's step time,
// with plan::predict_memory deciding which fit, and each pick explained in
// words.
//
//   plan::SearchOptions o{.devices = 64, .batch = 512, .device_memory = 80e9};
//   plan::SearchResult r = plan::search_layouts(g, o, plan::hardware_preset("H100"));
//   r.fitting[0].mesh;        // "pipeline=2,data=4,tensor=8"
//   for (auto& why : r.fitting[0].reasons) fmt::print("{}\n", why);
//
// The space: tensor t dividing the heads, at most a node's devices (its
// all-reduces sit on every layer's critical path); pipeline p with at least
// one layer per stage (interleaved: v = 2 or 4 chunks of whole layers, m a
// multiple of p); context c for long sequences (at least 1024 tokens per
// rank, the sequence divisible by 2 c, no pipeline); the rest data
// parallel, plain (f32 only) or sharded (zero1, zero2; zero3 without a
// pipeline, as the trainer requires); micro-batches m dividing each data
// rank's samples (powers of two: gradient accumulation lowers activation
// memory, and on a pipeline the bubble); sequence parallelism whenever
// t > 1 (the same bytes as the all-reduces it replaces, less activation
// memory; the trainer refuses it with a context axis); recompute on or
// off. Candidates are priced first (cheap); memory is predicted in order of
// time until `keep` candidates fit (in SearchOptions::usable(): the device
// less a stated reserve), with a lower bound (the model state alone)
// skipping those that cannot. Among candidates within 0.1% of each
// other's time, the one needing less memory ranks first.
// Thread-safety: pure functions. Errors: InvalidArgument naming the value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/time_model.h"

namespace meshtrain::plan {

struct SearchOptions {
  int devices = 8;
  int64_t batch = 0;               // global batch in samples
  double device_memory = 80e9;     // bytes per device
  // The share of device_memory kept free: the margin for what the memory
  // model does not count (the allocator's fragmentation and caching, the
  // runtime's own context and communication buffers, the tensors the
  // tracker does not see: docs/planner.md). A layout fits when its
  // predicted peak is at most usable().
  double reserve = 0.1;
  double usable() const { return device_memory * (1 - reserve); }
  DType precision = DType::bf16;   // param and reduce dtype (f32 allows plain data parallelism)
  int keep = 5;                    // fitting candidates to return
  layout::ContextComm cp_comm = layout::ContextComm::ring;
  double expert_imbalance = 1.0;   // for layouts with an expert axis (TrainingLayout::expert_imbalance)
};

struct Candidate {
  TrainingLayout layout;
  std::string mesh;    // "pipeline=16,data=8,tensor=8"
  std::string label;   // mesh and options: "... zero1, 1f1b m=192, sp, recompute"
  double step = 0;     // seconds per optimizer step
  double memory = 0;   // bytes on the device that needs the most (0: not predicted)
  bool fits = false;
  double tokens_per_second_per_device = 0;
  double model_flops_per_device = 0;  // per second
  std::vector<std::string> reasons = {};  // filled for the picks
};

struct SearchResult {
  std::vector<Candidate> fitting;       // fastest first, at most keep
  std::vector<Candidate> not_fitting;   // the faster ones that did not fit, with their memory
  int considered = 0;                   // layouts priced
};

SearchResult search_layouts(const GptShape& shape, const SearchOptions& options, const Hardware& hardware);

// A candidate for a given layout (priced, memory predicted, explained),
// e.g. a published run's, to set beside the search's picks.
Candidate evaluate_layout(const GptShape& shape, const TrainingLayout& layout, const SearchOptions& options,
                          const Hardware& hardware);

// "pipeline=16,data=8,tensor=8 zero1, 1f1b m=192, sp, recompute".
std::string describe_layout(const TrainingLayout& layout);

}  // namespace meshtrain::plan
