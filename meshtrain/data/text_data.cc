#include "meshtrain/data/text_data.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>

#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/error.h"

namespace meshtrain::data {
namespace {

namespace fs = std::filesystem;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

PreparedText prepare_text_data(const TextDataOptions& options) {
  const char* op = "prepare_text_data";
  if (options.out_dir.empty())
    throw InvalidArgument(op, "the output directory is empty", "pass a directory for the tokenizer and token files");
  TextCorpus corpus = load_text_corpus(options.corpus);
  PreparedText p;
  p.corpus = options.corpus;
  p.files = static_cast<int64_t>(corpus.files.size());
  p.skipped = std::move(corpus.skipped);
  p.bytes = static_cast<int64_t>(corpus.text.size());
  p.characters = count_characters(corpus.text);
  p.corpus_hash = content_hash(corpus.text);
  p.vocab_size = options.tokenizer.vocab_size;
  const std::string recipe = fmt::format("meshtrain-text;corpus_hash={:016x};corpus_bytes={};{};token_format={}",
                                         p.corpus_hash, p.bytes, options.tokenizer.describe(), kTokenFileVersion);
  p.key = fmt::format("{:016x}", content_hash(recipe));

  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec || !fs::is_directory(options.out_dir))
    throw IoError(op, fmt::format("cannot create the output directory '{}': {}", options.out_dir, ec.message()),
                  "pass a directory you can write to");
  const fs::path dir(options.out_dir);
  p.tokenizer_path = (dir / fmt::format("tokenizer-v{}-{}.model", p.vocab_size, p.key)).string();
  p.tokens_path = (dir / fmt::format("tokens-v{}-{}.bin", p.vocab_size, p.key)).string();

  // The tokenizer: reused when its file loads and has the vocabulary asked for.
  std::optional<Tokenizer> tok;
  if (fs::exists(p.tokenizer_path, ec)) {
    try {
      Tokenizer cached = Tokenizer::load(p.tokenizer_path);
      if (cached.vocab_size() == p.vocab_size)
        tok.emplace(std::move(cached));
      else
        p.notes.push_back(fmt::format("rebuilt {}: it has {} pieces, not {}", p.tokenizer_path, cached.vocab_size(),
                                      p.vocab_size));
    } catch (const Error& e) {
      p.notes.push_back(fmt::format("rebuilt {}: {}", p.tokenizer_path, e.what()));
    }
  }
  if (!tok) {
    const auto t0 = std::chrono::steady_clock::now();
    tok.emplace(Tokenizer::train(corpus.text, options.tokenizer));
    p.train_seconds = seconds_since(t0);
    if (tok->vocab_size() != p.vocab_size)
      throw InvalidArgument(op,
                            fmt::format("SentencePiece built {} pieces for a vocabulary of {} from '{}'",
                                        tok->vocab_size(), p.vocab_size, options.corpus),
                            "use a smaller vocabulary or more text");
    write_file_atomic(p.tokenizer_path, tok->serialized());
    p.trained = true;
  }

  // The token file: reused unless the tokenizer was just (re)trained or it
  // fails validation.
  if (!p.trained && fs::exists(p.tokens_path, ec)) {
    try {
      p.tokens = TokenFile::open(p.tokens_path, p.vocab_size).size();
      return p;
    } catch (const Error& e) {
      p.notes.push_back(fmt::format("rebuilt {}: {}", p.tokens_path, e.what()));
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok->encode(corpus.text);
  write_token_file(p.tokens_path, ids, p.vocab_size);
  p.encode_seconds = seconds_since(t0);
  p.tokens = static_cast<int64_t>(ids.size());
  p.tokenized = true;
  return p;
}

double unigram_entropy(const TokenFile& tokens, int64_t begin, int64_t end) {
  if (end < 0) end = tokens.size();
  if (begin < 0 || begin >= end || end > tokens.size())
    throw InvalidArgument("unigram_entropy",
                          fmt::format("tokens [{}, {}) of '{}', which holds {}", begin, end, tokens.path(),
                                      tokens.size()),
                          "pass a non-empty range inside the file");
  std::vector<int64_t> counts(static_cast<size_t>(tokens.vocab_size()), 0);
  std::vector<int32_t> chunk(size_t{1} << 16);
  for (int64_t at = begin; at < end;) {
    const int64_t n = std::min<int64_t>(end - at, static_cast<int64_t>(chunk.size()));
    tokens.read(at, n, chunk.data());
    for (int64_t i = 0; i < n; ++i) ++counts[static_cast<size_t>(chunk[static_cast<size_t>(i)])];
    at += n;
  }
  const double total = static_cast<double>(end - begin);
  double h = 0;
  for (const int64_t c : counts)
    if (c > 0) {
      const double q = static_cast<double>(c) / total;
      h -= q * std::log(q);
    }
  return h;
}

std::string_view split_name(TextSplit split) { return split == TextSplit::train ? "train" : "validation"; }

TokenWindows::TokenWindows(int64_t num_tokens, const WindowOptions& options, const std::string& what)
    : options_(options) {
  const char* op = "TokenWindows";
  if (options.context < 1 || options.context > (int64_t{1} << 24))
    throw InvalidArgument(op, fmt::format("context {} is outside [1, 2^24]", options.context),
                          "use the model's context length, e.g. 64");
  if (options.val_every < 2 || options.val_every > (int64_t{1} << 30))
    throw InvalidArgument(op, fmt::format("val_every {} is outside [2, 2^30]", options.val_every),
                          "every k-th window is validation: use e.g. 10 (10%)");
  const int64_t span = options.context + 1;
  windows_ = num_tokens / span;
  if (windows_ < 1)
    throw IoError(op,
                  fmt::format("'{}' holds {} tokens, shorter than one window of context {} + 1 = {} tokens", what,
                              num_tokens, options.context, span),
                  "use a longer corpus or a shorter context");
  if (windows_ < options.val_every)
    throw IoError(op,
                  fmt::format("'{}' holds {} tokens: {} window(s) of {} tokens, but with every {}-th window for "
                              "validation both splits need {} windows ({} tokens)",
                              what, num_tokens, windows_, span, options.val_every, options.val_every,
                              options.val_every * span),
                  "use a longer corpus, a shorter context or a smaller validation interval");
}

int64_t TokenWindows::count(TextSplit split) const {
  const int64_t val = windows_ / options_.val_every;
  return split == TextSplit::validation ? val : windows_ - val;
}

int64_t TokenWindows::window(TextSplit split, int64_t row) const {
  if (row < 0 || row >= count(split))
    throw InvalidArgument("TokenWindows::window",
                          fmt::format("row {} is outside the {} split's [0, {})", row, split_name(split), count(split)),
                          "pass a row of the split");
  const int64_t k = options_.val_every;
  return split == TextSplit::validation ? row * k + k - 1 : row + row / (k - 1);
}

TokenDataSource::TokenDataSource(std::shared_ptr<const TokenFile> tokens, TextSplit split,
                                 const WindowOptions& options, DType dtype)
    : tokens_(std::move(tokens)),
      split_(split),
      windows_(tokens_ ? tokens_->size() : 0, options, tokens_ ? tokens_->path() : std::string("(no token file)")),
      dtype_(dtype) {
  if (dtype != DType::i32 && dtype != DType::i64)
    throw InvalidArgument("TokenDataSource", fmt::format("token dtype {} is not i32 or i64", dtype_name(dtype)),
                          "embeddings and losses take i32 or i64 indices");
}

std::string TokenDataSource::source() const {
  return fmt::format("{} ({}: {} windows of {} tokens)", tokens_->path(), split_name(split_), size(), context() + 1);
}

void TokenDataSource::load(std::span<const int64_t> rows, Batch& batch, MemoryTracker* tracker) const {
  const int64_t b = static_cast<int64_t>(rows.size());
  const int64_t t = context();
  Tensor inputs = Tensor::empty({b, t}, dtype_, Device::cpu(), tracker, MemoryCategory::activations);
  Tensor targets = Tensor::empty({b, t}, dtype_, Device::cpu(), tracker, MemoryCategory::activations);
  std::vector<int64_t> window(static_cast<size_t>(t + 1));
  for (int64_t r = 0; r < b; ++r) {
    tokens_->read(window_start(rows[static_cast<size_t>(r)]), t + 1, window.data());
    for (int64_t k = 0; k < t; ++k) {
      if (dtype_ == DType::i64) {
        inputs.data<int64_t>()[r * t + k] = window[static_cast<size_t>(k)];
        targets.data<int64_t>()[r * t + k] = window[static_cast<size_t>(k + 1)];
      } else {
        inputs.data<int32_t>()[r * t + k] = static_cast<int32_t>(window[static_cast<size_t>(k)]);
        targets.data<int32_t>()[r * t + k] = static_cast<int32_t>(window[static_cast<size_t>(k + 1)]);
      }
    }
  }
  batch.add("tokens", std::move(inputs));
  batch.add("targets", std::move(targets));
}

}  // namespace meshtrain::data
