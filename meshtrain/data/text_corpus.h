// A text corpus: one text file, or every text file of a directory, read
// into one string (what the tokenizer trains on and encodes).
//
//   TextCorpus corpus = load_text_corpus();            // Debian's fortunes
//   corpus.text.size();                                // 2576674 bytes (fortunes 1:1.99.1-7.3)
//   corpus.files;                                      // {".../art", ".../ascii-art", ...}
//   count_characters(corpus.text);                     // UTF-8 code points
//   content_hash(corpus.text);                         // FNV-1a 64, the cache key's part
//
// Contracts:
// - A file path is read as it is (any bytes). A directory is walked
//   recursively; its files are read in the order of their paths relative to
//   the directory (byte-wise), and each file that does not end in '\n' gets
//   one appended. Left out, and listed in `skipped` with the reason:
//   entries whose name starts with '.', directories named "off" (the
//   offensive set of fortune(6), package fortunes-off), files holding a NUL
//   byte (binary: strfile's .dat indexes, images), and links to a file
//   already read (fortunes installs each file again as a <name>.u8 link).
// - The corpus is the same string on every machine for the same files
//   (nothing depends on the directory's listing order or the locale).
// Errors: IoError naming the path: missing (with the install hint for the
// fortunes directory), unreadable, a directory with no text file, a corpus
// of 0 bytes ("empty corpus").
// Thread-safety: pure functions of the files and their arguments.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::data {

// Where Debian's `fortunes` package installs the fortune files: about
// 2.5 MB of English text in 43 files (the default corpus).
inline constexpr std::string_view kFortunesDir = "/usr/share/games/fortunes";
inline constexpr std::string_view kFortunesInstallHint =
    "install it with `sudo apt install fortunes` (or run scripts/install-deps.sh), or pass a text file or "
    "directory of text files";

struct TextCorpus {
  std::string source;                // the path given
  std::string text;                  // the files' bytes, concatenated (see above)
  std::vector<std::string> files;    // the files read, in order
  std::vector<std::string> skipped;  // "path (reason)" for each entry left out
};

// Reads `path` (a file or a directory) by the rules above.
TextCorpus load_text_corpus(const std::string& path = std::string(kFortunesDir));

// UTF-8 code points in `text`: the bytes that do not continue a sequence
// (so an invalid byte counts as one character).
int64_t count_characters(std::string_view text);

// FNV-1a 64 of the bytes (offset basis 0xcbf29ce484222325, prime
// 0x100000001b3): a content key for caches, not a cryptographic hash.
uint64_t content_hash(std::string_view bytes);

}  // namespace meshtrain::data
