#include "meshtrain/testing/redistribute.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "meshtrain/mesh/device_mesh.h"

namespace meshtrain::testing {

using comm::ReduceOp;
using sharding::Layout;
using sharding::PartitionSpec;
using sharding::ShardedTensor;
using I64 = std::vector<int64_t>;

std::string Case::describe(const Layout& la, const Layout& lb) const {
  return fmt::format("{} {} -> {} (distribute from {}: {})", dtype_name(dtype), la.to_string(), lb.to_string(), src,
                     use_distribute);
}

namespace {

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

double value_at(int64_t flat) { return static_cast<double>(flat % 97 + 1); }

// This rank's term of value v under the partial axes (mesh order): terms that
// reduce back to v exactly, whatever order the axes are reduced in.
double partial_term(double v, ReduceOp op, const std::vector<int>& coords, const std::vector<int>& sizes) {
  double shift = 0;
  bool origin = true;
  for (size_t k = 0; k < coords.size(); ++k) {
    const int x = coords[k], s = sizes[k];
    if (op == ReduceOp::max) shift -= x;
    else shift += x > 0 ? x : -(s * (s - 1) / 2.0);
    origin = origin && x == 0;
  }
  if (op == ReduceOp::sum) return (origin ? v : 0.0) + shift;
  return v + shift;  // avg: the shifts average to 0; max: v at the origin, less elsewhere
}

Tensor make_global(const Case& k) {
  int64_t n = 1;
  for (int64_t s : k.shape) n *= s;
  std::vector<double> vals(n);
  for (int64_t i = 0; i < n; ++i) vals[i] = value_at(i);
  return Tensor::from_vector(vals, k.shape, k.dtype);
}

// Rank `rank`'s block of layout l, with partial terms.
Tensor make_local(const Case& k, const Layout& l, int rank) {
  const sharding::Box box = l.local_box(rank);
  const std::vector<int> coords = mesh::unravel(rank, l.mesh_shape());
  std::vector<int> pc, ps;
  ReduceOp op = ReduceOp::sum;
  for (size_t i = 0; i < l.axis_names().size(); ++i) {
    const auto it = l.partial().find(l.axis_names()[i]);
    if (it == l.partial().end()) continue;
    pc.push_back(coords[i]);
    ps.push_back(l.mesh_shape()[i]);
    op = it->second;
  }
  const I64 gstride = contiguous_strides(k.shape);
  const I64 lstride = contiguous_strides(box.sizes);
  const int64_t n = box.numel();
  std::vector<double> vals(n);
  for (int64_t j = 0; j < n; ++j) {
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

}  // namespace

std::vector<Case> generate_cases(std::mt19937_64& rng, const std::vector<std::string>& names, int ranks, int count) {
  const DType dtypes[] = {DType::f32, DType::i32, DType::bf16, DType::f64, DType::i8, DType::i64, DType::u8, DType::f16};
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
      for (const auto& a : names) {
        if (k.b.dim_of(a) >= 0) continue;
        if (k.pa.count(a) && rng() % 2 == 0) k.pb[a] = op;
        else if (rng() % 3 == 0) k.pb[a] = op;
      }
    k.use_distribute = k.pa.empty() && rng() % 2 == 0;
    k.src = static_cast<int>(rng() % ranks);
    k.dst = static_cast<int>(rng() % ranks);
    out.push_back(std::move(k));
  }
  return out;
}

std::vector<MeshCase> generate(uint64_t seed, int meshes, int cases_per_mesh, int max_ranks) {
  std::mt19937_64 rng(seed);
  const std::vector<std::string> all_names = {"x", "y", "z"};
  std::vector<MeshCase> out;
  while (static_cast<int>(out.size()) < meshes) {
    MeshCase m;
    const int nd = 1 + static_cast<int>(rng() % 3);
    int total = 1;
    for (int i = 0; i < nd; ++i) {
      m.shape.push_back(1 + static_cast<int>(rng() % 4));
      m.names.push_back(all_names[i]);
      total *= m.shape.back();
    }
    if (total > max_ranks) continue;
    m.cases = generate_cases(rng, m.names, total, cases_per_mesh);
    out.push_back(std::move(m));
  }
  return out;
}

void Tally::fail(std::string what) {
  std::lock_guard lock(mu);
  if (failures.size() < 20) failures.push_back(std::move(what));
}

void check_world(comm::Communicator& world, const MeshCase& m, Tally& tally) {
  mesh::DeviceMesh mesh(world, m.shape, m.names);
  const int me = mesh.rank();
  for (const Case& k : m.cases) {
    const Layout la(mesh, k.a, k.shape, {.partial = k.pa, .strict = false});
    const Layout lb(mesh, k.b, k.shape, {.partial = k.pb, .strict = false});
    const Tensor global = make_global(k);
    const Tensor want_b = global.contiguous();
    ShardedTensor a = k.use_distribute ? sharding::distribute(me == k.src ? global : Tensor(), la, k.src)
                                       : ShardedTensor(make_local(k, la, me), la);
    if (k.pa.empty() && !same_bytes(a.local(), make_local(k, la, me)))
      tally.fail(fmt::format("rank {}: distribute wrong for {}", me, k.describe(la, lb)));
    const ShardedTensor b = sharding::redistribute(a, lb);
    const std::string where = fmt::format("rank {} of mesh {}: {}", me, mesh::format_mesh(m.shape, m.names),
                                          k.describe(la, lb));
    if (k.pb.empty() && !same_bytes(b.local(), make_local(k, lb, me))) {
      std::string plan;
      for (const auto& s : sharding::plan_redistribute(la, lb)) plan += "\n  " + s.to_string();
      tally.fail(fmt::format("{}: block {} differs after{}\n got {}", where, lb.local_box(me).to_string(), plan,
                             b.local().to_string()));
    }
    if (!same_bytes(sharding::gather(b), global)) tally.fail(where + ": gather to all differs");
    const Tensor at_dst = sharding::gather(b, k.dst);
    if (me == k.dst ? !same_bytes(at_dst, global) : at_dst.defined())
      tally.fail(fmt::format("{}: gather to rank {} wrong", where, k.dst));
    if (me == 0) {
      std::lock_guard lock(tally.mu);
      ++tally.cases;
      for (const auto& s : sharding::plan_redistribute(la, lb)) {
        ++tally.steps[std::string(sharding::step_kind_name(s.kind))];
        tally.fallbacks += s.fallback;
      }
    }
  }
}

}  // namespace meshtrain::testing
