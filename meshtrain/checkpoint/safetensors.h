// safetensors files (model.safetensors, `meshtrain export`, --init-from).
//
//   save_safetensors("runs/mlp/model.safetensors", {{"0.weight", w}, ...});
//   for (auto& [name, t] : load_safetensors("runs/mlp/model.safetensors")) ...
//
// Written through write_file_atomic (core/atomic_file.h); read with the
// whole header validated before anything is allocated from it
// (internal/safetensors_header.h). Thread-safety: reentrant.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/tensor.h"

namespace meshtrain::checkpoint {

// safetensors (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length, a JSON header {name: {dtype, shape,
// data_offsets}} and the raw little-endian data. Tensors are written
// contiguously in the given order; any dtype of the core.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// Reads every tensor back (for tests and resuming).
std::vector<std::pair<std::string, Tensor>> load_safetensors(const std::string& path);

}  // namespace meshtrain::checkpoint
