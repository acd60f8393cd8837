// Property test of redistribute on the threads engine: a seeded generator
// draws meshes (1 to 3 axes, at most 8 ranks), global shapes (1 to 3 dims of
// sizes 0..9, most not divisible by their shard counts), dtypes, and pairs of
// layouts A -> B with random specs (multi-axis dims in random order) and random
// Partial axes. Each rank builds its block of A (for Partial sources, terms
// that reduce back to the value exactly), redistributes to B, and checks its
// block against the slice of the global tensor, then gathers to all ranks and
// to one. One world per mesh; the cases loop inside it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>

#include "meshtrain/comm/launch.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/testing/redistribute.h"

namespace meshtrain::testing {
namespace {

TEST(RedistributeProperty, RandomLayoutPairsMatchTheGlobalSlice) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<MeshCase> meshes = generate(/*seed=*/20240611, /*meshes=*/60, /*cases_per_mesh=*/20, 8);
  Tally tally;
  for (const MeshCase& m : meshes) {
    const int n = static_cast<int>(mesh::num_ranks(m.shape));
    comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(60)},
                 [&](comm::Communicator& world) { check_world(world, m, tally); });
  }
  for (const auto& f : tally.failures) ADD_FAILURE() << f;
  EXPECT_EQ(tally.cases, 60 * 20);
  // Every kind of step ran (the generator covers all transitions).
  for (const char* kind : {"local_slice", "all_gather", "all_to_all", "all_reduce", "reduce_scatter", "make_partial"})
    EXPECT_GT(tally.steps[kind], 0) << kind;
  EXPECT_GT(tally.fallbacks, 0);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string counts;
  for (const auto& [kind, count] : tally.steps) counts += fmt::format(" {}={}", kind, count);
  fmt::print("{} case pairs on {} meshes in {:.2f} s; steps:{}; fallback steps={}\n", tally.cases, meshes.size(), s,
             counts, tally.fallbacks);
}

}  // namespace
}  // namespace meshtrain::testing
