// issue 9: the safetensors reader allocated from the header before checking
// offsets, and base + offset could wrap past the bounds check. Crafted
// headers are refused, naming the file and the tensor, before any allocation.
#include "meshtrain/checkpoint/internal/safetensors_header.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "meshtrain/core/error.h"
#include "meshtrain/checkpoint/safetensors.h"

namespace meshtrain::checkpoint::internal {
namespace {

using ::testing::HasSubstr;

std::string error_of(std::string_view header, uint64_t data_bytes) {
  try {
    parse_safetensors_header(header, data_bytes, "m.safetensors");
  } catch (const IoError& e) {
    return e.what();
  }
  return "no error";
}

TEST(SafetensorsHeader, AcceptsAWellFormedHeader) {
  const auto e = parse_safetensors_header(
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[24,32]},)"
      R"("w":{"dtype":"BF16","shape":[3,4],"data_offsets":[0,24]},"e":{"dtype":"I64","shape":[0],"data_offsets":[32,32]}})",
      32, "m.safetensors");
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].name, "b");
  EXPECT_EQ(e[1].dtype, DType::bf16);
  EXPECT_EQ(e[1].shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(e[1].end, 24u);
}

TEST(SafetensorsHeader, RefusesCraftedHeaders) {
  // Offsets that wrapped base + offset past the bounds check.
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,0]}})", 4),
              HasSubstr("m.safetensors: tensor 'x': data_offsets [18446744073709551612, 0] are not inside the 4 data bytes"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,18446744073709551616]}})", 4),
              HasSubstr("tensor 'x'"));
  // A shape that would allocate terabytes (or overflow) for 8 bytes of data.
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[1099511627776],"data_offsets":[0,8]}})", 8),
              HasSubstr("tensor 'x': data_offsets [0, 8] hold 8 bytes, but F32 [1099511627776] needs 4398046511104"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
              HasSubstr("tensor 'x': shape [4294967296,4294967296] holds more than 2^63 - 1 bytes"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
              HasSubstr("tensor 'x': shape holds -1, not a non-negative integer"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4), HasSubstr("are not inside"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
              HasSubstr("data_offsets is not [begin, end]"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4.5]}})", 4),
              HasSubstr("not a non-negative integer"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", 4), HasSubstr("unsupported dtype 'Q4'"));
  EXPECT_THAT(error_of(R"({"x":{"shape":[1],"data_offsets":[0,4]}})", 4), HasSubstr("no dtype"));
  EXPECT_THAT(error_of(R"({"x":{"dtype":"F32","shape":1,"data_offsets":[0,4]}})", 4), HasSubstr("no shape array"));
  // Overlap, holes and unindexed bytes (the spec forbids all three).
  EXPECT_THAT(error_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
              HasSubstr("tensor 'b': bytes [4, 8] overlap"));
  EXPECT_THAT(error_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
              HasSubstr("tensor 'a': bytes [0, 4) belong to no tensor"));
  EXPECT_THAT(error_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
              HasSubstr("data bytes [4, 8) belong to no tensor"));
  // Not a header at all.
  EXPECT_THAT(error_of("{\"a\":", 0), HasSubstr("m.safetensors: header is not JSON"));
  EXPECT_THAT(error_of("[1, 2]", 0), HasSubstr("header is not a JSON object"));
  EXPECT_THAT(error_of(R"({"__metadata__":{"k":1}})", 0), HasSubstr("__metadata__ key 'k' is not a string"));
  EXPECT_THAT(error_of(R"({"a":3})", 0), HasSubstr("tensor 'a': entry is not an object"));
  // A name twice (JSON parsers keep the last one): refused, naming it.
  EXPECT_THAT(error_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
              HasSubstr("m.safetensors: tensor 'w': named twice in the header"));
  // Keys repeated below the top level are the tensors' own fields, not names.
  EXPECT_THAT(error_of(R"({"w":{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}})", 4), "no error");
}

// A directory or a FIFO where a file was meant: refused before it is opened
// (a FIFO's open waited for a writer forever), naming the path.
TEST(SafetensorsHeader, LoadRefusesWhatIsNotAFile) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "meshtrain_not_a_file";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "model.safetensors");
  const std::string fifo = (dir / "fifo.safetensors").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const auto& [path, what] : {std::pair{(dir / "model.safetensors").string(), "a directory"},
                                   std::pair{fifo, "a FIFO"},
                                   std::pair{(dir / "missing.safetensors").string(), "No such file"}}) {
    try {
      load_safetensors(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const IoError& e) {
      EXPECT_THAT(e.what(), HasSubstr("'" + path + "'"));
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(SafetensorsHeader, LoadRefusesACraftedFileBeforeAllocating) {
  const std::string path = (std::filesystem::temp_directory_path() / "meshtrain_crafted.safetensors").string();
  const std::string header = R"({"x":{"dtype":"F32","shape":[1099511627776,1024],"data_offsets":[0,4]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header + std::string(4, '\0');
  std::ofstream(path, std::ios::binary) << file;
  try {
    load_safetensors(path);
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + ": tensor 'x': data_offsets [0, 4] hold 4 bytes"));
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace meshtrain::checkpoint::internal
