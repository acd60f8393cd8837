#include "meshtrain/core/atomic_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "meshtrain/core/error.h"

namespace meshtrain {
namespace {

constexpr const char* kOp = "write_file_atomic";

std::string errno_text(int err) { return std::strerror(err); }

// Closes the descriptor and removes the temporary file unless released.
class TempFile {
 public:
  TempFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // close(2) reports deferred write errors (e.g. NFS); a failed close is a failed write.
  void close_or_throw() {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0)
      throw IoError(kOp, fmt::format("close '{}': {}", path_, errno_text(errno)), "check free disk space");
  }
  void release() { path_.clear(); }  // renamed: nothing to remove

 private:
  std::string path_;
  int fd_;
};

}  // namespace

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    throw IoError("fsync_directory", fmt::format("open '{}': {}", dir, errno_text(errno)), "check the directory");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory (EINVAL); their renames are as durable as they get.
  if (rc != 0 && err != EINVAL)
    throw IoError("fsync_directory", fmt::format("fsync '{}': {}", dir, errno_text(err)), "check the file system");
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  const std::filesystem::path target(path);
  if (!target.has_filename())
    throw IoError(kOp, fmt::format("'{}' names a directory, not a file", path), "give a file name");
  const std::string dir = target.parent_path().string();
  // A fresh name (O_EXCL); mode 0666 & ~umask like any new file.
  static std::atomic<uint64_t> counter{0};
  std::string tmp_name;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    tmp_name = (target.parent_path() / fmt::format(".{}.tmp.{}.{}", target.filename().string(), ::getpid(),
                                                    counter.fetch_add(1)))
                   .string();
    fd = ::open(tmp_name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0)
    throw IoError(kOp, fmt::format("cannot create a temporary file next to '{}': {}", path, errno_text(errno)),
                  "check that the directory exists and is writable");
  TempFile tmp(tmp_name, fd);
  for (size_t done = 0; done < contents.size();) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw IoError(kOp, fmt::format("write '{}' ({} of {} bytes written): {}", tmp.path(), done, contents.size(),
                                     n < 0 ? errno_text(errno) : "no progress"),
                    "check free disk space");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0)
    throw IoError(kOp, fmt::format("fsync '{}': {}", tmp.path(), errno_text(errno)), "check the file system");
  tmp.close_or_throw();
  if (::rename(tmp.path().c_str(), path.c_str()) != 0)
    throw IoError(kOp, fmt::format("rename '{}' -> '{}': {}", tmp.path(), path, errno_text(errno)),
                  "check that the destination is not a directory and is on the same file system");
  tmp.release();
  fsync_directory(dir);
}

}  // namespace meshtrain
