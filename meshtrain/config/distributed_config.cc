#include "meshtrain/config/distributed_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <set>

#include "meshtrain/core/error.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::config {
namespace {

constexpr const char* kOp = "DistributedConfig";

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// Range-checked before narrowing to int (core/strings.h), so no value wraps.
int parse_int(std::string_view text, std::string_view source, int64_t min, int64_t max) {
  return static_cast<int>(parse_int_in_range(text, source, min, max, kOp));
}

bool parse_bool(std::string_view text, std::string_view source) {
  const std::string t = to_lower(trim(text));
  if (t == "true" || t == "1" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "0" || t == "no" || t == "off") return false;
  throw InvalidArgument(kOp, fmt::format("{}: '{}' is not a boolean", source, text), "write true or false");
}

template <int DistributedConfig::*M, int64_t Min, int64_t Max>
void parse_int_field(DistributedConfig& c, std::string_view text, std::string_view source) {
  static_assert(Min <= Max && Max <= kIntMax);
  c.*M = parse_int(text, source, Min, Max);
}

template <int DistributedConfig::*M>
std::string format_int_field(const DistributedConfig& c) {
  return fmt::to_string(c.*M);
}

// The table: every key, flag, help line, parser and formatter, defined once.
constexpr ConfigField kFields[] = {
    {"enabled", "--distributed", "bool", "run distributed; set when a launcher's variables are present",
     [](DistributedConfig& c, std::string_view t, std::string_view s) { c.enabled = parse_bool(t, s); },
     [](const DistributedConfig& c) { return std::string(c.enabled ? "true" : "false"); }},
    {"world_size", "--world-size", "int", "ranks in the job, one per device",
     &parse_int_field<&DistributedConfig::world_size, 1, kIntMax>, &format_int_field<&DistributedConfig::world_size>},
    {"rank", "--rank", "int", "this process's rank, 0..world_size-1 (launchers set it)",
     &parse_int_field<&DistributedConfig::rank, 0, kIntMax>, &format_int_field<&DistributedConfig::rank>},
    {"local_rank", "--local-rank", "int", "rank within its node, 0..num_processes_per_node-1",
     &parse_int_field<&DistributedConfig::local_rank, 0, kIntMax>, &format_int_field<&DistributedConfig::local_rank>},
    {"num_nodes", "--num-nodes", "int", "nodes in the job", &parse_int_field<&DistributedConfig::num_nodes, 1, kIntMax>,
     &format_int_field<&DistributedConfig::num_nodes>},
    {"num_processes_per_node", "--num-processes-per-node", "int",
     "ranks per node (default: world_size / num_nodes)", &parse_int_field<&DistributedConfig::num_processes_per_node, 1, kIntMax>,
     &format_int_field<&DistributedConfig::num_processes_per_node>},
    {"master_addr", "--master-addr", "string", "host of rank 0, for TCP rendezvous (gloo, nccl)",
     [](DistributedConfig& c, std::string_view t, std::string_view) { c.master_addr = std::string(trim(t)); },
     [](const DistributedConfig& c) { return c.master_addr; }},
    {"master_port", "--master-port", "int", "port of rank 0, 1024..65535",
     &parse_int_field<&DistributedConfig::master_port, 1024, 65535>, &format_int_field<&DistributedConfig::master_port>},
    {"backend", "--backend", "engine", "engine: threads, mpi, gloo or nccl",
     [](DistributedConfig& c, std::string_view t, std::string_view s) {
       try {
         c.backend = comm::parse_engine(trim(t));
       } catch (const InvalidArgument& e) {
         throw InvalidArgument(kOp, fmt::format("{}: {}", s, e.detail()), e.hint());
       }
     },
     [](const DistributedConfig& c) { return std::string(comm::engine_name(c.backend)); }},
    {"tensor_parallel_size", "--tensor-parallel-size", "int", "ranks that split every layer (inside a node)",
     &parse_int_field<&DistributedConfig::tensor_parallel_size, 1, kIntMax>,
     &format_int_field<&DistributedConfig::tensor_parallel_size>},
    {"pipeline_parallel_size", "--pipeline-parallel-size", "int", "pipeline stages",
     &parse_int_field<&DistributedConfig::pipeline_parallel_size, 1, kIntMax>,
     &format_int_field<&DistributedConfig::pipeline_parallel_size>},
    {"context_parallel_size", "--context-parallel-size", "int", "ranks that split the sequence",
     &parse_int_field<&DistributedConfig::context_parallel_size, 1, kIntMax>,
     &format_int_field<&DistributedConfig::context_parallel_size>},
    {"mesh", "--mesh", "mesh", "named mesh, e.g. data=2,tensor=2 (default: derived from the sizes)",
     [](DistributedConfig& c, std::string_view t, std::string_view s) {
       if (trim(t).empty()) {
         c.mesh_shape.clear();
         c.mesh_axis_names.clear();
         return;
       }
       try {
         mesh::NamedShape m = mesh::parse_mesh_spec(t);
         c.mesh_shape = std::move(m.shape);
         c.mesh_axis_names = std::move(m.axis_names);
       } catch (const InvalidArgument& e) {
         throw InvalidArgument(kOp, fmt::format("{}: {}", s, e.detail()), e.hint());
       }
     },
     [](const DistributedConfig& c) { return mesh::NamedShape{c.mesh_shape, c.mesh_axis_names}.to_spec(); }},
    {"mixed_precision", "--mixed-precision", "precision", "no (or fp32), fp16 or bf16",
     [](DistributedConfig& c, std::string_view t, std::string_view s) {
       try {
         c.mixed_precision = layout::parse_precision(trim(t), "mixed_precision");
       } catch (const InvalidArgument& e) {
         throw InvalidArgument(kOp, fmt::format("{}: {}", s, e.detail()), e.hint());
       }
     },
     [](const DistributedConfig& c) { return std::string(mixed_precision_name(c.mixed_precision)); }},
};

const ConfigField& field(std::string_view key) {
  for (const ConfigField& f : kFields)
    if (f.key == key) return f;
  throw InvalidArgument(kOp, fmt::format("no field '{}'", key), "internal: the key table and the code disagree");
}

std::string join_ints(const std::vector<int>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += ", ";
    out += fmt::to_string(v[i]);
  }
  return out;
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(ch));
      continue;
    }
    out += ch;
  }
  return out + "\"";
}

// The divisors of n as "1, 2, 4 or 8" (n >= 1, at most 12 of them), else "".
std::string divisor_list(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n && d.size() <= 12; ++i)
    if (n % i == 0) d.push_back(i);
  if (d.size() > 12) return "";
  std::string out;
  for (size_t i = 0; i < d.size(); ++i)
    out += fmt::format("{}{}", i == 0 ? "" : (i + 1 == d.size() ? " or " : ", "), d[i]);
  return out;
}

void check_positive(const char* key, int v, const char* hint) {
  if (v < 1) throw InvalidArgument(kOp, fmt::format("{} must be >= 1, got {}", key, v), hint);
}

}  // namespace

std::string_view mixed_precision_name(DType precision) {
  return precision == DType::f32 ? "no" : layout::precision_name(precision);
}

std::string_view launcher_name(Launcher l) {
  switch (l) {
    case Launcher::none: return "none";
    case Launcher::torchrun: return "torchrun";
    case Launcher::mpirun: return "mpirun";
  }
  return "?";
}

const std::string* LauncherEnv::find(std::string_view name) const {
  auto it = variables.find(std::string(name));
  return it == variables.end() ? nullptr : &it->second;
}

Launcher LauncherEnv::launcher() const {
  if (find("OMPI_COMM_WORLD_SIZE") || find("PMIX_RANK")) return Launcher::mpirun;
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})
    if (find(v)) return Launcher::torchrun;
  return Launcher::none;
}

LauncherEnv read_launcher_env() {
  LauncherEnv env;
  for (std::string_view name : kLauncherVariables)
    if (const char* v = std::getenv(std::string(name).c_str())) env.variables.emplace(name, v);
  return env;
}

std::string read_job_token() {
  const char* v = std::getenv("MESHTRAIN_JOB_TOKEN");
  return v ? v : "";
}

std::span<const ConfigField> distributed_config_fields() { return kFields; }

void derive_processes_per_node(DistributedConfig& c, bool gave_world_or_nodes, bool gave_processes_per_node) {
  if (gave_world_or_nodes && !gave_processes_per_node && c.num_nodes > 0 && c.world_size > 0 &&
      c.world_size % c.num_nodes == 0)
    c.num_processes_per_node = c.world_size / c.num_nodes;
}

void finish_overlay(DistributedConfig& c, const GivenKeys& given, std::string_view where, std::string_view how) {
  if (given.mesh && (given.mesh_shape || given.mesh_axis_names))
    throw InvalidArgument(kOp,
                          fmt::format("{}{}both mesh and mesh_shape/mesh_axis_names are given", where,
                                      where.empty() ? "" : ": "),
                          fmt::format("give the mesh once: {}", how));
  if (given.mesh_shape && !given.mesh_axis_names) c.mesh_axis_names.clear();
  if (given.mesh_axis_names && !given.mesh_shape) c.mesh_shape.clear();
  derive_processes_per_node(c, given.world_or_nodes, given.processes_per_node);
}

void DistributedConfig::validate() const {
  // 1. Ranges.
  check_positive("world_size", world_size, "set world_size to the number of ranks, e.g. 4");
  check_positive("num_nodes", num_nodes, "set num_nodes to the number of machines, at least 1");
  check_positive("num_processes_per_node", num_processes_per_node,
                 "set num_processes_per_node to the ranks on each node, at least 1");
  check_positive("tensor_parallel_size", tensor_parallel_size, "use 1 for no tensor parallelism");
  check_positive("pipeline_parallel_size", pipeline_parallel_size, "use 1 for a single pipeline stage");
  check_positive("context_parallel_size", context_parallel_size, "use 1 for no context parallelism");
  if (rank < 0) throw InvalidArgument(kOp, fmt::format("rank must be >= 0, got {}", rank), "ranks count from 0");
  if (local_rank < 0)
    throw InvalidArgument(kOp, fmt::format("local_rank must be >= 0, got {}", local_rank), "local ranks count from 0");
  if (master_port < 1024 || master_port > 65535)
    throw InvalidArgument(kOp, fmt::format("master_port {} is outside [1024, 65535]", master_port),
                          "use a free unprivileged port, e.g. 29500");
  if (trim(master_addr).empty())
    throw InvalidArgument(kOp, "master_addr is empty", "set it to the host of rank 0, e.g. localhost");
  // 2. Ranks inside their ranges.
  if (rank >= world_size)
    throw InvalidArgument(kOp, fmt::format("rank {} is not below world_size {}", rank, world_size),
                          fmt::format("ranks run 0..world_size-1: set rank below {}, or world_size above {}",
                                      world_size, rank));
  if (local_rank >= num_processes_per_node)
    throw InvalidArgument(kOp,
                          fmt::format("local_rank {} is not below num_processes_per_node {}", local_rank,
                                      num_processes_per_node),
                          fmt::format("local ranks run 0..num_processes_per_node-1: set local_rank below {}, or "
                                      "num_processes_per_node above {}",
                                      num_processes_per_node, local_rank));
  // 3. Nodes.
  if (int64_t{num_nodes} * num_processes_per_node != world_size) {
    std::string hint = fmt::format("set world_size = {}", int64_t{num_nodes} * num_processes_per_node);
    if (world_size % num_nodes == 0)
      hint = fmt::format("set num_processes_per_node = {} (world_size / num_nodes), or {}", world_size / num_nodes,
                         hint);
    throw InvalidArgument(kOp,
                          fmt::format("world_size {} != num_nodes {} x num_processes_per_node {} = {}", world_size,
                                      num_nodes, num_processes_per_node, int64_t{num_nodes} * num_processes_per_node),
                          hint);
  }
  // 4. Engine.
  if (backend == comm::Engine::threads && num_nodes > 1)
    throw InvalidArgument(kOp, fmt::format("backend threads runs every rank in one process, but num_nodes is {}",
                                           num_nodes),
                          "use backend mpi, gloo or nccl across nodes, or set num_nodes = 1");
  // 5. Parallel sizes.
  const int64_t model = int64_t{tensor_parallel_size} * pipeline_parallel_size * context_parallel_size;
  if (model > world_size || world_size % model != 0) {
    const std::string divs = divisor_list(world_size);
    throw InvalidArgument(
        kOp,
        fmt::format("tensor_parallel_size {} x pipeline_parallel_size {} x context_parallel_size {} = {} {} "
                    "world_size {}",
                    tensor_parallel_size, pipeline_parallel_size, context_parallel_size, model,
                    model > world_size ? "exceeds" : "does not divide", world_size),
        divs.empty() ? fmt::format("choose parallel sizes whose product divides {}", world_size)
                     : fmt::format("choose parallel sizes whose product divides {} ({})", world_size, divs));
  }
  // 6. Mesh.
  if (mesh_shape.empty() && mesh_axis_names.empty()) return;
  if (mesh_shape.empty())
    throw InvalidArgument(kOp, fmt::format("mesh_axis_names ({}) given without mesh_shape",
                                           fmt::join(mesh_axis_names, ", ")),
                          "give mesh_shape too, or write the mesh as mesh = \"data=2,tensor=2\"");
  const mesh::NamedShape m{mesh_shape, mesh_axis_names};
  mesh::validate_mesh_config(m, world_size, kOp);
  struct Axis {
    std::string_view name;
    const char* key;
    int size;
  };
  for (const Axis& a : {Axis{mesh::kTensor, "tensor_parallel_size", tensor_parallel_size},
                        Axis{mesh::kPipeline, "pipeline_parallel_size", pipeline_parallel_size},
                        Axis{mesh::kContext, "context_parallel_size", context_parallel_size}}) {
    const int got = m.size_of(a.name);
    if (got == a.size) continue;
    if (std::find(mesh_axis_names.begin(), mesh_axis_names.end(), a.name) == mesh_axis_names.end())
      throw InvalidArgument(kOp, fmt::format("mesh {} has no {} axis but {} is {}", m.to_spec(), a.name, a.key, a.size),
                            fmt::format("add {}={} to the mesh, or set {} = 1", a.name, a.size, a.key));
    throw InvalidArgument(kOp, fmt::format("mesh {} has {}={} but {} is {}", m.to_spec(), a.name, got, a.key, a.size),
                          fmt::format("make them equal: set {} = {}, or the mesh's {} axis to {}", a.key, got, a.name,
                                      a.size));
  }
}

bool DistributedConfig::is_valid() const {
  try {
    validate();
    return true;
  } catch (const InvalidArgument&) {
    return false;
  }
}

int DistributedConfig::data_parallel_size() const {
  const int64_t model = int64_t{tensor_parallel_size} * pipeline_parallel_size * context_parallel_size;
  if (model < 1 || world_size < 1) return 0;
  return static_cast<int>(world_size / model);
}

mesh::NamedShape DistributedConfig::mesh() const {
  if (!mesh_shape.empty() || !mesh_axis_names.empty()) return {mesh_shape, mesh_axis_names};
  mesh::NamedShape m;
  const int sizes[] = {pipeline_parallel_size, data_parallel_size(), 1, context_parallel_size, tensor_parallel_size};
  static_assert(std::size(sizes) == mesh::kMeshAxisOrder.size());
  for (size_t i = 0; i < mesh::kMeshAxisOrder.size(); ++i)
    if (sizes[i] > 1) {
      m.shape.push_back(sizes[i]);
      m.axis_names.emplace_back(mesh::kMeshAxisOrder[i]);
    }
  if (m.shape.empty()) m = {{1}, {std::string(mesh::kData)}};
  return m;
}

void DistributedConfig::set_mesh(const mesh::NamedShape& m) {
  mesh_shape = m.shape;
  mesh_axis_names = m.axis_names;
  tensor_parallel_size = m.size_of(mesh::kTensor);
  pipeline_parallel_size = m.size_of(mesh::kPipeline);
  context_parallel_size = m.size_of(mesh::kContext);
}

ParallelismConfig DistributedConfig::parallelism_config() const {
  const mesh::NamedShape m = mesh();
  return ParallelismConfig::from_layout({.mesh = m, .fsdp = layout::resolve_fsdp_mode("", m, DType::f32)});
}

std::vector<std::string_view> distributed_config_keys() {
  std::vector<std::string_view> keys;
  for (const ConfigField& f : kFields) keys.push_back(f.key);
  keys.push_back("mesh_shape");
  keys.push_back("mesh_axis_names");
  return keys;
}

std::string unknown_key_hint(std::string_view key) {
  const auto keys = distributed_config_keys();
  const std::string_view close = closest_name(key, keys);
  return fmt::format("{}known keys: {}", close.empty() ? "" : fmt::format("did you mean '{}'? ", close),
                     fmt::join(keys, ", "));
}

DistributedConfig DistributedConfig::with_values(const std::vector<std::pair<std::string, std::string>>& values,
                                                 std::string_view source) const {
  DistributedConfig c = *this;
  std::set<std::string_view> given;
  const std::string prefix = source.empty() ? "" : fmt::format("{}: ", source);
  for (const auto& [key, text] : values) {
    const std::string where = prefix + key;
    if (key == "mesh_shape") {
      c.mesh_shape.clear();
      if (!trim(text).empty())
        for (std::string_view size : split(text))
          c.mesh_shape.push_back(static_cast<int>(
              parse_int_in_range(size, where, 1, std::numeric_limits<int>::max(), kOp)));
    } else if (key == "mesh_axis_names") {
      c.mesh_axis_names.clear();
      if (!trim(text).empty())
        for (std::string_view name : split(text)) c.mesh_axis_names.emplace_back(trim(name));
    } else {
      const auto f = std::find_if(std::begin(kFields), std::end(kFields), [&](const ConfigField& x) {
        return x.key == key;
      });
      if (f == std::end(kFields))
        throw InvalidArgument(kOp, fmt::format("{}unknown key '{}'", prefix, key), unknown_key_hint(key));
      f->parse(c, text, where);
    }
    given.insert(key);
  }
  finish_overlay(c, GivenKeys::of(given), source, "mesh=\"data=2,tensor=2\", or the two sequences");
  return c;
}

DistributedConfig DistributedConfig::with_env(const LauncherEnv& env) const {
  DistributedConfig c = *this;
  auto find = [&](const char* name) -> const std::string* { return name ? env.find(name) : nullptr; };
  struct Source {
    const char* key;
    const char* torchrun;
    const char* ompi;
  };
  const Source sources[] = {{"rank", "RANK", "OMPI_COMM_WORLD_RANK"},
                            {"world_size", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"},
                            {"local_rank", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"},
                            {"num_processes_per_node", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"},
                            {"master_addr", "MASTER_ADDR", nullptr},
                            {"master_port", "MASTER_PORT", nullptr}};
  std::set<std::string_view> given;
  bool ompi = false;
  for (const Source& s : sources) {
    const std::string* t = find(s.torchrun);
    const std::string* o = find(s.ompi);
    if (t && o && trim(*t) != trim(*o))
      throw InvalidArgument(kOp, fmt::format("{}={} but {}={}", s.torchrun, *t, s.ompi, *o),
                            "two launchers set this job's variables; unset the ones that do not belong to it");
    if (!t && !o) continue;
    field(s.key).parse(c, o ? *o : *t, o ? s.ompi : s.torchrun);
    given.insert(s.key);
    ompi = ompi || o;
  }
  if (const std::string* reason = find("MESHTRAIN_RESTART_REASON"); reason && !reason->empty()) {
    c.restart.reason = *reason;
    const std::string* at = find("MESHTRAIN_RESTART_EVENT_MS");
    const std::string* rendezvous = find("MESHTRAIN_RESTART_RENDEZVOUS_MS");
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    c.restart.event_unix_ms = at ? parse_int_in_range(*at, "MESHTRAIN_RESTART_EVENT_MS", 0, kMax, kOp) : 0;
    c.restart.rendezvous_ms =
        rendezvous ? parse_int_in_range(*rendezvous, "MESHTRAIN_RESTART_RENDEZVOUS_MS", 0, kMax, kOp) : 0;
  }
  const Launcher launcher = env.launcher();
  // Under mpirun the engine is mpi even when only PMIX_RANK says so.
  if (launcher == Launcher::mpirun) c.backend = comm::Engine::mpi;
  if (launcher != Launcher::none) c.launcher = launcher;
  if (given.empty()) return c;
  c.enabled = true;
  if (ompi) c.backend = comm::Engine::mpi;
  c.launcher_env.clear();
  for (std::string_view name : kLauncherVariables)
    if (const std::string* v = env.find(name)) c.launcher_env.push_back(fmt::format("{}={}", name, *v));
  const bool gave_world = given.count("world_size") > 0, gave_local = given.count("num_processes_per_node") > 0;
  if (gave_world && gave_local) {
    const char* w = find("OMPI_COMM_WORLD_SIZE") ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE";
    const char* l = find("OMPI_COMM_WORLD_LOCAL_SIZE") ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "LOCAL_WORLD_SIZE";
    if (c.num_processes_per_node < 1 || c.world_size % c.num_processes_per_node != 0)
      throw InvalidArgument(kOp, fmt::format("{}={} is not a multiple of {}={}", w, c.world_size, l,
                                             c.num_processes_per_node),
                            "every node must run the same number of ranks; check the launcher's arguments");
    c.num_nodes = c.world_size / c.num_processes_per_node;
  } else {
    derive_processes_per_node(c, gave_world, gave_local);
  }
  return c;
}

std::string DistributedConfig::to_toml() const {
  std::string out;
  if (!launcher_env.empty()) out += fmt::format("# launcher environment: {}\n", fmt::join(launcher_env, " "));
  out += "[distributed]\n";
  for (const ConfigField& f : kFields) {
    if (f.type == "mesh" && mesh_shape.size() != mesh_axis_names.size()) {
      std::vector<std::string> names;
      for (const auto& n : mesh_axis_names) names.push_back(quote(n));
      out += fmt::format("mesh_shape = [{}]\nmesh_axis_names = [{}]\n", join_ints(mesh_shape), fmt::join(names, ", "));
      continue;
    }
    const std::string v = f.format(*this);
    const bool bare = f.type == "bool" || f.type == "int";
    out += fmt::format("{} = {}", f.key, bare ? v : quote(v));
    if (f.type == "mesh" && v.empty()) out += fmt::format("  # derived: {}", mesh().to_spec());
    out += "\n";
  }
  return out;
}

std::string DistributedConfig::to_string() const {
  std::string out;
  for (const ConfigField& f : kFields) {
    std::string v = f.format(*this);
    if (f.type == "mesh" && v.empty()) v = mesh().to_spec() + " (derived)";
    out += fmt::format("{}{}={}", out.empty() ? "" : " ", f.key, v);
  }
  return out;
}

}  // namespace meshtrain::config
