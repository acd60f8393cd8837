#include "meshtrain/core/atomic_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A fresh empty directory per test.
fs::path fresh_dir(const std::string& name) { return testing::fresh_dir("meshtrain_atomic_file_" + name); }
using testing::entries;

TEST(AtomicFile, WritesAndReplaces) {
  const fs::path dir = fresh_dir("write");
  const std::string path = (dir / "a.txt").string();
  write_file_atomic(path, "first");
  EXPECT_EQ(testing::read_file(path), "first");
  write_file_atomic(path, std::string(100000, 'x'));
  EXPECT_EQ(testing::read_file(path), std::string(100000, 'x'));
  write_file_atomic(path, "");
  EXPECT_EQ(testing::read_file(path), "");
  EXPECT_EQ(entries(dir), std::vector<std::string>{"a.txt"});  // no temporary left
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(static_cast<mode_t>(fs::status(path).permissions()) & 0777, 0666 & ~mask);
}

TEST(AtomicFile, MissingDirectoryIsAnIoError) {
  EXPECT_THAT(testing::error_of<IoError>([] { write_file_atomic("/nonexistent_meshtrain_dir/a.txt", "x"); }),
              HasSubstr("cannot create a temporary file next to '/nonexistent_meshtrain_dir/a.txt'"));
}

TEST(AtomicFile, AFailedRenameLeavesTheTargetAndNoTemporary) {
  const fs::path dir = fresh_dir("rename");
  fs::create_directories(dir / "target" / "inside");  // a non-empty directory cannot be replaced by a file
  EXPECT_THAT(testing::error_of<IoError>([&] { write_file_atomic((dir / "target").string(), "x"); }), HasSubstr("rename"));
  EXPECT_EQ(entries(dir), std::vector<std::string>{"target"});
  EXPECT_TRUE(fs::is_directory(dir / "target" / "inside"));
}

// A write that runs out of space (here: past RLIMIT_FSIZE, errno EFBIG) keeps
// the previous file byte for byte and removes the temporary.
TEST(AtomicFile, AShortWriteKeepsThePreviousFile) {
  const fs::path dir = fresh_dir("short");
  const std::string path = (dir / "model.bin").string();
  write_file_atomic(path, "the previous model");
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string error = testing::error_of<IoError>([&] { write_file_atomic(path, std::string(1 << 20, 'n')); });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_THAT(error, HasSubstr("write '"));
  EXPECT_THAT(error, HasSubstr("free disk space"));
  EXPECT_EQ(testing::read_file(path), "the previous model");
  EXPECT_EQ(entries(dir), std::vector<std::string>{"model.bin"});
}

TEST(AtomicFile, FsyncDirectory) {
  const fs::path dir = fresh_dir("fsync");
  fsync_directory(dir.string());
  EXPECT_THAT(testing::error_of<IoError>([] { fsync_directory("/nonexistent_meshtrain_dir"); }),
              HasSubstr("fsync_directory: open '/nonexistent_meshtrain_dir'"));
}

}  // namespace
}  // namespace meshtrain
