#include "meshtrain/sharding/sharded_tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"

namespace meshtrain::sharding {
namespace {

constexpr int kDistributeTag = 0x5d00;
constexpr int kGatherTag = 0x5d01;

mesh::DeviceMesh& mesh_of(const Layout& l, const char* op) {
  if (l.mesh() == nullptr)
    throw InvalidArgument(op, fmt::format("{} is a pure layout (no DeviceMesh)", l.to_string()),
                          "build the Layout over a mesh::DeviceMesh to hold or move data");
  return *l.mesh();
}

Box full_box(const std::vector<int64_t>& shape) { return {std::vector<int64_t>(shape.size(), 0), shape}; }

// The part `b` of a tensor that holds block `holder` (a view; b within holder).
// An empty b may lie anywhere (an empty shard's offset is the dimension's end):
// it gets a new empty tensor.
Tensor block_view(const Tensor& t, const Box& holder, const Box& b) {
  if (b.empty()) return Tensor::empty(b.sizes, t.dtype());
  Tensor v = t;
  for (size_t d = 0; d < b.sizes.size(); ++d)
    v = v.narrow(static_cast<int>(d), b.offsets[d] - holder.offsets[d], b.sizes[d]);
  return v;
}

// Slot `i` of a flat staging buffer of slots of `slot` elements, viewed as `shape`.
Tensor slot_view(const Tensor& flat, int i, int64_t slot, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return flat.narrow(0, i * slot, n).view(shape);
}

// What a rank holds under the partial rule (see sharded_tensor.h).
enum class PartialRole : uint8_t { keep, zero, one };

PartialRole partial_role(const Layout& l, int rank, const PartialAxes& axes) {
  const std::vector<int> coords = mesh::unravel(rank, l.mesh_shape());
  for (const auto& [axis, op] : axes) {
    const auto pos = std::find(l.axis_names().begin(), l.axis_names().end(), axis) - l.axis_names().begin();
    if (coords[pos] == 0) continue;
    if (op == comm::ReduceOp::sum) return PartialRole::zero;
    if (op == comm::ReduceOp::prod) return PartialRole::one;
  }
  return PartialRole::keep;
}

// Overwrites a block with what `role` holds (nothing to do for keep).
void apply_partial_role(const Tensor& local, PartialRole role) {
  if (role == PartialRole::zero) local.fill(0.0);
  if (role == PartialRole::one) local.fill(1.0);
}

comm::Communicator& step_comm(mesh::DeviceMesh& mesh, const std::vector<std::string>& axes) {
  return axes.size() == 1 ? mesh.comm(axes[0]) : mesh.comm(axes);
}

// World ranks of this rank's group along `axes`, in the communicator's order.
std::vector<int> step_group(mesh::DeviceMesh& mesh, const std::vector<std::string>& axes, comm::Communicator& c) {
  std::vector<int> group = mesh.group_ranks(axes);
  if (static_cast<int>(group.size()) != c.size() || group[c.rank()] != mesh.rank())
    throw Error("redistribute",
                fmt::format("communicator of axes ({}) has rank {} of {}, the mesh says {} of {}", fmt::join(axes, ", "),
                            c.rank(), c.size(), std::find(group.begin(), group.end(), mesh.rank()) - group.begin(),
                            group.size()),
                "the mesh's sub-communicators must be ranked row-major over their axes; report this bug");
  return group;
}

// ---- one step of a plan ----------------------------------------------------------

struct StepContext {
  mesh::DeviceMesh& mesh;
  int me;
  const RedistributeStep& step;
};

Tensor run_all_gather(const StepContext& s, const Tensor& local) {
  comm::Communicator& c = step_comm(s.mesh, s.step.axes);
  const std::vector<int> group = step_group(s.mesh, s.step.axes, c);
  const Box target = s.step.to.local_box(s.me);
  std::vector<Box> from;
  int64_t slot = 0;
  for (int y : group) {
    from.push_back(s.step.from.local_box(y));
    slot = std::max(slot, from.back().numel());
  }
  const int n = static_cast<int>(group.size());
  const Tensor buf = Tensor::zeros({n * slot}, local.dtype());
  slot_view(buf, c.rank(), slot, local.shape()).copy_from(local);
  const auto* mine = static_cast<const std::byte*>(buf.data_ptr()) + c.rank() * slot * dtype_size(local.dtype());
  c.all_gather(mine, buf.data_ptr(), static_cast<size_t>(slot), local.dtype());
  const Tensor out = Tensor::empty(target.sizes, local.dtype());
  for (int i = 0; i < n; ++i) {
    const Box piece = from[i].intersect(target);
    if (piece.empty()) continue;
    block_view(out, target, piece).copy_from(block_view(slot_view(buf, i, slot, from[i].sizes), from[i], piece));
  }
  return out;
}

// Member y of a group sends member x the part of its old block that x's new
// block needs. Members that differ only in group axes the old layout does not
// use hold the same old block; of those, only the one whose coordinates on
// such axes equal x's sends, so each element reaches x once.
Tensor run_all_to_all(const StepContext& s, const Tensor& local) {
  comm::Communicator& c = step_comm(s.mesh, s.step.axes);
  const std::vector<int> group = step_group(s.mesh, s.step.axes, c);
  const Layout& from_layout = s.step.from;
  std::vector<int> replicated;  // mesh indices of group axes the old layout does not use
  for (const auto& a : s.step.axes)
    if (from_layout.spec().dim_of(a) < 0) replicated.push_back(s.mesh.axis_index(a));
  const int n = static_cast<int>(group.size());
  std::vector<Box> from, to;
  std::vector<std::vector<int>> coords;
  for (int y : group) {
    from.push_back(from_layout.local_box(y));
    to.push_back(s.step.to.local_box(y));
    coords.push_back(s.mesh.coords_of(y));
  }
  const auto sends = [&](int y, int x) {
    return std::all_of(replicated.begin(), replicated.end(), [&](int i) { return coords[y][i] == coords[x][i]; });
  };
  int64_t slot = 0;  // the largest piece any member sends any other
  for (int x = 0; x < n; ++x)
    for (int y = 0; y < n; ++y)
      if (sends(y, x)) slot = std::max(slot, from[y].intersect(to[x]).numel());
  const Tensor send = Tensor::zeros({n * slot}, local.dtype());
  const Tensor recv = Tensor::zeros({n * slot}, local.dtype());
  const int me = c.rank();
  for (int x = 0; x < n; ++x) {
    const Box piece = from[me].intersect(to[x]);
    if (sends(me, x) && !piece.empty())
      slot_view(send, x, slot, piece.sizes).copy_from(block_view(local, from[me], piece));
  }
  c.all_to_all(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(slot), local.dtype());
  const Tensor out = Tensor::empty(to[me].sizes, local.dtype());
  for (int y = 0; y < n; ++y) {
    const Box piece = from[y].intersect(to[me]);
    if (sends(y, me) && !piece.empty()) block_view(out, to[me], piece).copy_from(slot_view(recv, y, slot, piece.sizes));
  }
  return out;
}

comm::ReduceOp reduced_op(const RedistributeStep& step) { return step.from.partial().at(step.axes.at(0)); }

Tensor run_all_reduce(const StepContext& s, const Tensor& local) {
  comm::Communicator& c = step_comm(s.mesh, s.step.axes);
  const Tensor out = local.clone();
  c.all_reduce(out.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), out.dtype(), reduced_op(s.step));
  return out;
}

Tensor run_reduce_scatter(const StepContext& s, const Tensor& local) {
  comm::Communicator& c = step_comm(s.mesh, s.step.axes);
  const std::vector<int> group = step_group(s.mesh, s.step.axes, c);
  const Box mine = s.step.from.local_box(s.me);  // the same for the whole group
  std::vector<Box> to;
  int64_t slot = 0;
  for (int y : group) {
    to.push_back(s.step.to.local_box(y));
    slot = std::max(slot, to.back().numel());
  }
  const int n = static_cast<int>(group.size());
  const Tensor send = Tensor::zeros({n * slot}, local.dtype());
  for (int x = 0; x < n; ++x)
    if (!to[x].empty()) slot_view(send, x, slot, to[x].sizes).copy_from(block_view(local, mine, to[x]));
  const Tensor recv = Tensor::zeros({slot}, local.dtype());
  c.reduce_scatter(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(slot), local.dtype(), reduced_op(s.step));
  return slot_view(recv, 0, slot, to[c.rank()].sizes);
}

Tensor run_make_partial(const StepContext& s, const Tensor& local) {
  const std::string& axis = s.step.axes.at(0);
  const PartialRole role = partial_role(s.step.to, s.me, {{axis, s.step.to.partial().at(axis)}});
  if (role == PartialRole::keep) return local;
  const Tensor out = Tensor::empty(local.shape(), local.dtype());
  apply_partial_role(out, role);
  return out;
}

Tensor run_step(mesh::DeviceMesh& mesh, const RedistributeStep& step, const Tensor& local) {
  const StepContext s{mesh, mesh.rank(), step};
  switch (step.kind) {
    case StepKind::local_slice:
      return block_view(local, step.from.local_box(s.me), step.to.local_box(s.me)).contiguous();
    case StepKind::all_gather: return run_all_gather(s, local);
    case StepKind::all_to_all: return run_all_to_all(s, local);
    case StepKind::all_reduce: return run_all_reduce(s, local);
    case StepKind::reduce_scatter: return run_reduce_scatter(s, local);
    case StepKind::make_partial: return run_make_partial(s, local);
  }
  throw Error("redistribute", "unknown step kind", "report this bug");
}

void check_global(const Tensor& global, const Layout& layout, const char* op) {
  if (!global.defined())
    throw InvalidArgument(op, "the global tensor is undefined", "pass the full tensor");
  if (global.device().type != DeviceType::cpu)
    throw InvalidArgument(op, fmt::format("the global tensor is on {}", global.device().to_string()),
                          "distribute a cpu tensor");
  if (global.shape() != layout.global_shape())
    throw InvalidArgument(op,
                          fmt::format("the global tensor has shape {} but {} has global shape {}",
                                      shape_to_string(global.shape()), layout.to_string(),
                                      shape_to_string(layout.global_shape())),
                          "build the layout with the tensor's shape");
}

}  // namespace

// ---- ShardedTensor ------------------------------------------------------------------

ShardedTensor::ShardedTensor(Tensor local, Layout layout) {
  const mesh::DeviceMesh& mesh = mesh_of(layout, "ShardedTensor");
  const std::vector<int64_t> expected = layout.local_shape(mesh.rank());
  if (!local.defined())
    throw InvalidArgument("ShardedTensor", "the local tensor is undefined", "pass this rank's block");
  if (local.device().type != DeviceType::cpu || !local.is_contiguous())
    throw InvalidArgument("ShardedTensor",
                          fmt::format("the local tensor must be a contiguous cpu tensor (got {} on {})",
                                      local.is_contiguous() ? "contiguous" : "non-contiguous",
                                      local.device().to_string()),
                          "call contiguous() first");
  if (local.shape() != expected)
    throw InvalidArgument("ShardedTensor",
                          fmt::format("rank {} holds a local tensor of shape {} but {} gives it {}", mesh.rank(),
                                      shape_to_string(local.shape()), layout.to_string(), shape_to_string(expected)),
                          "use layout.local_shape(rank) for the block's shape");
  local_ = std::move(local);
  layout_.emplace(std::move(layout));
}

ShardedTensor ShardedTensor::empty(const Layout& layout, DType dtype, MemoryTracker* tracker,
                                   MemoryCategory category) {
  const int rank = mesh_of(layout, "ShardedTensor::empty").rank();
  return ShardedTensor(Tensor::empty(layout.local_shape(rank), dtype, Device{}, tracker, category), layout);
}

ShardedTensor ShardedTensor::zeros(const Layout& layout, DType dtype, MemoryTracker* tracker,
                                   MemoryCategory category) {
  const int rank = mesh_of(layout, "ShardedTensor::zeros").rank();
  return ShardedTensor(Tensor::zeros(layout.local_shape(rank), dtype, Device{}, tracker, category), layout);
}

const Layout& ShardedTensor::layout() const {
  if (!layout_) throw InvalidArgument("ShardedTensor::layout", "the ShardedTensor is undefined", "distribute first");
  return *layout_;
}

std::string ShardedTensor::to_string() const {
  if (!defined()) return "ShardedTensor(undefined)";
  return fmt::format("ShardedTensor({}, {}, rank {} holds {})", dtype_name(dtype()), layout().to_string(), rank(),
                     local_box().to_string());
}

// ---- distribute / gather --------------------------------------------------------------

ShardedTensor distribute_replicated(const Tensor& global, const Layout& layout) {
  const int me = mesh_of(layout, "distribute_replicated").rank();
  check_global(global, layout, "distribute_replicated");
  const Tensor local = block_view(global, full_box(global.shape()), layout.local_box(me)).clone();
  apply_partial_role(local, partial_role(layout, me, layout.partial()));
  return ShardedTensor(local, layout);
}

ShardedTensor distribute(const Tensor& global, const Layout& layout, int src_rank) {
  mesh::DeviceMesh& mesh = mesh_of(layout, "distribute");
  comm::Communicator& world = mesh.world();
  const int me = mesh.rank(), n = mesh.size();
  if (src_rank < 0 || src_rank >= n)
    throw InvalidArgument("distribute", fmt::format("src_rank {} outside [0, {})", src_rank, n),
                          "pass a rank of the mesh");
  // Header from src: {ok, dtype}, so that every rank fails together.
  int64_t header[2] = {0, 0};
  if (me == src_rank) {
    try {
      check_global(global, layout, "distribute");
      header[0] = 1;
      header[1] = static_cast<int64_t>(global.dtype());
    } catch (const InvalidArgument&) {
      header[0] = 0;  // rethrown below, after the others learn of it
    }
  }
  world.broadcast(header, 2, DType::i64, src_rank);
  if (header[0] != 1) {
    if (me == src_rank) check_global(global, layout, "distribute");
    throw InvalidArgument("distribute",
                          fmt::format("rank {}'s global tensor does not match {}", src_rank, layout.to_string()),
                          fmt::format("see rank {}'s error for the shapes", src_rank));
  }
  const auto dtype = static_cast<DType>(header[1]);
  const Box mine = layout.local_box(me);
  const Tensor local = Tensor::empty(mine.sizes, dtype);
  const Box whole = full_box(layout.global_shape());
  if (world.capabilities().send_recv) {
    if (me == src_rank) {
      for (int r = 0; r < n; ++r) {
        if (r == src_rank) continue;
        const Box b = layout.local_box(r);
        if (b.empty() || partial_role(layout, r, layout.partial()) != PartialRole::keep) continue;
        const Tensor piece = block_view(global, whole, b).contiguous();
        world.send(piece.data_ptr(), static_cast<size_t>(piece.numel()), dtype, r, kDistributeTag);
      }
      local.copy_from(block_view(global, whole, mine));
    } else if (!mine.empty() && partial_role(layout, me, layout.partial()) == PartialRole::keep) {
      world.recv(local.data_ptr(), static_cast<size_t>(local.numel()), dtype, src_rank, kDistributeTag);
    }
  } else {
    const Tensor all = me == src_rank ? global.contiguous() : Tensor::empty(layout.global_shape(), dtype);
    world.broadcast(all.data_ptr(), static_cast<size_t>(all.numel()), dtype, src_rank);
    local.copy_from(block_view(all, whole, mine));
  }
  apply_partial_role(local, partial_role(layout, me, layout.partial()));
  return ShardedTensor(local, layout);
}

Tensor gather(const ShardedTensor& t, int dst_rank) {
  const Layout& layout = t.layout();
  mesh::DeviceMesh& mesh = mesh_of(layout, "gather");
  const int me = mesh.rank(), n = mesh.size();
  if (dst_rank != kAllRanks && (dst_rank < 0 || dst_rank >= n))
    throw InvalidArgument("gather", fmt::format("dst_rank {} outside [0, {})", dst_rank, n),
                          "pass a rank of the mesh or kAllRanks");
  comm::Communicator& world = mesh.world();
  if (dst_rank == kAllRanks || !world.capabilities().send_recv) {
    const ShardedTensor full = redistribute(t, PartitionSpec::replicated(layout.ndim()));
    Tensor out = full.local();
    if (out.storage() == t.local().storage()) out = out.clone();
    if (dst_rank != kAllRanks && me != dst_rank) return Tensor();
    return out;
  }
  const ShardedTensor reduced = layout.has_partial() ? redistribute(t, layout.spec()) : t;
  // One holder per block sends it: the rank at coordinate 0 of every axis the
  // spec does not use.
  const std::vector<std::string> used = layout.spec().used_axes();
  Tensor out = me == dst_rank ? Tensor::empty(layout.global_shape(), t.dtype()) : Tensor();
  const Box whole = full_box(layout.global_shape());
  for (int r = 0; r < n; ++r) {
    const std::vector<int> coords = mesh.coords_of(r);
    bool holder = true;
    for (int i = 0; i < mesh.ndim(); ++i)
      if (coords[i] != 0 && std::find(used.begin(), used.end(), mesh.axis_names()[i]) == used.end()) holder = false;
    const Box b = layout.local_box(r);
    if (!holder || b.empty()) continue;
    if (r == me && me == dst_rank) {
      block_view(out, whole, b).copy_from(reduced.local());
    } else if (r == me) {
      world.send(reduced.local().data_ptr(), static_cast<size_t>(b.numel()), t.dtype(), dst_rank, kGatherTag);
    } else if (me == dst_rank) {
      const Tensor piece = Tensor::empty(b.sizes, t.dtype());
      world.recv(piece.data_ptr(), static_cast<size_t>(b.numel()), t.dtype(), r, kGatherTag);
      block_view(out, whole, b).copy_from(piece);
    }
  }
  return out;
}

// ---- redistribute -------------------------------------------------------------------

ShardedTensor redistribute(const ShardedTensor& t, const Layout& to) {
  const Layout& from = t.layout();
  mesh::DeviceMesh& mesh = mesh_of(from, "redistribute");
  if (to.mesh() != nullptr && to.mesh() != &mesh)
    throw InvalidArgument("redistribute", "the target layout is on another DeviceMesh object",
                          "build the target on the tensor's mesh (or pass a pure layout)");
  const Layout target = to.mesh() != nullptr
                            ? to
                            : Layout(mesh, to.spec(), to.global_shape(), {.partial = to.partial(), .strict = to.strict()});
  Tensor local = t.local();
  for (const RedistributeStep& step : plan_redistribute(from, target)) local = run_step(mesh, step, local);
  return ShardedTensor(local, target);
}

ShardedTensor redistribute(const ShardedTensor& t, const PartitionSpec& spec, const PartialAxes& partial) {
  return redistribute(t, t.layout().with_spec(spec, {.partial = partial, .strict = t.layout().strict()}));
}

// ---- layout-invariant fills ---------------------------------------------------------

namespace {

// Calls fill(run, start) for every run of this rank's block that is a run of
// consecutive global row-major indices, then applies the partial rule.
template <typename Fill>
void fill_block(ShardedTensor& t, const char* op, Fill&& fill) {
  const Layout& layout = t.layout();
  if (!is_floating(t.dtype()))
    throw InvalidArgument(op, fmt::format("dtype {} is not floating", dtype_name(t.dtype())),
                          "random fills need f32, f64, bf16 or f16");
  const int me = t.rank();
  const PartialRole role = partial_role(layout, me, layout.partial());
  const Tensor& local = t.local();
  if (role != PartialRole::keep || local.numel() == 0) {
    apply_partial_role(local, role);
    return;
  }
  const Box box = layout.local_box(me);
  const std::vector<int64_t>& shape = layout.global_shape();
  const int ndim = layout.ndim();
  // Dims [p, ndim) form one run: every dim after p is whole.
  int p = std::max(ndim - 1, 0);
  while (p > 0 && box.sizes[p] == shape[p]) --p;
  int64_t run = 1;
  for (int d = p; d < ndim; ++d) run *= box.sizes[d];
  const std::vector<int64_t> gstride = contiguous_strides(shape);
  const Tensor flat = local.view({local.numel()});
  std::vector<int64_t> idx(p, 0);  // index over the local dims [0, p)
  for (int64_t start = 0; start < local.numel(); start += run) {
    uint64_t global = 0;
    for (int d = 0; d < ndim; ++d) global += static_cast<uint64_t>((box.offsets[d] + (d < p ? idx[d] : 0)) * gstride[d]);
    fill(flat.narrow(0, start, run), global);
    for (int d = p - 1; d >= 0; --d) {
      if (++idx[d] < box.sizes[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

void fill_normal(ShardedTensor& t, uint64_t seed, std::string_view name, double mean, double std) {
  const uint64_t key = key_from_name(name);
  fill_block(t, "sharding::fill_normal", [&](const Tensor& run, uint64_t start) {
    meshtrain::fill_normal(run, seed, key, mean, std, start);
  });
}

void fill_uniform(ShardedTensor& t, uint64_t seed, std::string_view name, double lo, double hi) {
  const uint64_t key = key_from_name(name);
  fill_block(t, "sharding::fill_uniform", [&](const Tensor& run, uint64_t start) {
    meshtrain::fill_uniform(run, seed, key, lo, hi, start);
  });
}

}  // namespace meshtrain::sharding
