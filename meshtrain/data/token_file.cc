#include "meshtrain/data/token_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <utility>

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/error.h"

namespace meshtrain::data {
namespace {

static_assert(std::endian::native == std::endian::little, "the token file is read in place as little-endian");

constexpr const char* kOp = "TokenFile::open";
constexpr int64_t kU16VocabLimit = 65536;
constexpr const char* kRetokenize = "run `meshtrain tokenize` again to rebuild it";

int token_bytes_for(int64_t vocab_size) { return vocab_size <= kU16VocabLimit ? 2 : 4; }

uint32_t crc(const unsigned char* p, size_t n) {
  uLong c = crc32(0L, Z_NULL, 0);
  while (n > 0) {  // zlib takes uInt lengths
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, size_t{1} << 30));
    c = crc32(c, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(c);
}

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void store(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

uint32_t header_crc(const unsigned char* header) {
  unsigned char copy[kTokenFileHeaderBytes];
  std::memcpy(copy, header, kTokenFileHeaderBytes);
  store<uint32_t>(copy + 36, 0);
  return crc(copy, kTokenFileHeaderBytes);
}

// Largest token in the payload, for the range check.
template <typename T>
int64_t max_token(const unsigned char* payload, int64_t count, int64_t* where) {
  const T* t = reinterpret_cast<const T*>(payload);
  T best = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < count; ++i)
    if (t[i] > best) {
      best = t[i];
      at = i;
    }
  *where = at;
  return static_cast<int64_t>(best);
}

}  // namespace

void write_token_file(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size) {
  const char* op = "write_token_file";
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 31))
    throw InvalidArgument(op, fmt::format("{}: vocabulary size {} is outside [1, 2^31]", path, vocab_size),
                          "pass the tokenizer's vocabulary size");
  if (tokens.empty())
    throw InvalidArgument(op, fmt::format("{}: no tokens to write (an empty corpus)", path),
                          "tokenize a corpus with text in it");
  const int bytes = token_bytes_for(vocab_size);
  std::string out(kTokenFileHeaderBytes + tokens.size() * static_cast<size_t>(bytes), '\0');
  unsigned char* h = reinterpret_cast<unsigned char*>(out.data());
  unsigned char* payload = h + kTokenFileHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || t >= vocab_size)
      throw InvalidArgument(op, fmt::format("{}: token {} at position {} is outside [0, {})", path, t, i, vocab_size),
                            "pass the tokenizer's vocabulary size");
    if (bytes == 2)
      store<uint16_t>(payload + 2 * i, static_cast<uint16_t>(t));
    else
      store<uint32_t>(payload + 4 * i, static_cast<uint32_t>(t));
  }
  std::memcpy(h, kTokenFileMagic.data(), 8);
  store<uint32_t>(h + 8, kTokenFileVersion);
  store<uint32_t>(h + 12, static_cast<uint32_t>(bytes));
  store<uint64_t>(h + 16, static_cast<uint64_t>(vocab_size));
  store<uint64_t>(h + 24, tokens.size());
  store<uint32_t>(h + 32, crc(payload, out.size() - kTokenFileHeaderBytes));
  store<uint32_t>(h + 36, header_crc(h));
  write_file_atomic(path, out);
}

TokenFile TokenFile::open(const std::string& path, std::optional<int64_t> expected_vocab_size) {
  TokenFile f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw IoError(kOp, fmt::format("cannot open token file '{}': {}", path, std::strerror(errno)),
                  errno == ENOENT ? "run `meshtrain tokenize` to build it, or check the path"
                                  : "check the file's permissions");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(kOp, fmt::format("token file '{}' is not a regular file", path), "pass the path of a token file");
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kTokenFileHeaderBytes) {
    ::close(fd);
    throw IoError(kOp,
                  fmt::format("token file '{}' is truncated: {} bytes, shorter than the {}-byte header", path,
                              file_bytes, kTokenFileHeaderBytes),
                  kRetokenize);
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED)
    throw IoError(kOp, fmt::format("cannot map token file '{}': {}", path, std::strerror(map_errno)),
                  "check the memory limits");
  f.map_ = map;
  f.map_bytes_ = file_bytes;  // unmapped by the destructor from here on
  const unsigned char* h = static_cast<const unsigned char*>(map);

  if (std::memcmp(h, kTokenFileMagic.data(), 8) != 0)
    throw IoError(kOp,
                  fmt::format("'{}' is not a token file: it starts with {:?}, not the magic \"{}\"", path,
                              std::string(reinterpret_cast<const char*>(h), 8), kTokenFileMagic),
                  "pass a file written by `meshtrain tokenize`");
  const uint32_t version = load<uint32_t>(h + 8);
  if (version != kTokenFileVersion)
    throw IoError(kOp,
                  fmt::format("token file '{}' has format version {}; this build reads version {}", path, version,
                              kTokenFileVersion),
                  kRetokenize);
  const uint32_t bytes = load<uint32_t>(h + 12);
  const uint64_t vocab = load<uint64_t>(h + 16);
  const uint64_t count = load<uint64_t>(h + 24);
  if (bytes != 2 && bytes != 4)
    throw IoError(kOp, fmt::format("token file '{}': {} bytes per token (offset 12); only 2 and 4 exist", path, bytes),
                  kRetokenize);
  const uint64_t payload_bytes = file_bytes - kTokenFileHeaderBytes;
  if (count > payload_bytes / bytes || count * bytes != payload_bytes)
    throw IoError(
        kOp,
        count > payload_bytes / bytes
            ? fmt::format("token file '{}' is truncated: its header says {} tokens ({} bytes after the header), but the "
                          "file holds {} bytes after the header",
                          path, count, count <= UINT64_MAX / bytes ? count * bytes : UINT64_MAX, payload_bytes)
            : fmt::format("token file '{}': its header says {} tokens ({} bytes after the header), but the file holds "
                          "{} bytes after the header: the header lies or bytes were appended",
                          path, count, count * bytes, payload_bytes),
        kRetokenize);
  if (load<uint32_t>(h + 36) != header_crc(h))
    throw IoError(kOp, fmt::format("token file '{}': the header's checksum does not match (the header is corrupt)", path),
                  kRetokenize);
  if (vocab < 1 || vocab > (uint64_t{1} << 31) || static_cast<int>(bytes) != token_bytes_for(static_cast<int64_t>(vocab)))
    throw IoError(kOp,
                  fmt::format("token file '{}': vocabulary size {} with {} bytes per token (u16 holds vocabularies up "
                              "to 65536, u32 larger ones up to 2^31)",
                              path, vocab, bytes),
                  kRetokenize);
  if (count == 0)
    throw IoError(kOp, fmt::format("token file '{}' holds no tokens (an empty corpus)", path),
                  "tokenize a corpus with text in it");
  if (expected_vocab_size && static_cast<int64_t>(vocab) != *expected_vocab_size)
    throw IoError(kOp,
                  fmt::format("token file '{}' holds tokens of a vocabulary of {}, but the model's vocabulary is {}",
                              path, vocab, *expected_vocab_size),
                  fmt::format("tokenize the corpus with a vocabulary of {} (meshtrain tokenize --vocab {}), or give "
                              "the model a vocabulary of {}",
                              *expected_vocab_size, *expected_vocab_size, vocab));
  const unsigned char* payload = h + kTokenFileHeaderBytes;
  if (load<uint32_t>(h + 32) != crc(payload, payload_bytes))
    throw IoError(kOp, fmt::format("token file '{}': the tokens' checksum does not match (the payload is corrupt)", path),
                  kRetokenize);
  int64_t where = 0;
  const int64_t biggest = bytes == 2 ? max_token<uint16_t>(payload, static_cast<int64_t>(count), &where)
                                     : max_token<uint32_t>(payload, static_cast<int64_t>(count), &where);
  if (biggest >= static_cast<int64_t>(vocab))
    throw IoError(kOp,
                  fmt::format("token file '{}': token {} at position {} is outside its vocabulary of {}", path,
                              biggest, where, vocab),
                  kRetokenize);
  f.payload_ = payload;
  f.count_ = static_cast<int64_t>(count);
  f.vocab_size_ = static_cast<int64_t>(vocab);
  f.token_bytes_ = static_cast<int>(bytes);
  return f;
}

TokenFile::TokenFile(TokenFile&& other) noexcept { *this = std::move(other); }

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(map_, map_bytes_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    payload_ = std::exchange(other.payload_, nullptr);
    count_ = std::exchange(other.count_, 0);
    vocab_size_ = std::exchange(other.vocab_size_, 0);
    token_bytes_ = std::exchange(other.token_bytes_, 0);
  }
  return *this;
}

TokenFile::~TokenFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

void TokenFile::check_range(int64_t begin, int64_t count) const {
  if (begin < 0 || count < 0 || begin > count_ - count)
    throw InvalidArgument("TokenFile::read",
                          fmt::format("tokens [{}, {}) of '{}', which holds {}", begin, begin + count, path_, count_),
                          "read inside the file");
}

template <typename T>
void TokenFile::read_as(int64_t begin, int64_t count, T* out) const {
  check_range(begin, count);
  if (token_bytes_ == 2) {
    const uint16_t* t = reinterpret_cast<const uint16_t*>(payload_) + begin;
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(t[i]);
  } else {
    const uint32_t* t = reinterpret_cast<const uint32_t*>(payload_) + begin;
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(t[i]);
  }
}

int32_t TokenFile::at(int64_t i) const {
  int32_t v = 0;
  read_as(i, 1, &v);
  return v;
}

void TokenFile::read(int64_t begin, int64_t count, int32_t* out) const { read_as(begin, count, out); }
void TokenFile::read(int64_t begin, int64_t count, int64_t* out) const { read_as(begin, count, out); }

}  // namespace meshtrain::data
