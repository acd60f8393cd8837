// Text data: the window split, the token DataSource (targets shifted by one,
// windows inside their split), data-parallel invariance of the global
// batches, seeded determinism, resume from a saved DataPosition, the
// tokenizer/token-file cache, the unigram entropy and the errors.
#include "meshtrain/data/text_data.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::data {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

// A token file whose token at position i is i (so a batch shows where its
// windows are).
std::shared_ptr<const TokenFile> positions_file(const fs::path& dir, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 0);
  const std::string path = (dir / "positions.bin").string();
  write_token_file(path, t, 65536);
  return std::make_shared<const TokenFile>(TokenFile::open(path, 65536));
}

std::vector<int64_t> values(const Tensor& t) {
  const int64_t n = t.numel();
  if (t.dtype() == DType::i32) return std::vector<int64_t>(t.data<int32_t>(), t.data<int32_t>() + n);
  return std::vector<int64_t>(t.data<int64_t>(), t.data<int64_t>() + n);
}

TEST(TokenWindowsTest, EveryKthWindowIsValidationAndTheSplitsPartitionTheWindows) {
  const TokenWindows w(1005, {.context = 9, .val_every = 10}, "x");  // 100 windows of 10, 5 tokens unused
  EXPECT_EQ(w.windows(), 100);
  EXPECT_EQ(w.count(TextSplit::train), 90);
  EXPECT_EQ(w.count(TextSplit::validation), 10);
  std::set<int64_t> seen;
  for (int64_t r = 0; r < 90; ++r) {
    const int64_t j = w.window(TextSplit::train, r);
    EXPECT_NE(j % 10, 9) << r;
    EXPECT_TRUE(seen.insert(j).second);
    EXPECT_EQ(w.start(TextSplit::train, r), j * 10);
  }
  for (int64_t r = 0; r < 10; ++r) {
    EXPECT_EQ(w.window(TextSplit::validation, r), 10 * r + 9);
    EXPECT_TRUE(seen.insert(w.window(TextSplit::validation, r)).second);
  }
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(*seen.rbegin(), 99);
  EXPECT_EQ(w.window(TextSplit::train, 9), 10);  // skips window 9
  EXPECT_THAT(testing::error_of([&] { w.window(TextSplit::validation, 10); }),
              HasSubstr("row 10 is outside the validation split's [0, 10)"));
}

TEST(TokenWindowsTest, ShortCorporaAndBadOptionsAreErrors) {
  EXPECT_THAT(testing::error_of<IoError>([] { TokenWindows(64, {.context = 64}, "data/t.bin"); }),
              HasSubstr("'data/t.bin' holds 64 tokens, shorter than one window of context 64 + 1 = 65 tokens"));
  EXPECT_THAT(testing::error_of<IoError>([] { TokenWindows(650, {.context = 64, .val_every = 11}, "data/t.bin"); }),
              AllOf(HasSubstr("'data/t.bin' holds 650 tokens: 10 window(s) of 65 tokens"),
                    HasSubstr("both splits need 11 windows (715 tokens)")));
  EXPECT_EQ(TokenWindows(650, {.context = 64, .val_every = 10}, "t").count(TextSplit::validation), 1);
  EXPECT_THAT(testing::error_of([] { TokenWindows(1000, {.context = 0}, "t"); }), HasSubstr("context 0 is outside"));
  EXPECT_THAT(testing::error_of([] { TokenWindows(1000, {.context = 8, .val_every = 1}, "t"); }),
              HasSubstr("val_every 1 is outside [2, 2^30]"));
}

TEST(TokenDataSourceTest, TargetsAreInputsShiftedByOneInsideTheSplit) {
  const fs::path dir = testing::fresh_dir("meshtrain_token_source");
  const auto file = positions_file(dir, 5000);
  const WindowOptions opt{.context = 16, .val_every = 5};  // 294 windows of 17
  for (const TextSplit split : {TextSplit::train, TextSplit::validation}) {
    const TokenDataSource src(file, split, opt);
    EXPECT_EQ(src.size(), split == TextSplit::train ? 294 - 58 : 58);
    std::vector<int64_t> rows(static_cast<size_t>(src.size()));
    std::iota(rows.begin(), rows.end(), 0);
    Batch b;
    src.load(rows, b, nullptr);
    ASSERT_EQ(b["tokens"].shape(), (std::vector<int64_t>{src.size(), 16}));
    ASSERT_EQ(b["targets"].shape(), (std::vector<int64_t>{src.size(), 16}));
    EXPECT_EQ(b["tokens"].dtype(), DType::i64);
    const std::vector<int64_t> x = values(b["tokens"]), y = values(b["targets"]);
    for (int64_t r = 0; r < src.size(); ++r) {
      EXPECT_EQ(x[static_cast<size_t>(r * 16)], src.window_start(r));
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t pos = x[static_cast<size_t>(r * 16 + t)];
        ASSERT_EQ(y[static_cast<size_t>(r * 16 + t)], pos + 1);  // the next token
        // Inputs and targets stay in a window of this split.
        for (const int64_t p : {pos, pos + 1}) ASSERT_EQ((p / 17) % 5 == 4, split == TextSplit::validation) << p;
      }
    }
  }
  const TokenDataSource narrow(file, TextSplit::train, opt, DType::i32);
  Batch b;
  narrow.load(std::vector<int64_t>{3}, b, nullptr);
  EXPECT_EQ(b["tokens"].dtype(), DType::i32);
  EXPECT_EQ(values(b["targets"]).front(), 3 * 17 + 1);
  EXPECT_THAT(narrow.source(), HasSubstr("positions.bin (train: 236 windows of 17 tokens)"));
  EXPECT_THAT(testing::error_of([&] { TokenDataSource(file, TextSplit::train, opt, DType::f32); }),
              HasSubstr("token dtype f32 is not i32 or i64"));
}

TEST(TokenDataSourceTest, AnyDataParallelDegreeSeesTheOneDeviceGlobalBatches) {
  const fs::path dir = testing::fresh_dir("meshtrain_token_dp");
  const TokenDataSource src(positions_file(dir, 20000), TextSplit::train, {.context = 8, .val_every = 10});
  const int64_t global = 8;
  const DistributedSampler one(src.size(), global, 42, true);
  for (const int d : {2, 4}) {
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      for (int64_t b = 0; b < one.num_batches(); b += 37) {
        const Batch whole = load_batch(src, one, epoch, b);
        std::vector<int64_t> tokens, targets;
        for (int r = 0; r < d; ++r) {
          const Batch part = load_batch(src, DistributedSampler(src.size(), global, 42, true, r, d), epoch, b);
          EXPECT_EQ(part.size(), global / d);
          EXPECT_EQ(part.global_size, global);
          EXPECT_EQ(part.first_global_sample, r * global / d);
          for (const int64_t v : values(part["tokens"])) tokens.push_back(v);
          for (const int64_t v : values(part["targets"])) targets.push_back(v);
        }
        ASSERT_EQ(tokens, values(whole["tokens"])) << "d=" << d << " epoch " << epoch << " batch " << b;
        ASSERT_EQ(targets, values(whole["targets"]));
      }
    }
  }
}

TEST(TokenDataSourceTest, SeededDeterminismAndResumeFromASavedPosition) {
  const fs::path dir = testing::fresh_dir("meshtrain_token_resume");
  const TokenDataSource src(positions_file(dir, 4000), TextSplit::train, {.context = 8, .val_every = 10});
  const DistributedSampler s(src.size(), 16, 7, true, 1, 2);  // 400 train windows: 25 batches per epoch
  ASSERT_EQ(s.num_batches(), 25);
  // A run of 30 steps (crossing into epoch 1), its batches by position.
  std::vector<std::vector<int64_t>> run;
  DataPosition at;
  DataPosition saved;
  for (int64_t step = 0; step < 30; ++step) {
    EXPECT_EQ(at, DataPosition::at_step(s, step));
    EXPECT_EQ(at.step(s), step);
    if (step == 23) saved = at;
    run.push_back(values(load_batch(src, s, at)["tokens"]));
    at = at.next(s);
  }
  EXPECT_EQ(DataPosition::at_step(s, 26), (DataPosition{1, 1}));
  // Resume: a fresh sampler with the same seed, from the saved position.
  const DistributedSampler again(src.size(), 16, 7, true, 1, 2);
  DataPosition resumed = saved;
  for (int64_t step = 23; step < 30; ++step) {
    ASSERT_EQ(values(load_batch(src, again, resumed)["tokens"]), run[static_cast<size_t>(step)]) << step;
    resumed = resumed.next(again);
  }
  // Another seed draws other windows; another epoch another order.
  const DistributedSampler other(src.size(), 16, 8, true, 1, 2);
  EXPECT_NE(values(load_batch(src, other, DataPosition{})["tokens"]), run[0]);
  EXPECT_NE(run[25], run[0]);
  EXPECT_THAT(testing::error_of([&] { DataPosition{0, 25}.step(s); }), HasSubstr("batch 25 is outside [0, 25)"));
  EXPECT_THAT(testing::error_of([&] { DataPosition::at_step(s, -1); }), HasSubstr("step -1 < 0"));
}

TEST(UnigramEntropyTest, MatchesTheFormula) {
  const fs::path dir = testing::fresh_dir("meshtrain_unigram");
  const std::string p = (dir / "t.bin").string();
  write_token_file(p, std::vector<int32_t>{0, 0, 1, 1}, 10);
  EXPECT_NEAR(unigram_entropy(TokenFile::open(p, 10)), std::log(2.0), 1e-12);
  write_token_file(p, std::vector<int32_t>{0, 1, 2, 3, 3, 3}, 10);
  const TokenFile f = TokenFile::open(p, 10);
  EXPECT_NEAR(unigram_entropy(f), -(3 * (1.0 / 6) * std::log(1.0 / 6) + 0.5 * std::log(0.5)), 1e-12);
  EXPECT_NEAR(unigram_entropy(f, 3, 6), 0.0, 1e-12);
  EXPECT_NEAR(unigram_entropy(f, 0, 4), std::log(4.0), 1e-12);
  EXPECT_THAT(testing::error_of([&] { unigram_entropy(f, 4, 4); }), HasSubstr("tokens [4, 4) of"));
}

// A small corpus: the first 60 KB of fortunes when installed, else generated
// English-like text (the cache behaviour does not depend on which).
std::string small_corpus() {
  const fs::path f = fs::path(kFortunesDir) / "fortunes";
  if (fs::exists(f)) return testing::read_file(f).substr(0, 60000);
  std::string s;
  const char* words[] = {"the ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ", "dog ", "and ", "cat "};
  for (int i = 0; i < 20000; ++i) s += words[(i * 7 + i / 3) % 10] + std::string(i % 13 == 0 ? "\n" : "");
  return s;
}

struct FileId {
  ino_t inode;
  timespec mtime;
};
FileId file_id(const std::string& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return {st.st_ino, st.st_mtim};
}

TEST(PrepareTextDataTest, BuildsOnceThenReusesTheCache) {
  const fs::path dir = testing::fresh_dir("meshtrain_prepare_text");
  const std::string text = small_corpus();
  std::ofstream(dir / "corpus.txt", std::ios::binary) << text;
  TextDataOptions opt{.corpus = (dir / "corpus.txt").string(), .out_dir = (dir / "out").string(), .tokenizer = {}};
  opt.tokenizer.vocab_size = 500;

  const PreparedText first = prepare_text_data(opt);
  EXPECT_TRUE(first.trained);
  EXPECT_TRUE(first.tokenized);
  EXPECT_EQ(first.bytes, static_cast<int64_t>(text.size()));
  EXPECT_EQ(first.files, 1);
  EXPECT_EQ(first.key.size(), 16u);
  EXPECT_EQ(fs::path(first.tokenizer_path).filename(), fmt::format("tokenizer-v500-{}.model", first.key));
  EXPECT_EQ(fs::path(first.tokens_path).filename(), fmt::format("tokens-v500-{}.bin", first.key));
  const TokenFile tokens = TokenFile::open(first.tokens_path, 500);
  EXPECT_EQ(tokens.size(), first.tokens);
  std::vector<int32_t> ids(static_cast<size_t>(tokens.size()));
  tokens.read(0, tokens.size(), ids.data());
  EXPECT_EQ(Tokenizer::load(first.tokenizer_path).decode(ids), text);  // the token file is the corpus

  // Unchanged corpus and options: nothing trained, nothing written.
  const FileId model_id = file_id(first.tokenizer_path), tokens_id = file_id(first.tokens_path);
  const PreparedText second = prepare_text_data(opt);
  EXPECT_FALSE(second.trained);
  EXPECT_FALSE(second.tokenized);
  EXPECT_EQ(second.key, first.key);
  EXPECT_EQ(second.tokens, first.tokens);
  EXPECT_TRUE(second.notes.empty());
  const FileId model_again = file_id(first.tokenizer_path), tokens_again = file_id(first.tokens_path);
  EXPECT_EQ(model_again.inode, model_id.inode);
  EXPECT_EQ(model_again.mtime.tv_sec, model_id.mtime.tv_sec);
  EXPECT_EQ(model_again.mtime.tv_nsec, model_id.mtime.tv_nsec);
  EXPECT_EQ(tokens_again.inode, tokens_id.inode);
  EXPECT_EQ(tokens_again.mtime.tv_nsec, tokens_id.mtime.tv_nsec);

  // Another vocabulary or another corpus: another key, new files beside the old.
  opt.tokenizer.vocab_size = 520;
  const PreparedText other_vocab = prepare_text_data(opt);
  EXPECT_TRUE(other_vocab.trained);
  EXPECT_NE(other_vocab.key, first.key);
  opt.tokenizer.vocab_size = 500;
  std::ofstream(dir / "corpus.txt", std::ios::binary | std::ios::app) << "one more line\n";
  const PreparedText other_text = prepare_text_data(opt);
  EXPECT_TRUE(other_text.trained);
  EXPECT_NE(other_text.key, first.key);
  EXPECT_EQ(testing::entries(dir / "out").size(), 6u);

  // A damaged cached token file is rebuilt, and the note says why.
  std::string bytes = testing::read_file(other_text.tokens_path);
  bytes.resize(bytes.size() - 1);
  std::ofstream(other_text.tokens_path, std::ios::binary | std::ios::trunc) << bytes;
  const PreparedText repaired = prepare_text_data(opt);
  EXPECT_FALSE(repaired.trained);
  EXPECT_TRUE(repaired.tokenized);
  ASSERT_EQ(repaired.notes.size(), 1u);
  EXPECT_THAT(repaired.notes[0], AllOf(HasSubstr("rebuilt " + other_text.tokens_path), HasSubstr("truncated")));
  EXPECT_EQ(TokenFile::open(repaired.tokens_path, 500).size(), other_text.tokens);
}

TEST(PrepareTextDataTest, EmptyAndTooShortCorporaNameTheFile) {
  const fs::path dir = testing::fresh_dir("meshtrain_prepare_short");
  std::ofstream(dir / "empty.txt") << "";
  EXPECT_THAT(testing::error_of<IoError>([&] {
                prepare_text_data({.corpus = (dir / "empty.txt").string(), .out_dir = (dir / "out").string(), .tokenizer = {}});
              }),
              AllOf(HasSubstr("empty corpus"), HasSubstr("empty.txt")));
  std::ofstream(dir / "short.txt") << "A short corpus: a few tokens.\n";
  TextDataOptions opt{.corpus = (dir / "short.txt").string(), .out_dir = (dir / "out").string(), .tokenizer = {}};
  opt.tokenizer.vocab_size = 290;
  const PreparedText p = prepare_text_data(opt);
  const auto file = std::make_shared<const TokenFile>(TokenFile::open(p.tokens_path, 290));
  EXPECT_THAT(testing::error_of<IoError>([&] { TokenDataSource(file, TextSplit::train, {.context = 64}); }),
              AllOf(HasSubstr(p.tokens_path), HasSubstr("shorter than one window of context 64 + 1 = 65 tokens")));
}

}  // namespace
}  // namespace meshtrain::data
