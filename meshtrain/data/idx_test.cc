#include "meshtrain/data/idx.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"

namespace meshtrain::data {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

Bytes idx_bytes(const std::vector<uint32_t>& dims, const Bytes& data, uint8_t type = 0x08) {
  Bytes out{0, 0, type, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims)
    for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<uint8_t>(d >> shift));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes pattern(size_t n) {
  Bytes b(n);
  uint32_t x = 12345;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;  // pseudo-random, so gzip cannot shrink it much
    b[i] = static_cast<uint8_t>(x >> 16);
  }
  return b;
}

void write_raw(const fs::path& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void write_gz(const fs::path& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

Bytes read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

Bytes to_bytes(const Tensor& t) {
  const uint8_t* p = t.data<uint8_t>();
  return Bytes(p, p + t.numel());
}

class IdxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("meshtrain_idx_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The message of the IoError that read_idx(path) throws.
  static std::string idx_error(const fs::path& path) {
    try {
      read_idx(path.string());
    } catch (const IoError& e) {
      EXPECT_EQ(e.op(), "read_idx");
      EXPECT_NE(std::string(e.what()).find("'" + path.string() + "'"), std::string::npos) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "read_idx(" << path << ") did not throw IoError";
    return {};
  }

  fs::path dir_;
};

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "missing \"" << (needle) << "\" in: " << (haystack)

TEST_F(IdxTest, ReadsRawAndGzipFiles) {
  const Bytes data = pattern(2 * 3 * 4);
  write_raw(dir_ / "a.idx", idx_bytes({2, 3, 4}, data));
  write_gz(dir_ / "a.idx.gz", idx_bytes({2, 3, 4}, data));
  for (const char* name : {"a.idx", "a.idx.gz"}) {
    MemoryTracker tracker;
    const IdxArray a = read_idx((dir_ / name).string(), &tracker);
    EXPECT_EQ(a.dims, (std::vector<int64_t>{2, 3, 4})) << name;
    EXPECT_EQ(a.data.shape(), (std::vector<int64_t>{2, 3, 4})) << name;
    EXPECT_EQ(a.data.dtype(), DType::u8);
    EXPECT_EQ(to_bytes(a.data), data) << name;
    EXPECT_EQ(a.data.item({1, 2, 3}), data[23]);
    EXPECT_EQ(tracker.in_use(MemoryCategory::other), 24u);
  }
  write_gz(dir_ / "labels.gz", idx_bytes({5}, {9, 0, 3, 3, 7}));
  const IdxArray l = read_idx((dir_ / "labels.gz").string());
  EXPECT_EQ(l.dims, (std::vector<int64_t>{5}));
  EXPECT_EQ(to_bytes(l.data), (Bytes{9, 0, 3, 3, 7}));
  // Two gzip members (as `cat a.gz b.gz` makes) read as one stream.
  const Bytes whole = idx_bytes({2, 3, 4}, data);
  write_gz(dir_ / "m1.gz", Bytes(whole.begin(), whole.begin() + 10));
  write_gz(dir_ / "m2.gz", Bytes(whole.begin() + 10, whole.end()));
  Bytes two = read_file(dir_ / "m1.gz");
  const Bytes second = read_file(dir_ / "m2.gz");
  two.insert(two.end(), second.begin(), second.end());
  write_raw(dir_ / "two.gz", two);
  EXPECT_EQ(to_bytes(read_idx((dir_ / "two.gz").string()).data), data);
  // Anything else after the gzip stream is an error.
  two.insert(two.end(), {'x', 'y', 'z'});
  write_raw(dir_ / "junk.gz", two);
  EXPECT_HAS(idx_error(dir_ / "junk.gz"), "has corrupt gzip data at compressed byte offset ");
  write_raw(dir_ / "empty.idx", idx_bytes({0, 28}, {}));
  EXPECT_EQ(read_idx((dir_ / "empty.idx").string()).data.numel(), 0);
}

TEST_F(IdxTest, MissingFileNamesThePathAndTheHint) {
  const fs::path path = dir_ / "train-images-idx3-ubyte.gz";
  try {
    read_idx(path.string(), nullptr, kFashionMnistInstallHint);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_HAS(e.what(), "'" + path.string() + "' does not exist");
    EXPECT_HAS(e.hint(), "sudo apt install dataset-fashion-mnist");
    EXPECT_HAS(e.hint(), "scripts/install-deps.sh");
  }
  EXPECT_HAS(idx_error(dir_), "is a directory");
}

TEST_F(IdxTest, BadMagicAndUnsupportedType) {
  write_raw(dir_ / "magic", Bytes{1, 2, 3, 4, 0, 0, 0, 0});
  EXPECT_HAS(idx_error(dir_ / "magic"), "bad magic number 0x01020304 at byte offset 0");
  write_raw(dir_ / "ndims", Bytes{0, 0, 8, 0});
  EXPECT_HAS(idx_error(dir_ / "ndims"), "bad magic number 0x00000800 at byte offset 0");
  write_raw(dir_ / "float", idx_bytes({1}, {0, 0, 0, 0}, 0x0D));
  EXPECT_HAS(idx_error(dir_ / "float"), "element type 0x0d at byte offset 2");
}

TEST_F(IdxTest, TruncatedHeaderGivesTheOffset) {
  write_raw(dir_ / "short", Bytes{0, 0, 8, 3, 0, 0});
  EXPECT_HAS(idx_error(dir_ / "short"),
             "is truncated: the size of dim 0 needs 4 bytes from byte offset 4, but the file ends at byte offset 6");
  write_raw(dir_ / "nothing", Bytes{});
  EXPECT_HAS(idx_error(dir_ / "nothing"), "the 4-byte magic number needs 4 bytes from byte offset 0");
  write_gz(dir_ / "short.gz", Bytes{0, 0, 8, 2, 0, 0, 0, 2, 0});
  EXPECT_HAS(idx_error(dir_ / "short.gz"), "the size of dim 1 needs 4 bytes from byte offset 8, but the "
                                           "decompressed data ends at byte offset 9");
}

TEST_F(IdxTest, DimsInconsistentWithTheDataSize) {
  Bytes shorter = idx_bytes({2, 3}, {1, 2, 3, 4});  // 6 bytes promised, 4 present
  write_raw(dir_ / "short", shorter);
  write_gz(dir_ / "short.gz", shorter);
  EXPECT_HAS(idx_error(dir_ / "short"), "is truncated: dims [2, 3] need 6 data bytes after the 12-byte header "
                                        "(up to byte offset 18), but the file ends at byte offset 16");
  EXPECT_HAS(idx_error(dir_ / "short.gz"), "but the decompressed data ends at byte offset 16");

  Bytes longer = idx_bytes({2, 3}, {1, 2, 3, 4, 5, 6, 7});
  write_raw(dir_ / "long", longer);
  write_gz(dir_ / "long.gz", longer);
  EXPECT_HAS(idx_error(dir_ / "long"), "dims [2, 3] need 6 data bytes after the 12-byte header (up to byte offset "
                                       "18), but the file goes on past byte offset 18 (19 bytes in all)");
  EXPECT_HAS(idx_error(dir_ / "long.gz"), "but the decompressed data goes on past byte offset 18 (19 bytes in all)");
}

TEST_F(IdxTest, CutOffAndCorruptGzip) {
  const Bytes idx = idx_bytes({100, 50}, pattern(5000));
  write_gz(dir_ / "full.gz", idx);
  const Bytes gz = read_file(dir_ / "full.gz");
  ASSERT_GT(gz.size(), 4000u);

  write_raw(dir_ / "cut.gz", Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
  const std::string cut = idx_error(dir_ / "cut.gz");
  EXPECT_HAS(cut, "is truncated: the gzip stream is cut off at byte offset ");
  EXPECT_HAS(cut, "dims [100, 50] need 5000 data bytes after the 12-byte header");

  // All the data, but not the 8-byte trailer (CRC-32 and size).
  write_raw(dir_ / "notrailer.gz", Bytes(gz.begin(), gz.end() - 8));
  EXPECT_HAS(idx_error(dir_ / "notrailer.gz"),
             "the gzip stream ends after the data at byte offset 5012 without its trailer");

  Bytes bad_crc = gz;
  bad_crc[gz.size() - 8] ^= 0xff;
  write_raw(dir_ / "crc.gz", bad_crc);
  const std::string crc = idx_error(dir_ / "crc.gz");
  EXPECT_HAS(crc, "has corrupt gzip data at compressed byte offset " + std::to_string(gz.size() - 4) +
                      ", after byte offset 5012 of the decompressed data: incorrect data check");

  // Compressible data, damaged inside the deflate stream: found before the end.
  Bytes text(20000);
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<uint8_t>("meshtrain "[i % 10] + i / 1000);
  write_gz(dir_ / "text.gz", idx_bytes({20000}, text));
  Bytes garbled = read_file(dir_ / "text.gz");
  for (size_t i = garbled.size() / 2; i < garbled.size() / 2 + 4; ++i) garbled[i] ^= 0x5a;
  write_raw(dir_ / "garbled.gz", garbled);
  const std::string garbled_error = idx_error(dir_ / "garbled.gz");
  EXPECT_HAS(garbled_error, "has corrupt gzip data at compressed byte offset ");

  EXPECT_EQ(to_bytes(read_idx((dir_ / "full.gz").string()).data), pattern(5000));
}

TEST_F(IdxTest, LoadsAFashionMnistShapedDirectory) {
  const Bytes pixels = pattern(5 * 2 * 3);
  write_gz(dir_ / "train-images-idx3-ubyte.gz", idx_bytes({5, 2, 3}, pixels));
  write_raw(dir_ / "train-labels-idx1-ubyte", idx_bytes({5}, {9, 0, 0, 3, 2}));
  MemoryTracker tracker;
  const Dataset d = load_fashion_mnist(dir_.string(), Split::train, &tracker);
  EXPECT_EQ(d.size(), 5);
  EXPECT_EQ(d.height, 2);
  EXPECT_EQ(d.width, 3);
  EXPECT_EQ(d.features(), 6);
  EXPECT_EQ(d.num_classes, 10);
  EXPECT_EQ(d.images.shape(), (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(to_bytes(d.images), pixels);
  EXPECT_EQ(to_bytes(d.labels), (Bytes{9, 0, 0, 3, 2}));
  EXPECT_EQ(d.source, (dir_ / "train-images-idx3-ubyte.gz").string());
  EXPECT_EQ(tracker.in_use(MemoryCategory::other), 35u);
  EXPECT_EQ(kFashionMnistClasses[9], "Ankle boot");

  try {
    load_fashion_mnist(dir_.string(), Split::test);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.op(), "load_fashion_mnist");
    EXPECT_HAS(e.what(), "Fashion-MNIST test split: neither '" + (dir_ / "t10k-images-idx3-ubyte").string() + ".gz'");
    EXPECT_HAS(e.hint(), "sudo apt install dataset-fashion-mnist");
  }
  try {
    load_fashion_mnist((dir_ / "nowhere").string(), Split::train);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_HAS(e.what(), "(no directory '" + (dir_ / "nowhere").string() + "')");
  }
}

TEST_F(IdxTest, FashionMnistConsistencyErrors) {
  write_gz(dir_ / "train-images-idx3-ubyte.gz", idx_bytes({5, 2, 3}, pattern(30)));
  write_gz(dir_ / "train-labels-idx1-ubyte.gz", idx_bytes({4}, {1, 2, 3, 4}));
  try {
    load_fashion_mnist(dir_.string());
    FAIL();
  } catch (const IoError& e) {
    EXPECT_HAS(e.what(), "train-images-idx3-ubyte.gz' holds 5 images but '");
    EXPECT_HAS(e.what(), "train-labels-idx1-ubyte.gz' holds 4 labels");
  }
  write_gz(dir_ / "train-labels-idx1-ubyte.gz", idx_bytes({5}, {1, 2, 3, 10, 4}));
  try {
    load_fashion_mnist(dir_.string());
    FAIL();
  } catch (const IoError& e) {
    EXPECT_HAS(e.what(), "label 10 of sample 3 (byte offset 11) is outside 0..9");
  }
  write_gz(dir_ / "train-images-idx3-ubyte.gz", idx_bytes({5, 6}, pattern(30)));
  try {
    load_fashion_mnist(dir_.string());
    FAIL();
  } catch (const IoError& e) {
    EXPECT_HAS(e.what(), "has dims [5, 6]; images need 3 dims (N, height, width)");
  }
}

// The real dataset, where Debian's dataset-fashion-mnist installs it.
TEST(FashionMnistTest, RealDatasetIfInstalled) {
  if (!fs::exists(fs::path(kFashionMnistDir) / "train-images-idx3-ubyte.gz") &&
      !fs::exists(fs::path(kFashionMnistDir) / "train-images-idx3-ubyte"))
    GTEST_SKIP() << "Fashion-MNIST is not installed at " << kFashionMnistDir << " (" << kFashionMnistInstallHint
                 << ")";
  for (Split split : {Split::train, Split::test}) {
    const Dataset d = load_fashion_mnist(std::string(kFashionMnistDir), split);
    const int64_t n = split == Split::train ? 60000 : 10000;
    EXPECT_EQ(d.size(), n);
    EXPECT_EQ(d.images.shape(), (std::vector<int64_t>{n, 784}));
    EXPECT_EQ(d.height, 28);
    EXPECT_EQ(d.width, 28);
    // Both splits start with an ankle boot (label 9), and every class has the
    // same number of samples (6000 train, 1000 test).
    EXPECT_EQ(d.labels.item({0}), 9) << split_name(split);
    std::array<int64_t, 10> counts{};
    const uint8_t* labels = d.labels.data<uint8_t>();
    for (int64_t i = 0; i < n; ++i) ++counts.at(labels[i]);
    for (int64_t c : counts) EXPECT_EQ(c, n / 10) << split_name(split);
    int max_pixel = 0;
    const uint8_t* px = d.images.data<uint8_t>();
    for (int64_t i = 0; i < 784; ++i) max_pixel = std::max<int>(max_pixel, px[i]);
    EXPECT_EQ(max_pixel, 255) << split_name(split);  // images are normalized to the full byte range
  }
}

}  // namespace
}  // namespace meshtrain::data
