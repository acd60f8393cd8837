#include "meshtrain/train/run_dir.h"

#include <fcntl.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdio.h>  // renameat2 (glibc >= 2.28)
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>
#include <vector>

#include "meshtrain/checkpoint/checkpoint.h"
#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/error.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;
constexpr const char* kOp = "meshtrain train";
constexpr const char* kIncomplete = ".incomplete";

// "runs/mlp/" -> "runs/mlp"; "" and "/" name no directory a run can own.
std::string normalized(const std::string& path) {
  fs::path p = fs::path(path).lexically_normal();
  if (!p.has_filename() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  const std::string name = p.filename().string();
  if (path.empty() || name.empty() || name == "." || name == "..")
    throw InvalidArgument(kOp, fmt::format("run directory '{}' names no directory of its own", path),
                          "give a run directory such as --run-dir runs/my_run");
  return p.string();
}

bool is_run_artifact(const std::string& name, std::span<const std::string> more) {
  if (std::find(kRunArtifacts.begin(), kRunArtifacts.end(), name) != kRunArtifacts.end()) return true;
  if (std::find(more.begin(), more.end(), name) != more.end()) return true;
  // A temporary of write_file_atomic (".<artifact>.tmp.<pid>.<n>") left by a crash.
  return name.size() > 1 && name[0] == '.' && name.find(".tmp.") != std::string::npos;
}

// The newest complete checkpoint (a checkpoints/step_N directory with an
// index.json) under a run's directory, or "".
std::string newest_checkpoint(const fs::path& run) {
  std::error_code ec;
  std::string newest;
  for (const auto& e : fs::directory_iterator(run / "checkpoints", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && fs::exists(e.path() / "index.json", ec) && name > newest) newest = name;
  }
  return newest;
}

std::vector<std::string> entries_of(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Throws unless `path` may become this run's directory; returns whether it
// exists (then as a directory).
bool check_path(const std::string& path, bool overwrite, std::span<const std::string> more) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (!fs::exists(st)) return false;
  if (!fs::is_directory(st))
    throw InvalidArgument(kOp, fmt::format("run directory '{}' exists and is not a directory", path),
                          "give another --run-dir");
  const std::vector<std::string> names = entries_of(path);
  if (names.empty()) return true;
  std::vector<std::string> foreign;
  for (const auto& n : names)
    if (!is_run_artifact(n, more)) foreign.push_back(n);
  if (!overwrite)
    throw InvalidArgument(kOp,
                          fmt::format("run directory '{}' is not empty ({}){}", path, fmt::join(names, ", "),
                                      foreign.empty() ? ": it holds a previous run" : ""),
                          "pass --overwrite to replace that run (it is replaced only when the new run "
                          "succeeds), give another --run-dir, or leave run_dir unset to get the next "
                          "runs/<model>/version_<N>");
  if (!foreign.empty())
    throw InvalidArgument(kOp,
                          fmt::format("--overwrite would delete '{}', which holds files no run writes ({})", path,
                                      fmt::join(foreign, ", ")),
                          "give a --run-dir of its own: --overwrite only replaces a directory holding "
                          "nothing but a run's artifacts");
  return true;
}

[[noreturn]] void throw_io(const std::string& what, int err, const char* hint) {
  throw IoError(kOp, fmt::format("{}: {}", what, std::strerror(err)), hint);
}

std::string lock_path_of(const std::string& run_path) { return run_path + ".lock"; }

// What a held lock file says of its owner ("process 123 on host h since ...").
[[noreturn]] void throw_in_use(const std::string& run_path, int fd) {
  std::string owner(256, '\0');
  const ssize_t n = ::pread(fd, owner.data(), owner.size(), 0);
  owner.resize(n > 0 ? static_cast<size_t>(n) : 0);
  while (!owner.empty() && (owner.back() == '\n' || owner.back() == '\0')) owner.pop_back();
  throw InvalidArgument(kOp,
                        fmt::format("run directory '{}' is in use by {} (it holds the lock '{}')", run_path,
                                    owner.empty() ? std::string("another process") : owner,
                                    lock_path_of(run_path)),
                        "wait for that run to end or stop it (a killed run's lock goes with it), or give "
                        "another --run-dir");
}

// The lock on a run directory: an flock on "<run>.lock" beside it, held
// while a RunDirectory lives and released by the kernel when its process
// dies, so a killed run never blocks the next. The file is unlinked before
// it is unlocked; a process that opened the old file checks, once it holds
// the lock, that the path still names what it locked, and tries again.
class LockFile {
 public:
  explicit LockFile(const std::string& run_path) : path_(lock_path_of(run_path)) {
    for (int attempt = 0; attempt < 100; ++attempt) {
      fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      if (fd_ < 0) throw_io(fmt::format("cannot open the lock '{}'", path_), errno, "check the permissions of the run directory's parent");
      if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        if (err == EWOULDBLOCK) {
          const int fd = std::exchange(fd_, -1);
          try {
            throw_in_use(run_path, fd);
          } catch (...) {
            ::close(fd);
            throw;
          }
        }
        ::close(std::exchange(fd_, -1));
        throw_io(fmt::format("cannot lock '{}'", path_), err, "check that the file system supports flock");
      }
      struct stat held{}, named{};
      if (::fstat(fd_, &held) == 0 && ::stat(path_.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
          held.st_ino == named.st_ino)
        break;
      ::close(std::exchange(fd_, -1));  // unlinked by its last owner: lock the new one
    }
    if (fd_ < 0) throw IoError(kOp, fmt::format("could not lock '{}'", path_), "try again");
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string owner = fmt::format("process {} on host {} since {:%Y-%m-%d %H:%M:%S} UTC\n", ::getpid(), host,
                                          std::chrono::floor<std::chrono::seconds>(std::chrono::system_clock::now()));
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, owner.data(), owner.size(), 0) < 0) {
      // The owner's line is for messages only; the lock holds without it.
    }
  }
  LockFile(const LockFile&) = delete;
  LockFile& operator=(const LockFile&) = delete;
  ~LockFile() { unlock(path_, std::exchange(fd_, -1)); }
  // Hands the descriptor over (unlock() releases it).
  int release() { return std::exchange(fd_, -1); }
  const std::string& path() const { return path_; }

  static void unlock(const std::string& path, int fd) {
    if (fd < 0) return;
    ::unlink(path.c_str());
    ::close(fd);
  }
  // Throws as the constructor would when another process holds the lock;
  // takes nothing.
  static void probe(const std::string& run_path) {
    const std::string path = lock_path_of(run_path);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
      try {
        throw_in_use(run_path, fd);
      } catch (...) {
        ::close(fd);
        throw;
      }
    }
    ::close(fd);
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace

void RunDirectory::check(const std::string& path_in, bool overwrite, std::span<const std::string> more_artifacts) {
  const std::string path = normalized(path_in);
  LockFile::probe(path);
  (void)check_path(path, overwrite, more_artifacts);
}

RunDirectory RunDirectory::create(const std::string& path_in, bool overwrite,
                                  std::span<const std::string> more_artifacts) {
  const std::string path = normalized(path_in);
  bool reserved = false;
  if (!check_path(path, overwrite, more_artifacts)) {
    const fs::path parent = fs::path(path).parent_path();
    std::error_code ec;
    if (!parent.empty()) fs::create_directories(parent, ec);
    if (ec) throw IoError(kOp, fmt::format("cannot create '{}': {}", parent.string(), ec.message()),
                          "check the --run-dir path and its permissions");
    if (::mkdir(path.c_str(), 0777) == 0) {
      reserved = true;
    } else if (errno == EEXIST) {
      (void)check_path(path, overwrite, more_artifacts);  // another process was quicker: its rules apply
    } else {
      throw_io(fmt::format("cannot create run directory '{}'", path), errno, "check the --run-dir path and its permissions");
    }
  }
  return RunDirectory(path, reserved,
                      overwrite ? Staging::fresh_discarding_checkpoints : Staging::fresh);
}

RunDirectory RunDirectory::create_versioned(const std::string& parent_in) {
  const fs::path parent(normalized(parent_in));
  std::error_code ec;
  fs::create_directories(parent, ec);
  if (ec) throw IoError(kOp, fmt::format("cannot create '{}': {}", parent.string(), ec.message()),
                        "check the path and its permissions, or give --run-dir");
  int64_t next = 0;
  for (const std::string& name : entries_of(parent)) {
    constexpr std::string_view kPrefix = "version_";
    if (name.rfind(kPrefix, 0) != 0) continue;
    int64_t n = -1;
    const char* first = name.data() + kPrefix.size();
    const char* last = name.data() + name.size();
    auto [p, err] = std::from_chars(first, last, n);
    if (err == std::errc() && p == last && n >= 0 && n < INT64_MAX) next = std::max(next, n + 1);
  }
  for (int attempt = 0; attempt < 1000; ++attempt, ++next) {
    const std::string path = (parent / fmt::format("version_{}", next)).string();
    if (::mkdir(path.c_str(), 0777) == 0) return RunDirectory(path, true, Staging::fresh);
    if (errno != EEXIST) throw_io(fmt::format("cannot create run directory '{}'", path), errno, "give --run-dir");
  }
  throw IoError(kOp, fmt::format("no free version_<N> under '{}'", parent.string()), "give --run-dir");
}

RunDirectory RunDirectory::resume(const std::string& path_in) {
  const std::string path = normalized(path_in);
  LockFile::probe(path);  // a live run's checkpoints are not ours to judge
  const std::string staging = path + kIncomplete;
  if (!newest_checkpoint(staging).empty()) return RunDirectory(path, false, Staging::adopt);
  if (newest_checkpoint(path).empty())
    throw InvalidArgument(kOp, fmt::format("--resume '{}': neither it nor '{}' holds a checkpoint", path, staging),
                          "runs write checkpoints with --checkpoint-every N (and one at the end)");
  RunDirectory dir(path, false, Staging::fresh);
  // The committed run's files, its checkpoints as hard links (no copy of the data).
  std::error_code ec;
  for (const std::string& name : entries_of(path)) {
    const fs::path from = fs::path(path) / name, to = fs::path(dir.staging_) / name;
    if (name == "checkpoints")
      fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::create_hard_links, ec);
    if (ec || name != "checkpoints") {  // hard links failing (another file system): copy
      ec.clear();
      fs::remove_all(to, ec);
      fs::copy(from, to, fs::copy_options::recursive, ec);
    }
    if (ec) {
      const std::string why = ec.message();
      fs::remove_all(dir.staging_, ec);  // a partial copy must not look like a run to continue
      throw IoError(kOp, fmt::format("--resume: copy '{}' to '{}': {}", from.string(), to.string(), why),
                    "check the free space and permissions next to the run directory");
    }
  }
  return dir;
}

RunDirectory::RunDirectory(std::string path, bool reserved, Staging staging)
    : path_(std::move(path)), staging_(path_ + kIncomplete), reserved_(reserved) {
  // The lock first: a staging directory is only ever touched by its owner.
  std::optional<LockFile> lock;
  try {
    lock.emplace(path_);
  } catch (...) {
    if (reserved_) ::rmdir(path_.c_str());
    throw;
  }
  std::error_code ec;
  if (staging == Staging::adopt) {
    adopted_ = true;
  } else {
    if (const std::string newest = newest_checkpoint(staging_); !newest.empty() && staging == Staging::fresh) {
      if (reserved_) ::rmdir(path_.c_str());
      throw InvalidArgument(kOp,
                            fmt::format("'{}' holds the checkpoints of an interrupted run (the newest: {})",
                                        staging_, newest),
                            fmt::format("continue it with --resume {}, or pass --overwrite to discard them", path_));
    }
    fs::remove_all(staging_, ec);  // left by a killed run (its lock died with it)
    if (ec || ::mkdir(staging_.c_str(), 0777) != 0) {
      const int err = ec ? ec.value() : errno;
      if (reserved_) ::rmdir(path_.c_str());
      throw_io(fmt::format("cannot create the staging directory '{}'", staging_), err,
               "check the permissions of the run directory's parent");
    }
  }
  lock_path_ = lock->path();
  lock_fd_ = lock->release();
}

RunDirectory::RunDirectory(RunDirectory&& other) noexcept
    : path_(std::move(other.path_)),
      staging_(std::move(other.staging_)),
      lock_path_(std::move(other.lock_path_)),
      lock_fd_(std::exchange(other.lock_fd_, -1)),
      reserved_(other.reserved_),
      committed_(other.committed_),
      adopted_(other.adopted_) {
  other.moved_from_ = true;
}

RunDirectory::~RunDirectory() {
  if (moved_from_) return;
  if (!committed_) {
    std::error_code ec;
    if (newest_checkpoint(staging_).empty()) fs::remove_all(staging_, ec);  // else kept for --resume
    if (reserved_) ::rmdir(path_.c_str());  // only while empty
  }
  LockFile::unlock(lock_path_, std::exchange(lock_fd_, -1));
}

std::string RunDirectory::file(std::string_view name) const { return (fs::path(staging_) / name).string(); }

void RunDirectory::commit() {
  if (committed_) throw Error(kOp, fmt::format("run directory '{}' was committed already", path_), "");
  fsync_directory(staging_);
  const std::string parent = fs::path(path_).parent_path().string();
  std::error_code ec;
  const bool empty = !fs::exists(path_, ec) || fs::is_empty(path_, ec);
  if (empty) {
    // rename(2) replaces an empty directory atomically.
    if (::rename(staging_.c_str(), path_.c_str()) != 0)
      throw_io(fmt::format("rename '{}' -> '{}'", staging_, path_), errno, "check the run directory's parent");
  } else {
    // The previous run (allowed by --overwrite): swap both names at once where the file system can.
    if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, path_.c_str(), RENAME_EXCHANGE) == 0) {
      // staging_ now holds the previous run.
    } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
      const std::string old = path_ + ".old";
      fs::remove_all(old, ec);
      if (::rename(path_.c_str(), old.c_str()) != 0)
        throw_io(fmt::format("rename '{}' -> '{}'", path_, old), errno, "check the run directory's parent");
      if (::rename(staging_.c_str(), path_.c_str()) != 0) {
        const int err = errno;
        ::rename(old.c_str(), path_.c_str());  // put the previous run back
        throw_io(fmt::format("rename '{}' -> '{}'", staging_, path_), err, "check the run directory's parent");
      }
      staging_ = old;  // now the previous run
    } else {
      throw_io(fmt::format("exchange '{}' and '{}'", staging_, path_), errno, "check the run directory's parent");
    }
    fs::remove_all(staging_, ec);  // the previous run
  }
  committed_ = true;
  fsync_directory(parent.empty() ? "." : parent);
}

std::string resume_config(const std::string& run) {
  for (const std::string& dir : {run + kIncomplete, run}) {
    const std::string path = (fs::path(dir) / "config.toml").string();
    if (fs::exists(path)) return path;
  }
  throw InvalidArgument("--resume", fmt::format("'{}' holds no config.toml (nor does '{}{}')", run, run, kIncomplete),
                        "give the run directory of a run that wrote checkpoints (--checkpoint-every N)");
}

bool holds_checkpoint(const std::string& run) {
  for (const std::string& dir : {run + kIncomplete, run})
    if (checkpoint::latest_checkpoint((fs::path(dir) / "checkpoints").string())) return true;
  return false;
}

}  // namespace meshtrain::train
