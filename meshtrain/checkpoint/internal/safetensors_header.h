// Validation of a safetensors header (load_safetensors' first step), apart
// from the reader so tests and the fuzzer (safetensors_fuzzer.cc) reach it
// without files. Not a public header.
//
//   auto entries = parse_safetensors_header(header_json, data_bytes, "model.safetensors");
//
// Everything is checked before the caller allocates or copies anything:
// valid JSON object; "__metadata__", when present, maps strings to strings;
// every tensor has a known dtype, a shape of sizes >= 0 and data_offsets
// [begin, end] with begin <= end <= data_bytes and end - begin == elements x
// dtype size (computed without overflow); and, as the safetensors spec
// requires, the tensors' byte ranges cover [0, data_bytes) exactly, with no
// overlap and no hole. Errors are IoError naming the file and the tensor.
// Pure; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/dtype.h"

namespace meshtrain::checkpoint::internal {

// The longest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

// Entries in header order.
std::vector<SafetensorsEntry> parse_safetensors_header(std::string_view header, uint64_t data_bytes,
                                                       std::string_view path);

}  // namespace meshtrain::checkpoint::internal
