// The token file: a tokenized corpus, written once and read back
// memory-mapped (read-only), so that ranks and processes share the pages.
//
//   write_token_file("data/tokens.bin", ids, /*vocab_size=*/8192);  // atomic
//   TokenFile tokens = TokenFile::open("data/tokens.bin", /*expected_vocab_size=*/8192);
//   tokens.size();                                   // 815851 tokens
//   std::vector<int64_t> w(65);
//   tokens.read(1000, 65, w.data());                 // tokens [1000, 1065) widened to i64
//
// Format (version 1, little-endian), a 64-byte header then the payload:
//   offset  0  8 bytes  magic "MTTOKENS"
//   offset  8  u32      format version (1)
//   offset 12  u32      bytes per token: 2 (u16) when vocab_size <= 65536, else 4 (u32)
//   offset 16  u64      vocab_size (every token is < vocab_size)
//   offset 24  u64      token count N (>= 1)
//   offset 32  u32      CRC-32 (zlib's) of the payload
//   offset 36  u32      CRC-32 of the 64 header bytes with this field zero
//   offset 40  24 bytes zero
//   offset 64  N tokens, bytes-per-token each
// The file is exactly 64 + N * bytes-per-token bytes.
//
// Contracts:
// - write_token_file goes through write_file_atomic: the path holds the old
//   file or the whole new one, never a part.
// - open() validates everything before it returns (reading the payload once
//   for its checksum and range): afterwards every token is < vocab_size().
//   The mapping lives as long as the TokenFile (move-only).
// Errors: IoError naming the file and what is wrong with it: missing or
//   unreadable, shorter than the header (truncated), wrong magic (not a
//   token file), an unsupported version, a bytes-per-token other than the
//   vocabulary's, a header whose count disagrees with the file size (cut
//   short, or a header that lies), a corrupt header or payload (checksums),
//   no tokens (an empty corpus), a token outside the vocabulary, a
//   vocabulary size other than the expected one (the model's).
//   InvalidArgument: writing tokens outside [0, vocab_size) or none;
//   reading outside [0, size()).
// Thread-safety: a TokenFile is immutable; reads may run concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace meshtrain::data {

inline constexpr std::string_view kTokenFileMagic = "MTTOKENS";
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr size_t kTokenFileHeaderBytes = 64;

// Writes `tokens` (each in [0, vocab_size)) as a token file at `path`
// (its directory must exist), atomically.
void write_token_file(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size);

class TokenFile {
 public:
  // Maps and validates `path` (see above). With `expected_vocab_size`, a file
  // of another vocabulary is an IoError naming both sizes.
  static TokenFile open(const std::string& path, std::optional<int64_t> expected_vocab_size);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  const std::string& path() const { return path_; }
  int64_t size() const { return count_; }
  int64_t vocab_size() const { return vocab_size_; }
  int token_bytes() const { return token_bytes_; }

  int32_t at(int64_t i) const;
  // Tokens [begin, begin + count) into out[0 .. count), widened.
  void read(int64_t begin, int64_t count, int32_t* out) const;
  void read(int64_t begin, int64_t count, int64_t* out) const;

 private:
  TokenFile() = default;
  void check_range(int64_t begin, int64_t count) const;
  template <typename T>
  void read_as(int64_t begin, int64_t count, T* out) const;

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* payload_ = nullptr;
  int64_t count_ = 0;
  int64_t vocab_size_ = 0;
  int token_bytes_ = 0;
};

}  // namespace meshtrain::data
