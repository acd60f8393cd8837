#include "meshtrain/checkpoint/internal/safetensors_header.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <set>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::checkpoint::internal {
namespace {

constexpr const char* kOp = "load_safetensors";
// The most bytes a tensor may span (Tensor::empty's limit, core/tensor.cc).
constexpr int64_t kMaxTensorBytes = int64_t{1} << 56;

// The safetensors names of the core's dtypes (the writer's table, inverted).
constexpr std::pair<std::string_view, DType> kDTypes[] = {
    {"F32", DType::f32}, {"F64", DType::f64}, {"BF16", DType::bf16}, {"F16", DType::f16},
    {"I8", DType::i8},   {"I32", DType::i32}, {"I64", DType::i64},   {"U8", DType::u8}};

[[noreturn]] void corrupt(std::string_view path, std::string_view name, const std::string& what) {
  if (name.empty()) throw IoError(kOp, fmt::format("{}: {}", path, what), "the file is corrupt or not safetensors");
  throw IoError(kOp, fmt::format("{}: tensor '{}': {}", path, name, what), "the file is corrupt or not safetensors");
}

uint64_t unsigned_of(const nlohmann::ordered_json& v, std::string_view path, std::string_view name, const char* field) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
    corrupt(path, name, fmt::format("{} holds {}, not a non-negative integer", field, v.dump()));
  return v.get<uint64_t>();
}

}  // namespace

std::vector<SafetensorsEntry> parse_safetensors_header(std::string_view header, uint64_t data_bytes,
                                                       std::string_view path) {
  if (header.size() > kMaxSafetensorsHeaderBytes)
    corrupt(path, "", fmt::format("header of {} bytes, more than {}", header.size(), kMaxSafetensorsHeaderBytes));
  nlohmann::ordered_json doc;
  // JSON lets a key repeat (the parser keeps the last); a tensor named twice
  // is refused, not read as whichever came last.
  std::set<std::string> names;
  std::string twice;
  const auto on_key = [&](int depth, nlohmann::ordered_json::parse_event_t event, nlohmann::ordered_json& parsed) {
    if (event == nlohmann::ordered_json::parse_event_t::key && depth == 1 && twice.empty() &&
        !names.insert(parsed.get<std::string>()).second)
      twice = parsed.get<std::string>();
    return true;
  };
  try {
    doc = nlohmann::ordered_json::parse(header.begin(), header.end(), on_key);
  } catch (const nlohmann::json::exception& e) {
    corrupt(path, "", fmt::format("header is not JSON: {}", e.what()));
  }
  if (!twice.empty()) corrupt(path, twice, "named twice in the header");
  if (!doc.is_object()) corrupt(path, "", "header is not a JSON object");
  std::vector<SafetensorsEntry> out;
  for (const auto& [name, v] : doc.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) corrupt(path, "", "__metadata__ is not an object");
      for (const auto& [k, m] : v.items())
        if (!m.is_string()) corrupt(path, "", fmt::format("__metadata__ key '{}' is not a string", k));
      continue;
    }
    if (!v.is_object()) corrupt(path, name, "entry is not an object");
    SafetensorsEntry e;
    e.name = name;
    // dtype
    if (!v.contains("dtype") || !v["dtype"].is_string()) corrupt(path, name, "no dtype string");
    const std::string dtype = v["dtype"].get<std::string>();
    const auto* t = std::find_if(std::begin(kDTypes), std::end(kDTypes), [&](const auto& p) { return p.first == dtype; });
    if (t == std::end(kDTypes)) corrupt(path, name, fmt::format("unsupported dtype '{}' (F32, F64, BF16, F16, I8, I32, I64, U8)", dtype));
    e.dtype = t->second;
    // shape: elements x dtype size, without overflow
    if (!v.contains("shape") || !v["shape"].is_array()) corrupt(path, name, "no shape array");
    int64_t bytes = static_cast<int64_t>(dtype_size(e.dtype));
    int64_t extent = bytes;  // the same product with sizes of 0 counted as 1 (an empty tensor's strides)
    for (const auto& d : v["shape"]) {
      const uint64_t size = unsigned_of(d, path, name, "shape");
      if (size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        corrupt(path, name, fmt::format("dimension {} is past 2^63 - 1", size));
      e.shape.push_back(static_cast<int64_t>(size));
      const auto next = checked_mul(bytes, static_cast<int64_t>(size));
      if (!next) corrupt(path, name, fmt::format("shape {} holds more than 2^63 - 1 bytes", v["shape"].dump()));
      bytes = *next;
      const auto wider = checked_mul(extent, std::max<int64_t>(static_cast<int64_t>(size), 1));
      if (!wider || *wider > kMaxTensorBytes)
        corrupt(path, name, fmt::format("shape {} spans more than 2^56 bytes (sizes of 0 counted as 1)",
                                        v["shape"].dump()));
      extent = *wider;
    }
    // data_offsets: inside the data section and exactly the shape's bytes
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      corrupt(path, name, "data_offsets is not [begin, end]");
    e.begin = unsigned_of(v["data_offsets"][0], path, name, "data_offsets");
    e.end = unsigned_of(v["data_offsets"][1], path, name, "data_offsets");
    if (e.begin > e.end || e.end > data_bytes)
      corrupt(path, name, fmt::format("data_offsets [{}, {}] are not inside the {} data bytes", e.begin, e.end,
                                      data_bytes));
    if (e.end - e.begin != static_cast<uint64_t>(bytes))
      corrupt(path, name, fmt::format("data_offsets [{}, {}] hold {} bytes, but {} {} needs {}", e.begin, e.end,
                                      e.end - e.begin, dtype, v["shape"].dump(), bytes));
    out.push_back(std::move(e));
  }
  // The spec: the tensors index the whole data section, no holes, no overlap.
  std::vector<const SafetensorsEntry*> order;
  for (const auto& e : out) order.push_back(&e);
  std::sort(order.begin(), order.end(),
            [](const auto* a, const auto* b) { return std::tie(a->begin, a->end) < std::tie(b->begin, b->end); });
  uint64_t at = 0;
  for (const auto* e : order) {
    if (e->begin < at) corrupt(path, e->name, fmt::format("bytes [{}, {}] overlap another tensor's", e->begin, e->end));
    if (e->begin > at) corrupt(path, e->name, fmt::format("bytes [{}, {}) belong to no tensor", at, e->begin));
    at = e->end;
  }
  if (at != data_bytes) corrupt(path, "", fmt::format("data bytes [{}, {}) belong to no tensor", at, data_bytes));
  return out;
}

}  // namespace meshtrain::checkpoint::internal
