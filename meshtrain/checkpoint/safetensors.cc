#include "meshtrain/checkpoint/safetensors.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "meshtrain/checkpoint/internal/safetensors_header.h"
#include "meshtrain/core/atomic_file.h"
#include "meshtrain/core/error.h"

namespace meshtrain::checkpoint {

namespace {

std::string safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i8: return "I8";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
  }
  return "?";
}

}  // namespace

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string data;
  for (const auto& [name, t0] : tensors) {
    const Tensor t = t0.contiguous();
    const size_t begin = data.size();
    data.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
    header[name] = {{"dtype", safetensors_dtype(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // align the data to 8 bytes
  std::string file(8, '\0');
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  file += h;
  file += data;
  write_file_atomic(path, file);
}

std::vector<std::pair<std::string, Tensor>> load_safetensors(const std::string& path) {
  // A directory, FIFO or device is refused before it is opened (a FIFO's
  // open waits for a writer).
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw IoError("load_safetensors", fmt::format("cannot open '{}': {}", path, std::strerror(errno)), "check the path");
  if (!S_ISREG(st.st_mode))
    throw IoError("load_safetensors",
                  fmt::format("'{}' is {}, not a file", path,
                              S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "not a regular file"),
                  "give the path of a .safetensors file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("load_safetensors", fmt::format("cannot open '{}': {}", path, std::strerror(errno)), "check the path");
  std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (file.size() < 8) throw IoError("load_safetensors", fmt::format("{}: {} bytes, no header", path, file.size()), "");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(file[i])} << (8 * i);
  if (n > file.size() - 8)
    throw IoError("load_safetensors", fmt::format("{}: header of {} bytes past the end at offset 8", path, n), "");
  // The whole header is validated before anything is allocated from it.
  const size_t base = 8 + n;
  const auto entries = internal::parse_safetensors_header(std::string_view(file).substr(8, n), file.size() - base, path);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& e : entries) {
    Tensor x = Tensor::empty(e.shape, e.dtype);
    if (x.nbytes() != e.end - e.begin)
      throw IoError("load_safetensors", fmt::format("{}: tensor '{}' has bad data offsets", path, e.name), "");
    if (x.nbytes() > 0) std::memcpy(x.data_ptr(), file.data() + base + e.begin, x.nbytes());
    out.emplace_back(e.name, x);
  }
  return out;
}

}  // namespace meshtrain::checkpoint
