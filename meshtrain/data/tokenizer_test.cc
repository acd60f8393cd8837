// The corpus reader and the SentencePiece tokenizer: directory rules, exact
// round trips on real fortunes text and on arbitrary bytes, the vocabulary
// size, determinism, save/load, errors.
#include "meshtrain/data/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/data/text_corpus.h"

namespace meshtrain::data {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

void write(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

bool have_fortunes() { return fs::exists(fs::path(kFortunesDir) / "fortunes"); }

// The first bytes of the fortunes corpus (a real English slice) and the text
// after it (unseen by the tokenizer).
struct Fortunes {
  std::string seen, unseen;
};
const Fortunes& fortunes() {
  static const Fortunes f = [] {
    const TextCorpus c = load_text_corpus();
    return Fortunes{c.text.substr(0, 80000), c.text.substr(80000, 200000)};
  }();
  return f;
}

TEST(TextCorpusTest, DirectoryRulesOrderAndSkips) {
  const fs::path dir = testing::fresh_dir("meshtrain_corpus_rules");
  write(dir / "b.txt", "B\n");
  write(dir / "a.txt", "A");  // no trailing newline: one is added
  write(dir / "sub" / "c.txt", "C\n");
  write(dir / ".hidden", "H\n");
  write(dir / "off" / "x.txt", "X\n");
  write(dir / "bin.dat", std::string("\0\0\0\2", 4));
  write(dir / "empty.txt", "");
  fs::create_symlink(dir / "a.txt", dir / "a.txt.u8");
  const TextCorpus c = load_text_corpus(dir.string());
  EXPECT_EQ(c.text, "A\nB\nC\n");
  ASSERT_EQ(c.files.size(), 4u);  // a.txt, b.txt, empty.txt, sub/c.txt
  EXPECT_EQ(c.files[0], (dir / "a.txt").string());
  EXPECT_EQ(c.files[3], (dir / "sub" / "c.txt").string());
  std::string skipped;
  for (const std::string& s : c.skipped) skipped += s + "\n";
  EXPECT_THAT(skipped, AllOf(HasSubstr(".hidden (hidden)"), HasSubstr("off (fortune's offensive set)"),
                             HasSubstr("bin.dat (binary: holds a NUL byte)"),
                             HasSubstr("a.txt.u8 (a link to a file already read)")));
  EXPECT_EQ(c.skipped.size(), 4u);
}

TEST(TextCorpusTest, FortunesReadsTheTextFilesOnly) {
  if (!have_fortunes()) GTEST_SKIP() << "fortunes not installed (scripts/install-deps.sh)";
  const TextCorpus c = load_text_corpus();
  int64_t expected_bytes = 0;
  size_t text_files = 0;
  for (const auto& e : fs::directory_iterator(kFortunesDir)) {
    if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") continue;
    ++text_files;
    expected_bytes += static_cast<int64_t>(fs::file_size(e.path()));
  }
  EXPECT_EQ(c.files.size(), text_files);
  EXPECT_GE(static_cast<int64_t>(c.text.size()), expected_bytes);  // plus a '\n' where a file lacks one
  EXPECT_LE(static_cast<int64_t>(c.text.size()), expected_bytes + static_cast<int64_t>(text_files));
  EXPECT_GT(c.text.size(), 2'000'000u);
  for (const std::string& f : c.files) {
    EXPECT_NE(fs::path(f).extension(), ".dat") << f;
    EXPECT_NE(fs::path(f).extension(), ".u8") << f;
  }
  EXPECT_EQ(c.text.find('\0'), std::string::npos);
}

TEST(TextCorpusTest, ErrorsNameThePath) {
  const fs::path dir = testing::fresh_dir("meshtrain_corpus_errors");
  EXPECT_THAT(testing::error_of<IoError>([&] { load_text_corpus((dir / "nope").string()); }),
              AllOf(HasSubstr("nope' does not exist"), HasSubstr("check the path")));
  write(dir / "empty.txt", "");
  EXPECT_THAT(testing::error_of<IoError>([&] { load_text_corpus((dir / "empty.txt").string()); }),
              AllOf(HasSubstr("empty corpus"), HasSubstr("empty.txt")));
  fs::create_directories(dir / "nothing");
  write(dir / "nothing" / "x.dat", std::string("\0", 1));
  EXPECT_THAT(testing::error_of<IoError>([&] { load_text_corpus((dir / "nothing").string()); }),
              AllOf(HasSubstr("nothing' holds no text file"), HasSubstr("1 entries left out")));
}

TEST(TextCorpusTest, CharactersAndHash) {
  EXPECT_EQ(count_characters("a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xFF"), 5);  // a e-acute euro emoji, a bad byte
  EXPECT_EQ(content_hash(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(content_hash("a"), 0xaf63dc4c8601ec8cull);  // FNV-1a 64 test vector
  EXPECT_NE(content_hash("ab"), content_hash("ba"));
}

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!have_fortunes()) return;
    tok_ = new Tokenizer(Tokenizer::train(fortunes().seen, {.vocab_size = 1000}));
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (!tok_) GTEST_SKIP() << "fortunes not installed (scripts/install-deps.sh)";
  }
  static Tokenizer* tok_;
};
Tokenizer* TokenizerTest::tok_ = nullptr;

TEST_F(TokenizerTest, VocabularySizeIsHonoured) {
  EXPECT_EQ(tok_->vocab_size(), 1000);
  EXPECT_EQ(Tokenizer::train(fortunes().seen, {.vocab_size = 600}).vocab_size(), 600);
  EXPECT_EQ(tok_->piece(0), "<unk>");
  EXPECT_EQ(tok_->piece(tok_->byte_id('\n')), "<0x0A>");
}

TEST_F(TokenizerTest, RoundTripsFortunesAndCompresses) {
  for (const std::string* text : {&fortunes().seen, &fortunes().unseen}) {
    const std::vector<int32_t> ids = tok_->encode(*text);
    EXPECT_EQ(tok_->decode(ids), *text);
    for (const int32_t id : ids) ASSERT_TRUE(id > 0 && id < 1000) << id;  // never <unk>
    EXPECT_LT(static_cast<double>(ids.size()), 0.5 * static_cast<double>(text->size()));  // subwords, not bytes
  }
  const std::vector<int32_t> the = tok_->encode(" the");
  ASSERT_EQ(the.size(), 1u);
  EXPECT_EQ(tok_->piece(the[0]), "\xE2\x96\x81the");
}

TEST_F(TokenizerTest, RoundTripsAnyBytes) {
  std::vector<std::string> cases = {
      "",
      "\n",
      "\n\n  \t\r\n",
      "  leading and trailing spaces  ",
      "caf\xC3\xA9 na\xC3\xAFve \xE2\x82\xAC 5 \xF0\x9F\x98\x80 \xE4\xB8\xAD\xE6\x96\x87",  // accents, euro, emoji, CJK
      "e\xCC\x81",                                   // combining accent
      "\xEF\xBB\xBFwith a BOM",                      // U+FEFF
      "\xE2\x96\x81 is SentencePiece's space mark",  // U+2581 itself
      "\xC0\x80 overlong, \xED\xA0\x80 surrogate, \xF5\x80\x80\x80 too big, \xE2\x82 cut short",
      std::string("nul \0 byte", 10),
      "backspace over_\b_strike",
  };
  for (int b = 0; b < 256; ++b) cases.push_back(std::string(1, static_cast<char>(b)));
  std::mt19937 rng(7);
  for (int n = 0; n < 300; ++n) {
    std::string s(rng() % 64, '\0');
    for (char& c : s) c = static_cast<char>(rng() & 0xFF);
    cases.push_back(s);
  }
  for (const std::string& s : cases) {
    const std::vector<int32_t> ids = tok_->encode(s);
    ASSERT_EQ(tok_->decode(ids), s) << "bytes: " << s.size();
    for (const int32_t id : ids) ASSERT_NE(id, 0);  // byte fallback: never <unk>
  }
  // Invalid UTF-8 is written as its byte pieces.
  EXPECT_EQ(tok_->encode("\xFF"), std::vector<int32_t>{tok_->byte_id(0xFF)});
}

TEST_F(TokenizerTest, DeterministicAndSavedModelLoads) {
  const Tokenizer again = Tokenizer::train(fortunes().seen, {.vocab_size = 1000});
  EXPECT_EQ(again.serialized(), tok_->serialized());
  const fs::path dir = testing::fresh_dir("meshtrain_tokenizer_save");
  write(dir / "m.model", tok_->serialized());
  const Tokenizer loaded = Tokenizer::load((dir / "m.model").string());
  EXPECT_EQ(loaded.vocab_size(), 1000);
  EXPECT_EQ(loaded.encode(fortunes().unseen), tok_->encode(fortunes().unseen));
}

TEST_F(TokenizerTest, Errors) {
  EXPECT_THAT(testing::error_of([] { Tokenizer::train("hello", {.vocab_size = 100}); }),
              HasSubstr("vocabulary size 100 is outside [258, 1048576]"));
  EXPECT_THAT(testing::error_of([] { Tokenizer::train("hello", {.vocab_size = 300, .character_coverage = 0}); }),
              HasSubstr("character coverage 0 is outside (0, 1]"));
  EXPECT_THAT(testing::error_of([] { Tokenizer::train("hello world\n", {.vocab_size = 5000}); }),
              AllOf(HasSubstr("SentencePiece cannot train a BPE vocabulary of 5000 on 12 bytes"),
                    HasSubstr("smaller vocabulary or more text")));
  // Too many distinct characters for the vocabulary: the fix is a larger
  // one, and the hint says so (it used to say "smaller").
  std::string many_chars;
  for (char32_t c = 0x4e00; c < 0x4e00 + 200; ++c)  // 200 CJK characters, 3 bytes each in UTF-8
    many_chars += {static_cast<char>(0xe0 | (c >> 12)), static_cast<char>(0x80 | ((c >> 6) & 0x3f)),
                   static_cast<char>(0x80 | (c & 0x3f)), ' '};
  std::string text;
  for (int i = 0; i < 20; ++i) text += many_chars + "\n";
  EXPECT_THAT(testing::error_of([&] { Tokenizer::train(text, {.vocab_size = 300}); }),
              AllOf(HasSubstr("SentencePiece cannot train a BPE vocabulary of 300"),
                    HasSubstr("use a larger vocabulary: the text's characters need at least")));
  // A line longer than SentencePiece takes is named, not mistaken for too
  // large a vocabulary (it used to end in "no sentences").
  const std::string long_text = "a short line\n" + std::string(size_t{1} << 21, 'x') + "\nanother\n";
  EXPECT_THAT(testing::error_of([&] { Tokenizer::train(long_text, {.vocab_size = 300}); }),
              AllOf(HasSubstr("line 2 of the text is 2097152 bytes, longer than the 1048576 bytes SentencePiece "
                              "trains on"),
                    HasSubstr("fold -s -w 4096")));
  const fs::path dir = testing::fresh_dir("meshtrain_tokenizer_errors");
  EXPECT_THAT(testing::error_of<IoError>([&] { Tokenizer::load((dir / "missing.model").string()); }),
              AllOf(HasSubstr("missing.model"), HasSubstr("meshtrain tokenize")));
  write(dir / "junk.model", "this is not a protobuf");
  EXPECT_THAT(testing::error_of<IoError>([&] { Tokenizer::load((dir / "junk.model").string()); }),
              AllOf(HasSubstr("junk.model' is not a SentencePiece model")));
  const std::vector<int32_t> bad = {5, 1000};
  EXPECT_THAT(testing::error_of([&] { tok_->decode(bad); }), HasSubstr("id 1000 (position 1) is outside [0, 1000)"));
}

}  // namespace
}  // namespace meshtrain::data
