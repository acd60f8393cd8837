// libFuzzer target: the checkpoint index reader (docs/fuzzing.md).
//
// The input is the text of an index.json, fed to parse_checkpoint_index.
// IoError is the documented way to refuse it; any other exception, a crash,
// a sanitizer report or a leak is a finding. An accepted index is checked
// against what the parser promises (checkpoint.h): pieces inside their file,
// count x 4 bytes, regions inside their tensor, tensors sorted and unique.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "meshtrain/core/error.h"
#include "meshtrain/checkpoint/checkpoint.h"

namespace {

void check(bool ok) {
  if (!ok) std::abort();  // a broken promise of the parser
}

void check_accepted(const meshtrain::checkpoint::CheckpointIndex& index) {
  check(index.step >= 0);
  check(index.files.size() == index.file_bytes.size());
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    const auto& t = index.tensors[i];
    if (i > 0) check(index.tensors[i - 1].name < t.name);
    check(index.find(t.name) == &t);
    int64_t n = 1;
    for (int64_t d : t.shape) {
      check(d >= 0);
      n *= d;  // bounded by the parser (2^48 elements)
    }
    for (const auto& piece : t.pieces) {
      check(piece.file >= 0 && static_cast<size_t>(piece.file) < index.files.size());
      const uint64_t size = index.file_bytes[static_cast<size_t>(piece.file)];
      check(piece.offset <= size && piece.bytes <= size - piece.offset);
      // The placement comes out of the parser written out: view, box and count explicit.
      const meshtrain::sharding::Placement& p = piece.placement;
      check(p.shape == t.shape);
      check(p.count >= 0 && piece.bytes == static_cast<uint64_t>(p.count) * 4);
      check(p.box.offsets.size() == p.view.size() && p.box.sizes.size() == p.view.size());
      int64_t vn = 1;
      for (size_t d = 0; d < p.view.size(); ++d) {
        check(p.box.offsets[d] >= 0 && p.box.sizes[d] >= 0 && p.box.offsets[d] + p.box.sizes[d] <= p.view[d]);
        vn *= p.view[d];
      }
      check(vn == n);
      const int64_t bn = p.box.numel();
      check(p.start >= 0 && p.start <= bn && p.count <= bn - p.start);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    check_accepted(meshtrain::checkpoint::parse_checkpoint_index(text, "fuzz/index.json"));
  } catch (const meshtrain::IoError&) {
    // refused: the documented outcome for a bad index
  }
  return 0;
}
