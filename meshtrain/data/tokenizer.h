// A subword tokenizer: SentencePiece BPE (Debian's libsentencepiece-dev),
// trained on a corpus, saved as SentencePiece's own model file, and an exact
// encode/decode of any bytes.
//
//   TokenizerOptions opt;                        // BPE, 8192 pieces, byte fallback
//   Tokenizer tok = Tokenizer::train(corpus.text, opt);
//   std::vector<int32_t> ids = tok.encode("Hello, world\n");
//   tok.decode(ids);                             // "Hello, world\n", byte for byte
//   write_file_atomic("spm.model", tok.serialized());
//   Tokenizer again = Tokenizer::load("spm.model");
//
// The model: SentencePiece BPE with byte fallback (the 256 pieces <0x00> ..
// <0xFF> are in the vocabulary, so no text is ever <unk>), the identity
// normalization (no NFKC, extra whitespace kept, no dummy-prefix space), no
// <s>/</s>/<pad>: id 0 is <unk>, ids 1..256 the bytes, then the merges and
// characters. SentencePiece trains on the corpus's lines (split at '\n';
// empty lines left out), all of them, in order, on one thread with a fixed
// seed: the same corpus and options give the same model file.
//
// Exactness: encode(x) decodes to x for ANY bytes x. SentencePiece itself
// would turn invalid UTF-8 into U+FFFD and U+2581 ("▁", its space marker)
// into a space, so encode() hands only valid UTF-8 without U+2581 to it and
// writes the other bytes as their byte pieces; decode() is this file's own:
// a byte piece gives its byte, any other piece its text with "▁" -> ' ', and
// <unk> (never produced by encode) gives U+FFFD. '\n' is the byte piece
// <0x0A> (lines are encoded one at a time: a token never spans a newline).
//
// Errors: InvalidArgument for options out of range, a corpus SentencePiece
// cannot build the vocabulary from (its message, with the hint to lower the
// vocabulary or use more text), ids outside the vocabulary in decode();
// IoError naming the file for a model that cannot be read or is not such a
// model (wrong type, no byte fallback).
// Thread-safety: a Tokenizer is immutable; encode/decode may run
// concurrently. train() serializes with other train() calls (SentencePiece's
// random seed is process-global).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::data {

struct TokenizerOptions {
  // Pieces, <unk> and the 256 byte pieces included: 258 .. 2^20, and at
  // least 257 + the characters kept (fortunes: 336 for 80 KB of it).
  int vocab_size = 8192;
  double character_coverage = 0.9995;  // characters covered by pieces; the rarest go to byte pieces
  uint32_t seed = 42;                  // SentencePiece's random seed
  // "key=value;..." of every option that changes the model, with the fixed
  // ones (bpe, identity, byte fallback, one thread): the cache key's part.
  std::string describe() const;
};

class Tokenizer {
 public:
  // Trains on `text` (see above). Throws InvalidArgument for a bad option
  // or a corpus too small for the vocabulary.
  static Tokenizer train(std::string_view text, const TokenizerOptions& options);
  // Reads a model written from serialized(); IoError naming `path`.
  static Tokenizer load(const std::string& path);
  // From serialized() bytes; `what` names them in errors.
  static Tokenizer from_serialized(std::string_view bytes, const std::string& what);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // SentencePiece's model file (a ModelProto).
  std::string serialized() const;
  int vocab_size() const;
  std::vector<int32_t> encode(std::string_view text) const;
  // Throws InvalidArgument naming the first id outside [0, vocab_size()).
  std::string decode(std::span<const int32_t> ids) const;
  // The piece of `id` as SentencePiece spells it ("▁the", "<0x0A>").
  std::string piece(int32_t id) const;
  // The id of byte piece <0xXX>.
  int32_t byte_id(uint8_t byte) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::data
