// DistributedConfig: where this process sits in the job (world size, rank,
// local rank, nodes, rendezvous address), which engine moves the bytes, the
// parallel sizes and mesh, and mixed precision. Built from a TOML file, from
// the variables a launcher sets (torchrun, mpirun) and from CLI flags, all
// driven by one table of fields (distributed_config_fields()), so every key
// is defined once and --help, TOML and the dump agree.
//
//   using namespace meshtrain::config;
//   DistributedConfig c = DistributedConfig::from_toml_file("run.toml")   // defaults < TOML
//                             .with_env(read_launcher_env());             //          < launcher
//   c = flags.config(c);                 // < CLI flags (see distributed_flags.h)
//   c.validate();                        // throws InvalidArgument: what to change
//   fmt::print("{}", c.to_toml());       // the start-up dump, launcher variables echoed
//   mesh::DeviceMesh mesh(world, c.mesh().shape, c.mesh().axis_names);
//
// TOML: keys at the top level, or under [distributed] when the file has that
// table. A file may hold any of the sections in kTomlSections ([distributed],
// [train]); each loader reads its own and skips the others, and both reject
// an unknown section, an unknown key, a key outside any section next to a
// [distributed] table, and wrong types. Syntax errors name file:line:column. The mesh is `mesh = "data=2,tensor=2"` or the arrays
// `mesh_shape = [2, 2]` and `mesh_axis_names = ["data", "tensor"]`.
//
// Loaders (with_toml, with_env, DistributedFlags::config) overlay what their
// source gives on a copy of the config and do not validate; call validate()
// once, after the last one. When a source gives world_size or num_nodes but
// not num_processes_per_node, it becomes world_size / num_nodes (so
// `--world-size 8` alone means 8 ranks on one node).
//
// The environment is read only by read_launcher_env(), once, at start-up;
// everything else takes what it returns (a LauncherEnv) or the config made
// from it (DistributedConfig::launcher), so tests inject their own maps.
// Thread-safety: plain values; const methods may be called concurrently.
#pragma once

#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/config/sharding_config.h"
#include "meshtrain/core/dtype.h"
#include "meshtrain/mesh/mesh_shape.h"

namespace meshtrain::config {

// mixed_precision as the seeds spell it: "no" (f32), "bf16", "fp16". The
// names parse with layout::parse_precision (which also takes "fp32").
std::string_view mixed_precision_name(DType precision);

// The sections a meshtrain TOML file may hold: [distributed] (this config)
// and [train] (train::TrainConfig). Every TOML loader accepts a file with any
// subset of them and rejects other top-level tables.
inline constexpr std::string_view kTomlSections[] = {"distributed", "train"};

// Environment variables by name.
using EnvMap = std::map<std::string, std::string>;

// The launcher variables meshtrain reads (torchrun's and OpenMPI's; PMIX_RANK
// marks a process started by mpirun or srun with PMIx).
inline constexpr std::string_view kLauncherVariables[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMIX_RANK", "MESHTRAIN_RESTART_COUNT", "MESHTRAIN_RESTART_REASON", "MESHTRAIN_RESTART_EVENT_MS",
    "MESHTRAIN_RESTART_RENDEZVOUS_MS"};

// Which launcher started this process.
enum class Launcher : uint8_t { none, torchrun, mpirun };
std::string_view launcher_name(Launcher l);  // "none", "torchrun", "mpirun"

// What the launcher told this process: the launcher variables that are set.
// Built from the real environment by read_launcher_env(), or from any map
// (tests: LauncherEnv{{"RANK", "1"}, {"WORLD_SIZE", "2"}}, or an EnvMap).
struct LauncherEnv {
  LauncherEnv() = default;
  LauncherEnv(EnvMap v) : variables(std::move(v)) {}  // NOLINT: implicit, a map is an environment
  LauncherEnv(std::initializer_list<EnvMap::value_type> v) : variables(v) {}

  EnvMap variables;  // only names in kLauncherVariables are consulted
  // mpirun: OMPI_COMM_WORLD_SIZE or PMIX_RANK is set; torchrun: RANK,
  // WORLD_SIZE, LOCAL_RANK or LOCAL_WORLD_SIZE is (and mpirun's are not).
  Launcher launcher() const;
  // The value of one variable, or nullptr.
  const std::string* find(std::string_view name) const;
};

// The one place in meshtrain that reads the process environment (getenv):
// those of kLauncherVariables that are set. Call once at start-up and hand
// the result (or the DistributedConfig made from it) to whatever needs it.
LauncherEnv read_launcher_env();

// The job token: MESHTRAIN_JOB_TOKEN, or "" when it is not set. It is the
// secret every process of a job shows the rendezvous store
// (comm/tcp_store.h); `meshtrain launch` passes it on to its workers (or
// generates one for a single node). Read here, with the launcher variables,
// but kept out of LauncherEnv so that it never appears in a dump.
std::string read_job_token();

struct DistributedConfig {
  bool enabled = false;            // set by with_env when a launcher's variables are present
  int world_size = 1;              // ranks in the job, one per device
  int rank = 0;                    // this process's rank, 0 <= rank < world_size
  int local_rank = 0;              // rank within its node
  int num_nodes = 1;
  int num_processes_per_node = 1;  // ranks per node (threads engine: threads in the process)
  std::string master_addr = "localhost";  // rank 0's host, for TCP rendezvous (gloo, nccl)
  int master_port = 29500;
  comm::Engine backend = comm::Engine::threads;
  int tensor_parallel_size = 1;
  int pipeline_parallel_size = 1;
  int context_parallel_size = 1;
  std::vector<int> mesh_shape;     // empty: derived from the sizes (see mesh())
  std::vector<std::string> mesh_axis_names;
  DType mixed_precision = DType::f32;  // the compute precision; f32: no mixed precision

  // "NAME=value" for each launcher variable with_env used, echoed by to_toml().
  // Not a config key.
  std::vector<std::string> launcher_env;
  // The launcher that started this process, set by with_env. Not a config key.
  Launcher launcher = Launcher::none;
  // A restarted worker of `meshtrain launch` (comm/agent.h): what ended the
  // launcher's previous round and when, set by with_env from
  // MESHTRAIN_RESTART_REASON, _EVENT_MS and _RENDEZVOUS_MS. Not config keys.
  struct Restart {
    std::string reason;          // "" : not a launcher's restart after a failure or a regroup
    int64_t event_unix_ms = 0;   // when the launcher saw it (Unix ms)
    int64_t rendezvous_ms = 0;   // from then to this worker's start
    double replan_s = 0;         // choosing the layout for the devices (set by the command, not the launcher)
    bool operator==(const Restart&) const = default;
  };
  Restart restart;

  // Throws InvalidArgument (op "DistributedConfig") at the first broken rule,
  // saying what to change:
  //  1. world_size, num_nodes, num_processes_per_node and the three parallel
  //     sizes >= 1; rank, local_rank >= 0; master_port in [1024, 65535];
  //     master_addr not empty
  //  2. rank < world_size; local_rank < num_processes_per_node
  //  3. world_size == num_nodes x num_processes_per_node
  //  4. the threads engine runs on one node (num_nodes == 1)
  //  5. tensor x pipeline x context divides world_size
  //  6. mesh (if given): one known, distinct name per axis, sizes >= 1,
  //     product == world_size, and its tensor / pipeline / context axes
  //     (1 when absent) equal the parallel sizes
  void validate() const;
  bool is_valid() const;

  // world_size / (tensor x pipeline x context): data x fsdp ranks.
  int data_parallel_size() const;
  bool is_main_process() const { return rank == 0; }
  bool is_local_main_process() const { return local_rank == 0; }

  // The mesh to build: mesh_shape/mesh_axis_names when given, else derived
  // from the sizes: (pipeline, data, context, tensor), size-1 axes left out,
  // (data=1) for one rank. A pipeline-only config keeps its pipeline axis.
  mesh::NamedShape mesh() const;
  // The one way to give a mesh: sets mesh_shape and mesh_axis_names to m
  // and the three parallel sizes to its tensor, pipeline and context axes
  // (1 when absent), the seeds' keys being views of the mesh. world_size
  // and the processes per node stay as they are.
  void set_mesh(const mesh::NamedShape& m);
  // mesh() with the matching ShardingConfig (fsdp_enabled when the mesh has
  // an fsdp axis > 1).
  ParallelismConfig parallelism_config() const;

  // Overlay a TOML document / file / launcher environment; see the top of
  // this file. Errors name the file, line and key (InvalidArgument), or the
  // file that cannot be read (IoError).
  DistributedConfig with_toml(std::string_view text, std::string_view source_name = "<toml>") const;
  DistributedConfig with_toml_file(const std::string& path) const;
  // torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (num_nodes =
  // WORLD_SIZE / LOCAL_WORLD_SIZE), MASTER_ADDR, MASTER_PORT. OpenMPI:
  // OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}. Any of them sets
  // enabled. Started by mpirun (LauncherEnv::launcher): backend = mpi.
  // Sets `launcher`. Two launchers that disagree are an error.
  DistributedConfig with_env(const LauncherEnv& env) const;

  // Overlay (key, value) pairs, as the Python binding's DistributedConfig(**kw)
  // gives them: a key of distributed_config_keys(), its value as a flag takes
  // it (mesh_shape "4,2", mesh_axis_names "data,tensor"). Errors name
  // `source` and the key; an unknown key gets a "did you mean". Does not
  // validate.
  DistributedConfig with_values(const std::vector<std::pair<std::string, std::string>>& values,
                                std::string_view source) const;

  static DistributedConfig from_toml(std::string_view text) { return DistributedConfig{}.with_toml(text); }
  static DistributedConfig from_toml_file(const std::string& path) {
    return DistributedConfig{}.with_toml_file(path);
  }
  static DistributedConfig from_env(const LauncherEnv& env) { return DistributedConfig{}.with_env(env); }

  // A [distributed] table with every key (with_toml reads it back to an
  // equal config, launcher_env aside), preceded by a comment echoing
  // launcher_env and followed by the derived mesh when none was given.
  std::string to_toml() const;
  // One line: "world_size=4 rank=0 ... mesh=data=4 mixed_precision=no".
  std::string to_string() const;

  bool operator==(const DistributedConfig&) const = default;
};

// One row of the table that defines every key.
struct ConfigField {
  std::string_view key;   // TOML key, e.g. "world_size"
  std::string_view flag;  // CLI flag, e.g. "--world-size"
  std::string_view type;  // "bool", "int", "string", "engine", "precision", "mesh"
  std::string_view help;
  // Sets the field from text (a flag's value, an environment variable, a
  // TOML value); errors name `source` (e.g. "--rank", "RANK", "run.toml:3: rank").
  void (*parse)(DistributedConfig& c, std::string_view text, std::string_view source);
  // The field's value as that text ("4", "true", "localhost", "nccl", "data=2,tensor=2").
  std::string (*format)(const DistributedConfig& c);
};
std::span<const ConfigField> distributed_config_fields();

// Every key a DistributedConfig takes: the fields' (distributed_config_fields)
// and the mesh's two arrays, mesh_shape and mesh_axis_names.
std::vector<std::string_view> distributed_config_keys();
// The hint of an unknown key's error: "did you mean 'world_size'? known keys: ...".
std::string unknown_key_hint(std::string_view key);

// num_processes_per_node = world_size / num_nodes when a source gave world_size
// or num_nodes but not num_processes_per_node (used by every loader).
void derive_processes_per_node(DistributedConfig& c, bool gave_world_or_nodes, bool gave_processes_per_node);

// Which keys an overlay's source gave (TOML, keywords), for finish_overlay.
struct GivenKeys {
  bool mesh = false, mesh_shape = false, mesh_axis_names = false;
  bool world_or_nodes = false;      // world_size or num_nodes
  bool processes_per_node = false;  // num_processes_per_node
  // From the set of key names a loader recorded (std::set of string or string_view).
  template <typename Set>
  static GivenKeys of(const Set& keys) {
    return {.mesh = keys.count("mesh") > 0,
            .mesh_shape = keys.count("mesh_shape") > 0,
            .mesh_axis_names = keys.count("mesh_axis_names") > 0,
            .world_or_nodes = keys.count("world_size") > 0 || keys.count("num_nodes") > 0,
            .processes_per_node = keys.count("num_processes_per_node") > 0};
  }
};
// The end of an overlay of keys: refuses a mesh given both as `mesh` and as
// the arrays (InvalidArgument naming `where`, the source, with `how`: the
// two ways to give it once in that source's syntax), keeps the arrays
// together (one given alone clears the other, so validate() names the
// missing one) and derives num_processes_per_node (derive_processes_per_node).
void finish_overlay(DistributedConfig& c, const GivenKeys& given, std::string_view where, std::string_view how);

}  // namespace meshtrain::config
