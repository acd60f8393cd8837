// meshtrain plan --calibrate and --check: this machine's rates for the time
// model (plan/time_model.h), measured, and the planner's predictions of
// memory and step time set beside real runs of the trainer here (threads
// engine). docs/planner.md has the method and the results.
#pragma once

#include <string>

#include "meshtrain/plan/activation_memory.h"
#include "meshtrain/plan/time_model.h"

namespace meshtrain::cli {

struct CheckOptions {
  plan::GptShape shape;
  int64_t batch = 32;
  int steps = 6;                    // per layout; the first two are not timed
  std::string corpus = "/usr/share/games/fortunes/computers";
  std::string text_cache = "data/text";
  std::string only;                 // run only layouts whose name contains this
  double tolerance = 0.25;          // exit 1 when a step time misses by more
};

// "A100", "H100", or a JSON file that --calibrate wrote.
plan::Hardware load_hardware(const std::string& name_or_file);
std::string hardware_json(const plan::Hardware& hw);

// Measures this machine: GEMM rate and per-call overhead (one thread, and
// all cores), the attention kernel's rate against it, the threads engine's
// all_reduce latency and bandwidth on 2 ranks, and the elementwise
// bandwidth, fitted so that the model reproduces one measured step of the
// GPT on one device. Prints what it measured.
plan::Hardware calibrate_this_machine(const CheckOptions& options);

// Calibrates, then trains the check's layouts for options.steps steps each
// and prints predicted against measured memory (the largest device) and step
// time (median of the timed steps). Returns 0, or 1 when a step time missed
// by more than the tolerance or a memory peak by more than 5%.
int run_plan_check(const CheckOptions& options);

}  // namespace meshtrain::cli
