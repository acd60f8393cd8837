// Mesh planning: which mesh shape to use for a number of devices, and for a
// transformer of a given size and sequence length. Pure functions of their
// arguments; no communication, no devices touched.
//
//   get_optimal_mesh_shape(16, 2);                 // {4, 4}
//   auto p = optimize_for_transformer(8, "7B", 4096);
//   p.axis_names;                                  // {"data", "fsdp"}
//   p.shape;                                       // {2, 4}
//   for (auto& r : p.reasons) fmt::print("{}\n", r);  // why, with numbers
//   validate_mesh_config({2, 2}, 5);               // throws: uses 4 of 5 devices
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

namespace meshtrain::plan {

// The mesh axes meshtrain's strategies understand, in mesh order (outermost
// first; the last axis varies fastest, so its groups are consecutive ranks,
// i.e. on one node). Order follows traffic: pipeline sends activations between
// neighbours once per micro-batch, data all-reduces gradients once per step,
// fsdp all-gathers weights every layer, context rotates K/V every attention
// layer, tensor all-reduces activations in every layer.
inline constexpr std::array<std::string_view, 5> kMeshAxisOrder = {"pipeline", "data", "fsdp",
                                                                    "context", "tensor"};

// True if `name` is one of kMeshAxisOrder, or "node": a split of the
// data-parallel ranks into nodes (ZeRO++'s hierarchy: --mesh node=2,fsdp=2),
// outside fsdp in mesh order.
bool is_known_axis(std::string_view name);

// A shape with one name per axis, e.g. {{2, 2}, {"data", "tensor"}}.
struct NamedShape {
  std::vector<int> shape;
  std::vector<std::string> axis_names;

  // Size of the axis called `name`, 1 if there is none.
  int size_of(std::string_view name) const;
  // "data=2,tensor=2" (the --mesh syntax); "" when empty.
  std::string to_spec() const;
  bool operator==(const NamedShape&) const = default;
};

// Parses the --mesh syntax "data=2,tensor=2" (spaces around tokens allowed).
// Checks the syntax only (names non-empty, sizes positive integers); use
// validate_mesh_config for the rest. Throws InvalidArgument naming the bad token.
NamedShape parse_mesh_spec(std::string_view spec);

// The most balanced factorization of n into `dims` factors, ascending:
// among all (f_1 <= ... <= f_dims) with product n it minimizes the largest
// factor, then the second largest, and so on (lexicographically smallest when
// read from the largest down). Uses every device: the product is exactly n.
//   (16, 2) -> {4, 4}   (36, 2) -> {6, 6}   (12, 2) -> {3, 4}
//   (8, 3)  -> {2, 2, 2} (16, 4) -> {2, 2, 2, 2}   (7, 3) -> {1, 1, 7}
// Preconditions: n >= 1, dims >= 1; else throws InvalidArgument.
std::vector<int> get_optimal_mesh_shape(int n, int dims = 2);

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

  // The axes with size > 1, in kMeshAxisOrder; {1} named "data" when every
  // axis is 1 (one device).
  std::vector<int> shape;
  std::vector<std::string> axis_names;

  bool fits = true;                // false: even the least-memory mesh exceeds usable memory
  double bytes_per_device = 0;     // estimated peak: model state + activations
  double usable_bytes = 0;         // per device, after the reserve
  std::vector<std::string> reasons;  // one line per assumption and per axis, with numbers

  int device_count() const { return pipeline * data * fsdp * context * tensor; }
  NamedShape named_shape() const { return {shape, axis_names}; }
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

// Throws InvalidArgument unless `shape` is non-empty, every size >= 1 and the
// product is exactly n_devices (n_devices >= 1): a mesh that leaves devices
// idle is rejected, and the hint proposes a shape with the same number of
// axes that uses them all.
void validate_mesh_config(const std::vector<int>& shape, int n_devices);

// Same, plus the names: one per axis, each in kMeshAxisOrder, no repeats.
// `op` names the caller in the error (e.g. "DistributedConfig").
void validate_mesh_config(const NamedShape& mesh, int n_devices,
                          std::string_view op = "validate_mesh_config");

// The Markdown table of docs/mesh-planning.md: for n = 1..max_devices, the
// balanced 2-, 3- and 4-axis shapes and transformer plans for a few model
// sizes and sequence lengths (80GB devices, 8 per node).
std::string mesh_planning_table(int max_devices = 128);

}  // namespace meshtrain::plan
