// meshtrain tokenize: prepares a text corpus for language models (the
// SentencePiece tokenizer and the token file, cached; data/text_data.h) and
// prints what the model will see: characters, tokens, tokens per character,
// the unigram entropy (the loss to beat) and the train/validation split.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "meshtrain/core/error.h"
#include "meshtrain/data/text_data.h"

namespace meshtrain::cli {
namespace {

struct TokenizeFlags {
  std::string corpus = std::string(data::kFortunesDir);
  std::string out = std::string(data::kDefaultTextDataDir);
  int vocab = 8192;
  double coverage = 0.9995;
  uint32_t seed = 42;
  int64_t context = 64;
  int64_t val_every = 10;
  int show = 24;
};

std::string seconds(double s) { return fmt::format("{:.2f} s", s); }

int run_tokenize(const TokenizeFlags& f) {
  print_config("tokenize", {{"corpus", f.corpus},
                            {"vocab", std::to_string(f.vocab)},
                            {"out", f.out},
                            {"coverage", fmt::format("{}", f.coverage)},
                            {"seed", std::to_string(f.seed)},
                            {"context", std::to_string(f.context)},
                            {"val_every", std::to_string(f.val_every)}});
  std::error_code ec;
  if (!std::filesystem::exists(f.corpus, ec))
    throw InvalidArgument("meshtrain tokenize", fmt::format("--corpus: '{}' does not exist", f.corpus),
                          f.corpus == data::kFortunesDir ? std::string(data::kFortunesInstallHint)
                                                          : std::string("pass a text file or a directory of text files"));
  if (!(f.coverage > 0 && f.coverage <= 1))
    throw InvalidArgument("meshtrain tokenize", fmt::format("--coverage: {} is outside (0, 1]", f.coverage),
                          "use e.g. 0.9995");
  data::TextDataOptions opt{.corpus = f.corpus, .out_dir = f.out, .tokenizer = {}};
  opt.tokenizer.vocab_size = f.vocab;
  opt.tokenizer.character_coverage = f.coverage;
  opt.tokenizer.seed = f.seed;
  const auto t0 = std::chrono::steady_clock::now();
  const data::PreparedText p = data::prepare_text_data(opt);
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  fmt::print("corpus: {}: {} file(s), {} bytes, {} characters", p.corpus, p.files, p.bytes, p.characters);
  if (!p.skipped.empty())
    fmt::print(" ({} entries left out, e.g. {})", p.skipped.size(), p.skipped.front());
  fmt::print("\n");
  for (const std::string& n : p.notes) fmt::print("note: {}\n", n);
  fmt::print("tokenizer: {} (BPE, {} pieces, byte fallback; {})\n", p.tokenizer_path, p.vocab_size,
             p.trained ? "trained in " + seconds(p.train_seconds) : std::string("reused from the cache"));
  const auto tokens = std::make_shared<const data::TokenFile>(data::TokenFile::open(p.tokens_path, p.vocab_size));
  fmt::print("token file: {} ({} tokens, u{}; {})\n", p.tokens_path, p.tokens, 8 * tokens->token_bytes(),
             p.tokenized ? "encoded and written in " + seconds(p.encode_seconds) : std::string("reused from the cache"));
  fmt::print("characters {}, tokens {}: {:.4f} tokens per character ({:.3f} characters per token)\n", p.characters,
             p.tokens, static_cast<double>(p.tokens) / static_cast<double>(p.characters),
             static_cast<double>(p.characters) / static_cast<double>(p.tokens));
  const double h = data::unigram_entropy(*tokens);
  fmt::print("unigram entropy: {:.4f} nats/token (a model that ignores context cannot do better; ln {} = {:.4f})\n",
             h, p.vocab_size, std::log(static_cast<double>(p.vocab_size)));
  const data::WindowOptions w{.context = f.context, .val_every = f.val_every};
  const data::TokenDataSource tr(tokens, data::TextSplit::train, w), va(tokens, data::TextSplit::validation, w);
  fmt::print("split (context {}, every {}th window is validation): train {} windows ({} tokens), validation {} "
             "windows ({} tokens) of {} tokens\n",
             f.context, f.val_every, tr.size(), tr.size() * (f.context + 1), va.size(), va.size() * (f.context + 1),
             f.context + 1);
  if (f.show > 0) {
    const data::Tokenizer tok = data::Tokenizer::load(p.tokenizer_path);
    const int64_t n = std::min<int64_t>(f.show, p.tokens);
    std::vector<int32_t> ids(static_cast<size_t>(n));
    tokens->read(0, n, ids.data());
    std::string pieces;
    for (const int32_t id : ids) pieces += (pieces.empty() ? "" : "|") + tok.piece(id);
    fmt::print("first {} tokens: {}\n", n, pieces);
  }
  fmt::print("done in {}\n", seconds(total));
  return 0;
}

}  // namespace

std::vector<Command> add_data_commands(CLI::App& app) {
  auto f = std::make_shared<TokenizeFlags>();
  auto* cmd = app.add_subcommand(
      "tokenize", "train (or reuse) the BPE tokenizer on a text corpus and write its token file, then print counts");
  cmd->add_option("--corpus", f->corpus, "a text file or a directory of text files (default: Debian's fortunes)")
      ->capture_default_str();
  cmd->add_option("--vocab", f->vocab, "vocabulary size: <unk>, 256 byte pieces, merges")
      ->check(CLI::Range(258, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--out", f->out, "directory for the tokenizer model and the token file (the cache)")
      ->capture_default_str();
  cmd->add_option("--coverage", f->coverage, "share of characters given pieces; the rarest become byte pieces")
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "SentencePiece's random seed")->capture_default_str();
  cmd->add_option("--context", f->context, "tokens per input row T, for the split it prints (a window is T + 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  cmd->add_option("--val-every", f->val_every, "every k-th window is validation")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--show", f->show, "print the corpus's first N tokens as pieces (0: none)")
      ->check(CLI::Range(0, 10000))
      ->capture_default_str();
  return {{cmd, [f] { return run_tokenize(*f); }}};
}

}  // namespace meshtrain::cli
