// Text data for language models: a corpus (text_corpus.h) prepared once
// into a cached tokenizer (tokenizer.h) and token file (token_file.h), then
// served as windows of T + 1 tokens through the DataSource interface, so
// the trainer's DistributedSampler and Prefetcher (sampler.h) draw seeded
// global batches that are the same for any data-parallel degree.
//
//   PreparedText prep = prepare_text_data({.corpus = "/usr/share/games/fortunes", .out_dir = "data/text",
//                                          .tokenizer = {.vocab_size = 8192}});
//   auto tokens = std::make_shared<const TokenFile>(TokenFile::open(prep.tokens_path, prep.vocab_size));
//   TokenDataSource train(tokens, TextSplit::train, {.context = 64});
//   TokenDataSource valid(tokens, TextSplit::validation, {.context = 64});
//   DistributedSampler sampler(train.size(), /*global_batch=*/32, seed, /*drop_last=*/true, r, d);
//   Batch b = load_batch(train, sampler, epoch, index);
//   b["tokens"];   // (B_local, 64) i64: the window's tokens 0..63
//   b["targets"];  // (B_local, 64) i64: tokens 1..64 (the next token of each position)
//
// Windows and split (N tokens, context T, validation interval k):
// - The token stream is cut into W = N / (T + 1) disjoint windows; window j
//   holds tokens [j*(T+1), (j+1)*(T+1)). The N % (T + 1) tokens at the end are
//   not used. Disjoint windows keep the splits apart: no token of a
//   validation window is ever an input or a target of a training one.
// - Window j is a validation window when j % k == k - 1 (every k-th window:
//   with k = 10, 10% of the windows, spread evenly over the whole corpus, so
//   validation covers every file rather than the last ones); the others are
//   training windows. Row i of a split is its i-th window in corpus order:
//   train row i is window i + i / (k - 1), validation row i is window
//   i*k + k - 1.
// - Which windows form global batch b of an epoch is the DistributedSampler's
//   rule on the rows (a permutation that depends only on (seed, epoch)), so a
//   window's start is a pure function of (seed, epoch, b, row in the batch),
//   and rank r of d takes rows [r*B/d, (r+1)*B/d) of every global batch.
//   DataPosition (sampler.h) is the position to save and restore.
//
// Cache (prepare_text_data): in out_dir,
//   tokenizer-v<vocab>-<key>.model   SentencePiece's model file
//   tokens-v<vocab>-<key>.bin        the whole corpus, tokenized
// where key (16 hex digits) is FNV-1a 64 of the corpus's content hash and
// size, every tokenizer option (TokenizerOptions::describe) and the token
// format version. An unchanged corpus and options reuse both files (no
// training, no writes); any change gives new names, so nothing is
// overwritten. A cached file that fails to load is rebuilt (said in
// PreparedText::notes). Files are written atomically; two processes
// preparing the same directory at once both write the same bytes.
//
// Errors: IoError naming the file for a corpus or token file problem (see
// text_corpus.h, token_file.h) and for a token file shorter than the windows
// need ("shorter than one window", or too few windows for both splits);
// InvalidArgument for options out of range (naming the option).
// Thread-safety: a TokenDataSource only reads its (shared, immutable) token
// file; load() may run on a Prefetcher's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/data/sampler.h"
#include "meshtrain/data/text_corpus.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/data/tokenizer.h"

namespace meshtrain::data {

// Where `meshtrain tokenize` puts its files when no --out is given.
inline constexpr std::string_view kDefaultTextDataDir = "data/text";

struct TextDataOptions {
  std::string corpus = std::string(kFortunesDir);  // a text file or directory
  std::string out_dir = std::string(kDefaultTextDataDir);
  TokenizerOptions tokenizer;
};

struct PreparedText {
  std::string corpus;               // the path given
  int64_t files = 0;                // files read
  std::vector<std::string> skipped; // TextCorpus::skipped: entries left out, with the reason
  int64_t bytes = 0;                // corpus bytes
  int64_t characters = 0;           // UTF-8 code points (count_characters)
  uint64_t corpus_hash = 0;         // content_hash of the corpus
  std::string key;                  // the cache key, 16 hex digits
  std::string tokenizer_path;       // SentencePiece model
  std::string tokens_path;          // token file
  int64_t vocab_size = 0;
  int64_t tokens = 0;               // tokens in the token file
  bool trained = false;             // this call trained the tokenizer (else: cached)
  bool tokenized = false;           // this call wrote the token file (else: cached)
  double train_seconds = 0;         // training time (0 when cached)
  double encode_seconds = 0;        // encoding and writing time (0 when cached)
  std::vector<std::string> notes;   // cached files rebuilt, and why
};

// Reads the corpus, then reuses or builds the tokenizer and the token file
// in options.out_dir (created if missing), as described above.
PreparedText prepare_text_data(const TextDataOptions& options);

// The unigram entropy of tokens [begin, end) in nats per token:
// -sum_v p_v ln p_v with p_v the frequency of token v there. A model that
// ignores context cannot do better (its cross-entropy is at least this).
// Needs 0 <= begin < end <= tokens.size(); end < 0 means size().
double unigram_entropy(const TokenFile& tokens, int64_t begin = 0, int64_t end = -1);

enum class TextSplit { train, validation };
std::string_view split_name(TextSplit split);

struct WindowOptions {
  int64_t context = 64;    // T: tokens per input row; a window holds T + 1
  int64_t val_every = 10;  // k: every k-th window is validation (>= 2)
};

// The window arithmetic above, for N tokens. Throws InvalidArgument for
// context < 1 or val_every < 2, and IoError naming `what` when the tokens do
// not fill one window, or too few for one window in each split.
class TokenWindows {
 public:
  TokenWindows(int64_t num_tokens, const WindowOptions& options, const std::string& what);
  int64_t windows() const { return windows_; }  // W, both splits
  int64_t count(TextSplit split) const;
  // The index j of row `row` of `split`; needs 0 <= row < count(split).
  int64_t window(TextSplit split, int64_t row) const;
  // The first token of that window: window(split, row) * (T + 1).
  int64_t start(TextSplit split, int64_t row) const { return window(split, row) * (options_.context + 1); }
  const WindowOptions& options() const { return options_; }

 private:
  WindowOptions options_;
  int64_t windows_ = 0;
};

// One split of a token file as a DataSource: row i is the split's i-th
// window; load() adds "tokens" (B, T) and "targets" (B, T) in `dtype` (i32
// or i64), targets[b][t] = tokens of the window at t + 1.
class TokenDataSource final : public DataSource {
 public:
  TokenDataSource(std::shared_ptr<const TokenFile> tokens, TextSplit split, const WindowOptions& options,
                  DType dtype = DType::i64);
  int64_t size() const override { return windows_.count(split_); }
  // "<token file> (<split>: W windows of T+1 tokens)"
  std::string source() const override;
  void load(std::span<const int64_t> rows, Batch& batch, MemoryTracker* tracker) const override;

  // The first token of row `row`'s window in the token file.
  int64_t window_start(int64_t row) const { return windows_.start(split_, row); }
  int64_t context() const { return windows_.options().context; }
  TextSplit split() const { return split_; }
  const TokenFile& token_file() const { return *tokens_; }

 private:
  std::shared_ptr<const TokenFile> tokens_;
  TextSplit split_;
  TokenWindows windows_;
  DType dtype_;
};

}  // namespace meshtrain::data
