#include "meshtrain/mesh/device_mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::mesh {
namespace {

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) s += sep;
    s += parts[i];
  }
  return s;
}

std::string join_ints(const std::vector<int>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += sep;
    s += std::to_string(v[i]);
  }
  return s;
}

bool valid_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

// A shape with `ndim` axes and `n` ranks, as balanced as possible (largest
// first): the prime factors of n, largest first, each given to the currently
// smallest axis. suggest_shape(8, 2) == {4, 2}; suggest_shape(12, 3) == {3, 2, 2}.
std::vector<int> suggest_shape(int n, int ndim) {
  std::vector<int> primes;
  for (int p = 2; static_cast<int64_t>(p) * p <= n; ++p)
    while (n % p == 0) primes.push_back(p), n /= p;
  if (n > 1) primes.push_back(n);
  std::sort(primes.rbegin(), primes.rend());
  std::vector<int> shape(ndim, 1);
  for (int p : primes) *std::min_element(shape.begin(), shape.end()) *= p;
  std::sort(shape.rbegin(), shape.rend());
  return shape;
}

// Keep the user's sizes on every axis but the first where that works, else a
// balanced shape: "(data=2, tensor=4)".
std::string suggest_for(const std::vector<int>& shape, const std::vector<std::string>& names, int world) {
  std::vector<int> s = shape;
  const int64_t rest = num_ranks(shape) / shape[0];
  if (world % rest == 0) {
    s[0] = static_cast<int>(world / rest);
  } else {
    s = suggest_shape(world, static_cast<int>(shape.size()));
  }
  return format_mesh(s, names);
}

void check_axes(const std::vector<int>& axes, int ndim, const char* op) {
  std::vector<bool> seen(ndim, false);
  for (int a : axes) {
    if (a < 0 || a >= ndim)
      throw InvalidArgument(op, fmt::format("axis index {} out of range for a {}-D mesh", a, ndim),
                            fmt::format("use axis indices in [0, {})", ndim));
    if (seen[a]) throw InvalidArgument(op, fmt::format("axis {} listed twice", a), "list each axis once");
    seen[a] = true;
  }
}

// The mesh axes not in `axes`, in mesh order.
std::vector<int> other_axes(const std::vector<int>& axes, int ndim) {
  std::vector<int> rest;
  for (int a = 0; a < ndim; ++a)
    if (std::find(axes.begin(), axes.end(), a) == axes.end()) rest.push_back(a);
  return rest;
}

std::vector<int> pick(const std::vector<int>& v, const std::vector<int>& idx) {
  std::vector<int> out;
  out.reserve(idx.size());
  for (int i : idx) out.push_back(v[i]);
  return out;
}

// split(color, key) arguments that give the group along `axes` with
// sub-communicator rank == key: color numbers the groups like groups_along,
// key is the row-major index over `axes` in the order given.
std::pair<int, int> color_key(const std::vector<int>& coords, const std::vector<int>& shape,
                              const std::vector<int>& axes) {
  const auto rest = other_axes(axes, static_cast<int>(shape.size()));
  return {ravel(pick(coords, rest), pick(shape, rest)), ravel(pick(coords, axes), pick(shape, axes))};
}

// FNV-1a over (ndim, sizes, names): equal on every rank that passed the same mesh.
uint64_t digest(const std::vector<int>& shape, const std::vector<std::string>& names) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  };
  const uint64_t n = shape.size();
  mix(&n, sizeof n);
  for (int s : shape) mix(&s, sizeof s);
  for (const auto& name : names) {
    const uint64_t len = name.size();
    mix(&len, sizeof len);
    mix(name.data(), name.size());
  }
  return h;
}

// ---- rendering --------------------------------------------------------------

int digits(int v) { return static_cast<int>(std::to_string(v).size()); }

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

void rtrim_line(std::string& out) {
  while (!out.empty() && out.back() == ' ') out.pop_back();
  out += '\n';
}

// One grid: `nrows` x `ncols` cells holding ranks base + i * ncols + j. Without
// a row axis (1-D meshes) there is a single row and no row labels.
void render_grid(std::string& out, const std::string* row_name, int nrows, const std::string& col_name,
                 int ncols, int base, int max_rank) {
  const int w = std::max(digits(max_rank), digits(ncols - 1));  // number width
  const int cell = w + 4;                                       // "  7  "
  const int row_w = digits(nrows - 1);
  const int label = row_name ? static_cast<int>(row_name->size()) + row_w + 2 : 0;
  const int inner = ncols * cell + (ncols - 1);
  auto centered = [&](int v) { return fmt::format("  {:>{}}  ", v, w); };
  auto border = [&](const char* l, const char* m, const char* r) {
    out += std::string(label, ' ') + l;
    for (int j = 0; j < ncols; ++j) out += repeat("─", cell) + (j + 1 < ncols ? m : r);
    out += '\n';
  };

  const int name_pad = std::max(0, (inner - static_cast<int>(col_name.size())) / 2);
  out += std::string(label + 1 + name_pad, ' ') + col_name;
  rtrim_line(out);
  out += std::string(label + 1, ' ');
  for (int j = 0; j < ncols; ++j) out += centered(j) + " ";
  rtrim_line(out);
  border("┌", "┬", "┐");
  for (int i = 0; i < nrows; ++i) {
    if (i > 0) border("├", "┼", "┤");
    if (row_name) out += fmt::format("{:<{}} {:>{}} ", i == 0 ? *row_name : "", row_name->size(), i, row_w);
    out += "│";
    for (int j = 0; j < ncols; ++j) out += centered(base + i * ncols + j) + "│";
    out += '\n';
  }
  border("└", "┴", "┘");
}

}  // namespace

// ---- pure functions -----------------------------------------------------------

int64_t num_ranks(const std::vector<int>& shape) {
  int64_t n = 1;
  for (int s : shape) {
    n *= s;
    if (n > std::numeric_limits<int>::max() || n < -static_cast<int64_t>(std::numeric_limits<int>::max()))
      return n;  // already out of any valid range; stop before overflowing int64
  }
  return n;
}

std::string format_mesh(const std::vector<int>& shape, const std::vector<std::string>& axis_names) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < shape.size(); ++i)
    parts.push_back(i < axis_names.size() ? fmt::format("{}={}", axis_names[i], shape[i])
                                          : std::to_string(shape[i]));
  return fmt::format("({})", join(parts, ", "));
}

void validate_mesh(const std::vector<int>& shape, const std::vector<std::string>& names,
                   std::optional<int> world_size) {
  const char* op = "DeviceMesh";
  if (shape.empty() && names.empty())
    throw InvalidArgument(op, "empty mesh: the shape has no axes",
                          "give at least one axis, e.g. shape {4} with names {\"data\"}");
  if (shape.size() != names.size())
    throw InvalidArgument(op,
                          fmt::format("shape has {} axes ({}) but {} axis names were given ({})",
                                      shape.size(), join_ints(shape, ", "), names.size(), join(names, ", ")),
                          "give exactly one name per axis");
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].empty())
      throw InvalidArgument(op, fmt::format("axis {} has an empty name", i),
                            "name every axis, e.g. data, tensor, pipeline");
    if (!std::all_of(names[i].begin(), names[i].end(), valid_name_char))
      throw InvalidArgument(
          op, fmt::format("axis name '{}' has characters other than letters, digits, '_' and '-'", names[i]),
          "use names like data, tensor, pipeline, expert_0");
    for (size_t j = 0; j < i; ++j)
      if (names[j] == names[i])
        throw InvalidArgument(op,
                              fmt::format("axis name '{}' is used twice (axes {} and {})", names[i], j, i),
                              "give every axis a distinct name");
  }
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] < 1)
      throw InvalidArgument(op, fmt::format("axis '{}' (axis {}) has size {}", names[i], i, shape[i]),
                            "every axis size must be >= 1 (use 1 for an unused axis)");
  const int64_t n = num_ranks(shape);
  if (n > std::numeric_limits<int>::max())
    throw InvalidArgument(op,
                          fmt::format("mesh {} has more than {} ranks", format_mesh(shape, names),
                                      std::numeric_limits<int>::max()),
                          "use smaller axis sizes");
  if (world_size && n != *world_size) {
    std::string hint = fmt::format("use sizes whose product is {}", *world_size);
    if (*world_size >= 1) hint += ", e.g. " + suggest_for(shape, names, *world_size);
    throw InvalidArgument(
        op,
        fmt::format("mesh {} has {} ranks but the world has {}", format_mesh(shape, names), n, *world_size),
        hint);
  }
}

std::vector<int> unravel(int rank, const std::vector<int>& shape) {
  const int64_t n = num_ranks(shape);
  if (std::any_of(shape.begin(), shape.end(), [](int s) { return s < 1; }))
    throw InvalidArgument("mesh::unravel", fmt::format("shape {} has a size < 1", format_mesh(shape)),
                          "every axis size must be >= 1");
  if (rank < 0 || rank >= n)
    throw InvalidArgument("mesh::unravel",
                          fmt::format("rank {} out of range for mesh {}", rank, format_mesh(shape)),
                          fmt::format("use a rank in [0, {})", n));
  std::vector<int> coords(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    coords[i] = rank % shape[i];
    rank /= shape[i];
  }
  return coords;
}

int ravel(const std::vector<int>& coords, const std::vector<int>& shape) {
  if (coords.size() != shape.size())
    throw InvalidArgument("mesh::ravel",
                          fmt::format("{} coordinates ({}) for a {}-D mesh {}", coords.size(),
                                      join_ints(coords, ", "), shape.size(), format_mesh(shape)),
                          "give one coordinate per axis");
  int64_t rank = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (coords[i] < 0 || coords[i] >= shape[i])
      throw InvalidArgument(
          "mesh::ravel",
          fmt::format("coordinate {} on axis {} out of range for mesh {}", coords[i], i, format_mesh(shape)),
          fmt::format("use a coordinate in [0, {})", shape[i]));
    rank = rank * shape[i] + coords[i];
  }
  return static_cast<int>(rank);
}

std::vector<int> group_of(int rank, const std::vector<int>& shape, const std::vector<int>& axes) {
  const int ndim = static_cast<int>(shape.size());
  check_axes(axes, ndim, "mesh::group_of");
  const std::vector<int> coords = unravel(rank, shape);
  const std::vector<int> sub_shape = pick(shape, axes);
  const int n = static_cast<int>(num_ranks(sub_shape));
  std::vector<int> group;
  group.reserve(n);
  std::vector<int> c = coords;
  for (int k = 0; k < n; ++k) {
    const std::vector<int> kc = unravel(k, sub_shape);
    for (size_t i = 0; i < axes.size(); ++i) c[axes[i]] = kc[i];
    group.push_back(ravel(c, shape));
  }
  return group;
}

std::vector<std::vector<int>> groups_along(const std::vector<int>& shape, const std::vector<int>& axes) {
  const int ndim = static_cast<int>(shape.size());
  check_axes(axes, ndim, "mesh::groups_along");
  const std::vector<int> rest = other_axes(axes, ndim);
  const std::vector<int> rest_shape = pick(shape, rest);
  const int ngroups = static_cast<int>(num_ranks(rest_shape));
  std::vector<std::vector<int>> groups;
  groups.reserve(ngroups);
  for (int color = 0; color < ngroups; ++color) {
    const std::vector<int> rc = unravel(color, rest_shape);
    std::vector<int> c(ndim, 0);
    for (size_t i = 0; i < rest.size(); ++i) c[rest[i]] = rc[i];
    groups.push_back(group_of(ravel(c, shape), shape, axes));
  }
  return groups;
}

std::string render_mesh(const std::vector<int>& shape, const std::vector<std::string>& names) {
  validate_mesh(shape, names);
  const int ndim = static_cast<int>(shape.size());
  const int n = static_cast<int>(num_ranks(shape));
  std::string out = fmt::format("mesh {}: {} rank{}\n", format_mesh(shape, names), n, n == 1 ? "" : "s");
  if (n > kMaxRenderRanks) {
    out += fmt::format("(picture and group members left out: more than {} ranks)\n", kMaxRenderRanks);
    for (int a = 0; a < ndim; ++a) {
      std::vector<std::string> fixed;
      for (int b : other_axes({a}, ndim)) fixed.push_back(names[b]);
      out += fmt::format("{} groups (vary {}{}): {} groups of {} ranks\n", names[a], names[a],
                         fixed.empty() ? "" : ", fixed " + join(fixed, ", "), n / shape[a], shape[a]);
    }
    return out;
  }
  if (ndim == 1) {
    render_grid(out, nullptr, 1, names[0], shape[0], 0, n - 1);
  } else {
    const std::vector<int> lead_shape(shape.begin(), shape.end() - 2);
    const int nrows = shape[ndim - 2], ncols = shape[ndim - 1];
    const int nlead = static_cast<int>(num_ranks(lead_shape));
    for (int l = 0; l < nlead; ++l) {
      if (ndim > 2) {
        const std::vector<int> lc = unravel(l, lead_shape);
        std::vector<std::string> parts;
        for (size_t i = 0; i < lc.size(); ++i) parts.push_back(fmt::format("{}={}", names[i], lc[i]));
        out += join(parts, ", ") + ":\n";
      }
      render_grid(out, &names[ndim - 2], nrows, names[ndim - 1], ncols, l * nrows * ncols, n - 1);
    }
  }
  for (int a = 0; a < ndim; ++a) {
    std::vector<std::string> fixed;
    for (int b : other_axes({a}, ndim)) fixed.push_back(names[b]);
    out += fmt::format("{} groups (vary {}{}):", names[a], names[a],
                       fixed.empty() ? "" : ", fixed " + join(fixed, ", "));
    for (const auto& g : groups_along(shape, {a})) out += " [" + join_ints(g, " ") + "]";
    out += '\n';
  }
  return out;
}

// ---- DeviceMesh -----------------------------------------------------------------

DeviceMesh::DeviceMesh(comm::Communicator& world, std::vector<int> shape, std::vector<std::string> axis_names)
    : world_(&world), shape_(std::move(shape)), axis_names_(std::move(axis_names)) {
  // Local checks first: every rank sees the same world size, so a bad mesh
  // throws the same error everywhere before anyone waits on a collective.
  validate_mesh(shape_, axis_names_, world.size());
  coords_ = unravel(world.rank(), shape_);

  // Ranks that passed different meshes would split into inconsistent groups.
  const auto mine = static_cast<int64_t>(digest(shape_, axis_names_));
  std::vector<int64_t> all(world.size());
  world.all_gather(&mine, all.data(), 1, DType::i64);
  std::vector<int> differ;
  for (int r = 1; r < world.size(); ++r)
    if (all[r] != all[0]) differ.push_back(r);
  if (!differ.empty())
    throw InvalidArgument("DeviceMesh",
                          fmt::format("rank{} {} passed a different shape or axis names than rank 0 "
                                      "(this rank, {}, has {})",
                                      differ.size() > 1 ? "s" : "", join_ints(differ, ", "), world.rank(),
                                      format_mesh(shape_, axis_names_)),
                          "build the mesh from the same configuration on every rank");

  axis_comms_.reserve(shape_.size());
  for (int a = 0; a < ndim(); ++a) {
    const auto [color, key] = color_key(coords_, shape_, {a});
    auto sub = world.split(color, key);
    if (!sub || sub->size() != shape_[a] || sub->rank() != coords_[a])
      throw Error(
          "DeviceMesh",
          fmt::format("split for axis '{}' gave rank {} of {}, expected rank {} of {}", axis_names_[a],
                      sub ? sub->rank() : -1, sub ? sub->size() : 0, coords_[a], shape_[a]),
          "the engine's split does not order ranks by (key, old rank); report this bug");
    axis_comms_.push_back(std::move(sub));
  }
}

DeviceMesh::~DeviceMesh() = default;
DeviceMesh::DeviceMesh(DeviceMesh&&) noexcept = default;
DeviceMesh& DeviceMesh::operator=(DeviceMesh&&) noexcept = default;

int DeviceMesh::size() const { return world_->size(); }
int DeviceMesh::rank() const { return world_->rank(); }

int DeviceMesh::axis_index(std::string_view name) const {
  for (size_t i = 0; i < axis_names_.size(); ++i)
    if (axis_names_[i] == name) return static_cast<int>(i);
  throw InvalidArgument("DeviceMesh::axis_index",
                        fmt::format("unknown axis '{}' in mesh {}", name, format_mesh(shape_, axis_names_)),
                        "valid axis names: " + join(axis_names_, ", "));
}

std::vector<int> DeviceMesh::axis_indices(const std::vector<std::string>& axes, const char* op) const {
  std::vector<int> idx;
  idx.reserve(axes.size());
  for (const auto& name : axes) {
    const int a = axis_index(name);
    if (std::find(idx.begin(), idx.end(), a) != idx.end())
      throw InvalidArgument(op, fmt::format("axis '{}' listed twice in ({})", name, join(axes, ", ")),
                            "list each axis once");
    idx.push_back(a);
  }
  return idx;
}

comm::Communicator& DeviceMesh::comm(std::string_view axis) const { return *axis_comms_[axis_index(axis)]; }

comm::Communicator& DeviceMesh::comm(const std::vector<std::string>& axes) {
  const std::vector<int> idx = axis_indices(axes, "DeviceMesh::comm");
  if (idx.size() == 1) return *axis_comms_[idx[0]];
  std::vector<int> all(ndim());
  std::iota(all.begin(), all.end(), 0);
  if (idx == all) return *world_;
  auto it = group_comms_.find(idx);
  if (it != group_comms_.end()) return *it->second;
  const auto [color, key] = color_key(coords_, shape_, idx);
  auto sub = world_->split(color, key);
  const int expected = static_cast<int>(num_ranks(pick(shape_, idx)));
  if (!sub || sub->size() != expected || sub->rank() != key)
    throw Error("DeviceMesh::comm",
                fmt::format("split for axes ({}) gave rank {} of {}, expected rank {} of {}",
                            join(axes, ", "), sub ? sub->rank() : -1, sub ? sub->size() : 0, key, expected),
                "the engine's split does not order ranks by (key, old rank); report this bug");
  return *group_comms_.emplace(idx, std::move(sub)).first->second;
}

std::vector<std::pair<std::string, comm::Communicator*>> DeviceMesh::communicators() const {
  std::vector<std::pair<std::string, comm::Communicator*>> out;
  for (size_t a = 0; a < axis_comms_.size(); ++a) out.emplace_back(axis_names_[a], axis_comms_[a].get());
  for (const auto& [idx, c] : group_comms_) {
    std::string name;
    for (int a : idx) name += (name.empty() ? "" : "+") + axis_names_[static_cast<size_t>(a)];
    out.emplace_back(name.empty() ? "self" : std::move(name), c.get());
  }
  out.emplace_back("world", world_);
  return out;
}

std::vector<int> DeviceMesh::group_ranks(const std::vector<std::string>& axes) const {
  return group_of(rank(), shape_, axis_indices(axes, "DeviceMesh::group_ranks"));
}

std::vector<std::vector<int>> DeviceMesh::all_groups(const std::vector<std::string>& axes) const {
  return groups_along(shape_, axis_indices(axes, "DeviceMesh::all_groups"));
}

std::string DeviceMesh::to_string() const { return render_mesh(shape_, axis_names_); }

}  // namespace meshtrain::mesh
