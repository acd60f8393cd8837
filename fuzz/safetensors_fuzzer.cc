// libFuzzer target: the safetensors reader (docs/fuzzing.md).
//
// The first input byte picks what the rest is:
//   even: a whole .safetensors file, read by load_safetensors (from a memfd
//         named /proc/self/fd/N, so the library reads a real file);
//   odd:  [u16 little-endian data size, low 12 bits][header JSON...]: the
//         header goes to parse_safetensors_header with that data size, then
//         into a well-framed file (8-byte length, header, data bytes) for
//         load_safetensors, so mutations reach the JSON checks without
//         having to keep the length prefix right.
// IoError is the documented refusal; anything else is a finding. Accepted
// input is checked against the promises of safetensors_header.h (the
// tensors tile the data section) and every tensor's bytes are read.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fuzz/fuzz_input.h"
#include "meshtrain/core/error.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/checkpoint/internal/safetensors_header.h"

namespace {

using meshtrain::fuzz::check;
using meshtrain::fuzz::write_input;


void load(const std::string& file, uint64_t expect_data_bytes, bool known) {
  try {
    const auto tensors = meshtrain::checkpoint::load_safetensors(write_input(file.data(), file.size()));
    uint64_t total = 0;
    for (const auto& [name, t] : tensors) {
      check(t.is_contiguous());
      const auto* p = static_cast<const unsigned char*>(t.data_ptr());
      unsigned sum = 0;
      for (size_t i = 0; i < t.nbytes(); ++i) sum += p[i];  // every byte readable
      (void)sum;
      total += t.nbytes();
    }
    if (known) check(total == expect_data_bytes);
  } catch (const meshtrain::IoError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if ((data[0] & 1) == 0) {
    load(std::string(reinterpret_cast<const char*>(data + 1), size - 1), 0, false);
    return 0;
  }
  if (size < 3) return 0;
  const uint64_t data_bytes = (data[1] | (uint64_t{data[2]} << 8)) & 0x0fff;
  const std::string_view header(reinterpret_cast<const char*>(data + 3), size - 3);
  try {
    const auto entries =
        meshtrain::checkpoint::internal::parse_safetensors_header(header, data_bytes, "fuzz.safetensors");
    uint64_t at = 0, covered = 0;
    for (const auto& e : entries) {
      check(e.begin <= e.end && e.end <= data_bytes);
      covered += e.end - e.begin;
      at = std::max(at, e.end);
    }
    check(covered == data_bytes && at == data_bytes);  // no hole, no overlap
  } catch (const meshtrain::IoError&) {
  }
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file.append(header);
  for (uint64_t i = 0; i < data_bytes; ++i) file.push_back(static_cast<char>(i * 37));
  load(file, data_bytes, true);
  return 0;
}
