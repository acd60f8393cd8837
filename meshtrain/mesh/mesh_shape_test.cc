// The mesh vocabulary: balanced factorizations (checked against brute
// force), the --mesh syntax, and validation messages.
#include "meshtrain/mesh/mesh_shape.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <numeric>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::mesh {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Ints = std::vector<int>;

using meshtrain::testing::error_of;

int64_t product(const Ints& v) { return std::accumulate(v.begin(), v.end(), int64_t{1}, std::multiplies<>()); }

// Every ascending factorization of n into k factors.
void all_factorizations(int n, int k, int min_factor, Ints& cur, std::vector<Ints>& out) {
  if (k == 1) {
    if (n >= min_factor) {
      cur.push_back(n);
      out.push_back(cur);
      cur.pop_back();
    }
    return;
  }
  for (int f = min_factor; f <= n; ++f)
    if (n % f == 0) {
      cur.push_back(f);
      all_factorizations(n / f, k - 1, f, cur, out);
      cur.pop_back();
    }
}

TEST(MeshAxes, TheRolesAndTheirOrder) {
  EXPECT_EQ(known_axes_list(), "pipeline, data, node, fsdp, expert, context, tensor");
  for (std::string_view a : kKnownAxes) EXPECT_TRUE(is_known_axis(a)) << a;
  EXPECT_FALSE(is_known_axis("tensr"));
  EXPECT_FALSE(is_known_axis(""));
  const NamedShape m{{2, 3}, {"data", "tensor"}};
  EXPECT_TRUE(m.has(kTensor));
  EXPECT_FALSE(m.has(kFsdp));
  EXPECT_EQ(m.size_of(kTensor), 3);
  EXPECT_EQ(m.size_of(kFsdp), 1);
  EXPECT_THAT(divisors(12), ElementsAre(1, 2, 3, 4, 6, 12));
  EXPECT_THAT(divisors(1), ElementsAre(1));
}

// ---- get_optimal_mesh_shape --------------------------------------------------

TEST(OptimalMeshShape, IsBalancedWhereTheReferenceWasNot) {
  EXPECT_EQ(get_optimal_mesh_shape(16, 2), (Ints{4, 4}));  // reference: (2, 8)
  EXPECT_EQ(get_optimal_mesh_shape(36, 2), (Ints{6, 6}));  // reference: (4, 9)
  EXPECT_EQ(get_optimal_mesh_shape(12, 2), (Ints{3, 4}));
  EXPECT_EQ(get_optimal_mesh_shape(64, 2), (Ints{8, 8}));
  EXPECT_EQ(get_optimal_mesh_shape(128, 2), (Ints{8, 16}));
  EXPECT_EQ(get_optimal_mesh_shape(8, 3), (Ints{2, 2, 2}));
  EXPECT_EQ(get_optimal_mesh_shape(16, 3), (Ints{2, 2, 4}));
  EXPECT_EQ(get_optimal_mesh_shape(128, 3), (Ints{4, 4, 8}));
  // 4+ axes: the reference put everything on the first axis.
  EXPECT_EQ(get_optimal_mesh_shape(16, 4), (Ints{2, 2, 2, 2}));
  EXPECT_EQ(get_optimal_mesh_shape(32, 4), (Ints{2, 2, 2, 4}));
  EXPECT_EQ(get_optimal_mesh_shape(64, 6), (Ints{2, 2, 2, 2, 2, 2}));
  EXPECT_EQ(get_optimal_mesh_shape(7, 3), (Ints{1, 1, 7}));
  EXPECT_EQ(get_optimal_mesh_shape(1, 3), (Ints{1, 1, 1}));
  EXPECT_EQ(get_optimal_mesh_shape(9, 1), (Ints{9}));
  EXPECT_EQ(get_optimal_mesh_shape(2147483647, 2), (Ints{1, 2147483647}));  // prime
  EXPECT_EQ(get_optimal_mesh_shape(1 << 30, 3), (Ints{1024, 1024, 1024}));
}

TEST(OptimalMeshShape, MatchesBruteForceForEveryNUpTo128) {
  for (int dims = 1; dims <= 4; ++dims)
    for (int n = 1; n <= 128; ++n) {
      const Ints got = get_optimal_mesh_shape(n, dims);
      ASSERT_EQ(static_cast<int>(got.size()), dims);
      EXPECT_EQ(product(got), n) << "n=" << n << " dims=" << dims;
      EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
      std::vector<Ints> all;
      Ints cur;
      all_factorizations(n, dims, 1, cur, all);
      // The definition: lexicographically smallest when read largest first.
      Ints best = *std::min_element(all.begin(), all.end(), [](const Ints& a, const Ints& b) {
        return std::lexicographical_compare(a.rbegin(), a.rend(), b.rbegin(), b.rend());
      });
      EXPECT_EQ(got, best) << "n=" << n << " dims=" << dims;
    }
}

TEST(OptimalMeshShape, RejectsBadArguments) {
  EXPECT_THAT(error_of([] { get_optimal_mesh_shape(0, 2); }), HasSubstr("device count 0 < 1"));
  EXPECT_THAT(error_of([] { get_optimal_mesh_shape(-3, 2); }), HasSubstr("device count -3 < 1"));
  EXPECT_THAT(error_of([] { get_optimal_mesh_shape(8, 0); }), HasSubstr("dims 0 < 1"));
}

// ---- size strings ------------------------------------------------------------

TEST(ValidateMeshConfig, RejectsIdleDevicesAndZeroSizes) {
  EXPECT_NO_THROW(validate_mesh_config({2, 4}, 8));
  EXPECT_NO_THROW(validate_mesh_config({1}, 1));
  // The reference accepted under-use.
  std::string e = error_of([] { validate_mesh_config({2, 2}, 5); });
  EXPECT_THAT(e, HasSubstr("shape (2, 2) uses 4 of 5 devices, leaving 1 idle"));
  EXPECT_THAT(e, HasSubstr("product is exactly 5, e.g. (1, 5)"));
  e = error_of([] { validate_mesh_config({6, 5}, 32); });
  EXPECT_THAT(e, HasSubstr("uses 30 of 32 devices, leaving 2 idle"));
  EXPECT_THAT(e, HasSubstr("e.g. (4, 8)"));
  EXPECT_THAT(error_of([] { validate_mesh_config({4, 4}, 8); }), HasSubstr("needs 16 devices but there are 8"));
  EXPECT_THAT(error_of([] { validate_mesh_config({0, 4}, 4); }), HasSubstr("axis 0 of shape (0, 4) has size 0"));
  EXPECT_THAT(error_of([] { validate_mesh_config({0, 4}, 4); }), HasSubstr("use 1 for an unused axis"));
  EXPECT_THAT(error_of([] { validate_mesh_config(Ints{}, 4); }), HasSubstr("has no axes"));
  EXPECT_THAT(error_of([] { validate_mesh_config({1}, 0); }), HasSubstr("device count 0 < 1"));
  EXPECT_THAT(error_of([] { validate_mesh_config({65536, 65536}, 8); }), HasSubstr("needs 4294967296 devices"));
}

TEST(ValidateMeshConfig, ChecksNames) {
  EXPECT_NO_THROW(validate_mesh_config(NamedShape{{2, 2}, {"data", "tensor"}}, 4));
  EXPECT_THAT(error_of([] { validate_mesh_config(NamedShape{{2, 2}, {"data"}}, 4); }),
              HasSubstr("the mesh has 2 sizes (2, 2) but 1 axis names"));
  EXPECT_THAT(error_of([] { validate_mesh_config(NamedShape{{2, 2}, {"data", "tensr"}}, 4); }),
              HasSubstr("mesh axis 'tensr' is not one of pipeline, data, node, fsdp, expert, context, tensor"));
  EXPECT_THAT(error_of([] { validate_mesh_config(NamedShape{{2, 2}, {"data", "data"}}, 4); }),
              HasSubstr("mesh axis 'data' appears twice"));
  const std::string e = error_of([] { validate_mesh_config(NamedShape{{2, 2}, {"data", "tensor"}}, 8, "Cfg"); });
  EXPECT_THAT(e, HasSubstr("Cfg: mesh data=2,tensor=2: shape (2, 2) uses 4 of 8 devices, leaving 4 idle"));
  EXPECT_THAT(e, HasSubstr("e.g. (2, 4)"));
}

TEST(ParseMeshSpec, ParsesAndRejects) {
  EXPECT_EQ(parse_mesh_spec("data=2,tensor=2"), (NamedShape{{2, 2}, {"data", "tensor"}}));
  EXPECT_EQ(parse_mesh_spec(" pipeline = 2 , data=4 "), (NamedShape{{2, 4}, {"pipeline", "data"}}));
  EXPECT_EQ(parse_mesh_spec("data=2,tensor=2").to_spec(), "data=2,tensor=2");
  EXPECT_THAT(error_of([] { parse_mesh_spec(""); }), HasSubstr("empty mesh"));
  EXPECT_THAT(error_of([] { parse_mesh_spec("data"); }), HasSubstr("'data' in mesh 'data' has no '='"));
  EXPECT_THAT(error_of([] { parse_mesh_spec("data=2,"); }), HasSubstr("'' in mesh 'data=2,' has no '='"));
  EXPECT_THAT(error_of([] { parse_mesh_spec("=2"); }), HasSubstr("has no axis name"));
  EXPECT_THAT(error_of([] { parse_mesh_spec("data=0"); }), HasSubstr("axis 'data' in mesh 'data=0' has size '0'"));
  EXPECT_THAT(error_of([] { parse_mesh_spec("data=x"); }), HasSubstr("has size 'x'"));
  EXPECT_THAT(error_of([] { parse_mesh_spec("data=2x"); }), HasSubstr("has size '2x'"));
}

}  // namespace
}  // namespace meshtrain::mesh

namespace meshtrain::mesh {
namespace {

TEST(ResizeDataAxis, TheDataAxisTakesWhatTheFixedAxesLeave) {
  const auto spec = [](const std::optional<NamedShape>& m) { return m ? m->to_spec() : std::string("none"); };
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("data=4,tensor=2"), 4)), "data=2,tensor=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("data=2,tensor=2"), 2)), "data=1,tensor=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("data=4"), 6)), "data=6");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("tensor=2"), 8)), "data=4,tensor=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("pipeline=2,fsdp=2"), 8)), "pipeline=2,data=2,fsdp=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("tensor=2"), 2)), "tensor=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("data=2,tensor=4"), 2)), "none");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("fsdp=2,pipeline=2"), 6)), "data=3,fsdp=1,pipeline=2");
  // The fsdp size when the data axis alone cannot take the change.
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("fsdp=4"), 2)), "fsdp=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("fsdp=4"), 6)), "data=3,fsdp=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("data=2,fsdp=4,tensor=2"), 4)), "data=1,fsdp=2,tensor=2");
  EXPECT_EQ(spec(resize_data_axis(parse_mesh_spec("fsdp=4,tensor=2"), 3)), "none");
  EXPECT_THROW(resize_data_axis(parse_mesh_spec("data=2"), 0), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::mesh
