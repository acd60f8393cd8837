// DistributedMetrics on the threads engine: built-in and custom reductions,
// gather, keys present on some ranks only, a mesh axis, and the errors.
#include "meshtrain/parallel/distributed_metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/mesh/device_mesh.h"

namespace meshtrain::parallel {
namespace {

using ::testing::HasSubstr;
using Results = std::map<std::string, double>;

void run_ranks(int n, const std::function<void(comm::Communicator&)>& fn) {
  comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(30)}, fn);
}

double median(const std::vector<double>& v) {
  std::vector<double> s = v;
  std::sort(s.begin(), s.end());
  return s.size() % 2 ? s[s.size() / 2] : 0.5 * (s[s.size() / 2 - 1] + s[s.size() / 2]);
}

TEST(DistributedMetrics, ReducesEveryKindOnFourRanks) {
  std::vector<Results> got(4);
  std::vector<std::vector<double>> gathered(4);
  std::vector<uint64_t> collectives(4);
  run_ranks(4, [&](comm::Communicator& comm) {
    const int r = comm.rank();
    DistributedMetrics m(comm);
    m.register_reduction("median", median);
    m.register_reduction("range", [](const std::vector<double>& v) {
      return *std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end());
    });
    m.add("loss", r + 1.0);                     // mean of 1..4
    m.add("acc", 0.5 * r);                      // two adds per rank: mean of 8 values
    m.add("acc", 0.5 * r + 1.0);
    m.add("tokens", 10.0 * (r + 1), Reduction::sum);
    m.add("peak", r == 2 ? 9.0 : r, Reduction::max);
    m.add("low", r - 1.5, Reduction::min);
    m.add("step_ms", 10.0 + r * r, "median");   // 10, 11, 14, 19
    m.add("spread", 3.0 * r, "range");          // 0..9
    if (r == 3) m.add("rare", 42.0, Reduction::sum);  // only one rank has it
    m.add("nan_max", r == 1 ? std::nan("") : 1.0, Reduction::max);
    const uint64_t before = comm.seq();
    got[r] = m.reduce();
    collectives[r] = comm.seq() - before;
    EXPECT_TRUE(m.empty());
    gathered[r] = m.gather("rank_x2", 2.0 * r);
    // A second window starts from nothing.
    m.add("loss", 1.0);
    EXPECT_EQ(m.reduce(), (Results{{"loss", 1.0}}));
  });
  for (int r = 0; r < 4; ++r) {
    const Results& g = got[r];
    EXPECT_EQ(g.size(), 9u);
    EXPECT_EQ(g.at("loss"), 2.5);
    EXPECT_DOUBLE_EQ(g.at("acc"), (0 + 0.5 + 1 + 1.5 + 1 + 1.5 + 2 + 2.5) / 8);
    EXPECT_EQ(g.at("tokens"), 100.0);
    EXPECT_EQ(g.at("peak"), 9.0);
    EXPECT_EQ(g.at("low"), -1.5);
    EXPECT_EQ(g.at("step_ms"), 12.5);
    EXPECT_EQ(g.at("spread"), 9.0);
    EXPECT_EQ(g.at("rare"), 42.0);
    EXPECT_TRUE(std::isnan(g.at("nan_max")));
    EXPECT_EQ(gathered[r], (std::vector<double>{0, 2, 4, 6}));
    EXPECT_EQ(collectives[r], 2u) << "every key in two all_gathers";
    // Identical on every rank, bit for bit (NaN aside).
    for (const auto& [k, v] : g) {
      if (!std::isnan(v)) {
        EXPECT_EQ(v, got[0].at(k)) << k;
      }
    }
  }
}

TEST(DistributedMetrics, ReducesOverOneMeshAxis) {
  // Mesh (data=2, tensor=2): data groups are world ranks {0, 2} and {1, 3}.
  std::vector<Results> got(4);
  run_ranks(4, [&](comm::Communicator& world) {
    mesh::DeviceMesh mesh(world, {2, 2}, {"data", "tensor"});
    DistributedMetrics m(mesh.comm("data"));
    m.add("rank_sum", world.rank(), Reduction::sum);
    got[world.rank()] = m.reduce();
  });
  EXPECT_EQ(got[0].at("rank_sum"), 2.0);
  EXPECT_EQ(got[2].at("rank_sum"), 2.0);
  EXPECT_EQ(got[1].at("rank_sum"), 4.0);
  EXPECT_EQ(got[3].at("rank_sum"), 4.0);
}

TEST(DistributedMetrics, SizesOneAndTwoAndNothingAdded) {
  for (int n : {1, 2}) {
    std::vector<Results> got(n), empty(n);
    run_ranks(n, [&](comm::Communicator& comm) {
      DistributedMetrics m(comm);
      empty[comm.rank()] = m.reduce();  // collective even with nothing added
      m.add("x", comm.rank() + 1.0, Reduction::sum);
      got[comm.rank()] = m.reduce();
    });
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(empty[r].empty());
      EXPECT_EQ(got[r].at("x"), n == 1 ? 1.0 : 3.0);
    }
  }
}

TEST(DistributedMetrics, UnknownReductionIsAnErrorNamingIt) {
  run_ranks(1, [](comm::Communicator& comm) {
    DistributedMetrics m(comm);
    m.register_reduction("median", median);
    try {
      m.add("loss", 1.0, "medain");
      ADD_FAILURE() << "expected an error";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("unknown reduction 'medain' for metric 'loss'"));
      EXPECT_THAT(e.what(), HasSubstr("mean, sum, max, min, median"));
    }
    EXPECT_TRUE(m.empty());  // nothing recorded
    EXPECT_THROW(m.register_reduction("sum", median), InvalidArgument);
    EXPECT_THROW(m.register_reduction("median", median), InvalidArgument);
    EXPECT_THROW(m.register_reduction("empty_fn", nullptr), InvalidArgument);
    m.add("loss", 1.0, Reduction::mean);
    EXPECT_THROW(m.add("loss", 1.0, Reduction::sum), InvalidArgument);
  });
}

TEST(DistributedMetrics, DisagreementsAcrossRanksFailOnEveryRank) {
  std::vector<std::string> reduce_err(2), custom_err(2), gather_err(2);
  run_ranks(2, [&](comm::Communicator& comm) {
    const int r = comm.rank();
    DistributedMetrics m(comm);
    m.add("loss", 1.0, r == 0 ? Reduction::mean : Reduction::sum);
    try {
      m.reduce();
    } catch (const InvalidArgument& e) {
      reduce_err[r] = e.what();
    }
    if (r == 1) m.register_reduction("median", median);  // registered on rank 1 only
    if (r == 1) m.add("t", 1.0, "median");
    try {
      m.reduce();
    } catch (const InvalidArgument& e) {
      custom_err[r] = e.what();
    }
    try {
      m.gather(r == 0 ? "a" : "b", 1.0);
    } catch (const InvalidArgument& e) {
      gather_err[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(reduce_err[r], HasSubstr("metric 'loss' uses reduction 'mean' on rank 0 but 'sum' on rank 1"));
    EXPECT_THAT(gather_err[r], HasSubstr("rank(s) 1 gathered a different key"));
  }
  EXPECT_THAT(custom_err[0], HasSubstr("reduction 'median' (from rank 1), which is not registered on rank 0"));
  EXPECT_EQ(custom_err[1], "");
}

}  // namespace
}  // namespace meshtrain::parallel
