#include "meshtrain/data/tokenizer.h"

#include <fmt/format.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <unordered_map>

#include "meshtrain/core/error.h"

namespace meshtrain::data {
namespace {

constexpr int kMinVocab = 258;  // <unk>, 256 bytes, one more piece
constexpr int kMaxVocab = 1 << 20;
// The longest line SentencePiece trains on (its max_sentence_length).
constexpr size_t kMaxSentenceBytes = size_t{1} << 20;
constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// Length of the valid UTF-8 sequence at text[i] (1..4), or 0 when the bytes
// there are not one (overlong forms, surrogates, > U+10FFFF, cut short).
size_t utf8_length(std::string_view text, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((at(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (at(i + k) & 0x3F);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
    return 0;
  return n;
}

// The corpus's non-empty lines, for SentencePiece's trainer.
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(std::string_view text) : text_(text) { advance(); }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    while (pos_ < text_.size()) {
      size_t end = text_.find('\n', pos_);
      if (end == std::string_view::npos) end = text_.size();
      line_.assign(text_.substr(pos_, end - pos_));
      pos_ = end + 1;
      if (!line_.empty()) return;
    }
    done_ = true;
  }
  std::string_view text_;
  size_t pos_ = 0;
  std::string line_;
  bool done_ = false;
};

std::mutex& train_mutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
  std::string serialized;
  std::array<int32_t, 256> byte_ids{};
  std::vector<std::string> text_of;  // decode's text of each id
  std::vector<int16_t> byte_of;      // the byte of a byte piece, else -1
};

std::string TokenizerOptions::describe() const {
  return fmt::format(
      "model=bpe;vocab_size={};character_coverage={};seed={};byte_fallback=1;normalization=identity;"
      "add_dummy_prefix=0;remove_extra_whitespaces=0;threads=1;lines=all",
      vocab_size, character_coverage, seed);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::train(std::string_view text, const TokenizerOptions& options) {
  const char* op = "Tokenizer::train";
  if (options.vocab_size < kMinVocab || options.vocab_size > kMaxVocab)
    throw InvalidArgument(op, fmt::format("vocabulary size {} is outside [{}, {}]", options.vocab_size, kMinVocab,
                                          kMaxVocab),
                          "the vocabulary holds <unk> and the 256 byte pieces: use e.g. 8192");
  if (!(options.character_coverage > 0 && options.character_coverage <= 1))
    throw InvalidArgument(op, fmt::format("character coverage {} is outside (0, 1]", options.character_coverage),
                          "use e.g. 0.9995");
  // SentencePiece skips a line longer than max_sentence_length without a
  // word, and a text of only such lines ends in "no sentences": say so.
  {
    size_t longest = 0, longest_line = 0, line = 0;
    for (size_t begin = 0; begin < text.size(); ++line) {
      size_t end = text.find('\n', begin);
      if (end == std::string_view::npos) end = text.size();
      if (end - begin > longest) longest = end - begin, longest_line = line;
      begin = end + 1;
    }
    if (longest > kMaxSentenceBytes)
      throw InvalidArgument(op,
                            fmt::format("line {} of the text is {} bytes, longer than the {} bytes SentencePiece "
                                        "trains on (it would skip the line)",
                                        longest_line + 1, longest, kMaxSentenceBytes),
                            "split long lines first, e.g. `fold -s -w 4096 corpus.txt > corpus_lines.txt`, and "
                            "tokenize that");
  }
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"character_coverage", fmt::format("{}", options.character_coverage)},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"unk_id", "0"},
      {"bos_id", "-1"},
      {"eos_id", "-1"},
      {"pad_id", "-1"},
      {"num_threads", "1"},
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
      {"max_sentence_length", std::to_string(kMaxSentenceBytes)},
      {"minloglevel", "2"},
  };
  std::string model;
  {
    std::lock_guard<std::mutex> lock(train_mutex());
    sentencepiece::SetRandomGeneratorSeed(options.seed);
    LineIterator lines(text);
    const sentencepiece::util::Status st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
    if (!st.ok()) {
      // SentencePiece needs a piece for each distinct character it keeps
      // ("... smaller than required_chars. 300 vs 344."): too small a
      // vocabulary fails too, and the fix is the opposite one.
      const std::string why = st.ToString();
      std::string hint = "use a smaller vocabulary or more text";
      if (const size_t at = why.find("required_chars"); at != std::string::npos) {
        const size_t vs = why.find(" vs ", at);
        const size_t digits = vs == std::string::npos ? vs : why.find_first_not_of("0123456789", vs + 4);
        const std::string need = vs == std::string::npos ? "more" : why.substr(vs + 4, digits - (vs + 4));
        hint = fmt::format("use a larger vocabulary: the text's characters need at least {} pieces", need);
      }
      throw InvalidArgument(op,
                            fmt::format("SentencePiece cannot train a BPE vocabulary of {} on {} bytes of text: {}",
                                        options.vocab_size, text.size(), why),
                            hint);
    }
  }
  return from_serialized(model, "the model just trained");
}

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw IoError("Tokenizer::load", fmt::format("cannot open tokenizer model '{}': {}", path, std::strerror(errno)),
                  "run `meshtrain tokenize` to build it, or check the path");
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return from_serialized(bytes, "'" + path + "'");
}

Tokenizer Tokenizer::from_serialized(std::string_view bytes, const std::string& what) {
  const char* op = "Tokenizer::load";
  auto impl = std::make_unique<Impl>();
  const sentencepiece::util::Status st = impl->sp.LoadFromSerializedProto(bytes);
  if (!st.ok())
    throw IoError(op, fmt::format("{} is not a SentencePiece model: {}", what, st.ToString()),
                  "delete it and run `meshtrain tokenize` again");
  impl->serialized.assign(bytes);
  const int n = impl->sp.GetPieceSize();
  impl->text_of.resize(static_cast<size_t>(n));
  impl->byte_of.assign(static_cast<size_t>(n), -1);
  impl->byte_ids.fill(-1);
  for (int id = 0; id < n; ++id) {
    const std::string& p = impl->sp.IdToPiece(id);
    if (impl->sp.IsByte(id)) {
      unsigned value = 0;
      if (p.size() != 6 || std::sscanf(p.c_str(), "<0x%02X>", &value) != 1 || value > 255)
        throw IoError(op, fmt::format("{}: byte piece {} is '{}', not <0xXX>", what, id, p),
                      "delete it and run `meshtrain tokenize` again");
      impl->byte_of[static_cast<size_t>(id)] = static_cast<int16_t>(value);
      impl->byte_ids[value] = id;
    } else if (impl->sp.IsUnknown(id)) {
      impl->text_of[static_cast<size_t>(id)] = "\xEF\xBF\xBD";  // U+FFFD
    } else if (!impl->sp.IsControl(id)) {
      std::string t;
      for (size_t k = 0; k < p.size();) {
        if (p.compare(k, kSpaceMarker.size(), kSpaceMarker) == 0) {
          t += ' ';
          k += kSpaceMarker.size();
        } else {
          t += p[k++];
        }
      }
      impl->text_of[static_cast<size_t>(id)] = std::move(t);
    }
  }
  for (int b = 0; b < 256; ++b)
    if (impl->byte_ids[static_cast<size_t>(b)] < 0)
      throw IoError(op, fmt::format("{} has no byte piece <0x{:02X}>: it was trained without byte fallback", what, b),
                    "train it with Tokenizer::train (or `meshtrain tokenize`), which turns byte fallback on");
  return Tokenizer(std::move(impl));
}

std::string Tokenizer::serialized() const { return impl_->serialized; }
int Tokenizer::vocab_size() const { return impl_->sp.GetPieceSize(); }
int32_t Tokenizer::byte_id(uint8_t byte) const { return impl_->byte_ids[byte]; }

std::string Tokenizer::piece(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw InvalidArgument("Tokenizer::piece", fmt::format("id {} is outside [0, {})", id, vocab_size()),
                          "pass an id of this tokenizer's vocabulary");
  return impl_->sp.IdToPiece(id);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 16);
  std::vector<int> ids;
  // SentencePiece gets the runs of valid UTF-8 (without '\n' and U+2581);
  // every other byte becomes its byte piece.
  const auto flush = [&](size_t begin, size_t end) {
    if (begin == end) return;
    ids.clear();
    const sentencepiece::util::Status st = impl_->sp.Encode(text.substr(begin, end - begin), &ids);
    if (!st.ok())
      throw InvalidArgument("Tokenizer::encode", fmt::format("SentencePiece failed: {}", st.ToString()),
                            "report this: encode takes any bytes");
    out.insert(out.end(), ids.begin(), ids.end());
  };
  size_t run = 0;  // start of the pending valid run
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_length(text, i);
    if (n == 0 || text[i] == '\n' || (n == 3 && text.compare(i, 3, kSpaceMarker) == 0)) {
      flush(run, i);
      const size_t raw = n == 0 ? 1 : n;
      for (size_t k = 0; k < raw; ++k) out.push_back(impl_->byte_ids[static_cast<unsigned char>(text[i + k])]);
      i += raw;
      run = i;
    } else {
      i += n;
    }
  }
  flush(run, text.size());
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  const int32_t n = vocab_size();
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (id < 0 || id >= n)
      throw InvalidArgument("Tokenizer::decode", fmt::format("id {} (position {}) is outside [0, {})", id, k, n),
                            "decode ids of this tokenizer's vocabulary");
    const int16_t b = impl_->byte_of[static_cast<size_t>(id)];
    if (b >= 0)
      out += static_cast<char>(b);
    else
      out += impl_->text_of[static_cast<size_t>(id)];
  }
  return out;
}

}  // namespace meshtrain::data
