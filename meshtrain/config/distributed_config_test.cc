// DistributedConfig: every validation rule's message, the helpers, the
// derived mesh (pipeline-only keeps its axis), TOML (round trip, both mesh
// spellings, errors with file and line), launcher environments (torchrun,
// OpenMPI, conflicts), CLI flags, and docs/configs.md listing every key.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/testing/testing.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "meshtrain/config/distributed_config.h"
#include "meshtrain/config/distributed_flags.h"
#include "meshtrain/core/error.h"

namespace meshtrain::config {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Ints = std::vector<int>;
using Names = std::vector<std::string>;

using meshtrain::testing::error_of;

std::string invalid(const std::function<void(DistributedConfig&)>& edit) {
  DistributedConfig c;
  edit(c);
  return error_of([&] { c.validate(); });
}

// A config with every field away from its default.
DistributedConfig everything_set() {
  DistributedConfig c;
  c.enabled = true;
  c.world_size = 16;
  c.rank = 9;
  c.local_rank = 1;
  c.num_nodes = 2;
  c.num_processes_per_node = 8;
  c.master_addr = "node-0.cluster";
  c.master_port = 29511;
  c.backend = comm::Engine::nccl;
  c.tensor_parallel_size = 2;
  c.pipeline_parallel_size = 2;
  c.context_parallel_size = 1;
  c.mesh_shape = {2, 2, 2, 2};
  c.mesh_axis_names = {"pipeline", "data", "fsdp", "tensor"};
  c.mixed_precision = DType::bf16;
  return c;
}

// ---- validation -----------------------------------------------------------------

TEST(DistributedConfig, SetMeshMakesTheParallelSizesViewsOfTheMesh) {
  DistributedConfig c;
  c.world_size = c.num_processes_per_node = 8;
  c.tensor_parallel_size = 4;  // replaced: the mesh has no tensor axis of 4
  c.set_mesh(mesh::parse_mesh_spec("pipeline=2,data=2,context=2"));
  EXPECT_EQ(c.pipeline_parallel_size, 2);
  EXPECT_EQ(c.context_parallel_size, 2);
  EXPECT_EQ(c.tensor_parallel_size, 1);
  EXPECT_EQ(c.data_parallel_size(), 2);
  EXPECT_EQ(c.mesh().to_spec(), "pipeline=2,data=2,context=2");
  EXPECT_TRUE(c.is_valid());
}

TEST(DistributedConfigValidate, DefaultsAndAFullConfigAreValid) {
  EXPECT_TRUE(DistributedConfig{}.is_valid());
  EXPECT_NO_THROW(everything_set().validate());
}

TEST(DistributedConfigValidate, SizesMustBePositive) {
  EXPECT_THAT(invalid([](auto& c) { c.world_size = 0; }),
              HasSubstr("DistributedConfig: world_size must be >= 1, got 0"));
  EXPECT_THAT(invalid([](auto& c) { c.world_size = 0; }), HasSubstr("set world_size to the number of ranks"));
  EXPECT_THAT(invalid([](auto& c) { c.num_nodes = 0; }), HasSubstr("num_nodes must be >= 1, got 0"));
  EXPECT_THAT(invalid([](auto& c) { c.num_processes_per_node = -1; }),
              HasSubstr("num_processes_per_node must be >= 1, got -1"));
  EXPECT_THAT(invalid([](auto& c) { c.tensor_parallel_size = 0; }), HasSubstr("tensor_parallel_size must be >= 1"));
  EXPECT_THAT(invalid([](auto& c) { c.pipeline_parallel_size = 0; }),
              HasSubstr("pipeline_parallel_size must be >= 1"));
  EXPECT_THAT(invalid([](auto& c) { c.context_parallel_size = 0; }), HasSubstr("context_parallel_size must be >= 1"));
  EXPECT_THAT(invalid([](auto& c) { c.rank = -1; }), HasSubstr("rank must be >= 0, got -1"));
  EXPECT_THAT(invalid([](auto& c) { c.local_rank = -1; }), HasSubstr("local_rank must be >= 0, got -1"));
}

TEST(DistributedConfigValidate, PortAndAddress) {
  EXPECT_THAT(invalid([](auto& c) { c.master_port = 80; }), HasSubstr("master_port 80 is outside [1024, 65535]"));
  EXPECT_THAT(invalid([](auto& c) { c.master_port = 70000; }), HasSubstr("master_port 70000 is outside"));
  EXPECT_THAT(invalid([](auto& c) { c.master_port = 80; }), HasSubstr("e.g. 29500"));
  EXPECT_EQ(invalid([](auto& c) { c.master_port = 1024; }), "");
  EXPECT_EQ(invalid([](auto& c) { c.master_port = 65535; }), "");
  EXPECT_THAT(invalid([](auto& c) { c.master_addr = " "; }), HasSubstr("master_addr is empty"));
}

TEST(DistributedConfigValidate, RanksInsideTheirRanges) {
  EXPECT_THAT(invalid([](auto& c) { c.rank = 4, c.world_size = 4, c.num_processes_per_node = 4; }),
              HasSubstr("rank 4 is not below world_size 4"));
  EXPECT_THAT(invalid([](auto& c) { c.rank = 4, c.world_size = 4, c.num_processes_per_node = 4; }),
              HasSubstr("set rank below 4, or world_size above 4"));
  EXPECT_THAT(invalid([](auto& c) { c.world_size = 4, c.num_processes_per_node = 2, c.num_nodes = 2,
                                    c.local_rank = 2, c.backend = comm::Engine::mpi; }),
              HasSubstr("local_rank 2 is not below num_processes_per_node 2"));
}

TEST(DistributedConfigValidate, WorldIsNodesTimesProcesses) {
  const std::string e = invalid([](auto& c) {
    c.world_size = 8, c.num_nodes = 2, c.num_processes_per_node = 3, c.backend = comm::Engine::gloo;
  });
  EXPECT_THAT(e, HasSubstr("world_size 8 != num_nodes 2 x num_processes_per_node 3 = 6"));
  EXPECT_THAT(e, HasSubstr("set num_processes_per_node = 4 (world_size / num_nodes), or set world_size = 6"));
  EXPECT_THAT(invalid([](auto& c) { c.world_size = 7, c.num_nodes = 2, c.num_processes_per_node = 3; }),
              HasSubstr("(hint: set world_size = 6)"));
}

TEST(DistributedConfigValidate, ThreadsEngineIsOneNode) {
  const std::string e = invalid([](auto& c) { c.world_size = 4, c.num_nodes = 2, c.num_processes_per_node = 2; });
  EXPECT_THAT(e, HasSubstr("backend threads runs every rank in one process, but num_nodes is 2"));
  EXPECT_THAT(e, HasSubstr("use backend mpi, gloo or nccl across nodes"));
}

TEST(DistributedConfigValidate, ParallelSizesDivideTheWorld) {
  std::string e = invalid([](auto& c) { c.world_size = 8, c.num_processes_per_node = 8, c.tensor_parallel_size = 3; });
  EXPECT_THAT(e, HasSubstr("tensor_parallel_size 3 x pipeline_parallel_size 1 x context_parallel_size 1 = 3 does not "
                           "divide world_size 8"));
  EXPECT_THAT(e, HasSubstr("whose product divides 8 (1, 2, 4 or 8)"));
  e = invalid([](auto& c) {
    c.world_size = 8, c.num_processes_per_node = 8, c.tensor_parallel_size = 4, c.pipeline_parallel_size = 4;
  });
  EXPECT_THAT(e, HasSubstr("= 16 exceeds world_size 8"));
}

TEST(DistributedConfigValidate, MeshRules) {
  auto mesh = [](Ints shape, Names names, int tp = 1, int pp = 1, int cp = 1) {
    return invalid([&](DistributedConfig& c) {
      c.world_size = 8, c.num_processes_per_node = 8;
      c.mesh_shape = shape, c.mesh_axis_names = names;
      c.tensor_parallel_size = tp, c.pipeline_parallel_size = pp, c.context_parallel_size = cp;
    });
  };
  EXPECT_EQ(mesh({4, 2}, {"data", "tensor"}, 2), "");
  EXPECT_THAT(mesh({}, {"data"}), HasSubstr("mesh_axis_names (data) given without mesh_shape"));
  EXPECT_THAT(mesh({4, 2}, {}), HasSubstr("the mesh has 2 sizes (4, 2) but 0 axis names"));
  EXPECT_THAT(mesh({4, 2}, {}), HasSubstr("give one name per axis, e.g. --mesh data=2,tensor=2"));
  EXPECT_THAT(mesh({4, 2}, {"data", "model"}), HasSubstr("mesh axis 'model' is not one of"));
  EXPECT_THAT(mesh({4, 2}, {"data", "data"}), HasSubstr("mesh axis 'data' appears twice"));
  EXPECT_THAT(mesh({0, 8}, {"data", "tensor"}), HasSubstr("has size 0"));
  const std::string e = mesh({2, 2}, {"data", "tensor"}, 2);
  EXPECT_THAT(e, HasSubstr("DistributedConfig: mesh data=2,tensor=2: shape (2, 2) uses 4 of 8 devices"));
  EXPECT_THAT(e, HasSubstr("product is exactly 8"));
  EXPECT_THAT(mesh({4, 2}, {"data", "tensor"}, 4), HasSubstr("mesh data=4,tensor=2 has tensor=2 but "
                                                             "tensor_parallel_size is 4"));
  EXPECT_THAT(mesh({8}, {"data"}, 1, 2), HasSubstr("mesh data=8 has no pipeline axis but pipeline_parallel_size is 2"));
  EXPECT_THAT(mesh({8}, {"data"}, 1, 2), HasSubstr("add pipeline=2 to the mesh, or set pipeline_parallel_size = 1"));
  EXPECT_THAT(mesh({4, 2}, {"data", "context"}), HasSubstr("has context=2 but context_parallel_size is 1"));
}

// ---- helpers and the derived mesh ------------------------------------------------

TEST(DistributedConfig, Helpers) {
  DistributedConfig c = everything_set();
  EXPECT_EQ(c.data_parallel_size(), 4);
  EXPECT_FALSE(c.is_main_process());
  EXPECT_FALSE(c.is_local_main_process());
  c.rank = 0, c.local_rank = 0;
  EXPECT_TRUE(c.is_main_process());
  EXPECT_TRUE(c.is_local_main_process());
  EXPECT_EQ(DistributedConfig{}.data_parallel_size(), 1);
  EXPECT_EQ(mixed_precision_name(DType::bf16), "bf16");
  EXPECT_EQ(mixed_precision_name(DType::f16), "fp16");
  EXPECT_EQ(mixed_precision_name(DType::f32), "no");
}

TEST(DistributedConfig, DerivedMeshKeepsThePipelineAxis) {
  auto derived = [](int world, int tp, int pp, int cp) {
    DistributedConfig c;
    c.world_size = c.num_processes_per_node = world;
    c.tensor_parallel_size = tp, c.pipeline_parallel_size = pp, c.context_parallel_size = cp;
    EXPECT_TRUE(c.is_valid());
    EXPECT_TRUE(c.parallelism_config().is_valid()) << c.mesh().to_spec();
    return c.mesh().to_spec();
  };
  EXPECT_EQ(derived(1, 1, 1, 1), "data=1");
  EXPECT_EQ(derived(4, 1, 1, 1), "data=4");
  EXPECT_EQ(derived(4, 1, 4, 1), "pipeline=4");  // the reference gave (data=4)
  EXPECT_EQ(derived(8, 2, 2, 1), "pipeline=2,data=2,tensor=2");
  EXPECT_EQ(derived(16, 2, 2, 2), "pipeline=2,data=2,context=2,tensor=2");
  const DistributedConfig full = everything_set();
  EXPECT_EQ(full.mesh().to_spec(), "pipeline=2,data=2,fsdp=2,tensor=2");
  const ParallelismConfig p = full.parallelism_config();
  EXPECT_TRUE(p.is_valid());
  EXPECT_TRUE(p.sharding.fsdp_enabled);
  EXPECT_EQ(p.sharding.data_parallel_size, 4);
}

// ---- TOML ----------------------------------------------------------------------

TEST(DistributedConfigToml, RoundTripsEveryField) {
  const DistributedConfig c = everything_set();
  const std::string text = c.to_toml();
  EXPECT_THAT(text, HasSubstr("[distributed]\n"));
  EXPECT_THAT(text, HasSubstr("mesh = \"pipeline=2,data=2,fsdp=2,tensor=2\"\n"));
  EXPECT_THAT(text, HasSubstr("backend = \"nccl\"\n"));
  EXPECT_THAT(text, HasSubstr("world_size = 16\n"));
  EXPECT_THAT(text, HasSubstr("enabled = true\n"));
  EXPECT_EQ(DistributedConfig::from_toml(text), c) << text;
  EXPECT_EQ(DistributedConfig::from_toml(DistributedConfig{}.to_toml()), DistributedConfig{});
  EXPECT_THAT(DistributedConfig{}.to_toml(), HasSubstr("mesh = \"\"  # derived: data=1\n"));
  // Mismatched lengths are dumped as arrays so that validate() can report them after a reload.
  DistributedConfig odd;
  odd.mesh_shape = {2, 2};
  odd.mesh_axis_names = {"data"};
  EXPECT_EQ(DistributedConfig::from_toml(odd.to_toml()), odd) << odd.to_toml();
}

TEST(DistributedConfigToml, TopLevelOrDistributedTableAndBothMeshSpellings) {
  DistributedConfig a = DistributedConfig::from_toml(R"(
world_size = 4
mesh = "data=2,tensor=2"
tensor_parallel_size = 2
mixed_precision = "bf16"
)");
  EXPECT_EQ(a.world_size, 4);
  EXPECT_EQ(a.num_processes_per_node, 4);  // derived: world_size / num_nodes
  EXPECT_EQ(a.mesh_shape, (Ints{2, 2}));
  EXPECT_EQ(a.mesh_axis_names, (Names{"data", "tensor"}));
  EXPECT_EQ(a.mixed_precision, DType::bf16);
  EXPECT_TRUE(a.is_valid());
  DistributedConfig b = DistributedConfig::from_toml(R"(
[train]
steps = 100   # another section's keys are not ours
[distributed]
world_size = 4
mesh_shape = [2, 2]
mesh_axis_names = ["data", "tensor"]
tensor_parallel_size = 2
mixed_precision = "bf16"
)");
  EXPECT_EQ(a, b);
  // Overlay: only the keys given change.
  DistributedConfig c = b.with_toml("rank = 3");
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.mesh_shape, (Ints{2, 2}));
}

// issue 9: a file with only a [train] section was rejected ("unknown key
// 'train'"): every loader takes any subset of the project's sections.
TEST(DistributedConfigToml, AcceptsAFileWithAnySubsetOfTheSections) {
  EXPECT_EQ(DistributedConfig::from_toml("[train]\nepochs = 1\n"), DistributedConfig{});
  EXPECT_EQ(DistributedConfig::from_toml(""), DistributedConfig{});
  EXPECT_EQ(DistributedConfig::from_toml("[distributed]\nworld_size = 2\n").world_size, 2);
  EXPECT_EQ(DistributedConfig::from_toml("world_size = 2\n[train]\nepochs = 1\n").world_size, 2);
  EXPECT_EQ(DistributedConfig::from_toml("[train]\nepochs = 1\n[distributed]\nworld_size = 2\n").world_size, 2);
}

TEST(DistributedConfigToml, ErrorsNameTheFileLineAndKey) {
  auto err = [](const char* text) { return error_of([&] { DistributedConfig{}.with_toml(text, "run.toml"); }); };
  EXPECT_THAT(err("world_size = 4\nwrold_size = 4\n"), HasSubstr("run.toml:2: unknown key 'wrold_size'"));
  EXPECT_THAT(err("wrold_size = 4\n"), HasSubstr("did you mean 'world_size'?"));
  EXPECT_THAT(err("[trian]\nsteps = 1\n"), HasSubstr("run.toml:1:2: unknown section [trian]"));
  EXPECT_THAT(err("[trian]\nsteps = 1\n"), HasSubstr("holds the sections [distributed], [train]"));
  EXPECT_THAT(err("rank = 1\n[distributed]\nworld_size = 2\n"),
              HasSubstr("run.toml:1:1: key 'rank' is outside any section, but the file has [distributed]"));
  EXPECT_THAT(err("epochs = 3\n"), HasSubstr("training keys under [train]"));
  EXPECT_THAT(err("world_size = \"4\"\n"), HasSubstr("run.toml:1: world_size must be an integer, got a string"));
  EXPECT_THAT(err("enabled = 1\n"), HasSubstr("enabled must be a boolean, got an integer"));
  EXPECT_THAT(err("backend = 3\n"), HasSubstr("backend must be a string, got an integer"));
  EXPECT_THAT(err("mesh = 4\n"), HasSubstr("write e.g. mesh = \"data=2,tensor=2\""));
  EXPECT_THAT(err("world_size = 99999999999\n"), HasSubstr("run.toml:1: world_size: 99999999999 is outside [1, 2147483647]"));
  EXPECT_THAT(err("master_port = 80\n"), HasSubstr("run.toml:1: master_port: 80 is outside [1024, 65535]"));
  EXPECT_THAT(err("mesh_shape = [4294967298]\n"), HasSubstr("mesh_shape: 4294967298 is outside [1, 2147483647]"));
  EXPECT_THAT(err("backend = \"tcp\"\n"), HasSubstr("run.toml:1: backend: unknown engine 'tcp'"));
  EXPECT_THAT(err("backend = \"tcp\"\n"), HasSubstr("use one of threads, mpi, gloo, nccl"));
  EXPECT_THAT(err("mixed_precision = \"fp8\"\n"), HasSubstr("mixed_precision: precision 'fp8'"));
  EXPECT_THAT(err("mesh = \"data=2,tensor\"\n"), HasSubstr("run.toml:1: mesh: 'tensor' in mesh"));
  EXPECT_THAT(err("mesh_shape = [2, \"x\"]\n"), HasSubstr("mesh_shape must be an array of integers, got a string"));
  EXPECT_THAT(err("mesh_axis_names = \"data\"\n"), HasSubstr("mesh_axis_names must be an array of strings"));
  EXPECT_THAT(err("mesh = \"data=4\"\nmesh_shape = [4]\n"), HasSubstr("both mesh and mesh_shape/mesh_axis_names"));
  EXPECT_THAT(err("distributed = 3\n"), HasSubstr("run.toml: distributed must be a table"));
  EXPECT_THAT(err("world_size = \n"), HasSubstr("run.toml:1:"));
  EXPECT_THAT(err("world_size = \n"), HasSubstr("fix the TOML syntax"));
  EXPECT_THAT(err("[distributed]\nworld_size = 2\nrank = = 1\n"), HasSubstr("run.toml:3:8:"));
}

TEST(DistributedConfigToml, Files) {
  const std::string path = ::testing::TempDir() + "/meshtrain_config_test.toml";
  {
    std::ofstream out(path);
    out << everything_set().to_toml();
  }
  EXPECT_EQ(DistributedConfig::from_toml_file(path), everything_set());
  std::remove(path.c_str());
  try {
    DistributedConfig::from_toml_file(path);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot read '" + path + "'"));
  }
}

TEST(DistributedConfigValues, KeywordValuesSetWhatTomlSets) {
  // What DistributedConfig(**kw) in Python passes: every key as its text.
  const DistributedConfig c = DistributedConfig{}.with_values(
      {{"enabled", "true"}, {"world_size", "8"}, {"num_nodes", "2"}, {"backend", "gloo"},
       {"tensor_parallel_size", "2"}, {"pipeline_parallel_size", "2"}, {"mixed_precision", "bf16"}},
      "DistributedConfig");
  EXPECT_EQ(c, DistributedConfig::from_toml("enabled = true\nworld_size = 8\nnum_nodes = 2\nbackend = \"gloo\"\n"
                                            "tensor_parallel_size = 2\npipeline_parallel_size = 2\n"
                                            "mixed_precision = \"bf16\"\n"));
  EXPECT_EQ(c.num_processes_per_node, 4);  // derived as the loaders derive it
  EXPECT_EQ(c.data_parallel_size(), 2);
  const DistributedConfig m = DistributedConfig{}.with_values(
      {{"world_size", "4"}, {"mesh_shape", "2,2"}, {"mesh_axis_names", "data,tensor"}, {"tensor_parallel_size", "2"}},
      "DistributedConfig");
  EXPECT_EQ(m.mesh().to_spec(), "data=2,tensor=2");
  EXPECT_NO_THROW(m.validate());
}

TEST(DistributedConfigValues, ErrorsNameTheKey) {
  auto err = [](std::vector<std::pair<std::string, std::string>> v) {
    return error_of([&] { DistributedConfig{}.with_values(v, "DistributedConfig(...)"); });
  };
  EXPECT_THAT(err({{"wrold_size", "4"}}), HasSubstr("DistributedConfig(...): unknown key 'wrold_size' (hint: did you "
                                                    "mean 'world_size'?"));
  EXPECT_THAT(err({{"zzz", "4"}}), Not(HasSubstr("did you mean")));
  EXPECT_THAT(err({{"world_size", "many"}}), HasSubstr("world_size"));
  EXPECT_THAT(err({{"mesh_shape", "2,0"}}), HasSubstr("DistributedConfig(...): mesh_shape: 0 is outside [1, "));
  EXPECT_THAT(err({{"mesh", "data=2"}, {"mesh_shape", "2"}}),
              HasSubstr("both mesh and mesh_shape/mesh_axis_names are given"));
}

// ---- launcher environment ----------------------------------------------------------

TEST(DistributedConfigEnv, Torchrun) {
  const EnvMap env = {{"RANK", "5"},         {"WORLD_SIZE", "8"},          {"LOCAL_RANK", "1"},
                      {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"},
                      {"PATH", "/usr/bin"}};
  DistributedConfig base;
  base.backend = comm::Engine::gloo;
  const DistributedConfig c = base.with_env(env);
  EXPECT_TRUE(c.enabled);
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.num_processes_per_node, 4);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "10.0.0.1");
  EXPECT_EQ(c.master_port, 29400);
  EXPECT_EQ(c.backend, comm::Engine::gloo);  // torchrun does not say which engine
  EXPECT_TRUE(c.is_valid());
  EXPECT_FALSE(c.is_main_process());
  EXPECT_THAT(c.to_toml(), HasSubstr("# launcher environment: RANK=5 WORLD_SIZE=8 LOCAL_RANK=1 LOCAL_WORLD_SIZE=4 "
                                     "MASTER_ADDR=10.0.0.1 MASTER_PORT=29400\n"));
}

TEST(DistributedConfigEnv, ALaunchersRestartSaysWhyAndWhen) {
  const EnvMap env = {{"RANK", "0"},
                      {"WORLD_SIZE", "2"},
                      {"MESHTRAIN_RESTART_COUNT", "1"},
                      {"MESHTRAIN_RESTART_REASON", "node 1 sent no heartbeat for 15 s"},
                      {"MESHTRAIN_RESTART_EVENT_MS", "1780000000123"},
                      {"MESHTRAIN_RESTART_RENDEZVOUS_MS", "15400"}};
  const DistributedConfig c = DistributedConfig::from_env(env);
  EXPECT_EQ(c.restart.reason, "node 1 sent no heartbeat for 15 s");
  EXPECT_EQ(c.restart.event_unix_ms, 1780000000123);
  EXPECT_EQ(c.restart.rendezvous_ms, 15400);
  EXPECT_EQ(DistributedConfig::from_env({{"RANK", "0"}}).restart, DistributedConfig::Restart{});
  EXPECT_THAT(error_of([] {
                DistributedConfig::from_env(
                    {{"MESHTRAIN_RESTART_REASON", "x"}, {"MESHTRAIN_RESTART_EVENT_MS", "soon"}});
              }),
              HasSubstr("MESHTRAIN_RESTART_EVENT_MS: 'soon' is not an integer"));
}

TEST(DistributedConfigEnv, OpenMpi) {
  const EnvMap env = {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  const DistributedConfig c = DistributedConfig::from_env(env);
  EXPECT_TRUE(c.enabled);
  EXPECT_EQ(c.backend, comm::Engine::mpi);
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.num_processes_per_node, 2);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_TRUE(c.is_valid());
  // Only RANK and SIZE (one node): processes per node follow the world size.
  const DistributedConfig d = DistributedConfig::from_env({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(d.num_processes_per_node, 2);
  EXPECT_TRUE(d.is_valid());
}

TEST(DistributedConfigEnv, NoLauncherChangesNothing) {
  DistributedConfig base = everything_set();
  EXPECT_EQ(base.with_env({{"HOME", "/root"}}), base);
  EXPECT_FALSE(DistributedConfig::from_env({}).enabled);
}

TEST(DistributedConfigEnv, Errors) {
  EXPECT_THAT(error_of([] { DistributedConfig::from_env({{"RANK", "abc"}}); }), HasSubstr("RANK: 'abc' is not an integer"));
  EXPECT_THAT(error_of([] { DistributedConfig::from_env({{"MASTER_PORT", "x1"}}); }),
              HasSubstr("MASTER_PORT: 'x1' is not an integer"));
  const std::string e = error_of([] { DistributedConfig::from_env({{"RANK", "1"}, {"OMPI_COMM_WORLD_RANK", "2"}}); });
  EXPECT_THAT(e, HasSubstr("RANK=1 but OMPI_COMM_WORLD_RANK=2"));
  EXPECT_THAT(e, HasSubstr("two launchers"));
  EXPECT_EQ(DistributedConfig::from_env({{"RANK", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}}).rank, 2);  // agreeing is fine
  EXPECT_THAT(error_of([] { DistributedConfig::from_env({{"WORLD_SIZE", "6"}, {"LOCAL_WORLD_SIZE", "4"}}); }),
              HasSubstr("WORLD_SIZE=6 is not a multiple of LOCAL_WORLD_SIZE=4"));
  // Values that parse but break a rule are reported by validate().
  EXPECT_THAT(error_of([] { DistributedConfig::from_env({{"RANK", "4"}, {"WORLD_SIZE", "4"}}).validate(); }),
              HasSubstr("rank 4 is not below world_size 4"));
}

TEST(DistributedConfigEnv, ReadLauncherEnvReadsOnlyLauncherVariables) {
  ::setenv("MASTER_PORT", "29777", 1);
  ::setenv("MESHTRAIN_UNRELATED_TEST_VARIABLE", "1", 1);
  const LauncherEnv env = read_launcher_env();
  ::unsetenv("MASTER_PORT");
  ::unsetenv("MESHTRAIN_UNRELATED_TEST_VARIABLE");
  EXPECT_EQ(env.variables.at("MASTER_PORT"), "29777");
  EXPECT_EQ(env.variables.count("MESHTRAIN_UNRELATED_TEST_VARIABLE"), 0u);
  for (const auto& [k, v] : env.variables)
    EXPECT_NE(std::find(std::begin(kLauncherVariables), std::end(kLauncherVariables), k), std::end(kLauncherVariables));
}

TEST(DistributedConfigEnv, TheJobTokenIsReadButNeverDumped) {
  ::setenv("MESHTRAIN_JOB_TOKEN", "s3cret-token", 1);
  ::setenv("RANK", "0", 1);
  const std::string token = read_job_token();
  const LauncherEnv env = read_launcher_env();
  ::unsetenv("MESHTRAIN_JOB_TOKEN");
  ::unsetenv("RANK");
  EXPECT_EQ(token, "s3cret-token");
  EXPECT_EQ(read_job_token(), "");
  EXPECT_EQ(env.variables.count("MESHTRAIN_JOB_TOKEN"), 0u);
  EXPECT_THAT(DistributedConfig{}.with_env(env).to_toml(), Not(HasSubstr("s3cret")));
}

TEST(DistributedConfigEnv, WhichLauncherStartedTheProcess) {
  EXPECT_EQ((LauncherEnv{}.launcher()), Launcher::none);
  EXPECT_EQ((LauncherEnv{{"MASTER_ADDR", "h"}}.launcher()), Launcher::none);  // an address alone starts nothing
  EXPECT_EQ((LauncherEnv{{"RANK", "0"}, {"WORLD_SIZE", "2"}}.launcher()), Launcher::torchrun);
  EXPECT_EQ((LauncherEnv{{"LOCAL_RANK", "0"}}.launcher()), Launcher::torchrun);
  EXPECT_EQ((LauncherEnv{{"OMPI_COMM_WORLD_SIZE", "2"}, {"RANK", "0"}}.launcher()), Launcher::mpirun);
  EXPECT_EQ((LauncherEnv{{"PMIX_RANK", "3"}}.launcher()), Launcher::mpirun);
  EXPECT_EQ(launcher_name(Launcher::torchrun), "torchrun");

  // The config carries it, so nothing else needs the environment.
  const DistributedConfig t = DistributedConfig::from_env(LauncherEnv{{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(t.launcher, Launcher::torchrun);
  EXPECT_EQ(t.backend, comm::Engine::threads);  // torchrun does not say which engine
  const DistributedConfig m = DistributedConfig::from_env(
      LauncherEnv{{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}});
  EXPECT_EQ(m.launcher, Launcher::mpirun);
  EXPECT_EQ(m.backend, comm::Engine::mpi);
  EXPECT_EQ(m.rank, 1);
  // srun with PMIx may set only PMIX_RANK: still mpirun and the mpi engine,
  // nothing else changes (the engine takes sizes from MPI itself).
  const DistributedConfig p = DistributedConfig::from_env(LauncherEnv{{"PMIX_RANK", "0"}});
  EXPECT_EQ(p.launcher, Launcher::mpirun);
  EXPECT_EQ(p.backend, comm::Engine::mpi);
  EXPECT_FALSE(p.enabled);
  EXPECT_EQ(p.world_size, 1);
  const DistributedConfig none = DistributedConfig::from_env(LauncherEnv{{"HOME", "/root"}});
  EXPECT_EQ(none.launcher, Launcher::none);
  EXPECT_EQ(none, DistributedConfig{});
}

// read_launcher_env() is the one reader of the launcher's environment: no
// other file of the library or the CLI calls getenv but the two below.
TEST(DistributedConfigEnv, NothingElseReadsTheEnvironment) {
  namespace fs = std::filesystem;
  const fs::path root(MESHTRAIN_SOURCE_DIR);
  std::vector<std::string> readers;
  for (const char* dir : {"meshtrain", "cli", "bench"})
    for (const auto& entry : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".cc" && ext != ".h") continue;
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      const std::string s = text.str();
      if (s.find("getenv(") != std::string::npos || s.find("secure_getenv(") != std::string::npos ||
          s.find(" environ[") != std::string::npos)
        readers.push_back(fs::relative(entry.path(), root).string());
    }
  // This test names the call too; it reads nothing.
  std::erase(readers, "meshtrain/config/distributed_config_test.cc");
  std::sort(readers.begin(), readers.end());
  // The gloo engine's rendezvous reads torchrun's variables itself, as
  // MPI reads mpirun's inside MPI_Init: comm::launch takes no environment.
  // core reads MESHTRAIN_CPU_ISA (and OPENBLAS_CORETYPE and the GEMM threads'
  // idle waits) once, before the first kernel picks its path, as oneDNN,
  // libgomp and OpenBLAS read theirs; and MESHTRAIN_GEMM_BACKEND and
  // MESHTRAIN_GEMM_CACHE once, at the first product.
  EXPECT_EQ(readers, (std::vector<std::string>{"meshtrain/comm/gloo/launch.cc", "meshtrain/config/distributed_config.cc",
                                               "meshtrain/core/cpu_isa.cc",
                                               "meshtrain/core/gemm_choice.cc"}));
}

// ---- CLI flags ------------------------------------------------------------------

TEST(DistributedFlags, ParseOverlayOnlyWhatWasGiven) {
  CLI::App app{"test"};
  DistributedFlags flags(&app);
  app.parse("--world-size 8 --mesh data=4,tensor=2 --tensor-parallel-size 2 --backend gloo --distributed "
            "--mixed-precision bf16 --master-port 29600",
            false);
  DistributedConfig base;
  base.master_addr = "from-toml";
  const DistributedConfig c = flags.config(base);
  EXPECT_TRUE(c.enabled);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.num_processes_per_node, 8);  // derived
  EXPECT_EQ(c.mesh_shape, (Ints{4, 2}));
  EXPECT_EQ(c.mesh_axis_names, (Names{"data", "tensor"}));
  EXPECT_EQ(c.backend, comm::Engine::gloo);
  EXPECT_EQ(c.mixed_precision, DType::bf16);
  EXPECT_EQ(c.master_port, 29600);
  EXPECT_EQ(c.master_addr, "from-toml");  // not given: kept
  EXPECT_TRUE(c.is_valid());
}

TEST(DistributedFlags, EveryFieldHasAFlagAndBadValuesNameIt) {
  CLI::App app{"test"};
  DistributedFlags flags = add_distributed_flags(&app);
  const std::string help = app.help();
  for (const ConfigField& f : distributed_config_fields()) EXPECT_THAT(help, HasSubstr(std::string(f.flag)));
  EXPECT_THAT(help, HasSubstr("29500"));  // defaults come from the table
  app.parse("--rank two --distributed=false", false);
  EXPECT_THAT(error_of([&] { flags.config(); }), HasSubstr("--rank: 'two' is not an integer"));
  CLI::App app2{"test"};
  DistributedFlags flags2(&app2);
  app2.parse("--mesh data=2,,tensor=2 --num-nodes 2", false);
  EXPECT_THAT(error_of([&] { flags2.config(); }), HasSubstr("--mesh: '' in mesh 'data=2,,tensor=2' has no '='"));
  CLI::App app3{"test"};
  DistributedFlags flags3(&app3);
  app3.parse("--distributed=false --num-nodes 2 --world-size 8", false);
  const DistributedConfig c = flags3.config();
  EXPECT_FALSE(c.enabled);
  EXPECT_EQ(c.num_processes_per_node, 4);
}

// ---- docs -----------------------------------------------------------------------

TEST(DistributedConfigDocs, ConfigsPageListsEveryKeyAndFlag) {
  std::ifstream in(std::string(MESHTRAIN_SOURCE_DIR) + "/docs/configs.md");
  ASSERT_TRUE(in) << "docs/configs.md is missing";
  std::stringstream doc;
  doc << in.rdbuf();
  // The key table in the docs is this table's rows, verbatim.
  const DistributedConfig defaults;
  for (const ConfigField& f : distributed_config_fields()) {
    const std::string d = f.format(defaults);
    const std::string row = fmt::format("| `{}` | `{}` | {} | {} | {} |", f.key, f.flag, f.type,
                                        d.empty() ? "derived" : fmt::format("`{}`", d), f.help);
    EXPECT_THAT(doc.str(), HasSubstr(row));
  }
  for (std::string_view v : kLauncherVariables) EXPECT_THAT(doc.str(), HasSubstr(std::string(v)));
}

}  // namespace
}  // namespace meshtrain::config
