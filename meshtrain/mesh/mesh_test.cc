// DeviceMesh tests: the pure rank <-> coordinate math and validation without
// communication, then meshes on the threads engine (1-D, 2x2, 2x2x2) whose
// sub-communicators are checked by gathering world ranks over them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <sstream>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/mesh/device_mesh.h"

namespace meshtrain::testing {
namespace {

using namespace std::chrono_literals;
using comm::Communicator;
using comm::ReduceOp;
using mesh::DeviceMesh;
using ::testing::HasSubstr;
using Ints = std::vector<int>;
using Names = std::vector<std::string>;

constexpr auto kTimeout = 5s;

void run(int n, const std::function<void(Communicator&)>& fn) {
  comm::launch({.engine = comm::Engine::threads, .ranks = n, .timeout = kTimeout}, fn);
}

// what() of the InvalidArgument `fn` throws, or "" if it throws none.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

std::string validation_error(const Ints& shape, const Names& names, std::optional<int> world = std::nullopt) {
  return error_of([&] { mesh::validate_mesh(shape, names, world); });
}

// ---- pure math ------------------------------------------------------------------

TEST(MeshMath, RoundTripsEveryRankInRowMajorOrder) {
  for (const Ints& shape : {Ints{8}, Ints{2, 2}, Ints{2, 2, 2}, Ints{4, 2}, Ints{3, 1, 2}}) {
    const int n = static_cast<int>(mesh::num_ranks(shape));
    Ints prev;
    for (int r = 0; r < n; ++r) {
      const Ints c = mesh::unravel(r, shape);
      ASSERT_EQ(c.size(), shape.size());
      for (size_t i = 0; i < c.size(); ++i) {
        EXPECT_GE(c[i], 0);
        EXPECT_LT(c[i], shape[i]);
      }
      EXPECT_EQ(mesh::ravel(c, shape), r) << mesh::format_mesh(shape);
      if (r > 0) {
        EXPECT_LT(prev, c) << "rank " << r << " of " << mesh::format_mesh(shape);  // last axis fastest
      }
      prev = c;
    }
  }
  EXPECT_EQ(mesh::num_ranks({3, 1, 2}), 6);
  EXPECT_EQ(mesh::unravel(5, {4, 2}), (Ints{2, 1}));
  EXPECT_EQ(mesh::unravel(5, {2, 2, 2}), (Ints{1, 0, 1}));
  EXPECT_EQ(mesh::unravel(5, {3, 1, 2}), (Ints{2, 0, 1}));
  EXPECT_EQ(mesh::unravel(7, {8}), (Ints{7}));
  EXPECT_EQ(mesh::ravel({3, 0}, {4, 2}), 6);
  EXPECT_EQ(mesh::ravel({1, 1, 0}, {2, 2, 2}), 6);
}

TEST(MeshMath, OutOfRangeRanksAndCoordsThrow) {
  EXPECT_THAT(error_of([] { mesh::unravel(8, {4, 2}); }), HasSubstr("rank 8 out of range for mesh (4, 2)"));
  EXPECT_THAT(error_of([] { mesh::unravel(-1, {4, 2}); }), HasSubstr("use a rank in [0, 8)"));
  EXPECT_THAT(error_of([] {
                mesh::ravel({4, 0}, {4, 2});
              }),
              HasSubstr("coordinate 4 on axis 0 out of range"));
  EXPECT_THAT(error_of([] { mesh::ravel({1}, {4, 2}); }), HasSubstr("1 coordinates (1) for a 2-D mesh"));
  EXPECT_THAT(error_of([] { mesh::group_of(0, {4, 2}, {2}); }), HasSubstr("axis index 2 out of range"));
  EXPECT_THAT(error_of([] { mesh::groups_along({4, 2}, {1, 1}); }), HasSubstr("axis 1 listed twice"));
}

TEST(MeshMath, GroupsVaryTheListedAxesInTheGivenOrder) {
  EXPECT_EQ(mesh::group_of(5, {4, 2}, {0}), (Ints{1, 3, 5, 7}));
  EXPECT_EQ(mesh::group_of(5, {4, 2}, {1}), (Ints{4, 5}));
  EXPECT_EQ(mesh::group_of(5, {4, 2}, {}), (Ints{5}));
  EXPECT_EQ(mesh::group_of(5, {4, 2}, {0, 1}), (Ints{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(mesh::group_of(5, {2, 2, 2}, {1, 2}), (Ints{4, 5, 6, 7}));
  EXPECT_EQ(mesh::group_of(5, {2, 2, 2}, {2, 1}), (Ints{4, 6, 5, 7}));
  EXPECT_EQ(mesh::group_of(5, {2, 2, 2}, {0, 2}), (Ints{0, 1, 4, 5}));
  EXPECT_EQ(mesh::groups_along({4, 2}, {0}), (std::vector<Ints>{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh::groups_along({4, 2}, {1}), (std::vector<Ints>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh::groups_along({2, 2, 2}, {0}), (std::vector<Ints>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh::groups_along({2, 2, 2}, {1, 2}), (std::vector<Ints>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(mesh::groups_along({3, 1, 2}, {1}), (std::vector<Ints>{{0}, {1}, {2}, {3}, {4}, {5}}));
}

TEST(MeshValidation, EveryBadMeshHasAClearError) {
  EXPECT_EQ(validation_error({4, 2}, {"data", "tensor"}, 8), "");
  EXPECT_EQ(validation_error({1}, {"data"}, 1), "");

  std::string e = validation_error({4, 3}, {"data", "tensor"}, 8);
  EXPECT_THAT(e, HasSubstr("DeviceMesh: mesh (data=4, tensor=3) has 12 ranks but the world has 8"));
  EXPECT_THAT(e, HasSubstr("use sizes whose product is 8, e.g. (data=4, tensor=2)"));
  // Keeps the sizes of the later axes when they divide the world.
  EXPECT_THAT(validation_error({3, 2}, {"data", "tensor"}, 8), HasSubstr("e.g. (data=4, tensor=2)"));
  EXPECT_THAT(
      validation_error({2}, {"data"}, 6),
      HasSubstr("has 2 ranks but the world has 6 (hint: use sizes whose product is 6, e.g. (data=6))"));
  EXPECT_THAT(validation_error({2, 2, 5}, {"pipeline", "data", "tensor"}, 12),
              HasSubstr("e.g. (pipeline=3, data=2, tensor=2)"));

  EXPECT_THAT(validation_error({4, 2}, {"data"}),
              HasSubstr("shape has 2 axes (4, 2) but 1 axis names were given (data)"));
  EXPECT_THAT(validation_error({4, 2}, {"data"}), HasSubstr("give exactly one name per axis"));
  EXPECT_THAT(validation_error({}, {}), HasSubstr("empty mesh: the shape has no axes"));
  EXPECT_THAT(validation_error({4, 2}, {"data", ""}), HasSubstr("axis 1 has an empty name"));
  EXPECT_THAT(validation_error({2, 2, 2}, {"data", "tensor", "data"}),
              HasSubstr("axis name 'data' is used twice (axes 0 and 2)"));
  EXPECT_THAT(validation_error({2, 2}, {"data", "ten sor"}),
              HasSubstr("axis name 'ten sor' has characters other than letters, digits, '_' and '-'"));
  EXPECT_THAT(validation_error({4, 0}, {"data", "tensor"}), HasSubstr("axis 'tensor' (axis 1) has size 0"));
  EXPECT_THAT(validation_error({-2, 4}, {"data", "tensor"}), HasSubstr("axis 'data' (axis 0) has size -2"));
  EXPECT_THAT(validation_error({-2, 4}, {"data", "tensor"}), HasSubstr("every axis size must be >= 1"));
  EXPECT_THAT(validation_error({65536, 65536}, {"a", "b"}), HasSubstr("has more than 2147483647 ranks"));
  EXPECT_THAT(error_of([] { mesh::render_mesh({2, 2}, {"x", "x"}); }), HasSubstr("used twice"));
}

// ---- rendering ------------------------------------------------------------------

TEST(MeshRender, FourByTwoGrid) {
  const std::string expected =
      "mesh (data=4, tensor=2): 8 ranks\n"
      "          tensor\n"
      "          0     1\n"
      "       ┌─────┬─────┐\n"
      "data 0 │  0  │  1  │\n"
      "       ├─────┼─────┤\n"
      "     1 │  2  │  3  │\n"
      "       ├─────┼─────┤\n"
      "     2 │  4  │  5  │\n"
      "       ├─────┼─────┤\n"
      "     3 │  6  │  7  │\n"
      "       └─────┴─────┘\n"
      "data groups (vary data, fixed tensor): [0 2 4 6] [1 3 5 7]\n"
      "tensor groups (vary tensor, fixed data): [0 1] [2 3] [4 5] [6 7]\n";
  EXPECT_EQ(mesh::render_mesh({4, 2}, {"data", "tensor"}), expected);
}

TEST(MeshRender, OneDimensionalIsOneRow) {
  const std::string expected =
      "mesh (data=4): 4 ranks\n"
      "          data\n"
      "   0     1     2     3\n"
      "┌─────┬─────┬─────┬─────┐\n"
      "│  0  │  1  │  2  │  3  │\n"
      "└─────┴─────┴─────┴─────┘\n"
      "data groups (vary data): [0 1 2 3]\n";
  EXPECT_EQ(mesh::render_mesh({4}, {"data"}), expected);
}

TEST(MeshRender, ThreeDimensionalHasOneGridPerLeadingIndex) {
  const std::string s = mesh::render_mesh({2, 2, 3}, {"pipeline", "data", "tensor"});
  EXPECT_THAT(s, HasSubstr("mesh (pipeline=2, data=2, tensor=3): 12 ranks\n"));
  EXPECT_THAT(s, HasSubstr("pipeline=0:\n"));
  EXPECT_THAT(s, HasSubstr("pipeline=1:\n"));
  EXPECT_THAT(s, HasSubstr("data 0 │   6  │   7  │   8  │\n"));  // 2-digit ranks widen every cell
  EXPECT_THAT(s, HasSubstr("     1 │   9  │  10  │  11  │\n"));
  EXPECT_THAT(
      s, HasSubstr(
             "pipeline groups (vary pipeline, fixed data, tensor): [0 6] [1 7] [2 8] [3 9] [4 10] [5 11]\n"));
  EXPECT_THAT(
      s,
      HasSubstr("data groups (vary data, fixed pipeline, tensor): [0 3] [1 4] [2 5] [6 9] [7 10] [8 11]\n"));
  EXPECT_THAT(
      s, HasSubstr("tensor groups (vary tensor, fixed pipeline, data): [0 1 2] [3 4 5] [6 7 8] [9 10 11]\n"));
  EXPECT_LT(s.find("pipeline=0:"), s.find("pipeline=1:"));
  std::istringstream lines(s);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_FALSE(line.empty());
    EXPECT_NE(line.back(), ' ') << "trailing space in '" << line << "'";
  }
  EXPECT_THAT(mesh::render_mesh({1, 2, 1, 2}, {"a", "b", "c", "d"}), HasSubstr("a=0, b=1:\n"));
}

// ---- meshes on the threads engine -----------------------------------------------

// What one rank saw through one axis sub-communicator.
struct AxisView {
  int size = -1, rank = -1;
  Ints members;      // world ranks all_gathered over the sub-communicator
  Ints group_ranks;  // mesh.group_ranks({axis})
  int sum = -1;      // all_reduce(sum) of world ranks over the sub-communicator
};

// Builds the mesh on every rank and records each axis's view.
std::vector<std::vector<AxisView>> views(const Ints& shape, const Names& names) {
  const int n = static_cast<int>(mesh::num_ranks(shape));
  std::vector<std::vector<AxisView>> out(n, std::vector<AxisView>(shape.size()));
  run(n, [&](Communicator& world) {
    DeviceMesh mesh(world, shape, names);
    for (size_t a = 0; a < names.size(); ++a) {
      AxisView& v = out[world.rank()][a];
      Communicator& c = mesh.comm(names[a]);
      v.size = c.size();
      v.rank = c.rank();
      const int me = world.rank();
      v.members.resize(c.size());
      c.all_gather(&me, v.members.data(), 1, DType::i32);
      c.all_reduce(&me, &v.sum, 1, DType::i32, ReduceOp::sum);
      v.group_ranks = mesh.group_ranks({names[a]});
    }
  });
  return out;
}

void check_axes(const Ints& shape, const Names& names) {
  const auto out = views(shape, names);
  for (int r = 0; r < static_cast<int>(out.size()); ++r) {
    const Ints coords = mesh::unravel(r, shape);
    int stride = 1;
    for (int a = static_cast<int>(shape.size()) - 1; a >= 0; stride *= shape[a], --a) {
      const AxisView& v = out[r][a];
      SCOPED_TRACE("rank " + std::to_string(r) + " axis " + names[a]);
      EXPECT_EQ(v.size, shape[a]);
      EXPECT_EQ(v.rank, coords[a]);
      EXPECT_EQ(v.members, v.group_ranks);
      // The group is base, base + stride, ..., with base the rank at coordinate 0.
      const int base = r - coords[a] * stride, k = shape[a];
      Ints expected(k);
      for (int i = 0; i < k; ++i) expected[i] = base + i * stride;
      EXPECT_EQ(v.group_ranks, expected);
      EXPECT_EQ(v.sum, k * base + stride * k * (k - 1) / 2);
    }
  }
}

TEST(DeviceMesh, OneDimensionalAxisIsTheWorld) { check_axes({4}, {"data"}); }
TEST(DeviceMesh, TwoByTwoAxes) { check_axes({2, 2}, {"data", "tensor"}); }
TEST(DeviceMesh, TwoByTwoByTwoAxes) { check_axes({2, 2, 2}, {"pipeline", "data", "tensor"}); }
TEST(DeviceMesh, AxisOfSizeOne) { check_axes({3, 1, 2}, {"data", "expert", "tensor"}); }

TEST(DeviceMesh, AccessorsOnEveryRank) {
  std::mutex mu;
  std::vector<std::string> failures;
  run(8, [&](Communicator& world) {
    DeviceMesh mesh(world, {2, 2, 2}, {"pipeline", "data", "tensor"});
    const int r = world.rank();
    auto check = [&](bool ok, const std::string& what) {
      if (ok) return;
      std::lock_guard l(mu);
      failures.push_back("rank " + std::to_string(r) + ": " + what);
    };
    check(mesh.ndim() == 3 && mesh.size() == 8 && mesh.rank() == r, "ndim/size/rank");
    check(mesh.shape() == Ints{2, 2, 2}, "shape");
    check(mesh.axis_names() == Names{"pipeline", "data", "tensor"}, "names");
    check(mesh.coords() == Ints{r / 4, (r / 2) % 2, r % 2}, "coords");
    check(mesh.coords_of(6) == Ints{1, 1, 0} && mesh.rank_of({1, 0, 1}) == 5, "coords_of/rank_of");
    check(mesh.axis_index("tensor") == 2 && mesh.axis_size("data") == 2, "axis_index/axis_size");
    check(mesh.axis_rank("pipeline") == r / 4 && mesh.axis_rank("tensor") == r % 2, "axis_rank");
    check(&mesh.world() == &world, "world");
    check(mesh.all_groups({"pipeline"}) == std::vector<Ints>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}, "all_groups");
    check(mesh.to_string() == mesh::render_mesh({2, 2, 2}, {"pipeline", "data", "tensor"}), "to_string");
    const std::string unknown = error_of([&] { mesh.axis_index("model"); });
    check(unknown.find("unknown axis 'model' in mesh (pipeline=2, data=2, tensor=2)") != std::string::npos &&
              unknown.find("valid axis names: pipeline, data, tensor") != std::string::npos,
          "unknown axis error: " + unknown);
    check(error_of([&] { mesh.comm("model"); }).find("unknown axis 'model'") != std::string::npos,
          "comm(model)");
    check(error_of([&] {
            mesh.group_ranks({"data", "data"});
          }).find("axis 'data' listed twice") != std::string::npos,
          "repeated axis");
  });
  EXPECT_THAT(failures, ::testing::IsEmpty());
}

TEST(DeviceMesh, MultiAxisCommunicators) {
  struct View {
    int size = -1, rank = -1;
    Ints members, group;
  };
  // Per rank: {data, tensor}, {tensor, data}, {pipeline, tensor}.
  std::vector<std::vector<View>> out(8, std::vector<View>(3));
  std::vector<int> cached(8, 0);
  run(8, [&](Communicator& world) {
    DeviceMesh mesh(world, {2, 2, 2}, {"pipeline", "data", "tensor"});
    const Names sets[3] = {{"data", "tensor"}, {"tensor", "data"}, {"pipeline", "tensor"}};
    const int me = world.rank();
    for (int i = 0; i < 3; ++i) {
      const Names& axes = sets[i];
      Communicator& c = mesh.comm(axes);
      View& v = out[me][i];
      v.size = c.size();
      v.rank = c.rank();
      v.members.resize(c.size());
      c.all_gather(&me, v.members.data(), 1, DType::i32);
      v.group = mesh.group_ranks(axes);
    }
    // Cached, and the trivial sets map to existing communicators without a split.
    // (Every rank makes every call: comm(Names{}) is a collective split.)
    Communicator* again = &mesh.comm({"data", "tensor"});
    Communicator* first = &mesh.comm(Names{"data", "tensor"});
    Communicator* one = &mesh.comm({"data"});
    Communicator* all = &mesh.comm({"pipeline", "data", "tensor"});
    const int alone = mesh.comm(Names{}).size();
    cached[me] = again == first && one == &mesh.comm("data") && all == &world && alone == 1;
  });
  for (int r = 0; r < 8; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int p = r / 4, d = (r / 2) % 2, t = r % 2;
    EXPECT_EQ(out[r][0].size, 4);
    EXPECT_EQ(out[r][0].rank, d * 2 + t);
    EXPECT_EQ(out[r][0].members, (Ints{4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3}));
    EXPECT_EQ(out[r][0].members, out[r][0].group);
    EXPECT_EQ(out[r][1].rank, t * 2 + d);
    EXPECT_EQ(out[r][1].members, (Ints{4 * p, 4 * p + 2, 4 * p + 1, 4 * p + 3}));
    EXPECT_EQ(out[r][1].members, out[r][1].group);
    EXPECT_EQ(out[r][2].rank, p * 2 + t);
    EXPECT_EQ(out[r][2].members, (Ints{2 * d, 2 * d + 1, 2 * d + 4, 2 * d + 5}));
    EXPECT_EQ(out[r][2].members, out[r][2].group);
    EXPECT_EQ(cached[r], 1);
  }
}

TEST(DeviceMesh, BadShapeThrowsTheSameErrorOnEveryRankBeforeCommunicating) {
  std::vector<std::string> errors(4);
  EXPECT_THROW(
      run(4,
          [&](Communicator& world) {
            errors[world.rank()] = error_of([&] { DeviceMesh mesh(world, {4, 2}, {"data", "tensor"}); });
            if (!errors[world.rank()].empty()) throw InvalidArgument("test", errors[world.rank()]);
          }),
      InvalidArgument);
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("mesh (data=4, tensor=2) has 8 ranks but the world has 4"));
    EXPECT_THAT(e, HasSubstr("e.g. (data=2, tensor=2)"));
    EXPECT_EQ(e, errors[0]);
  }
}

TEST(DeviceMesh, RanksThatPassDifferentMeshesAreNamed) {
  std::vector<std::string> errors(4);
  try {
    run(4, [&](Communicator& world) {
      const bool odd = world.rank() == 3;
      errors[world.rank()] = error_of([&] {
        DeviceMesh mesh(world, odd ? Ints{4, 1} : Ints{2, 2}, {"data", "tensor"});
      });
    });
  } catch (const std::exception& e) {
    FAIL() << e.what();
  }
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("DeviceMesh: rank 3 passed a different shape or axis names than rank 0"));
    EXPECT_THAT(e, HasSubstr("build the mesh from the same configuration on every rank"));
  }
  EXPECT_THAT(errors[3], HasSubstr("this rank, 3, has (data=4, tensor=1)"));
}

// issue 9: mesh --devices 16777216 printed 1.2 GB and 2147483647 ran out of
// memory; beyond kMaxRenderRanks the picture is left out.
TEST(RenderMesh, LargeMeshesStayBounded) {
  const std::string text = mesh::render_mesh({4096, 4096}, {"data", "tensor"});
  EXPECT_LT(text.size(), 1000u);
  EXPECT_THAT(text, HasSubstr("mesh (data=4096, tensor=4096): 16777216 ranks"));
  EXPECT_THAT(text, HasSubstr("data groups (vary data, fixed tensor): 4096 groups of 4096 ranks"));
  EXPECT_LT(mesh::render_mesh({1, 2147483647}, {"a", "b"}).size(), 1000u);
  EXPECT_THAT(mesh::render_mesh({64, 64}, {"data", "tensor"}), HasSubstr("[0 64 128"));  // 4096: still drawn
}

}  // namespace
}  // namespace meshtrain::testing
