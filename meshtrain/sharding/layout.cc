#include "meshtrain/sharding/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::sharding {
namespace {

using AxisList = std::vector<std::string>;

int index_in(const AxisList& list, const std::string& axis) {
  const auto it = std::find(list.begin(), list.end(), axis);
  return it == list.end() ? -1 : static_cast<int>(it - list.begin());
}

std::string partial_to_string(const PartialAxes& partial) {
  std::vector<std::string> parts;
  for (const auto& [axis, op] : partial) parts.push_back(fmt::format("{}: {}", axis, comm::reduce_op_name(op)));
  return fmt::format("{{{}}}", fmt::join(parts, ", "));
}

// "P(data, None)" or "P(data, None) partial {tensor: sum}".
std::string short_string(const Layout& l) {
  if (!l.has_partial()) return l.spec().to_string();
  return fmt::format("{} partial {}", l.spec().to_string(), partial_to_string(l.partial()));
}

}  // namespace

// ---- Box ---------------------------------------------------------------------

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool Box::contains(const Box& other) const {
  if (other.empty()) return true;
  for (size_t d = 0; d < sizes.size(); ++d)
    if (other.offsets[d] < offsets[d] || other.offsets[d] + other.sizes[d] > offsets[d] + sizes[d]) return false;
  return true;
}

Box Box::intersect(const Box& other) const {
  Box out{offsets, sizes};
  for (size_t d = 0; d < sizes.size(); ++d) {
    const int64_t lo = std::max(offsets[d], other.offsets[d]);
    const int64_t hi = std::min(offsets[d] + sizes[d], other.offsets[d] + other.sizes[d]);
    out.offsets[d] = lo;
    out.sizes[d] = std::max<int64_t>(0, hi - lo);
  }
  return out;
}

std::string Box::to_string() const {
  std::vector<std::string> parts;
  // A box read from a file may be malformed: no index past offsets, no signed overflow.
  for (size_t d = 0; d < sizes.size(); ++d)
    parts.push_back(d < offsets.size() ? fmt::format("{}:{}", offsets[d], static_cast<__int128>(offsets[d]) + sizes[d])
                                       : fmt::format("?:+{}", sizes[d]));
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

// ---- Layout ------------------------------------------------------------------

Layout::Layout(std::vector<int> mesh_shape, std::vector<std::string> axis_names, PartitionSpec spec,
               std::vector<int64_t> global_shape, LayoutOptions options)
    : mesh_shape_(std::move(mesh_shape)),
      axis_names_(std::move(axis_names)),
      spec_(std::move(spec)),
      global_shape_(std::move(global_shape)),
      partial_(std::move(options.partial)),
      strict_(options.strict) {
  validate("Layout");
}

Layout::Layout(mesh::DeviceMesh& mesh, PartitionSpec spec, std::vector<int64_t> global_shape,
               LayoutOptions options)
    : Layout(mesh.shape(), mesh.axis_names(), std::move(spec), std::move(global_shape), std::move(options)) {
  mesh_ = &mesh;
}

Layout Layout::from_placements(mesh::DeviceMesh& mesh, const std::vector<AxisPlacement>& placements,
                               std::vector<int64_t> global_shape, bool strict) {
  const int ndim = static_cast<int>(global_shape.size());
  PartitionSpec spec = sharding::from_placements(placements, mesh.axis_names(), ndim);
  LayoutOptions options{.partial = {}, .strict = strict};
  for (size_t i = 0; i < placements.size(); ++i)
    if (placements[i].is_partial()) options.partial[mesh.axis_names()[i]] = placements[i].reduce;
  return Layout(mesh, std::move(spec), std::move(global_shape), std::move(options));
}

void Layout::validate(const char* op) const {
  mesh::validate_mesh(mesh_shape_, axis_names_);
  for (size_t d = 0; d < global_shape_.size(); ++d)
    if (global_shape_[d] < 0)
      throw InvalidArgument(op, fmt::format("dimension {} has negative size {}", d, global_shape_[d]),
                            "sizes are >= 0");
  // Element counts (Box::numel, local_numel) are int64: the whole tensor's must fit.
  int64_t elements = 1;
  for (int64_t size : global_shape_) {
    const auto next = checked_mul(elements, size);
    if (!next)
      throw InvalidArgument(op, fmt::format("shape {} has more than 2^63 - 1 elements", shape_to_string(global_shape_)),
                            "use sizes whose product fits in int64");
    elements = *next;
  }
  spec_.validate(axis_names_, ndim());
  std::set<comm::ReduceOp> ops;
  for (const auto& [axis, reduce] : partial_) {
    if (index_in(axis_names_, axis) < 0)
      throw InvalidArgument(op,
                            fmt::format("partial axis '{}' is not in the mesh ({})", axis, fmt::join(axis_names_, ", ")),
                            "use the mesh's axis names");
    const int d = spec_.dim_of(axis);
    if (d >= 0)
      throw InvalidArgument(op,
                            fmt::format("mesh axis '{}' both shards dimension {} of {} and is partial", axis, d,
                                        spec_.to_string()),
                            "an axis is either Shard or Partial: reduce it first (redistribute), then shard");
    ops.insert(reduce);
  }
  const bool linear = std::all_of(ops.begin(), ops.end(), [](comm::ReduceOp o) {
    return o == comm::ReduceOp::sum || o == comm::ReduceOp::avg;
  });
  if (ops.size() > 1 && !linear)
    throw InvalidArgument(op, fmt::format("partial axes mix reductions: {}", partial_to_string(partial_)),
                          "use one op for every partial axis (sum and avg may mix)");
  if (!strict_) return;
  for (int d = 0; d < ndim(); ++d) {
    const int k = num_shards(d);
    if (global_shape_[d] % k == 0) continue;
    std::vector<int> sizes;
    for (const auto& a : spec_.axes(d)) sizes.push_back(mesh_shape_[axis_index(a)]);
    throw InvalidArgument(
        op,
        fmt::format("strict layout {}: dimension {} of size {} does not divide into {} shards over axes ({}) of sizes "
                    "({})",
                    spec_.to_string(), d, global_shape_[d], k, fmt::join(spec_.axes(d), ", "), fmt::join(sizes, ", ")),
        fmt::format("make the size a multiple of {}, or drop strict to allow ceil-division shards (the trailing ones "
                    "smaller or empty)",
                    k));
  }
}

int Layout::axis_index(const std::string& axis) const { return index_in(axis_names_, axis); }

int Layout::num_ranks() const { return static_cast<int>(mesh::num_ranks(mesh_shape_)); }

bool Layout::is_even() const {
  for (int d = 0; d < ndim(); ++d)
    if (global_shape_[d] % num_shards(d) != 0) return false;
  return true;
}

int Layout::num_shards(int dim) const {
  int k = 1;
  for (const auto& a : spec_.axes(dim)) k *= mesh_shape_[axis_index(a)];
  return k;
}

int64_t Layout::chunk_size(int dim) const {
  const int64_t k = num_shards(dim), n = global_shape_[dim];
  return n / k + (n % k != 0);  // ceil(n / k) without n + k - 1, which wraps near INT64_MAX
}

std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t shard, int64_t shards) {
  if (n < 0 || shards < 1 || shard < 0 || shard >= shards)
    throw InvalidArgument("chunk_range", fmt::format("shard {} of {} over {} items", shard, shards, n),
                          "pass n >= 0 and 0 <= shard < shards");
  const int64_t c = n / shards + (n % shards != 0);  // ceil(n / k) without n + k - 1, which wraps near INT64_MAX
  // min(n, s * c) without forming s * c when it would pass n (and maybe wrap).
  const auto at = [&](int64_t s) { return c == 0 || s > n / c ? n : std::min(n, s * c); };
  return {at(shard), at(shard + 1)};
}

std::pair<int64_t, int64_t> Layout::shard_range(int dim, int shard) const {
  const int k = num_shards(dim);
  if (shard < 0 || shard >= k)
    throw InvalidArgument("Layout::shard_range", fmt::format("shard {} of dim {} split into {}", shard, dim, k),
                          "pass a shard in [0, num_shards(dim))");
  return chunk_range(global_shape_[dim], shard, k);
}

int Layout::shard_index(int rank, int dim) const {
  const std::vector<int> coords = mesh::unravel(rank, mesh_shape_);
  int j = 0;
  for (const auto& a : spec_.axes(dim)) {
    const int i = axis_index(a);
    j = j * mesh_shape_[i] + coords[i];
  }
  return j;
}

Box Layout::local_box(int rank) const {
  const std::vector<int> coords = mesh::unravel(rank, mesh_shape_);
  Box box{std::vector<int64_t>(ndim()), std::vector<int64_t>(ndim())};
  for (int d = 0; d < ndim(); ++d) {
    int j = 0;
    for (const auto& a : spec_.axes(d)) {
      const int i = axis_index(a);
      j = j * mesh_shape_[i] + coords[i];
    }
    const auto [b, e] = shard_range(d, j);
    box.offsets[d] = b;
    box.sizes[d] = e - b;
  }
  return box;
}

std::vector<int64_t> Layout::local_shape(int rank) const { return local_box(rank).sizes; }
std::vector<int64_t> Layout::local_offsets(int rank) const { return local_box(rank).offsets; }

std::vector<AxisPlacement> Layout::placements() const {
  std::vector<AxisPlacement> out = to_placements(spec_, axis_names_);
  for (size_t i = 0; i < axis_names_.size(); ++i) {
    const auto it = partial_.find(axis_names_[i]);
    if (it != partial_.end()) out[i] = AxisPlacement::Partial(it->second);
  }
  return out;
}

Layout Layout::with_spec(PartitionSpec spec, LayoutOptions options) const {
  Layout out(mesh_shape_, axis_names_, std::move(spec), global_shape_, std::move(options));
  out.mesh_ = mesh_;
  return out;
}

bool Layout::same_mesh(const Layout& other) const {
  return mesh_shape_ == other.mesh_shape_ && axis_names_ == other.axis_names_;
}

std::string Layout::to_string() const {
  std::string s = fmt::format("Layout({}, shape {}, mesh {}", spec_.to_string(), shape_to_string(global_shape_),
                              mesh::format_mesh(mesh_shape_, axis_names_));
  if (!is_even()) s += ", uneven";
  if (strict_) s += ", strict";
  if (!partial_.empty()) s += ", partial " + partial_to_string(partial_);
  return s + ")";
}

bool Layout::operator==(const Layout& o) const {
  return same_mesh(o) && spec_ == o.spec_ && global_shape_ == o.global_shape_ && partial_ == o.partial_;
}

// ---- plan_redistribute ---------------------------------------------------------

std::string_view step_kind_name(StepKind kind) {
  switch (kind) {
    case StepKind::local_slice: return "local_slice";
    case StepKind::all_gather: return "all_gather";
    case StepKind::all_to_all: return "all_to_all";
    case StepKind::all_reduce: return "all_reduce";
    case StepKind::reduce_scatter: return "reduce_scatter";
    case StepKind::make_partial: return "make_partial";
  }
  return "?";
}

std::string RedistributeStep::to_string() const {
  std::string s(step_kind_name(kind));
  if (!axes.empty()) s += fmt::format(" over ({})", fmt::join(axes, ", "));
  s += fmt::format(": {} -> {}", short_string(from), short_string(to));
  if (fallback) s += " [fallback]";
  return s;
}

namespace {

// The axes of `cur` that can stay where they are on the way to `target`: the
// greedy subsequence of cur whose order agrees with target's.
AxisList keepers(const AxisList& cur, const AxisList& target) {
  AxisList out;
  int last = -1;
  for (const auto& a : cur) {
    const int i = index_in(target, a);
    if (i > last) {
      out.push_back(a);
      last = i;
    }
  }
  return out;
}

bool consistent(const AxisList& cur, const AxisList& target) { return keepers(cur, target).size() == cur.size(); }

// Inserts `axis` into `cur` (consistent with target) where it keeps cur a
// subsequence of target.
AxisList insert_axis(AxisList cur, const std::string& axis, const AxisList& target) {
  const int ia = index_in(target, axis);
  size_t pos = 0;
  while (pos < cur.size() && index_in(target, cur[pos]) < ia) ++pos;
  cur.insert(cur.begin() + static_cast<std::ptrdiff_t>(pos), axis);
  return cur;
}

std::vector<int> axis_indices(const Layout& l, const AxisList& axes) {
  std::vector<int> idx;
  for (const auto& a : axes) idx.push_back(index_in(l.axis_names(), a));
  return idx;
}

// Sorts axes into mesh order.
AxisList mesh_order(const Layout& l, const std::set<std::string>& axes) {
  AxisList out;
  for (const auto& a : l.axis_names())
    if (axes.count(a)) out.push_back(a);
  return out;
}

// True when [lo, hi) is covered by the union of `ranges`.
bool covers(std::vector<std::pair<int64_t, int64_t>> ranges, int64_t lo, int64_t hi) {
  std::sort(ranges.begin(), ranges.end());
  int64_t reached = lo;
  for (const auto& [b, e] : ranges) {
    if (reached >= hi) break;
    if (b >= e) continue;
    if (b > reached) return false;
    reached = std::max(reached, e);
  }
  return reached >= hi;
}

// Boxes of every rank, computed once per layout.
std::vector<Box> all_boxes(const Layout& l) {
  std::vector<Box> boxes;
  for (int r = 0; r < l.num_ranks(); ++r) boxes.push_back(l.local_box(r));
  return boxes;
}

// Every rank's new block lies within the union of the old blocks of its group
// along `axes`. The old blocks of a group are a product over dimensions (each
// dimension's range depends on its own axes only), so the union is the
// product of the per-dimension unions and the test is per dimension.
bool group_covers(const Layout& from, const Layout& to, const AxisList& axes) {
  const std::vector<Box> fb = all_boxes(from), tb = all_boxes(to);
  const std::vector<int> idx = axis_indices(from, axes);
  for (int r = 0; r < from.num_ranks(); ++r) {
    if (tb[r].empty()) continue;
    const std::vector<int> group = mesh::group_of(r, from.mesh_shape(), idx);
    for (int d = 0; d < from.ndim(); ++d) {
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (int y : group) ranges.emplace_back(fb[y].offsets[d], fb[y].offsets[d] + fb[y].sizes[d]);
      if (!covers(std::move(ranges), tb[r].offsets[d], tb[r].offsets[d] + tb[r].sizes[d])) return false;
    }
  }
  return true;
}

// Every rank's new block lies within its old one.
bool all_local(const Layout& from, const Layout& to) {
  for (int r = 0; r < from.num_ranks(); ++r)
    if (!from.local_box(r).contains(to.local_box(r))) return false;
  return true;
}

// Every group along `axes` needs one block (the same for all its ranks).
bool same_targets(const Layout& to, const AxisList& axes) {
  const std::vector<Box> tb = all_boxes(to);
  const std::vector<int> idx = axis_indices(to, axes);
  for (int r = 0; r < to.num_ranks(); ++r)
    for (int y : mesh::group_of(r, to.mesh_shape(), idx))
      if (!(tb[y] == tb[r])) return false;
  return true;
}

// True when every axis of `axes` shards some dimension of `l`.
bool all_shard(const Layout& l, const AxisList& axes) {
  return std::all_of(axes.begin(), axes.end(), [&](const std::string& a) { return l.spec().dim_of(a) >= 0; });
}

class Planner {
 public:
  Planner(const Layout& from, const Layout& to) : cur_(from), to_(to) {}

  std::vector<RedistributeStep> run() {
    reduce_partials();
    const Layout before = cur_;
    const size_t mark = steps_.size();
    if (!per_axis_moves()) {
      // A step would need a wider group, or moves form a cycle: move the data
      // in one exchange over every axis of the affected dimensions instead.
      steps_.erase(steps_.begin() + static_cast<std::ptrdiff_t>(mark), steps_.end());
      cur_ = before;
      direct_move();
    }
    make_partials();
    if (!(cur_ == to_))
      throw Error("plan_redistribute",
                  fmt::format("planned {} but the target is {}", cur_.to_string(), to_.to_string()),
                  "this is a bug in the planner; please report it with both layouts");
    return std::move(steps_);
  }

 private:
  const AxisList& target_axes(int d) const { return to_.spec().dims()[d]; }

  Layout next_layout(std::vector<AxisList> dims, PartialAxes partial) const {
    return cur_.with_spec(PartitionSpec(std::move(dims)), {.partial = std::move(partial), .strict = false});
  }

  void push(StepKind kind, AxisList axes, const Layout& next, bool fallback) {
    steps_.push_back({.kind = kind, .axes = std::move(axes), .from = cur_, .to = next, .fallback = fallback});
    cur_ = next;
  }

  void push_exchange(const Layout& next, AxisList group, bool fallback) {
    const bool gather = same_targets(next, group) && all_shard(cur_, group);
    push(gather ? StepKind::all_gather : StepKind::all_to_all, std::move(group), next, fallback);
  }

  // A data-movement step from cur_ to next over `axis` alone; false when
  // that axis's groups do not hold every rank's new block.
  bool move(const Layout& next, const std::string& axis) {
    if (all_local(cur_, next)) {
      push(StepKind::local_slice, {}, next, false);
      return true;
    }
    if (!group_covers(cur_, next, {axis})) return false;
    push_exchange(next, {axis}, false);
    return true;
  }

  // cur_'s data in to_'s spec (keeping cur_'s partial axes) in one step over
  // every axis of the dimensions whose axes differ. Their groups hold every
  // block of those dimensions, so they cover any new block.
  void direct_move() {
    const Layout next = next_layout(to_.spec().dims(), cur_.partial());
    if (next == cur_) return;
    if (all_local(cur_, next)) {
      push(StepKind::local_slice, {}, next, true);
      return;
    }
    std::set<std::string> wide;
    for (int d = 0; d < cur_.ndim(); ++d) {
      const AxisList& a = cur_.spec().dims()[d];
      const AxisList& b = target_axes(d);
      if (a == b) continue;
      wide.insert(a.begin(), a.end());
      wide.insert(b.begin(), b.end());
    }
    AxisList group = mesh_order(cur_, wide);
    if (!group_covers(cur_, next, group))
      throw Error("plan_redistribute",
                  fmt::format("{} -> {}: the group ({}) does not cover the new blocks", cur_.to_string(),
                              next.to_string(), fmt::join(group, ", ")),
                  "this is a bug in the planner; please report it with both layouts");
    push_exchange(next, std::move(group), true);
  }

  // Partial axes that to_ does not keep with the same op: reduce_scatter when
  // to_ shards the axis and each rank's new block lies in its old one, else
  // all_reduce (a fallback when to_ shards the axis; the shard is then taken
  // by the moves that follow).
  void reduce_partials() {
    const AxisList names = cur_.axis_names();  // a copy: push() replaces cur_
    for (const auto& axis : names) {
      const auto it = cur_.partial().find(axis);
      if (it == cur_.partial().end()) continue;
      const auto kept = to_.partial().find(axis);
      if (kept != to_.partial().end() && kept->second == it->second) continue;
      PartialAxes rest = cur_.partial();
      rest.erase(axis);
      const int d = to_.spec().dim_of(axis);
      if (d >= 0 && consistent(cur_.spec().dims()[d], target_axes(d))) {
        std::vector<AxisList> dims = cur_.spec().dims();
        dims[d] = insert_axis(dims[d], axis, target_axes(d));
        const Layout next = next_layout(std::move(dims), rest);
        if (all_local(cur_, next)) {
          push(StepKind::reduce_scatter, {axis}, next, false);
          continue;
        }
      }
      push(StepKind::all_reduce, {axis}, next_layout(cur_.spec().dims(), rest), d >= 0);
    }
  }

  // One step per changed axis, in mesh order: axes that must leave their
  // dimension (not wanted there, or out of order) move to their new dimension
  // (all_to_all) when its other axes are final, else are removed (all_gather);
  // then new axes are inserted (local slicing where possible). False when a
  // step would need more than its own axis or the moves form a cycle.
  bool per_axis_moves() {
    for (;;) {
      // Innermost first (removing an inner axis keeps the outer blocks), then mesh order.
      std::vector<std::pair<int, std::string>> ordered;
      for (const auto& axis : cur_.axis_names()) {
        const int d = cur_.spec().dim_of(axis);
        if (d < 0) continue;
        const AxisList& list = cur_.spec().dims()[d];
        if (index_in(keepers(list, target_axes(d)), axis) < 0)
          ordered.emplace_back(static_cast<int>(list.size()) - 1 - index_in(list, axis), axis);
      }
      if (ordered.empty()) break;
      std::stable_sort(ordered.begin(), ordered.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      AxisList pending;
      for (auto& [depth, axis] : ordered) pending.push_back(std::move(axis));
      std::string chosen;
      int to_dim = -1;
      for (const auto& axis : pending) {
        const int d2 = to_.spec().dim_of(axis);
        if (d2 < 0) {
          chosen = axis;
          break;
        }
        AxisList others = cur_.spec().dims()[d2];
        others.erase(std::remove(others.begin(), others.end(), axis), others.end());
        if (consistent(others, target_axes(d2))) {
          chosen = axis;
          to_dim = d2;
          break;
        }
      }
      if (chosen.empty()) return false;  // a cycle of moves
      std::vector<AxisList> dims = cur_.spec().dims();
      AxisList& from_list = dims[cur_.spec().dim_of(chosen)];
      from_list.erase(std::remove(from_list.begin(), from_list.end(), chosen), from_list.end());
      if (to_dim >= 0) dims[to_dim] = insert_axis(dims[to_dim], chosen, target_axes(to_dim));
      if (!move(next_layout(std::move(dims), cur_.partial()), chosen)) return false;
    }
    // Outermost first, so that each insertion nests inside the blocks so far.
    for (int d = 0; d < to_.ndim(); ++d) {
      for (const auto& axis : target_axes(d)) {
        if (cur_.spec().dim_of(axis) >= 0) continue;
        std::vector<AxisList> dims = cur_.spec().dims();
        dims[d] = insert_axis(dims[d], axis, target_axes(d));
        if (!move(next_layout(std::move(dims), cur_.partial()), axis)) return false;
      }
    }
    return true;
  }

  void make_partials() {
    for (const auto& [axis, op] : to_.partial()) {
      if (cur_.partial().count(axis)) continue;
      PartialAxes partial = cur_.partial();
      partial[axis] = op;
      push(StepKind::make_partial, {axis}, next_layout(cur_.spec().dims(), std::move(partial)), false);
    }
  }

  Layout cur_;
  const Layout& to_;
  std::vector<RedistributeStep> steps_;
};

}  // namespace

std::vector<RedistributeStep> plan_redistribute(const Layout& from, const Layout& to) {
  if (!from.same_mesh(to))
    throw InvalidArgument("plan_redistribute",
                          fmt::format("layouts on different meshes: {} and {}",
                                      mesh::format_mesh(from.mesh_shape(), from.axis_names()),
                                      mesh::format_mesh(to.mesh_shape(), to.axis_names())),
                          "redistribute within one mesh (reshard across meshes through a checkpoint)");
  if (from.global_shape() != to.global_shape())
    throw InvalidArgument("plan_redistribute",
                          fmt::format("global shapes differ: {} and {}", shape_to_string(from.global_shape()),
                                      shape_to_string(to.global_shape())),
                          "redistribution keeps the global shape; reshape the tensor first");
  return Planner(from, to).run();
}

}  // namespace meshtrain::sharding
