// The token file: round trips in u16 and u32, the exact layout, atomic
// writes, and every validation error naming the file.
#include "meshtrain/data/token_file.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::data {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<int32_t> random_tokens(size_t n, int32_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

void put(const fs::path& p, const std::string& bytes) { std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes; }

template <typename T>
void poke(std::string& bytes, size_t offset, T v) {
  std::memcpy(bytes.data() + offset, &v, sizeof(T));
}

uint32_t crc_of(const char* p, size_t n) {
  return static_cast<uint32_t>(crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(p), static_cast<uInt>(n)));
}

// Recomputes both checksums after an edit (a consistent file that lies).
void reseal(std::string& bytes) {
  poke<uint32_t>(bytes, 32, crc_of(bytes.data() + 64, bytes.size() - 64));
  poke<uint32_t>(bytes, 36, 0);
  poke<uint32_t>(bytes, 36, crc_of(bytes.data(), 64));
}

class TokenFileTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::fresh_dir("meshtrain_token_file"); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(TokenFileTest, RoundTripU16WithTheDocumentedLayout) {
  const std::vector<int32_t> tokens = random_tokens(1001, 8192, 1);
  write_token_file(path("t.bin"), tokens, 8192);
  const std::string bytes = testing::read_file(path("t.bin"));
  ASSERT_EQ(bytes.size(), 64u + 2 * 1001);
  EXPECT_EQ(bytes.substr(0, 8), "MTTOKENS");
  EXPECT_EQ(testing::entries(dir_), std::vector<std::string>{"t.bin"});  // no temporary left behind

  const TokenFile f = TokenFile::open(path("t.bin"), 8192);
  EXPECT_EQ(f.size(), 1001);
  EXPECT_EQ(f.vocab_size(), 8192);
  EXPECT_EQ(f.token_bytes(), 2);
  std::vector<int64_t> wide(1001);
  f.read(0, 1001, wide.data());
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(wide[i], tokens[i]) << i;
  std::vector<int32_t> part(10);
  f.read(500, 10, part.data());
  EXPECT_EQ(part, std::vector<int32_t>(tokens.begin() + 500, tokens.begin() + 510));
  EXPECT_EQ(f.at(1000), tokens[1000]);
  EXPECT_THAT(testing::error_of([&] { f.read(995, 10, part.data()); }),
              HasSubstr("tokens [995, 1005) of '" + path("t.bin") + "', which holds 1001"));
  // Moving keeps the mapping valid.
  TokenFile moved = TokenFile::open(path("t.bin"), std::nullopt);
  const TokenFile other = std::move(moved);
  EXPECT_EQ(other.at(7), tokens[7]);
}

TEST_F(TokenFileTest, LargeVocabulariesUseU32) {
  const std::vector<int32_t> tokens = {0, 65535, 65536, 69999, 3};
  write_token_file(path("w.bin"), tokens, 70000);
  EXPECT_EQ(fs::file_size(path("w.bin")), 64u + 4 * 5);
  const TokenFile f = TokenFile::open(path("w.bin"), 70000);
  EXPECT_EQ(f.token_bytes(), 4);
  std::vector<int32_t> back(5);
  f.read(0, 5, back.data());
  EXPECT_EQ(back, tokens);
  // 65536 still fits u16 (tokens < 65536).
  write_token_file(path("e.bin"), std::vector<int32_t>{65535}, 65536);
  EXPECT_EQ(TokenFile::open(path("e.bin"), 65536).token_bytes(), 2);
}

TEST_F(TokenFileTest, WriterRejectsBadTokens) {
  EXPECT_THAT(testing::error_of([&] { write_token_file(path("x.bin"), std::vector<int32_t>{1, 400}, 400); }),
              HasSubstr("token 400 at position 1 is outside [0, 400)"));
  EXPECT_THAT(testing::error_of([&] { write_token_file(path("x.bin"), std::vector<int32_t>{}, 400); }),
              HasSubstr("no tokens to write (an empty corpus)"));
  EXPECT_FALSE(fs::exists(path("x.bin")));
}

TEST_F(TokenFileTest, ValidationErrorsNameTheFile) {
  const std::vector<int32_t> tokens = random_tokens(100, 400, 2);
  write_token_file(path("good.bin"), tokens, 400);
  const std::string good = testing::read_file(path("good.bin"));
  const auto open_error = [&](const std::string& bytes, std::optional<int64_t> vocab = 400) {
    put(path("bad.bin"), bytes);
    return testing::error_of<IoError>([&] { TokenFile::open(path("bad.bin"), vocab); });
  };
  const std::string bad = fmt::format("'{}'", path("bad.bin"));

  EXPECT_THAT(testing::error_of<IoError>([&] { TokenFile::open(path("missing.bin"), 400); }),
              AllOf(HasSubstr("missing.bin"), HasSubstr("meshtrain tokenize")));
  EXPECT_THAT(open_error(good.substr(0, 40)),
              AllOf(HasSubstr(bad + " is truncated: 40 bytes, shorter than the 64-byte header")));
  EXPECT_THAT(open_error(good.substr(0, good.size() - 3)),
              HasSubstr(bad + " is truncated: its header says 100 tokens (200 bytes after the header), but the file "
                              "holds 197 bytes after the header"));
  std::string s = good;
  s[0] = 'X';
  EXPECT_THAT(open_error(s), AllOf(HasSubstr(bad + " is not a token file"), HasSubstr("MTTOKENS")));
  s = good;
  poke<uint32_t>(s, 8, 2);
  EXPECT_THAT(open_error(s), HasSubstr("has format version 2; this build reads version 1"));
  // A header that lies about the count, with both checksums made consistent.
  s = good;
  poke<uint64_t>(s, 24, 90);
  reseal(s);
  EXPECT_THAT(open_error(s),
              HasSubstr(bad + ": its header says 90 tokens (180 bytes after the header), but the file holds 200 "
                              "bytes after the header: the header lies"));
  s = good;
  poke<uint64_t>(s, 24, 1000000);
  reseal(s);
  EXPECT_THAT(open_error(s), HasSubstr(bad + " is truncated: its header says 1000000 tokens"));
  s = good + "xx";
  EXPECT_THAT(open_error(s), HasSubstr("holds 202 bytes after the header: the header lies or bytes were appended"));
  s = good;
  poke<uint64_t>(s, 16, 401);  // not resealed
  EXPECT_THAT(open_error(s), HasSubstr(bad + ": the header's checksum does not match"));
  s = good;
  s[64 + 11] ^= 0x01;
  EXPECT_THAT(open_error(s), HasSubstr(bad + ": the tokens' checksum does not match"));
  s = good;
  poke<uint32_t>(s, 12, 4);
  s += std::string(200, '\0');
  reseal(s);
  EXPECT_THAT(open_error(s), HasSubstr("vocabulary size 400 with 4 bytes per token"));
  s = good;
  poke<uint16_t>(s, 64 + 2 * 17, 400);
  reseal(s);
  EXPECT_THAT(open_error(s), HasSubstr(bad + ": token 400 at position 17 is outside its vocabulary of 400"));
  s = good.substr(0, 64);
  poke<uint64_t>(s, 24, 0);
  reseal(s);
  EXPECT_THAT(open_error(s), HasSubstr(bad + " holds no tokens (an empty corpus)"));
  EXPECT_THAT(open_error(good, 512),
              AllOf(HasSubstr(bad + " holds tokens of a vocabulary of 400, but the model's vocabulary is 512"),
                    HasSubstr("meshtrain tokenize --vocab 512")));
  EXPECT_EQ(open_error(good, std::nullopt), "");
}

}  // namespace
}  // namespace meshtrain::data
