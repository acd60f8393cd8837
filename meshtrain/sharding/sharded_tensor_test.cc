// ShardedTensor tests on the threads engine: distribute from one rank or from
// replicated copies, gather to one rank or all, the partial rule, the values
// each collective produces, every dtype, error messages on every rank, and
// layout-invariant initialization (bit for bit against the unsharded fill).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <mutex>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"
#include "meshtrain/sharding/sharded_tensor.h"
#include "meshtrain/testing/mesh.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::testing {
namespace {

using comm::Communicator;
using comm::ReduceOp;
using mesh::DeviceMesh;
using sharding::Layout;
using sharding::PartitionSpec;
using sharding::ShardedTensor;
using ::testing::HasSubstr;
using I64 = std::vector<int64_t>;


Tensor iota(const I64& shape, DType dtype = DType::f32) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(i % 101);
  return Tensor::from_vector(v, shape, dtype);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return a.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), a.nbytes()) == 0;
}

using testing::Failures;

TEST(ShardedTensor, DistributeFromOneRankAndGatherToOneOrAll) {
  const Tensor global = iota({5, 7});
  Failures f;
  on_mesh({2, 2}, {"data", "tensor"}, [&](DeviceMesh& mesh) {
    const int me = mesh.rank();
    const Layout l(mesh, PartitionSpec::parse("data,tensor"), {5, 7});
    const ShardedTensor t = sharding::distribute(me == 3 ? global : Tensor(), l, /*src_rank=*/3);
    // Rank 3 = (data 1, tensor 1): rows 3..4, columns 4..6; its first value is 3 * 7 + 4.
    if (me == 3 && (t.local().shape() != I64{2, 3} || t.local().item({0, 0}) != 25.0))
      f.add("rank 3 block: " + t.to_string());
    if (!same_bytes(t.local(), global.narrow(0, l.local_offsets(me)[0], l.local_shape(me)[0])
                                   .narrow(1, l.local_offsets(me)[1], l.local_shape(me)[1])))
      f.add(fmt::format("rank {} block differs", me));
    const Tensor at1 = sharding::gather(t, 1);
    if (me == 1 ? !same_bytes(at1, global) : at1.defined()) f.add(fmt::format("gather to 1 on rank {}", me));
    if (!same_bytes(sharding::gather(t), global)) f.add(fmt::format("gather to all on rank {}", me));
  });
  f.report();
}

TEST(ShardedTensor, PartialRuleKeepsSumOnCoordinateZeroAndMaxEverywhere) {
  const Tensor global = iota({4, 2});
  Failures f;
  on_mesh({2, 2}, {"data", "tensor"}, [&](DeviceMesh& mesh) {
    const int me = mesh.rank();
    const Layout psum(mesh, PartitionSpec::parse("data,None"), {4, 2}, {.partial = {{"tensor", ReduceOp::sum}}});
    const ShardedTensor s = sharding::distribute_replicated(global, psum);
    const double first = s.local().item({0, 0});
    const double want = mesh.axis_rank("tensor") == 0 ? 2.0 * mesh.axis_rank("data") * 2 : 0.0;
    if (first != want) f.add(fmt::format("rank {}: sum-partial block starts with {}, want {}", me, first, want));
    if (!same_bytes(sharding::gather(s), global)) f.add(fmt::format("rank {}: sum gather", me));
    const Layout pmax(mesh, PartitionSpec::replicated(2), {4, 2}, {.partial = {{"data", ReduceOp::max}}});
    const ShardedTensor m = sharding::distribute(me == 0 ? global : Tensor(), pmax, 0);
    if (!same_bytes(m.local(), global)) f.add(fmt::format("rank {}: max-partial block", me));
    const Tensor at2 = sharding::gather(m, 2);
    if (me == 2 ? !same_bytes(at2, global) : at2.defined()) f.add(fmt::format("rank {}: max gather to 2", me));
  });
  f.report();
}

TEST(ShardedTensor, PartialSumReduceScattersAndAllReducesTheValues) {
  Failures f;
  on_mesh({2, 2}, {"data", "tensor"}, [&](DeviceMesh& mesh) {
    const int me = mesh.rank();
    // Every rank holds (rank + 1) * [0, 1, ..., 7] as its term; the value is 10 * [0..7]
    // over the whole world, i.e. (2 ranks' terms) summed over tensor alone.
    const Layout partial(mesh, PartitionSpec::replicated(1), {8},
                         {.partial = {{"data", ReduceOp::sum}, {"tensor", ReduceOp::sum}}});
    std::vector<float> v(8);
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>((me + 1) * i);
    const ShardedTensor t(Tensor::from_vector(v, {8}), partial);
    const ShardedTensor s = sharding::redistribute(t, PartitionSpec::parse("(data,tensor)"));
    // Rank r gets elements [2r, 2r + 2) of 10 * i.
    const std::vector<double> want = {20.0 * me, 20.0 * me + 10};
    if (s.local().to_vector() != want) f.add(fmt::format("rank {}: {}", me, s.local().to_string()));
    const auto steps = sharding::plan_redistribute(partial, s.layout());
    if (steps.size() != 2 || steps[0].kind != sharding::StepKind::reduce_scatter ||
        steps[1].kind != sharding::StepKind::reduce_scatter)
      f.add("expected two reduce_scatters");
    const ShardedTensor r = sharding::redistribute(t, PartitionSpec::replicated(1));
    if (r.local().item({7}) != 70.0) f.add(fmt::format("rank {}: all_reduce gave {}", me, r.local().to_string()));
    // sum over data, avg over tensor: the terms (rank + 1) * i average to ...
    const Layout mixed(mesh, PartitionSpec::replicated(1), {8},
                       {.partial = {{"data", ReduceOp::sum}, {"tensor", ReduceOp::avg}}});
    const Tensor g = sharding::gather(ShardedTensor(Tensor::from_vector(v, {8}), mixed));
    // avg over tensor of (r+1)*i: data 0 -> 1.5 i, data 1 -> 3.5 i; summed: 5 i.
    if (g.item({2}) != 10.0) f.add(fmt::format("rank {}: mixed sum/avg gather {}", me, g.to_string()));
  });
  f.report();
}

TEST(ShardedTensor, EveryDtypeMovesExactly) {
  Failures f;
  on_mesh({2, 2}, {"data", "tensor"}, [&](DeviceMesh& mesh) {
    for (DType dt : kAllDTypes) {
      const Tensor global = iota({3, 5}, dt);
      const Layout a(mesh, PartitionSpec::parse("data,tensor"), {3, 5});
      const Layout b(mesh, PartitionSpec::parse("(tensor,data),None"), {3, 5});
      const ShardedTensor t = sharding::distribute_replicated(global, a);
      const ShardedTensor u = sharding::redistribute(t, b);
      if (!same_bytes(sharding::gather(u), global)) f.add(fmt::format("{} on rank {}", dtype_name(dt), mesh.rank()));
      if (u.dtype() != dt) f.add("dtype changed");
    }
  });
  f.report();
}

TEST(ShardedTensor, MultiAxisFallbacksCreateTheirCommunicatorOnceAndAgree) {
  Failures f;
  const Tensor global = iota({7, 6});
  on_mesh({2, 2, 2}, {"a", "b", "c"}, [&](DeviceMesh& mesh) {
    const Layout from(mesh, PartitionSpec::parse("(a,c),b"), {7, 6});
    const Layout to(mesh, PartitionSpec::parse("(c,a),None"), {7, 6});
    for (int round = 0; round < 2; ++round) {
      const ShardedTensor t = sharding::distribute_replicated(global, from);
      const ShardedTensor u = sharding::redistribute(t, to);
      const sharding::Box box = to.local_box(mesh.rank());
      const Tensor want = global.narrow(0, box.offsets[0], box.sizes[0]);
      if (!same_bytes(u.local(), want)) f.add(fmt::format("round {} rank {}: {}", round, mesh.rank(), u.to_string()));
    }
  });
  f.report();
}

TEST(ShardedTensor, RedistributeWithoutMovesSharesStorage) {
  on_mesh({2}, {"data"}, [&](DeviceMesh& mesh) {
    const Layout l(mesh, PartitionSpec::parse("data"), {4});
    const ShardedTensor t = ShardedTensor::zeros(l, DType::f32);
    EXPECT_EQ(sharding::redistribute(t, l).local().storage(), t.local().storage());
  });
}

TEST(ShardedTensor, FromPlacementsBuildsTheSpecAndPartialAxes) {
  on_mesh({2, 2}, {"data", "tensor"}, [&](DeviceMesh& mesh) {
    using sharding::AxisPlacement;
    const Layout l =
        Layout::from_placements(mesh, {AxisPlacement::Shard(1), AxisPlacement::Partial(ReduceOp::avg)}, {4, 6});
    EXPECT_EQ(l.spec(), PartitionSpec::parse("None,data"));
    EXPECT_EQ(l.partial(), (sharding::PartialAxes{{"tensor", ReduceOp::avg}}));
    EXPECT_EQ(l.placements(),
              (std::vector<AxisPlacement>{AxisPlacement::Shard(1), AxisPlacement::Partial(ReduceOp::avg)}));
  });
}

// ---- errors -------------------------------------------------------------------------

TEST(ShardedTensor, DistributeOfAWrongShapeFailsOnEveryRank) {
  Failures f;
  on_mesh({2, 2}, {"data", "tensor"}, [&](DeviceMesh& mesh) {
    const Layout l(mesh, PartitionSpec::parse("data,tensor"), {4, 4});
    try {
      (void)sharding::distribute(mesh.rank() == 2 ? iota({4, 5}) : Tensor(), l, 2);
      f.add(fmt::format("rank {} did not throw", mesh.rank()));
    } catch (const InvalidArgument& e) {
      const std::string want = mesh.rank() == 2 ? "the global tensor has shape [4, 5] but Layout(P(data, tensor), "
                                                  "shape [4, 4], mesh (data=2, tensor=2)) has global shape [4, 4]"
                                                : "rank 2's global tensor does not match Layout(P(data, tensor)";
      if (std::string(e.what()).find(want) == std::string::npos) f.add(e.what());
    }
  });
  f.report();
}

TEST(ShardedTensor, ConstructorAndRedistributeCheckTheirArguments) {
  on_mesh({2}, {"data"}, [&](DeviceMesh& mesh) {
    const Layout l(mesh, PartitionSpec::parse("data"), {5});
    try {
      ShardedTensor(Tensor::zeros({2}, DType::f32), l);
      if (mesh.rank() == 0) ADD_FAILURE() << "rank 0 holds 3 elements, not 2";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("rank 0 holds a local tensor of shape [2] but Layout(P(data), shape [5], "
                                      "mesh (data=2), uneven) gives it [3]"));
    }
    const Layout pure({2}, {"data"}, PartitionSpec::parse("data"), {5});
    try {
      ShardedTensor::zeros(pure, DType::f32);
      ADD_FAILURE() << "pure layouts hold no data";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("is a pure layout (no DeviceMesh)"));
    }
    ShardedTensor t = ShardedTensor::zeros(l, DType::i32);
    try {
      sharding::fill_normal(t, 1, "w", 0.0, 1.0);
      ADD_FAILURE() << "integer fill";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("dtype i32 is not floating"));
    }
    try {
      sharding::redistribute(t, Layout(pure.mesh_shape(), pure.axis_names(), PartitionSpec::parse("None"), {6}));
      ADD_FAILURE() << "shape change";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("global shapes differ: [5] and [6]"));
    }
  });
}

// ---- layout-invariant initialization ------------------------------------------------

TEST(ShardedTensor, FillsMatchTheUnshardedFillBitForBitInEveryLayout) {
  struct Spec {
    const char* spec;
    I64 shape;
    sharding::PartialAxes partial;
  };
  const std::vector<Spec> specs = {
      {"a,b", {8, 6}, {}},         {"(a,b),None", {7, 5}, {}},        {"None,(c,a)", {3, 9}, {}},
      {"(b,c,a)", {13}, {}},       {"c,None,(a,b)", {3, 4, 5}, {}},   {"None,b", {2, 3}, {{"a", ReduceOp::sum}}},
      {"(a,b,c)", {5}, {}},        {"None,None", {6, 6}, {{"c", ReduceOp::max}}}, {"", {}, {}},
  };
  const uint64_t seed = 1234;
  Failures f;
  on_mesh({2, 2, 2}, {"a", "b", "c"}, [&](DeviceMesh& mesh) {
    for (const Spec& s : specs) {
      for (DType dt : {DType::f32, DType::bf16, DType::f64, DType::f16}) {
        for (int kind = 0; kind < 2; ++kind) {
          const std::string name = fmt::format("layers.{}.w", s.spec);
          const Layout l(mesh, PartitionSpec::parse(s.spec), s.shape, {.partial = s.partial, .strict = false});
          ShardedTensor t = ShardedTensor::empty(l, dt);
          const Tensor full = Tensor::empty(s.shape, dt);
          if (kind == 0) {
            sharding::fill_normal(t, seed, name, 0.5, 0.02);
            meshtrain::fill_normal(full, seed, key_from_name(name), 0.5, 0.02);
          } else {
            sharding::fill_uniform(t, seed, name, -1.0, 1.0);
            meshtrain::fill_uniform(full, seed, key_from_name(name), -1.0, 1.0);
          }
          if (!same_bytes(sharding::gather(t), full))
            f.add(fmt::format("{} {} {} on rank {}", kind ? "uniform" : "normal", dtype_name(dt), l.to_string(),
                              mesh.rank()));
        }
      }
    }
  });
  f.report();
}

}  // namespace
}  // namespace meshtrain::testing
