// Mesh planning: which mesh shape to use for a number of devices, and for a
// transformer of a given size and sequence length. Pure functions of their
// arguments; no communication, no devices touched.
//
//   auto p = optimize_for_transformer(8, "7B", 4096);
//   p.axis_names;                                  // {"data", "fsdp"}
//   p.shape;                                       // {2, 4}
//   for (auto& r : p.reasons) fmt::print("{}\n", r);  // why, with numbers
//
// Every plan uses every device: the product of a returned shape always equals
// the device count (the Python reference idled devices: 5 -> 2x2, 32 -> 6x5).
// The table of results for 1..128 devices is in docs/mesh-planning.md
// (mesh_planning_table() prints it; a test keeps the two in sync).
//
// Thread-safety: all functions are pure and may be called from any thread.
// Errors: InvalidArgument with the operation, the values and what to change.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/mesh/mesh_shape.h"

namespace meshtrain::plan {

// Parameter count of a model-size string: a decimal number with an optional
// suffix K (1e3), M (1e6), B or G (1e9), T (1e12), any case:
// "7B", "7b", "350M", "1.5T", "125k", "1000". Throws InvalidArgument otherwise
// (empty, negative, zero, not finite, unknown suffix, trailing text), its
// op `what`: the flag or field the text came from ("--size").
double parse_model_size(std::string_view text, std::string_view what = "model size");

// Bytes of a memory-size string. Decimal units K, M, G, T (with or without
// "B": "80GB" = "80G" = 80e9 bytes) and binary units KiB, MiB, GiB, TiB
// ("24GiB" = 24 * 2^30); no unit means bytes; any case. Throws
// InvalidArgument for anything else, zero, negative or not finite, its op
// `what` ("--device-memory: '-80GB' is negative").
double parse_memory_size(std::string_view text, std::string_view what = "memory size");

// A mesh chosen for a transformer workload. Axis sizes are named; their
// product is always the device count.
struct MeshPlan {
  int pipeline = 1;
  int data = 1;
  int fsdp = 1;
  int context = 1;
  int tensor = 1;

  // The axes with size > 1, in mesh::kMeshAxisOrder; {1} named "data" when every
  // axis is 1 (one device).
  std::vector<int> shape;
  std::vector<std::string> axis_names;

  bool fits = true;                // false: even the least-memory mesh exceeds usable memory
  double bytes_per_device = 0;     // estimated peak: model state + activations
  double usable_bytes = 0;         // per device, after the reserve
  std::vector<std::string> reasons;  // one line per assumption and per axis, with numbers

  int device_count() const { return pipeline * data * fsdp * context * tensor; }
  mesh::NamedShape named_shape() const { return {shape, axis_names}; }
  // "data=2,fsdp=4" (mesh order, size-1 axes left out; "data=1" for one device)
  std::string to_spec() const;
};

// Assumptions of optimize_for_transformer (documented in docs/mesh-planning.md).
inline constexpr double kBytesPerParameter = 16;  // bf16 weights+grads, fp32 master, Adam m, v
inline constexpr double kActivationBytesPerToken = 34;  // per hidden unit and layer (bf16, flash attention)
inline constexpr double kUsableMemoryFraction = 0.9;    // 10% reserved for buffers, fragmentation
inline constexpr int64_t kLongSequence = 32768;         // context parallelism from here on

// Picks (pipeline, data, fsdp, context, tensor) for training a decoder-only
// transformer of `model_size` parameters (parse_model_size) on `n_devices`
// devices of `device_memory` each (parse_memory_size), `devices_per_node` per
// node, with sequences of `sequence_length` tokens and micro-batch 1.
//
// Memory model, per device (see docs/mesh-planning.md):
//   state       = 16 bytes/param * P / (tensor * pipeline * fsdp)
//   activations = 34 * seq * hidden * layers / (tensor * context)
// with hidden = cbrt(128 * P / 12) and layers = hidden / 128 (P = 12 L h^2).
// Candidates: every factorization of n_devices into the axes where tensor
// divides devices_per_node (or n_devices, when they fit on one node) and
// context > 1 only when sequence_length >= kLongSequence. Among those that fit
// in 90% of device memory the plan takes the smallest tensor, then context,
// then fsdp (the costlier a parallelism's traffic, the later it is used); the
// remaining devices go to data. Pipeline stays 1: in this model it divides the
// state exactly like fsdp but adds a bubble (the reasons say so). If no
// candidate fits: the least-memory one, fits = false, and a reason saying
// what to change. Larger models never get a smaller (tensor, context, fsdp)
// among fitting plans; every plan uses every device.
// Preconditions: n_devices >= 1, sequence_length >= 1, devices_per_node >= 1,
// valid size strings; else throws InvalidArgument.
MeshPlan optimize_for_transformer(int n_devices, std::string_view model_size, int64_t sequence_length,
                                  std::string_view device_memory = "80GB", int devices_per_node = 8);

// The Markdown table of docs/mesh-planning.md: for n = 1..max_devices, the
// balanced 2-, 3- and 4-axis shapes and transformer plans for a few model
// sizes and sequence lengths (80GB devices, 8 per node).
std::string mesh_planning_table(int max_devices = 128);

}  // namespace meshtrain::plan
