// Redistribution property checks shared by the threads-engine property test
// (sharded_tensor_property_test.cc) and its run under mpirun
// (tests/redistribute_mpi_main.cc). Test support, not part of the library.
//
//   std::mt19937_64 rng(seed);
//   MeshCase m{{2, 2}, {"x", "y"}, generate_cases(rng, {"x", "y"}, 4, 40)};
//   comm::launch(..., [&](comm::Communicator& w) { check_world(w, m, tally); });
//
// A case is a global shape, a dtype and a pair of layouts A -> B (random specs
// with multi-axis dims in random order, random Partial axes). Every rank builds
// its block of A (for Partial sources, terms that reduce back to the value
// exactly), redistributes to B, checks its block against the slice of the
// global tensor, then gathers to all ranks and to one. Failures go to the
// Tally; check_world throws only on engine errors.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/sharding/sharded_tensor.h"

namespace meshtrain::testing {

struct Case {
  std::vector<int64_t> shape;
  DType dtype = DType::f32;
  sharding::PartitionSpec a, b;
  sharding::PartialAxes pa, pb;
  bool use_distribute = false;
  int src = 0;
  int dst = 0;

  std::string describe(const sharding::Layout& la, const sharding::Layout& lb) const;
};

struct MeshCase {
  std::vector<int> shape;
  std::vector<std::string> names;
  std::vector<Case> cases;
};

// count random cases for a mesh of `ranks` ranks with these axis names.
std::vector<Case> generate_cases(std::mt19937_64& rng, const std::vector<std::string>& names, int ranks, int count);
// `meshes` random meshes (1 to 3 axes x, y, z; at most max_ranks ranks), each
// with cases_per_mesh cases.
std::vector<MeshCase> generate(uint64_t seed, int meshes, int cases_per_mesh, int max_ranks);

struct Tally {
  std::mutex mu;
  std::vector<std::string> failures;  // the first 20
  std::map<std::string, int> steps;   // step kind -> count over all cases (rank 0)
  int fallbacks = 0;
  int cases = 0;

  void fail(std::string what);
};

// Runs every case of m on the world (mesh::num_ranks(m.shape) ranks).
void check_world(comm::Communicator& world, const MeshCase& m, Tally& tally);

}  // namespace meshtrain::testing
