// Writes the fuzzers' seed corpus (fuzz/corpus/<target>/) with the library's
// own writers where there is one: valid files plus a few edge cases. The
// files carry each fuzzer's mode byte (see the fuzzers' comments).
//
//   build/fuzz/fuzz/fuzz_make_corpus fuzz/corpus
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/comm/internal/tcp_store_wire.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/data/token_file.h"

namespace fs = std::filesystem;
using nlohmann::json;
using meshtrain::DType;
using meshtrain::Tensor;

namespace {

fs::path root;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void put(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(root / target);
  std::ofstream(root / target / name, std::ios::binary) << bytes;
}

std::string with_mode(uint8_t mode, const std::string& bytes) { return std::string(1, static_cast<char>(mode)) + bytes; }

// ---- checkpoint index ----

json piece(int file, uint64_t offset, std::vector<int64_t> view, std::vector<int64_t> offsets,
           std::vector<int64_t> sizes, int64_t start, int64_t count) {
  return json{{"file", file},   {"offset", offset}, {"bytes", count * 4}, {"crc32", 305419896},
              {"view", view},   {"offsets", offsets}, {"sizes", sizes},   {"start", start},
              {"count", count}};
}

json index_of(json tensors, json files) {
  return json{{"format", "meshtrain.checkpoint"},
              {"version", 1},
              {"step", 120},
              {"metadata", json{{"model", "mlp"}, {"loss", 0.5}}},
              {"files", files},
              {"tensors", tensors}};
}

void checkpoint_index() {
  const std::string t = "checkpoint_index_fuzzer";
  const json files = json::array({json{{"name", "rank_00000.bin"}, {"bytes", 128}},
                                  json{{"name", "rank_00001.bin"}, {"bytes", 64}}});
  // w (4, 6) sharded by rows over two files; b (6) flattened in two runs; a scalar.
  json w{{"name", "0.weight"}, {"dtype", "f32"}, {"shape", {4, 6}}, {"pieces", json::array()}};
  w["pieces"].push_back(piece(0, 0, {4, 6}, {0, 0}, {2, 6}, 0, 12));
  w["pieces"].push_back(piece(1, 0, {4, 6}, {2, 0}, {2, 6}, 0, 12));
  json b{{"name", "0.bias"}, {"dtype", "f32"}, {"shape", {6}}, {"pieces", json::array()}};
  b["pieces"].push_back(piece(0, 64, {2, 3}, {0, 0}, {2, 3}, 0, 4));
  b["pieces"].push_back(piece(0, 80, {2, 3}, {0, 0}, {2, 3}, 4, 2));
  json s{{"name", "step_scale"}, {"dtype", "f32"}, {"shape", json::array()}, {"pieces", json::array()}};
  s["pieces"].push_back(piece(0, 96, {}, {}, {}, 0, 1));
  put(t, "valid_sharded.json", index_of(json::array({b, w, s}), files).dump(1));
  // An empty tensor, the defaults of view/box (empty lists) and count -1.
  json e{{"name", "empty"}, {"dtype", "f32"}, {"shape", {0, 3}}, {"pieces", json::array()}};
  e["pieces"].push_back(piece(0, 0, {}, {}, {}, 0, 0));
  json d{{"name", "dflt"}, {"dtype", "f32"}, {"shape", {2, 2}}, {"pieces", json::array()}};
  json dp = piece(0, 0, {}, {}, {}, 0, 4);
  dp["count"] = -1;
  d["pieces"].push_back(dp);
  put(t, "valid_defaults.json", index_of(json::array({d, e}), files).dump());
  put(t, "no_tensors.json", index_of(json::array(), json::array()).dump());
  // Refused: twice the same tensor, a piece past its file, a box outside its view.
  put(t, "dup_tensor.json", index_of(json::array({b, b}), files).dump());
  json far = w;
  far["pieces"][1]["offset"] = 60;
  put(t, "past_file.json", index_of(json::array({far}), files).dump());
  json out = w;
  out["pieces"][0]["offsets"] = {3, 0};
  put(t, "box_outside.json", index_of(json::array({out}), files).dump());
  put(t, "not_object.json", "[1, 2, 3]");
}

// ---- safetensors ----

void safetensors() {
  const std::string t = "safetensors_fuzzer";
  const fs::path tmp = fs::temp_directory_path() / ("make_corpus_" + std::to_string(::getpid()) + ".safetensors");
  auto file_of = [&](const std::vector<std::pair<std::string, Tensor>>& tensors,
                     const std::map<std::string, std::string>& meta) {
    meshtrain::checkpoint::save_safetensors(tmp.string(), tensors, meta);
    return slurp(tmp);
  };
  const std::string a = file_of({{"0.weight", Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3})},
                                 {"0.bias", Tensor::from_vector(std::vector<float>{0.5f, -1}, {2}, DType::bf16)},
                                 {"steps", Tensor::from_vector(std::vector<int64_t>{7}, {})}},
                                {{"format", "pt"}});
  const std::string b = file_of({{"ids", Tensor::from_vector(std::vector<int64_t>{1, 2, 3}, {3}, DType::i32)},
                                 {"mask", Tensor::from_vector(std::vector<int64_t>{1, 0, 1, 1}, {2, 2}, DType::u8)},
                                 {"h", Tensor::from_vector(std::vector<float>{1, 2}, {1, 2}, DType::f16)},
                                 {"d", Tensor::from_vector(std::vector<double>{3.25}, {1})},
                                 {"q", Tensor::from_vector(std::vector<int64_t>{-3, 4}, {2}, DType::i8)},
                                 {"none", Tensor::from_vector(std::vector<float>{}, {0, 4})}},
                                {});
  const std::string empty = file_of({}, {});
  fs::remove(tmp);
  put(t, "file_mixed.st", with_mode(0, a));
  put(t, "file_dtypes.st", with_mode(0, b));
  put(t, "file_empty.st", with_mode(0, empty));
  put(t, "file_truncated.st", with_mode(0, a.substr(0, a.size() - 3)));
  // Header-only inputs: [1][u16 data bytes][header].
  auto header_input = [](const std::string& file) {
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(file[i])} << (8 * i);
    const uint64_t data = file.size() - 8 - n;
    return std::string{'\x01', static_cast<char>(data & 0xff), static_cast<char>(data >> 8)} + file.substr(8, n);
  };
  put(t, "header_mixed.st", header_input(a));
  put(t, "header_dtypes.st", header_input(b));
  // Refused: a hole, an overlap, an offset past the data.
  put(t, "header_hole.st", std::string{'\x01', 8, 0} + R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})");
  put(t, "header_overlap.st",
      std::string{'\x01', 8, 0} +
          R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[1],"data_offsets":[4,8]}})");
  put(t, "header_zero_dims.st",
      std::string{'\x01', 0, 0} + R"({"z":{"dtype":"F64","shape":[0,65536,65536],"data_offsets":[0,0]}})");
}

// ---- token file ----

void token_file() {
  const std::string t = "token_file_fuzzer";
  const fs::path tmp = fs::temp_directory_path() / ("make_corpus_" + std::to_string(::getpid()) + ".tokens");
  auto file_of = [&](const std::vector<int32_t>& tokens, int64_t vocab) {
    meshtrain::data::write_token_file(tmp.string(), tokens, vocab);
    return slurp(tmp);
  };
  const std::string u16 = file_of({1, 5, 99, 0, 42, 42, 7, 98, 3, 2, 11, 64}, 100);
  const std::string u32 = file_of({70000, 0, 65536, 123456, 9}, 200000);
  const std::string one = file_of({0}, 1);
  fs::remove(tmp);
  put(t, "u16.tok", with_mode(0, u16));
  put(t, "u32.tok", with_mode(0, u32));
  put(t, "one_token.tok", with_mode(0, one));
  put(t, "u16_expected.tok", with_mode(2, u16));    // expected vocabulary = the header's
  put(t, "u32_mismatch.tok", with_mode(6, u32));    // expected vocabulary = the header's + 1
  put(t, "u16_fixcrc.tok", with_mode(1, u16));      // checksums recomputed by the fuzzer
  std::string bad = u16;
  bad[64 + 4] = '\x7f';  // token 0x007f = 127 >= vocabulary 100
  put(t, "token_out_of_vocab.tok", with_mode(1, bad));
  put(t, "header_only.tok", with_mode(1, u16.substr(0, 64)));
  put(t, "truncated.tok", with_mode(0, u16.substr(0, 40)));
}

// ---- IDX ----

std::string be32(uint32_t v) {
  return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                     static_cast<char>(v)};
}

std::string idx(std::vector<uint32_t> dims, const std::string& data) {
  std::string s{0, 0, 8, static_cast<char>(dims.size())};
  for (uint32_t d : dims) s += be32(d);
  return s + data;
}

std::string gzip(const std::string& s) {
  z_stream zs{};
  deflateInit2(&zs, Z_BEST_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&zs, s.size()) + 32, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(s.data()));
  zs.avail_in = static_cast<uInt>(s.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

void idx_files() {
  const std::string t = "idx_fuzzer";
  const std::string labels = idx({10}, std::string("\x09\x00\x00\x03\x00\x02\x07\x02\x05\x05", 10));
  std::string pixels;
  for (int i = 0; i < 2 * 4 * 4; ++i) pixels.push_back(static_cast<char>(i * 8));
  const std::string images = idx({2, 4, 4}, pixels);
  put(t, "labels_raw.idx", with_mode(0, labels));
  put(t, "images_raw.idx", with_mode(0, images));
  put(t, "images_gz.idx", with_mode(0, gzip(images)));  // gzip written here: the fuzzer's mode 0 keeps it
  put(t, "labels_gzip_mode.idx", with_mode(1, labels));
  put(t, "images_gzip_cut.idx", with_mode(2 | (3 << 2), images));  // compressed, then 4 bytes cut
  put(t, "images_two_members.idx", with_mode(3 | (32 << 2), images));
  put(t, "four_dims.idx", with_mode(0, idx({1, 2, 2, 2}, std::string(8, '\x11'))));
  put(t, "zero_dim.idx", with_mode(0, idx({0, 28, 28}, "")));
  put(t, "extra_byte.idx", with_mode(0, labels + "!"));
  put(t, "short.idx", with_mode(1, images.substr(0, images.size() - 5)));
  put(t, "bad_magic.idx", with_mode(0, std::string("\x00\x00\x0d\x01", 4) + be32(1) + "x"));
}

// ---- the store's wire protocol ----

namespace wire = meshtrain::comm::internal;

std::string frame(const std::function<void(wire::FrameWriter&)>& fill) {
  wire::FrameWriter w;
  fill(w);
  return w.finish("make_corpus");
}

void store_wire() {
  const std::string t = "store_wire_fuzzer";
  auto u8 = [](wire::StoreOp o) { return static_cast<uint8_t>(o); };
  const std::string hello = frame([&](auto& w) { w.u8(u8(wire::StoreOp::hello)).str("fuzz-token"); });
  const std::string requests =
      frame([&](auto& w) { w.u8(u8(wire::StoreOp::set)).str("key").str("value"); }) +
      frame([&](auto& w) { w.u8(u8(wire::StoreOp::get)).str("key").u64(1000); }) +
      frame([&](auto& w) { w.u8(u8(wire::StoreOp::add)).str("n").u64(static_cast<uint64_t>(-3)); }) +
      frame([&](auto& w) { w.u8(u8(wire::StoreOp::check)).u32(2).str("key").str("n"); }) +
      frame([&](auto& w) { w.u8(u8(wire::StoreOp::wait)).u32(1).str("missing").u64(10); }) +
      frame([&](auto& w) { w.u8(u8(wire::StoreOp::delete_key)).str("key"); });
  put(t, "token_session.bin", with_mode(1, hello + requests));
  put(t, "no_token_session.bin", with_mode(0, requests));
  put(t, "wrong_token.bin",
      with_mode(1, frame([&](auto& w) { w.u8(u8(wire::StoreOp::hello)).str("wrong"); }) + requests));
  put(t, "no_hello.bin", with_mode(1, requests));
  put(t, "long_first_frame.bin", with_mode(1, std::string("\x00\x00\x00\x04", 4) + std::string(64, 'x')));
  put(t, "parked_get.bin",
      with_mode(0, frame([&](auto& w) { w.u8(u8(wire::StoreOp::get)).str("never").u64(100000); })));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (fuzz/corpus)\n", argv[0]);
    return 2;
  }
  root = argv[1];
  checkpoint_index();
  safetensors();
  token_file();
  idx_files();
  store_wire();
  return 0;
}
