// The mesh vocabulary: the axis roles meshtrain's strategies understand,
// a shape with one name per axis, its --mesh syntax, and the checks every
// caller shares. Every layer that names a mesh axis uses these constants;
// parse_mesh_spec is the one parser of "data=2,tensor=2".
//
//   mesh::NamedShape m = mesh::parse_mesh_spec("data=2,tensor=2");
//   m.size_of(mesh::kTensor);                 // 2
//   mesh::validate_mesh_config(m, 4, "--mesh");
//   mesh::get_optimal_mesh_shape(16, 2);      // {4, 4}
//
// Thread-safety: constants and pure functions. Errors: InvalidArgument naming
// the value and what to change.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::mesh {

// The axis roles. A training mesh names each axis by one of them; DeviceMesh
// itself takes any names (its tests and the seeds' examples use others).
inline constexpr std::string_view kPipeline = "pipeline";  // stages of the model
inline constexpr std::string_view kData = "data";          // replicas of the batch
inline constexpr std::string_view kNode = "node";          // data ranks split into nodes (ZeRO++'s hierarchy)
inline constexpr std::string_view kFsdp = "fsdp";          // data ranks that shard the model state
inline constexpr std::string_view kExpert = "expert";      // data ranks that split a MoE model's experts
inline constexpr std::string_view kContext = "context";    // shards of the sequence
inline constexpr std::string_view kTensor = "tensor";      // shards of every layer

// The axes in mesh order (outermost first; the last axis varies fastest, so
// its groups are consecutive ranks, i.e. on one node). Order follows traffic:
// pipeline sends activations between neighbours once per micro-batch, data
// all-reduces gradients once per step, fsdp all-gathers weights every layer,
// context rotates K/V every attention layer, tensor all-reduces activations
// in every layer. kNode and kExpert are not in it: they split the
// data-parallel ranks (node outside fsdp: --mesh node=2,fsdp=2; expert
// inside it, beside context: --mesh data=2,expert=2). The expert axis
// splits the batch like data, and a mixture-of-experts model's experts
// (every other parameter is replicated over it).
inline constexpr std::array<std::string_view, 5> kMeshAxisOrder = {kPipeline, kData, kFsdp, kContext, kTensor};

// Every role, for messages: "pipeline, data, node, fsdp, expert, context, tensor".
inline constexpr std::array<std::string_view, 7> kKnownAxes = {kPipeline, kData, kNode, kFsdp,
                                                               kExpert, kContext, kTensor};
std::string known_axes_list();

// True if `name` is one of kKnownAxes.
bool is_known_axis(std::string_view name);

// A shape with one name per axis, e.g. {{2, 2}, {"data", "tensor"}}.
struct NamedShape {
  std::vector<int> shape;
  std::vector<std::string> axis_names;

  // Size of the axis called `name`, 1 if there is none.
  int size_of(std::string_view name) const;
  // True if an axis is called `name` (whatever its size).
  bool has(std::string_view name) const;
  // "data=2,tensor=2" (the --mesh syntax); "" when empty.
  std::string to_spec() const;
  bool operator==(const NamedShape&) const = default;
};

// Parses the --mesh syntax "data=2,tensor=2" (spaces around tokens allowed).
// Checks the syntax only (names non-empty, sizes positive integers); use
// validate_mesh_config for the rest. Throws InvalidArgument naming the bad token.
NamedShape parse_mesh_spec(std::string_view spec);

// A mesh for `world_size` devices that keeps every axis of `m` but the data
// axis, which takes what is left (an elastic restart on more or fewer
// devices: the tensor, pipeline, context, expert, fsdp and node sizes are
// the run's fixed choices). A mesh without a data axis gains one, after a
// pipeline axis or first (kMeshAxisOrder), unless it would have size 1.
// When the fsdp size does not fit either, the data and fsdp axes share
// what the other axes leave: fsdp = gcd(its size, that), the data axis the
// rest (the checkpoint reshards onto any fsdp size).
// nullopt when the other axes' product does not divide world_size (>= 1).
//   (data=4,tensor=2, 4) -> data=2,tensor=2    (tensor=2, 8) -> data=4,tensor=2
//   (fsdp=4, 2) -> fsdp=2    (fsdp=4, 6) -> data=3,fsdp=2
//   (data=2,tensor=4, 2) -> nullopt
std::optional<NamedShape> resize_data_axis(const NamedShape& m, int world_size);

// The divisors of n >= 1, ascending: the sizes an axis of an n-device mesh
// can take.
std::vector<int> divisors(int n);

// The most balanced factorization of n into `dims` factors, ascending:
// among all (f_1 <= ... <= f_dims) with product n it minimizes the largest
// factor, then the second largest, and so on (lexicographically smallest when
// read from the largest down). Uses every device: the product is exactly n.
//   (16, 2) -> {4, 4}   (36, 2) -> {6, 6}   (12, 2) -> {3, 4}
//   (8, 3)  -> {2, 2, 2} (16, 4) -> {2, 2, 2, 2}   (7, 3) -> {1, 1, 7}
// Preconditions: n >= 1, dims >= 1; else throws InvalidArgument.
std::vector<int> get_optimal_mesh_shape(int n, int dims = 2);

// Throws InvalidArgument unless `shape` is non-empty, every size >= 1 and the
// product is exactly n_devices (n_devices >= 1): a mesh that leaves devices
// idle is rejected, and the hint proposes a shape with the same number of
// axes that uses them all.
void validate_mesh_config(const std::vector<int>& shape, int n_devices);

// Same, plus the names: one per axis, each in kKnownAxes, no repeats.
// `op` names the caller in the error (e.g. "DistributedConfig").
void validate_mesh_config(const NamedShape& mesh, int n_devices, std::string_view op = "validate_mesh_config");

}  // namespace meshtrain::mesh
