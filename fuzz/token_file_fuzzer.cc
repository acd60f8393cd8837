// libFuzzer target: the token file reader (docs/fuzzing.md).
//
// Input: [mode byte][token file bytes]. The file bytes are written to a
// memfd and opened as /proc/self/fd/N with TokenFile::open. Mode bits:
//   bit 0: first recompute both checksums (payload at offset 32, header at
//          36), so mutations get past the CRC checks to the later ones;
//   bit 1: pass an expected vocabulary size (the header's, or with bit 2
//          the header's + 1, which must be refused).
// IoError is the documented refusal; anything else is a finding. An opened
// file is read whole and must keep open()'s promise: every token is <
// vocab_size(); a read outside [0, size()) must throw InvalidArgument.
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "meshtrain/core/error.h"
#include "meshtrain/data/token_file.h"

namespace {

using meshtrain::data::TokenFile;

using meshtrain::fuzz::check;
using meshtrain::fuzz::write_input;


uint32_t crc(const unsigned char* p, size_t n) {
  return static_cast<uint32_t>(crc32(crc32(0L, Z_NULL, 0), p, static_cast<uInt>(n)));
}

void fix_checksums(std::vector<unsigned char>& f) {
  constexpr size_t H = meshtrain::data::kTokenFileHeaderBytes;
  if (f.size() < H) return;
  const uint32_t payload = crc(f.data() + H, f.size() - H);
  std::memcpy(f.data() + 32, &payload, 4);
  std::memset(f.data() + 36, 0, 4);
  const uint32_t header = crc(f.data(), H);
  std::memcpy(f.data() + 36, &header, 4);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::vector<unsigned char> file(data + 1, data + size);
  if (mode & 1) fix_checksums(file);
  std::optional<int64_t> expected;
  if ((mode & 2) && file.size() >= 24) {
    int64_t v = 0;
    std::memcpy(&v, file.data() + 16, 8);
    expected = (mode & 4) && v < INT64_MAX ? v + 1 : v;
  }
  try {
    const TokenFile t = TokenFile::open(write_input(file.data(), file.size()), expected);
    check(t.size() >= 1 && t.vocab_size() >= 1 && t.vocab_size() <= (int64_t{1} << 31));
    check(t.token_bytes() == (t.vocab_size() <= 65536 ? 2 : 4));
    check(file.size() == meshtrain::data::kTokenFileHeaderBytes + static_cast<size_t>(t.size()) * t.token_bytes());
    if (expected) check(*expected == t.vocab_size());
    std::vector<int64_t> all(static_cast<size_t>(t.size()));
    t.read(0, t.size(), all.data());
    for (int64_t v : all) check(v >= 0 && v < t.vocab_size());
    check(t.at(t.size() - 1) == all.back());
    bool refused = false;
    try {
      int32_t one = 0;
      t.read(t.size(), 1, &one);
    } catch (const meshtrain::InvalidArgument&) {
      refused = true;
    }
    check(refused);
  } catch (const meshtrain::IoError&) {
  }
  return 0;
}
