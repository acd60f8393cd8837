// Redistribution under mpirun: `mpirun -np 4 redistribute_mpi_test`.
// A fixed, seeded subset of the property test (meshes (4), (2, 2), (2, 1, 2)
// and (1, 4); 1 to 3-D shapes of sizes 0..9; random specs with multi-axis
// dims; Partial sources of sum, avg and max) runs on the mpi engine: every
// rank redistributes A -> B and compares its block with the slice of the
// global tensor, then gathers to all ranks and to one. Exit code 0 only if
// every rank passed every case.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <cstring>
#include <random>

#include "meshtrain/comm/launch.h"
#include "meshtrain/sharding/sharded_tensor.h"

namespace {

using namespace meshtrain;
using comm::ReduceOp;
using sharding::Layout;
using sharding::PartialAxes;
using sharding::PartitionSpec;
using sharding::ShardedTensor;
using I64 = std::vector<int64_t>;

struct Case {
  I64 shape;
  DType dtype = DType::f32;
  PartitionSpec a, b;
  PartialAxes pa, pb;
  bool use_distribute = false;
  int src = 0, dst = 0;
};

bool reducible(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::i32 || t == DType::i64; }

PartitionSpec random_spec(std::mt19937_64& rng, const std::vector<std::string>& names, int ndim) {
  std::vector<std::vector<std::string>> dims(ndim);
  for (const auto& a : names) {
    const int d = static_cast<int>(rng() % (ndim + 1));
    if (d < ndim) dims[d].push_back(a);
  }
  for (auto& list : dims) std::shuffle(list.begin(), list.end(), rng);
  return PartitionSpec(std::move(dims));
}

std::vector<Case> generate(std::mt19937_64& rng, const std::vector<std::string>& names, int ranks, int count) {
  const DType dtypes[] = {DType::f32, DType::i32, DType::bf16, DType::f64, DType::i8, DType::u8};
  const ReduceOp ops[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max};
  std::vector<Case> out;
  for (int c = 0; c < count; ++c) {
    Case k;
    const int ndim = 1 + static_cast<int>(rng() % 3);
    for (int d = 0; d < ndim; ++d) k.shape.push_back(rng() % 25 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 9));
    k.dtype = dtypes[rng() % std::size(dtypes)];
    k.a = random_spec(rng, names, ndim);
    k.b = random_spec(rng, names, ndim);
    const ReduceOp op = ops[rng() % std::size(ops)];
    if (reducible(k.dtype) && rng() % 2 == 0)
      for (const auto& a : names)
        if (k.a.dim_of(a) < 0 && rng() % 2 == 0) k.pa[a] = op;
    if (reducible(k.dtype) && rng() % 3 == 0)
      for (const auto& a : names)
        if (k.b.dim_of(a) < 0 && rng() % 3 == 0) k.pb[a] = op;
    k.use_distribute = k.pa.empty() && rng() % 2 == 0;
    k.src = static_cast<int>(rng() % ranks);
    k.dst = static_cast<int>(rng() % ranks);
    out.push_back(std::move(k));
  }
  return out;
}

double value_at(int64_t flat) { return static_cast<double>(flat % 97 + 1); }

// Terms that reduce back to v exactly over the partial axes, in any order.
double partial_term(double v, ReduceOp op, const std::vector<int>& coords, const std::vector<int>& sizes) {
  double shift = 0;
  bool origin = true;
  for (size_t i = 0; i < coords.size(); ++i) {
    shift += op == ReduceOp::max ? -coords[i] : (coords[i] > 0 ? coords[i] : -(sizes[i] * (sizes[i] - 1) / 2.0));
    origin = origin && coords[i] == 0;
  }
  return op == ReduceOp::sum ? (origin ? v : 0.0) + shift : v + shift;
}

// Rank `rank`'s block of l: value_at of each global index, or its partial
// term when with_partial and l has partial axes.
Tensor make_block(const Case& k, const Layout& l, int rank, bool with_partial) {
  const sharding::Box box = l.local_box(rank);
  const std::vector<int> coords = mesh::unravel(rank, l.mesh_shape());
  std::vector<int> pc, ps;
  ReduceOp op = ReduceOp::sum;
  for (size_t i = 0; with_partial && i < l.axis_names().size(); ++i) {
    const auto it = l.partial().find(l.axis_names()[i]);
    if (it == l.partial().end()) continue;
    pc.push_back(coords[i]);
    ps.push_back(l.mesh_shape()[i]);
    op = it->second;
  }
  const I64 gstride = contiguous_strides(k.shape), lstride = contiguous_strides(box.sizes);
  std::vector<double> vals(box.numel());
  for (int64_t j = 0; j < box.numel(); ++j) {
    int64_t flat = 0;
    for (size_t d = 0; d < box.sizes.size(); ++d) flat += (box.offsets[d] + (j / lstride[d]) % box.sizes[d]) * gstride[d];
    vals[j] = pc.empty() ? value_at(flat) : partial_term(value_at(flat), op, pc, ps);
  }
  return Tensor::from_vector(vals, box.sizes, k.dtype);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return a.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), a.nbytes()) == 0;
}

// Runs the cases on one mesh; returns the number of failed checks on this rank.
int run_mesh(comm::Communicator& world, const std::vector<int>& shape, const std::vector<std::string>& names,
             const std::vector<Case>& cases) {
  mesh::DeviceMesh mesh(world, shape, names);
  const int me = mesh.rank();
  int failed = 0;
  for (const Case& k : cases) {
    const Layout la(mesh, k.a, k.shape, {.partial = k.pa, .strict = false});
    const Layout lb(mesh, k.b, k.shape, {.partial = k.pb, .strict = false});
    const Tensor global = make_block(k, la.with_spec(PartitionSpec::replicated(la.ndim())), me, false);
    const ShardedTensor a = k.use_distribute ? sharding::distribute(me == k.src ? global : Tensor(), la, k.src)
                                             : ShardedTensor(make_block(k, la, me, true), la);
    const ShardedTensor b = sharding::redistribute(a, lb);
    std::vector<std::string> bad;
    if (k.pb.empty() && !same_bytes(b.local(), make_block(k, lb, me, false))) bad.push_back("block");
    if (!same_bytes(sharding::gather(b), global)) bad.push_back("gather to all");
    const Tensor at_dst = sharding::gather(b, k.dst);
    if (me == k.dst ? !same_bytes(at_dst, global) : at_dst.defined()) bad.push_back("gather to one");
    if (!bad.empty()) {
      ++failed;
      fmt::print(stderr, "FAIL rank {} mesh {}: {} {} -> {}: {}\n", me, mesh::format_mesh(shape, names),
                 dtype_name(k.dtype), la.to_string(), lb.to_string(), fmt::join(bad, ", "));
    }
  }
  return failed;
}

}  // namespace

int main() {
  int status = 0;
  comm::launch({.engine = comm::Engine::mpi, .ranks = 0, .timeout = std::chrono::seconds(120)},
               [&](comm::Communicator& world) {
                 try {
                   if (world.size() != 4) {
                     if (world.rank() == 0) fmt::print(stderr, "run with mpirun -np 4 (got {})\n", world.size());
                     status = 1;
                     return;
                   }
                   std::mt19937_64 rng(20240611);
                   const std::vector<std::pair<std::vector<int>, std::vector<std::string>>> meshes = {
                       {{4}, {"x"}}, {{2, 2}, {"x", "y"}}, {{2, 1, 2}, {"x", "y", "z"}}, {{1, 4}, {"x", "y"}}};
                   int failed = 0, total = 0;
                   for (const auto& [shape, names] : meshes) {
                     const std::vector<Case> cases = generate(rng, names, 4, 40);
                     failed += run_mesh(world, shape, names, cases);
                     total += static_cast<int>(cases.size());
                   }
                   int32_t ok = failed == 0 ? 1 : 0;
                   world.all_reduce(&ok, &ok, 1, DType::i32, comm::ReduceOp::min);
                   if (world.rank() == 0)
                     fmt::print("mpi redistribute: {} ranks, {} case pairs on {} meshes, {}\n", world.size(), total,
                                meshes.size(), ok ? "PASS" : "FAIL");
                   status = ok ? 0 : 1;
                 } catch (const std::exception& e) {
                   fmt::print(stderr, "FAIL: {}\n", e.what());
                   status = 1;
                 }
               });
  return status;
}
