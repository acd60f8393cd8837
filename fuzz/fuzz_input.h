// What the fuzz targets share: a reader's broken promise aborts (libFuzzer
// records the input), and the readers that take a path get the input as a
// file: one memfd per process, rewritten for every input.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace meshtrain::fuzz {

inline void check(bool ok) {
  if (!ok) std::abort();  // a broken promise of the reader
}

// The input as the file at the returned path ("/proc/self/fd/N").
inline const std::string& write_input(const void* data, size_t size) {
  static const int fd = [] {
    const int f = memfd_create("meshtrain_fuzz_input", MFD_CLOEXEC);
    check(f >= 0);
    return f;
  }();
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  check(ftruncate(fd, 0) == 0);
  check(size == 0 || pwrite(fd, data, size, 0) == static_cast<ssize_t>(size));
  return path;
}

}  // namespace meshtrain::fuzz
