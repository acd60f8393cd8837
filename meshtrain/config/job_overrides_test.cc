// apply_job_overrides: the command line's engine, devices, mesh and
// precision over a configuration, with errors that name the flag.
#include "meshtrain/config/job_overrides.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::config {
namespace {

using ::testing::HasSubstr;
using meshtrain::testing::error_of;

TEST(JobOverrides, TheEngineFollowsTheLauncherUnlessGiven) {
  const DistributedConfig mpirun = DistributedConfig{}.with_env(
      LauncherEnv{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}});
  EXPECT_EQ(apply_job_overrides(mpirun, {}).backend, comm::Engine::mpi);
  const DistributedConfig torchrun = DistributedConfig{}.with_env(LauncherEnv{{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(apply_job_overrides(torchrun, {.gloo_available = true}).backend, comm::Engine::gloo);
  EXPECT_EQ(apply_job_overrides(torchrun, {.gloo_available = false}).backend, comm::Engine::threads);
  EXPECT_EQ(apply_job_overrides(DistributedConfig{}, {}).backend, comm::Engine::threads);
  EXPECT_THAT(error_of([] { apply_job_overrides(DistributedConfig{}, {.engine = "mpi", .devices = "4"}); }),
              HasSubstr("--devices: the mpi engine takes its ranks from its launcher"));
}

TEST(JobOverrides, AMeshReplacesTheConfigurationsSizesAndSetsTheDevices) {
  DistributedConfig c;
  c.world_size = c.num_processes_per_node = 4;
  c.tensor_parallel_size = 4;
  const DistributedConfig d = apply_job_overrides(c, {.mesh = "data=2,pipeline=3"});
  EXPECT_EQ(d.world_size, 6);
  EXPECT_EQ(d.num_processes_per_node, 6);
  EXPECT_EQ(d.tensor_parallel_size, 1);
  EXPECT_EQ(d.pipeline_parallel_size, 3);
  EXPECT_EQ(d.mesh().to_spec(), "data=2,pipeline=3");
  EXPECT_EQ(apply_job_overrides(DistributedConfig{}, {.devices = "8", .mesh = "data=2,tensor=4"}).tensor_parallel_size,
            4);
  EXPECT_THAT(error_of<Unsupported>([] { apply_job_overrides(DistributedConfig{}, {.mesh = "data=2,model=2"}); }),
              HasSubstr("--mesh: mesh data=2,model=2 has a model axis of size 2, which training cannot use"));
  DistributedConfig file;
  file.world_size = file.num_processes_per_node = 4;
  file.mesh_shape = {2, 2};
  file.mesh_axis_names = {"data", "model"};
  EXPECT_THAT(error_of<Unsupported>([&] { apply_job_overrides(file, {.config_source = "run.toml"}); }),
              HasSubstr("run.toml: mesh data=2,model=2 has a model axis of size 2"));
  EXPECT_THAT(error_of([] { apply_job_overrides(DistributedConfig{}, {.mesh = "data=2048"}); }),
              HasSubstr("--mesh: 2048 devices, more than the threads engine's 1024"));
  EXPECT_THAT(error_of([] { apply_job_overrides(DistributedConfig{}, {.mesh = "data=0"}); }), HasSubstr("--mesh"));
}

// A launcher's restart repeats the command line: a --mesh that no longer
// fits the world size (a node lost) is re-planned, the data axis taking the
// change and the fixed axes kept; not on a fresh run.
TEST(JobOverrides, AResumedRunsMeshThatNoLongerFitsIsReplanned) {
  const DistributedConfig two = DistributedConfig{}.with_env(
      LauncherEnv{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}});
  std::vector<std::string> notes;
  const DistributedConfig d = apply_job_overrides(
      two, {.mesh = "data=2,tensor=2", .gloo_available = true, .resuming = true, .notes = &notes});
  EXPECT_EQ(d.mesh().to_spec(), "data=1,tensor=2");
  EXPECT_EQ(d.tensor_parallel_size, 2);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0], HasSubstr("resuming on 2 devices: mesh data=2,tensor=2 -> data=1,tensor=2"));
  EXPECT_THAT(error_of([&] { apply_job_overrides(two, {.mesh = "data=2,tensor=2", .gloo_available = true}); }),
              HasSubstr("needs 4 devices but there are 2"));
  EXPECT_THAT(error_of([&] {
                apply_job_overrides(two, {.mesh = "pipeline=2,tensor=2", .gloo_available = true, .resuming = true});
              }),
              HasSubstr("give --mesh for 2 devices"));
  // A run saved by a two-node job resumes on simulated devices: one node.
  DistributedConfig saved = two;
  saved.num_nodes = 2;
  saved.num_processes_per_node = 1;
  EXPECT_NO_THROW(apply_job_overrides(saved, {.engine = "threads", .devices = "4"}).validate());
}

TEST(JobOverrides, PrecisionIsOneSettingUnderTwoNames) {
  EXPECT_EQ(apply_job_overrides(DistributedConfig{}, {.precision = "bf16"}).mixed_precision, DType::bf16);
  EXPECT_EQ(apply_job_overrides(DistributedConfig{}, {.precision = "fp32"}).mixed_precision, DType::f32);
  EXPECT_EQ(apply_job_overrides(DistributedConfig{}, {.mixed_precision = "no", .precision = "fp32"}).mixed_precision,
            DType::f32);
  EXPECT_THAT(error_of([] {
                apply_job_overrides(DistributedConfig{}, {.mixed_precision = "fp16", .precision = "bf16"});
              }),
              HasSubstr("--mixed-precision fp16 and --precision bf16 disagree"));
  EXPECT_THAT(error_of([] { apply_job_overrides(DistributedConfig{}, {.precision = "fp8"}); }),
              HasSubstr("--precision"));
}

}  // namespace
}  // namespace meshtrain::config
