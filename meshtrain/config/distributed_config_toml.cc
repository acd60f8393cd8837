// DistributedConfig's TOML loader, kept apart so toml++ stays inside this
// file (no public header includes it).
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::config {
namespace {

constexpr const char* kOp = "DistributedConfig";

const char* type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    default: return "a date or time";
  }
}

bool is_toml_section(std::string_view name) {
  return std::find(std::begin(kTomlSections), std::end(kTomlSections), name) != std::end(kTomlSections);
}

std::string toml_section_list() {
  std::vector<std::string> names;
  for (std::string_view s : kTomlSections) names.push_back(fmt::format("[{}]", s));
  return fmt::format("{}", fmt::join(names, ", "));
}

[[noreturn]] void unknown_key(std::string_view where, std::string_view key, bool top_level) {
  std::string hint = unknown_key_hint(key);
  if (top_level) hint += "; in a file with sections, put these keys under [distributed] (training keys under [train])";
  throw InvalidArgument(kOp, fmt::format("{}: unknown key '{}'", where, key), hint);
}

[[noreturn]] void wrong_type(std::string_view where, const toml::node& n, std::string_view wanted,
                             std::string_view example) {
  throw InvalidArgument(kOp, fmt::format("{} must be {}, got {}", where, wanted, type_name(n)),
                        fmt::format("write e.g. {}", example));
}

// A field's TOML value as the text its parser takes.
std::string value_text(const ConfigField& f, const toml::node& n, std::string_view where) {
  if (f.type == "bool") {
    if (auto v = n.as_boolean()) return v->get() ? "true" : "false";
    wrong_type(where, n, "a boolean", fmt::format("{} = true", f.key));
  }
  if (f.type == "int") {
    if (auto v = n.as_integer()) return fmt::to_string(v->get());
    wrong_type(where, n, "an integer", fmt::format("{} = 4", f.key));
  }
  if (auto v = n.as_string()) return v->get();
  wrong_type(where, n, "a string", f.type == "mesh" ? std::string("mesh = \"data=2,tensor=2\"")
                                                    : fmt::format("{} = \"{}\"", f.key, f.format({})));
}

std::vector<int> int_array(const toml::node& n, std::string_view where) {
  const toml::array* a = n.as_array();
  if (!a) wrong_type(where, n, "an array of integers", "mesh_shape = [2, 2]");
  std::vector<int> out;
  for (const toml::node& e : *a) {
    auto v = e.as_integer();
    if (!v) wrong_type(where, e, "an array of integers", "mesh_shape = [2, 2]");
    check_int_in_range(v->get(), where, 1, std::numeric_limits<int>::max(), kOp);
    out.push_back(static_cast<int>(v->get()));
  }
  return out;
}

std::vector<std::string> string_array(const toml::node& n, std::string_view where) {
  const toml::array* a = n.as_array();
  if (!a) wrong_type(where, n, "an array of strings", "mesh_axis_names = [\"data\", \"tensor\"]");
  std::vector<std::string> out;
  for (const toml::node& e : *a) {
    auto v = e.as_string();
    if (!v) wrong_type(where, e, "an array of strings", "mesh_axis_names = [\"data\", \"tensor\"]");
    out.push_back(v->get());
  }
  return out;
}

}  // namespace

DistributedConfig DistributedConfig::with_toml(std::string_view text, std::string_view source_name) const {
  toml::table doc;
  try {
    doc = toml::parse(text, std::string(source_name));
  } catch (const toml::parse_error& e) {
    throw InvalidArgument(kOp,
                          fmt::format("{}:{}:{}: {}", source_name, e.source().begin.line, e.source().begin.column,
                                      e.description()),
                          "fix the TOML syntax at that position");
  }
  // The file may hold any of the project's sections (kTomlSections); ours is
  // [distributed], or the top-level keys when there is no such table. Other
  // known sections belong to other loaders; anything else is an error here,
  // so a misspelt section is never silently skipped.
  const toml::table* table = &doc;
  const bool top_level = !doc.contains("distributed");
  if (!top_level) {
    table = doc["distributed"].as_table();
    if (!table)
      throw InvalidArgument(kOp, fmt::format("{}: distributed must be a table", source_name),
                            "write the keys under a [distributed] header");
  }
  for (auto&& [k, v] : doc) {
    const std::string_view key = k.str();
    if (key == "distributed") continue;
    const std::string at = fmt::format("{}:{}:{}", source_name, k.source().begin.line, k.source().begin.column);
    if (v.is_table()) {
      if (is_toml_section(key)) continue;
      throw InvalidArgument(kOp, fmt::format("{}: unknown section [{}]", at, key),
                            fmt::format("a meshtrain TOML file holds the sections {}", toml_section_list()));
    }
    if (!top_level)
      throw InvalidArgument(kOp, fmt::format("{}: key '{}' is outside any section, but the file has [distributed]", at,
                                             key),
                            "move it under [distributed] (or under [train], for a training key)");
  }
  // Visit keys in file order, so the first error is the first in the file.
  std::vector<std::pair<std::string, const toml::node*>> entries;
  for (auto&& [k, v] : *table)
    if (!(top_level && v.is_table())) entries.emplace_back(std::string(k.str()), &v);  // sections: checked above
  std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    return a.second->source().begin.line < b.second->source().begin.line;
  });

  DistributedConfig c = *this;
  std::set<std::string> given;
  for (const auto& [key, node] : entries) {
    const std::string where = fmt::format("{}:{}: {}", source_name, node->source().begin.line, key);
    if (key == "mesh_shape") {
      c.mesh_shape = int_array(*node, where);
    } else if (key == "mesh_axis_names") {
      c.mesh_axis_names = string_array(*node, where);
    } else {
      const auto fields = distributed_config_fields();
      auto f = std::find_if(fields.begin(), fields.end(), [&](const ConfigField& x) { return x.key == key; });
      if (f == fields.end()) unknown_key(fmt::format("{}:{}", source_name, node->source().begin.line), key, top_level);
      f->parse(c, value_text(*f, *node, where), where);
    }
    given.insert(key);
  }
  finish_overlay(c, GivenKeys::of(given), source_name, "mesh = \"data=2,tensor=2\", or the two arrays");
  return c;
}

DistributedConfig DistributedConfig::with_toml_file(const std::string& path) const {
  std::ifstream in(path);
  if (!in)
    throw IoError("DistributedConfig::with_toml_file", fmt::format("cannot read '{}': {}", path, std::strerror(errno)),
                  "check the path and its permissions");
  std::stringstream text;
  text << in.rdbuf();
  return with_toml(text.str(), path);
}

}  // namespace meshtrain::config
