// libFuzzer target: the IDX reader (docs/fuzzing.md).
//
// Input: [mode byte][IDX bytes]. The file is written to a memfd and read
// with read_idx("/proc/self/fd/N"). Mode, low 2 bits:
//   0: the bytes as they are (raw IDX, or gzip data when they start 1f 8b);
//   1: gzip-compressed first, so mutations of the IDX header and payload go
//      through read_idx's inflate path with a valid stream;
//   2: compressed, then cut short by 1..64 bytes (mode >> 2, + 1);
//   3: compressed as two gzip members, split at (mode >> 2) / 64 of the bytes.
// IoError is the documented refusal; anything else is a finding. An accepted
// array is checked (1..4 dims, u8, numel = product of dims) and read whole.
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "meshtrain/core/error.h"
#include "meshtrain/data/idx.h"

namespace {

using meshtrain::fuzz::check;
using meshtrain::fuzz::write_input;


// One gzip member holding `n` bytes at `p`, appended to `out`.
void gzip_append(const uint8_t* p, size_t n, std::vector<unsigned char>& out) {
  z_stream zs{};
  check(deflateInit2(&zs, Z_BEST_SPEED, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  const size_t at = out.size();
  out.resize(at + deflateBound(&zs, n) + 32);
  zs.next_in = const_cast<Bytef*>(p);
  zs.avail_in = static_cast<uInt>(n);
  zs.next_out = out.data() + at;
  zs.avail_out = static_cast<uInt>(out.size() - at);
  check(deflate(&zs, Z_FINISH) == Z_STREAM_END);
  out.resize(at + zs.total_out);
  deflateEnd(&zs);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const uint8_t* body = data + 1;
  const size_t n = size - 1;
  std::vector<unsigned char> file;
  switch (mode & 3) {
    case 0:
      file.assign(body, body + n);
      break;
    case 1:
      gzip_append(body, n, file);
      break;
    case 2:
      gzip_append(body, n, file);
      file.resize(file.size() - std::min<size_t>(file.size(), (mode >> 2) + 1u));
      break;
    default: {
      const size_t split = n * (mode >> 2) / 64;
      gzip_append(body, split, file);
      gzip_append(body + split, n - split, file);
    }
  }
  try {
    const meshtrain::data::IdxArray a = meshtrain::data::read_idx(write_input(file.data(), file.size()));
    check(a.dims.size() >= 1 && a.dims.size() <= 4);
    check(a.data.dtype() == meshtrain::DType::u8 && a.data.shape() == a.dims && a.data.is_contiguous());
    int64_t elements = std::count(a.dims.begin(), a.dims.end(), 0) > 0 ? 0 : 1;
    if (elements != 0)
      for (int64_t d : a.dims) elements *= d;  // bounded by the reader (2^34)
    check(a.data.numel() == elements);
    const uint8_t* p = a.data.data<uint8_t>();
    unsigned sum = 0;
    for (int64_t i = 0; i < elements; ++i) sum += p[i];  // every byte readable
    (void)sum;
  } catch (const meshtrain::IoError&) {
  }
  return 0;
}
