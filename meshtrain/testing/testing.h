// Helpers for meshtrain's own tests (header-only; not part of the library's
// API). The testing folder holds every layer's test support: this file
// (errors, temporary directories), grad_check.h (finite differences),
// optim.h (parameters for optimizer tests), redistribute.h (the layout
// property checks, in the meshtrain_testing library).
//
//   EXPECT_THAT(testing::error_of([] { parse_dtype("f17"); }), HasSubstr("unknown dtype"));
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <mutex>

#include "meshtrain/core/error.h"

namespace meshtrain::testing {

// Failures collected on rank threads (gtest's macros from several threads
// would interleave), reported on the test thread.
//   testing::Failures f;  ... f.add("rank 1: ...") on a rank ...;  f.report();
struct Failures {
  std::mutex mu;
  std::vector<std::string> list;
  void add(std::string s) {
    std::lock_guard lock(mu);
    list.push_back(std::move(s));
  }
  void report() {
    for (const auto& f : list) ADD_FAILURE() << f;
  }
};

// what() of the E (InvalidArgument unless given) `fn` throws, or "" if it
// throws none (other exceptions propagate, so a wrong error type fails the
// test).
template <typename E = InvalidArgument>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// An empty directory under the system's temporary directory (removed first
// if it exists).
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// The names in `dir`, sorted.
inline std::vector<std::string> entries(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A file's bytes ("" if it cannot be read).
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace meshtrain::testing
