#include "meshtrain/train/run_dir.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

fs::path fresh_parent(const std::string& name) { return testing::fresh_dir("meshtrain_run_dir_" + name); }
using testing::entries;

using Names = std::vector<std::string>;

TEST(RunDirectory, AResumedRunReadsItsStagingConfigFirstAndARestartNeedsACheckpoint) {
  const fs::path parent = fresh_parent("resume_config");
  const std::string run = (parent / "run").string();
  EXPECT_THAT(testing::error_of([&] { resume_config(run); }),
              ::testing::HasSubstr("--resume: '" + run + "' holds no config.toml (nor does '" + run + ".incomplete')"));
  EXPECT_FALSE(holds_checkpoint(run));
  fs::create_directories(run);
  write_file_atomic(run + "/config.toml", "model = \"mlp\"\n");
  EXPECT_EQ(resume_config(run), run + "/config.toml");
  fs::create_directories(run + ".incomplete/checkpoints/step_00000003");
  write_file_atomic(run + ".incomplete/config.toml", "model = \"mlp\"\n");
  EXPECT_EQ(resume_config(run), run + ".incomplete/config.toml");  // the interrupted run's
  EXPECT_FALSE(holds_checkpoint(run));                               // a step without an index is no checkpoint
  write_file_atomic(run + ".incomplete/checkpoints/step_00000003/index.json", "{}");
  EXPECT_TRUE(holds_checkpoint(run));
}

TEST(RunDirectory, AFreshRunIsStagedAndCommitted) {
  const fs::path parent = fresh_parent("fresh");
  const std::string path = (parent / "run").string();
  {
    RunDirectory dir = RunDirectory::create(path + "/", false);  // a trailing slash names the same directory
    EXPECT_EQ(dir.path(), path);
    EXPECT_EQ(dir.staging(), path + ".incomplete");
    EXPECT_EQ(entries(parent), (Names{"run", "run.incomplete", "run.lock"}));  // the lock: while the run lives
    EXPECT_TRUE(fs::is_empty(path));  // reserved, empty until commit
    write_file_atomic(dir.file("config.toml"), "new config");
    write_file_atomic(dir.file("model.safetensors"), "new model");
    dir.commit();
  }
  EXPECT_EQ(entries(parent), Names{"run"});
  EXPECT_EQ(entries(path), (Names{"config.toml", "model.safetensors"}));
  EXPECT_EQ(testing::read_file(parent / "run" / "config.toml"), "new config");
}

TEST(RunDirectory, AFailedFreshRunLeavesNothing) {
  const fs::path parent = fresh_parent("failed");
  {
    RunDirectory dir = RunDirectory::create((parent / "run").string(), false);
    write_file_atomic(dir.file("config.toml"), "config");
  }  // no commit: the run failed
  EXPECT_TRUE(entries(parent).empty());
}

TEST(RunDirectory, ARunDirectoryHoldingARunIsRefused) {
  const fs::path parent = fresh_parent("refuse");
  const fs::path path = parent / "run";
  fs::create_directories(path);
  write_file_atomic((path / "model.safetensors").string(), "old model");
  const std::string error = testing::error_of<Error>([&] { (void)RunDirectory::create(path.string(), false); });
  EXPECT_THAT(error, HasSubstr(fmt::format("run directory '{}' is not empty (model.safetensors): it holds a "
                                           "previous run", path.string())));
  EXPECT_THAT(error, HasSubstr("pass --overwrite to replace that run"));
  EXPECT_THAT(testing::error_of<Error>([&] { RunDirectory::check(path.string(), false); }), HasSubstr("is not empty"));
  EXPECT_EQ(testing::error_of<Error>([&] { RunDirectory::check(path.string(), true); }), "");
  EXPECT_EQ(entries(parent), Names{"run"});
  EXPECT_EQ(testing::read_file(path / "model.safetensors"), "old model");
  // An empty directory is fine; so is a path that does not exist yet.
  fs::create_directories(parent / "empty");
  EXPECT_EQ(testing::error_of<Error>([&] { RunDirectory::create((parent / "empty").string(), false).commit(); }), "");
}

TEST(RunDirectory, OverwriteReplacesTheRunOnlyWhenTheNewOneSucceeds) {
  const fs::path parent = fresh_parent("overwrite");
  const fs::path path = parent / "run";
  fs::create_directories(path);
  for (const char* name : {"config.toml", "model.safetensors", "metrics.jsonl", "samples.png"})
    write_file_atomic((path / name).string(), std::string("old ") + name);
  {
    RunDirectory dir = RunDirectory::create(path.string(), true);
    write_file_atomic(dir.file("config.toml"), "new config");
  }  // failed: the old run stays, byte for byte
  EXPECT_EQ(entries(parent), Names{"run"});
  EXPECT_EQ(testing::read_file(path / "model.safetensors"), "old model.safetensors");
  EXPECT_EQ(testing::read_file(path / "config.toml"), "old config.toml");
  {
    RunDirectory dir = RunDirectory::create(path.string(), true);
    write_file_atomic(dir.file("config.toml"), "new config");
    write_file_atomic(dir.file("model.safetensors"), "new model");
    EXPECT_EQ(testing::read_file(path / "model.safetensors"), "old model.safetensors");  // untouched until commit
    dir.commit();
  }
  EXPECT_EQ(entries(parent), Names{"run"});
  EXPECT_EQ(entries(path), (Names{"config.toml", "model.safetensors"}));  // nothing of the old run is left
  EXPECT_EQ(testing::read_file(path / "model.safetensors"), "new model");
}

TEST(RunDirectory, OverwriteNeverDeletesOtherFiles) {
  const fs::path parent = fresh_parent("foreign");
  fs::create_directories(parent / "home");
  write_file_atomic((parent / "home" / "notes.txt").string(), "mine");
  write_file_atomic((parent / "home" / "config.toml").string(), "x");
  EXPECT_THAT(testing::error_of<Error>([&] { (void)RunDirectory::create((parent / "home").string(), true); }),
              HasSubstr("--overwrite would delete '" + (parent / "home").string() +
                        "', which holds files no run writes (notes.txt)"));
  EXPECT_EQ(testing::read_file(parent / "home" / "notes.txt"), "mine");
  write_file_atomic((parent / "file").string(), "x");
  EXPECT_THAT(testing::error_of<Error>([&] { (void)RunDirectory::create((parent / "file").string(), true); }),
              HasSubstr("exists and is not a directory"));
  EXPECT_THAT(testing::error_of<Error>([] { (void)RunDirectory::create("", false); }), HasSubstr("names no directory"));
  EXPECT_THAT(testing::error_of<Error>([] { (void)RunDirectory::create("/", true); }), HasSubstr("names no directory"));
  EXPECT_THAT(testing::error_of<Error>([] { (void)RunDirectory::create(".", true); }), HasSubstr("names no directory"));
  EXPECT_EQ(entries(parent), (Names{"file", "home"}));
}

TEST(RunDirectory, AStaleStagingDirectoryIsReplaced) {
  const fs::path parent = fresh_parent("stale");
  fs::create_directories(parent / "run.incomplete");
  write_file_atomic((parent / "run.incomplete" / "metrics.jsonl").string(), "killed run");
  {
    RunDirectory dir = RunDirectory::create((parent / "run").string(), false);
    EXPECT_TRUE(fs::is_empty(dir.staging()));
    write_file_atomic(dir.file("metrics.jsonl"), "this run");
    dir.commit();
  }
  EXPECT_EQ(entries(parent), Names{"run"});
  EXPECT_EQ(testing::read_file(parent / "run" / "metrics.jsonl"), "this run");
}

// Two runs into one directory: the second is refused at once, naming the
// first's process, and touches nothing of it (the first's staging survives
// and it commits); check() refuses too; so does a resume of it. Once the
// first is done the path is free again.
TEST(RunDirectory, ASecondOwnerIsRefusedNamingTheFirst) {
  const fs::path parent = fresh_parent("owner");
  const std::string path = (parent / "run").string();
  {
    RunDirectory first = RunDirectory::create(path, false);
    write_file_atomic(first.file("config.toml"), "first");
    const std::string owner = fmt::format("is in use by process {} on host ", ::getpid());
    for (const auto& second : std::vector<std::function<void()>>{
             [&] { (void)RunDirectory::create(path, false); },
             [&] { (void)RunDirectory::create(path, true); },
             [&] { RunDirectory::check(path, false); },
             [&] { (void)RunDirectory::resume(path); }}) {
      const std::string error = testing::error_of<InvalidArgument>(second);
      EXPECT_THAT(error, HasSubstr(fmt::format("run directory '{}' {}", path, owner)));
      EXPECT_THAT(error, HasSubstr(fmt::format("(it holds the lock '{}.lock')", path)));
      EXPECT_THAT(error, HasSubstr("give another --run-dir"));
    }
    EXPECT_EQ(testing::read_file(fs::path(first.file("config.toml"))), "first");  // untouched
    first.commit();
  }
  EXPECT_EQ(entries(parent), Names{"run"});  // the lock is gone with its owner
  EXPECT_EQ(testing::read_file(parent / "run" / "config.toml"), "first");
  RunDirectory again = RunDirectory::create(path, true);  // free again
}

// The kernel drops a killed owner's lock: the next run is not blocked, and
// the killed run's staging (no checkpoint) is cleaned up.
TEST(RunDirectory, AKilledOwnerDoesNotBlockTheNextRun) {
  const fs::path parent = fresh_parent("killed");
  const std::string path = (parent / "run").string();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    RunDirectory dir = RunDirectory::create(path, false);
    write_file_atomic(dir.file("config.toml"), "killed");
    ::raise(SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(entries(parent), (Names{"run", "run.incomplete", "run.lock"}));  // what the kill left
  {
    RunDirectory next = RunDirectory::create(path, false);
    EXPECT_TRUE(entries(next.staging()).empty());
    next.commit();
  }
  EXPECT_EQ(entries(parent), Names{"run"});
}

TEST(RunDirectory, VersionedDirectoriesCountUp) {
  const fs::path parent = fresh_parent("versions");
  {
    RunDirectory a = RunDirectory::create_versioned((parent / "mlp").string());
    EXPECT_EQ(a.path(), (parent / "mlp" / "version_0").string());
    a.commit();
  }
  fs::create_directories(parent / "mlp" / "version_7");
  fs::create_directories(parent / "mlp" / "version_x");
  {
    RunDirectory b = RunDirectory::create_versioned((parent / "mlp").string());
    EXPECT_EQ(b.path(), (parent / "mlp" / "version_8").string());
  }  // failed: version_8 is not left behind
  EXPECT_EQ(entries(parent / "mlp"), (Names{"version_0", "version_7", "version_x"}));
}

}  // namespace
}  // namespace meshtrain::train
