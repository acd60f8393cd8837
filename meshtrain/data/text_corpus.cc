#include "meshtrain/data/text_corpus.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <system_error>

#include "meshtrain/core/error.h"

namespace meshtrain::data {
namespace {

namespace fs = std::filesystem;
constexpr const char* kOp = "load_text_corpus";

std::string read_bytes(const fs::path& path) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw IoError(kOp, fmt::format("cannot open '{}': {}", path.string(), std::strerror(errno)),
                  "check the file's permissions");
  std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad()) throw IoError(kOp, fmt::format("reading '{}' failed", path.string()), "check the file system");
  return bytes;
}

void append_file(TextCorpus& corpus, std::string bytes, const std::string& name) {
  corpus.text += bytes;
  if (!bytes.empty() && bytes.back() != '\n') corpus.text += '\n';
  corpus.files.push_back(name);
}

std::string missing_hint(const std::string& path) {
  return fs::path(path).lexically_normal() == fs::path(kFortunesDir) ? std::string(kFortunesInstallHint)
                                                                     : std::string("check the path");
}

void read_directory(TextCorpus& corpus, const fs::path& dir) {
  // Sorted by the path relative to `dir` (byte-wise): independent of the
  // file system's listing order.
  std::vector<std::pair<std::string, fs::directory_entry>> entries;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::none, ec), end;
  if (ec)
    throw IoError(kOp, fmt::format("cannot list '{}': {}", dir.string(), ec.message()),
                  "check the directory's permissions");
  for (; it != end; it.increment(ec)) {
    if (ec)
      throw IoError(kOp, fmt::format("cannot list '{}': {}", dir.string(), ec.message()),
                    "check the directory's permissions");
    const fs::directory_entry& e = *it;
    const std::string name = e.path().filename().string();
    const std::string rel = e.path().lexically_relative(dir).generic_string();
    if (!name.empty() && name.front() == '.') {
      corpus.skipped.push_back(fmt::format("{} (hidden)", e.path().string()));
      if (e.is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (e.is_directory(ec)) {
      if (name == "off") {
        corpus.skipped.push_back(fmt::format("{} (fortune's offensive set)", e.path().string()));
        it.disable_recursion_pending();
      }
      continue;
    }
    if (e.is_regular_file(ec)) entries.emplace_back(rel, e);
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });

  // Real files first, so that a link is the one left out, whatever the order.
  std::set<fs::path> seen;
  for (const auto& [rel, e] : entries)
    if (!e.is_symlink(ec)) seen.insert(fs::weakly_canonical(e.path(), ec));
  std::set<fs::path> read_links;
  for (const auto& [rel, e] : entries) {
    const fs::path canonical = fs::weakly_canonical(e.path(), ec);
    if (e.is_symlink(ec)) {
      if (seen.count(canonical) || read_links.count(canonical)) {
        corpus.skipped.push_back(fmt::format("{} (a link to a file already read)", e.path().string()));
        continue;
      }
      read_links.insert(canonical);
    }
    std::string bytes = read_bytes(e.path());
    if (bytes.find('\0') != std::string::npos) {
      corpus.skipped.push_back(fmt::format("{} (binary: holds a NUL byte)", e.path().string()));
      continue;
    }
    append_file(corpus, std::move(bytes), e.path().string());
  }
  if (corpus.files.empty())
    throw IoError(kOp,
                  fmt::format("directory '{}' holds no text file ({} entries left out)", dir.string(),
                              corpus.skipped.size()),
                  "pass a directory of text files, or a text file");
}

}  // namespace

TextCorpus load_text_corpus(const std::string& path) {
  TextCorpus corpus;
  corpus.source = path;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st))
    throw IoError(kOp, fmt::format("corpus '{}' does not exist", path), missing_hint(path));
  if (fs::is_directory(st)) {
    read_directory(corpus, fs::path(path));
  } else {
    append_file(corpus, read_bytes(path), path);
  }
  if (corpus.text.empty())
    throw IoError(kOp, fmt::format("empty corpus: '{}' holds no text (0 bytes in {} file(s))", path,
                                   corpus.files.size()),
                  "pass a file or directory with text in it");
  return corpus;
}

int64_t count_characters(std::string_view text) {
  int64_t n = 0;
  for (const char c : text) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

uint64_t content_hash(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace meshtrain::data
