// The mesh vocabulary (mesh_shape.h).
#include "meshtrain/mesh/mesh_shape.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <charconv>
#include <cstdint>
#include <optional>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::mesh {
namespace {

// f^k >= m, without overflow.
bool pow_at_least(int64_t f, int k, int64_t m) {
  int64_t p = 1;
  for (int i = 0; i < k; ++i) {
    if (p >= m) return true;
    p *= f;
  }
  return p >= m;
}

// Lexicographically smallest non-increasing factorization of m into k factors,
// each <= cap (largest first), or nullopt. `divs` holds the divisors of the
// original n (a superset of m's). Greedy is exact: the first feasible largest
// factor is the smallest possible one, and the rest is solved the same way.
std::optional<std::vector<int>> balanced(int m, int k, int cap, const std::vector<int>& divs) {
  if (k == 1) {
    if (m > cap) return std::nullopt;
    return std::vector<int>{m};
  }
  for (int f : divs) {
    if (f > cap || f > m) break;
    if (m % f != 0 || !pow_at_least(f, k, m)) continue;
    if (auto rest = balanced(m / f, k - 1, f, divs)) {
      rest->insert(rest->begin(), f);
      return rest;
    }
  }
  return std::nullopt;
}

}  // namespace

std::string known_axes_list() { return fmt::format("{}", fmt::join(kKnownAxes, ", ")); }

bool is_known_axis(std::string_view name) {
  return std::find(kKnownAxes.begin(), kKnownAxes.end(), name) != kKnownAxes.end();
}

int NamedShape::size_of(std::string_view name) const {
  for (size_t i = 0; i < axis_names.size() && i < shape.size(); ++i)
    if (axis_names[i] == name) return shape[i];
  return 1;
}

bool NamedShape::has(std::string_view name) const {
  return std::find(axis_names.begin(), axis_names.end(), name) != axis_names.end();
}

std::string NamedShape::to_spec() const {
  std::string out;
  for (size_t i = 0; i < shape.size() && i < axis_names.size(); ++i)
    out += fmt::format("{}{}={}", i ? "," : "", axis_names[i], shape[i]);
  return out;
}

NamedShape parse_mesh_spec(std::string_view spec) {
  const char* op = "parse_mesh_spec";
  const char* hint = "write the mesh as name=size pairs separated by commas, e.g. data=2,tensor=2";
  NamedShape out;
  if (trim(spec).empty()) throw InvalidArgument(op, "empty mesh", hint);
  for (const std::string_view piece : split(spec)) {
    const std::string_view token = trim(piece);
    const size_t eq = token.find('=');
    if (eq == std::string_view::npos)
      throw InvalidArgument(op, fmt::format("'{}' in mesh '{}' has no '='", token, spec), hint);
    const std::string_view name = trim(token.substr(0, eq));
    const std::string_view size = trim(token.substr(eq + 1));
    if (name.empty()) throw InvalidArgument(op, fmt::format("'{}' in mesh '{}' has no axis name", token, spec), hint);
    int value = 0;
    auto [end, ec] = std::from_chars(size.data(), size.data() + size.size(), value);
    if (size.empty() || ec != std::errc() || end != size.data() + size.size() || value < 1)
      throw InvalidArgument(op, fmt::format("axis '{}' in mesh '{}' has size '{}'", name, spec, size),
                            "axis sizes are integers from 1 to 2147483647, e.g. data=2,tensor=2");
    out.axis_names.emplace_back(name);
    out.shape.push_back(value);
  }
  return out;
}

std::vector<int> get_optimal_mesh_shape(int n, int dims) {
  if (n < 1)
    throw InvalidArgument("get_optimal_mesh_shape", fmt::format("device count {} < 1", n),
                          "pass the number of devices, at least 1");
  if (dims < 1)
    throw InvalidArgument("get_optimal_mesh_shape", fmt::format("dims {} < 1", dims),
                          "ask for at least one mesh axis");
  auto best = balanced(n, dims, n, divisors(n));  // always exists: (n, 1, ..., 1)
  std::reverse(best->begin(), best->end());
  return *best;
}

std::optional<NamedShape> resize_data_axis(const NamedShape& m, int world_size) {
  if (world_size < 1)
    throw InvalidArgument("resize_data_axis", fmt::format("world size {}", world_size), "need at least 1 device");
  int64_t others = 1, fixed = 1;  // the axes but data; but data and fsdp
  for (size_t i = 0; i < m.shape.size(); ++i) {
    if (m.axis_names[i] != kData) others *= m.shape[i];
    if (m.axis_names[i] != kData && m.axis_names[i] != kFsdp) fixed *= m.shape[i];
  }
  NamedShape out = m;
  if (world_size % others != 0) {
    if (world_size % fixed != 0 || m.size_of(kFsdp) == 1) return std::nullopt;
    const int rest = static_cast<int>(world_size / fixed);
    for (size_t i = 0; i < out.shape.size(); ++i)
      if (out.axis_names[i] == kFsdp) out.shape[i] = std::gcd(out.shape[i], rest);
    others = fixed * std::gcd(m.size_of(kFsdp), rest);
  }
  const int data = static_cast<int>(world_size / others);
  for (size_t i = 0; i < out.shape.size(); ++i)
    if (out.axis_names[i] == kData) {
      out.shape[i] = data;
      return out;
    }
  if (data == 1) return out;
  const size_t at = !out.axis_names.empty() && out.axis_names.front() == kPipeline ? 1 : 0;
  out.axis_names.insert(out.axis_names.begin() + static_cast<std::ptrdiff_t>(at), std::string(kData));
  out.shape.insert(out.shape.begin() + static_cast<std::ptrdiff_t>(at), data);
  return out;
}

std::vector<int> divisors(int n) {
  std::vector<int> small, large;
  for (int d = 1; static_cast<int64_t>(d) * d <= n; ++d) {
    if (n % d != 0) continue;
    small.push_back(d);
    if (d != n / d) large.push_back(n / d);
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

void validate_mesh_config(const std::vector<int>& shape, int n_devices) {
  const char* op = "validate_mesh_config";
  if (n_devices < 1)
    throw InvalidArgument(op, fmt::format("device count {} < 1", n_devices), "pass the number of devices, at least 1");
  if (shape.empty())
    throw InvalidArgument(op, "the mesh shape has no axes",
                          fmt::format("use at least one axis, e.g. ({})", n_devices));
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] < 1)
      throw InvalidArgument(op, fmt::format("axis {} of shape ({}) has size {}", i, fmt::join(shape, ", "), shape[i]),
                            "every axis size must be >= 1 (use 1 for an unused axis)");
  int64_t product = 1;
  for (int s : shape) product = std::min<int64_t>(product * s, int64_t{1} << 40);
  if (product != n_devices) {
    const std::vector<int> fix = get_optimal_mesh_shape(n_devices, static_cast<int>(shape.size()));
    const std::string what =
        product < n_devices ? fmt::format("uses {} of {} devices, leaving {} idle", product, n_devices,
                                          n_devices - product)
                            : fmt::format("needs {} devices but there are {}", product, n_devices);
    throw InvalidArgument(op, fmt::format("shape ({}) {}", fmt::join(shape, ", "), what),
                          fmt::format("use sizes whose product is exactly {}, e.g. ({})", n_devices,
                                      fmt::join(fix, ", ")));
  }
}

void validate_mesh_config(const NamedShape& mesh, int n_devices, std::string_view op_name) {
  const std::string op(op_name);
  if (mesh.shape.size() != mesh.axis_names.size())
    throw InvalidArgument(op,
                          fmt::format("the mesh has {} sizes ({}) but {} axis names", mesh.shape.size(),
                                      fmt::join(mesh.shape, ", "), mesh.axis_names.size()),
                          "give one name per axis, e.g. --mesh data=2,tensor=2");
  for (size_t i = 0; i < mesh.axis_names.size(); ++i) {
    const std::string& name = mesh.axis_names[i];
    if (!is_known_axis(name))
      throw InvalidArgument(op, fmt::format("mesh axis '{}' is not one of {}", name, known_axes_list()),
                            "rename the axis to one of those, e.g. --mesh data=2,tensor=2");
    for (size_t j = 0; j < i; ++j)
      if (mesh.axis_names[j] == name)
        throw InvalidArgument(op, fmt::format("mesh axis '{}' appears twice ({})", name, mesh.to_spec()),
                              "give each axis once and multiply the sizes into it");
  }
  try {
    validate_mesh_config(mesh.shape, n_devices);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(op, fmt::format("mesh {}: {}", mesh.to_spec(), e.detail()), e.hint());
  }
}

}  // namespace meshtrain::mesh
