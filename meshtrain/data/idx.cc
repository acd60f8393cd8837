#include "meshtrain/data/idx.h"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>

#include "meshtrain/core/error.h"

namespace meshtrain::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kOp = "read_idx";
constexpr uint8_t kTypeU8 = 0x08;
constexpr int kMaxDims = 4;
// Larger payloads are treated as a corrupt header rather than allocated.
constexpr uint64_t kMaxElements = uint64_t{1} << 34;
// Deflate's largest expansion: a gzip file of n bytes holds at most 1032 n.
constexpr uint64_t kMaxInflateRatio = 1032;
// Bytes per file read. 64 KiB amortizes the read calls and stays below the
// size where allocators (glibc's, ASan's) map fresh pages per allocation.
constexpr size_t kChunk = size_t{1} << 16;

std::string in_quotes(const std::string& path) { return "'" + path + "'"; }

std::string dims_string(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

struct FileClose {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

// Sequential reader over a gzip or raw file that knows its offset in the
// decompressed stream and turns every failure into an IoError naming the file.
// It drives zlib's inflate itself (rather than gzread, which drops the
// partly decoded buffer on an error) so that a corrupt gzip stream is located
// exactly: bytes decoded before the error, and the compressed offset.
class Reader {
 public:
  Reader(const std::string& path, std::string_view missing_hint) : path_(path), in_(std::make_unique_for_overwrite<unsigned char[]>(kChunk)) {
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    if (!fs::exists(st))
      throw IoError(kOp, fmt::format("{} does not exist", in_quotes(path)),
                    missing_hint.empty() ? std::string("check the path") : std::string(missing_hint));
    if (fs::is_directory(st))
      throw IoError(kOp, fmt::format("{} is a directory, not an IDX file", in_quotes(path)),
                    "pass the path of an *-idx?-ubyte[.gz] file");
    errno = 0;
    file_.reset(std::fopen(path.c_str(), "rb"));
    if (!file_)
      throw IoError(kOp, fmt::format("cannot open {}: {}", in_quotes(path), std::strerror(errno)),
                    "check the file's permissions");
    refill();
    compressed_ = in_len_ >= 2 && in_[0] == 0x1f && in_[1] == 0x8b;  // the gzip magic
    if (compressed_) {
      if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK)
        throw IoError(kOp, fmt::format("cannot start decompressing {}", in_quotes(path)), "out of memory?");
      zs_open_ = true;
      member_open_ = true;
    } else {
      raw_size_ = static_cast<uint64_t>(fs::file_size(path, ec));
    }
  }
  ~Reader() {
    if (zs_open_) inflateEnd(&zs_);
  }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }
  bool compressed() const { return compressed_; }
  // Size of a raw file, 0 for gzip (unknown until decompressed).
  uint64_t raw_size() const { return raw_size_; }
  // True when a gzip file ended inside a member (data or trailer missing).
  bool gzip_truncated() const { return truncated_; }

  // Reads up to n bytes; fewer only at the end of the stream. Throws on a
  // read error or corrupt gzip data.
  size_t read_some(void* dst, size_t n) {
    const size_t got = compressed_ ? inflate_some(static_cast<unsigned char*>(dst), n)
                                   : copy_some(static_cast<unsigned char*>(dst), n);
    offset_ += got;
    return got;
  }

  // Reads exactly n bytes for `what`, or throws IoError giving the offset
  // where the data ended.
  void read_exact(void* dst, size_t n, const std::string& what) {
    const uint64_t start = offset_;
    if (read_some(dst, n) < n)
      throw IoError(kOp,
                    fmt::format("{} is truncated: {} needs {} bytes from byte offset {}, but the {} ends at "
                                "byte offset {}",
                                in_quotes(path_), what, n, start,
                                !compressed_ ? "file" : truncated_ ? "cut-off gzip stream" : "decompressed data",
                                offset_),
                    "the file is incomplete; download or reinstall it again");
  }

 private:
  // Reads the next block of the file into in_ (in_len_ = 0 at the end).
  void refill() {
    in_pos_ = 0;
    in_len_ = std::fread(in_.get(), 1, kChunk, file_.get());
    consumed_before_ = file_pos_;
    file_pos_ += in_len_;
    if (in_len_ == 0 && std::ferror(file_.get()))
      throw IoError(kOp, fmt::format("reading {} failed at byte offset {}: {}", in_quotes(path_), file_pos_,
                                     std::strerror(errno)),
                    "check the disk and the file");
  }

  size_t copy_some(unsigned char* dst, size_t n) {
    size_t got = 0;
    while (got < n) {
      if (in_pos_ == in_len_) {
        refill();
        if (in_len_ == 0) break;
      }
      const size_t k = std::min(n - got, in_len_ - in_pos_);
      std::memcpy(dst + got, in_.get() + in_pos_, k);
      in_pos_ += k;
      got += k;
    }
    return got;
  }

  size_t inflate_some(unsigned char* dst, size_t n) {
    size_t got = 0;
    while (got < n && !finished_) {
      if (in_pos_ == in_len_) {
        refill();
        if (in_len_ == 0) {  // end of file
          truncated_ = member_open_;
          finished_ = true;
          break;
        }
      }
      if (!member_open_) {  // another gzip member follows (as gzip -c a b > ab makes)
        inflateReset(&zs_);
        member_open_ = true;
      }
      zs_.next_in = in_.get() + in_pos_;
      zs_.avail_in = static_cast<uInt>(in_len_ - in_pos_);
      zs_.next_out = dst + got;
      zs_.avail_out = static_cast<uInt>(std::min<size_t>(n - got, UINT_MAX));
      const int ret = inflate(&zs_, Z_NO_FLUSH);
      const size_t produced = static_cast<size_t>(zs_.next_out - (dst + got));
      in_pos_ = in_len_ - zs_.avail_in;
      got += produced;
      if (ret == Z_STREAM_END) {
        member_open_ = false;
      } else if (ret != Z_OK && ret != Z_BUF_ERROR) {
        throw IoError(kOp,
                      fmt::format("{} has corrupt gzip data at compressed byte offset {}, after byte offset {} of "
                                  "the decompressed data: {}",
                                  in_quotes(path_), consumed_before_ + in_pos_, offset_ + got,
                                  zs_.msg ? zs_.msg : zError(ret)),
                      "the file is damaged; download or reinstall it again");
      }
    }
    return got;
  }

  std::string path_;
  std::unique_ptr<std::FILE, FileClose> file_;
  std::unique_ptr<unsigned char[]> in_;  // file bytes not yet consumed: [in_pos_, in_len_)
  size_t in_pos_ = 0;
  size_t in_len_ = 0;
  uint64_t file_pos_ = 0;         // file bytes read so far
  uint64_t consumed_before_ = 0;  // file offset of in_[0]
  bool compressed_ = false;
  z_stream zs_{};
  bool zs_open_ = false;
  bool member_open_ = false;  // inside a gzip member (its trailer not yet read)
  bool finished_ = false;
  bool truncated_ = false;
  uint64_t raw_size_ = 0;
  uint64_t offset_ = 0;  // decompressed bytes delivered
};

// The data is shorter (actual_end: where the stream ended) or longer
// (actual_end: total bytes) than the header's dims say.
[[noreturn]] void throw_size_mismatch(const Reader& in, const std::vector<int64_t>& dims, uint64_t header_bytes,
                                      uint64_t data_bytes, uint64_t actual_end, bool longer) {
  const std::string need = fmt::format("dims {} need {} data bytes after the {}-byte header (up to byte offset {})",
                                       dims_string(dims), data_bytes, header_bytes, header_bytes + data_bytes);
  const char* stream = in.compressed() ? "decompressed data" : "file";
  if (!longer)
    throw IoError(kOp, fmt::format("{} is truncated: {}, but the {} ends at byte offset {}", in_quotes(in.path()), need,
                                   stream, actual_end),
                  "the file is incomplete; download or reinstall it again");
  throw IoError(kOp,
                fmt::format("{}: {}, but the {} goes on past byte offset {}{}", in_quotes(in.path()), need, stream,
                            header_bytes + data_bytes,
                            fmt::format(" ({} bytes in all)", actual_end)),
                "the header's dims disagree with the file's size; is this the right file?");
}

}  // namespace

std::string_view split_name(Split split) { return split == Split::train ? "train" : "test"; }

IdxArray read_idx(const std::string& path, MemoryTracker* tracker, std::string_view missing_hint) {
  Reader in(path, missing_hint);
  uint8_t magic[4];
  in.read_exact(magic, 4, "the 4-byte magic number");
  const uint32_t magic_value = (uint32_t{magic[0]} << 24) | (uint32_t{magic[1]} << 16) |
                               (uint32_t{magic[2]} << 8) | uint32_t{magic[3]};
  if (magic[0] != 0 || magic[1] != 0 || magic[3] == 0 || magic[3] > kMaxDims)
    throw IoError(kOp,
                  fmt::format("{} has a bad magic number 0x{:08x} at byte offset 0 (an IDX file starts with two "
                              "zero bytes, a type byte and 1..{} dims)",
                              in_quotes(path), magic_value, kMaxDims),
                  "is this an IDX file (e.g. train-images-idx3-ubyte.gz)?");
  if (magic[2] != kTypeU8)
    throw IoError(kOp,
                  fmt::format("{} has element type 0x{:02x} at byte offset 2; only unsigned bytes (0x08) are "
                              "supported",
                              in_quotes(path), magic[2]),
                  "convert the file to u8 IDX");
  const int ndims = magic[3];
  IdxArray out;
  uint64_t elements = 1;
  uint64_t extent = 1;  // the same product with sizes of 0 counted as 1 (the tensor's strides)
  for (int d = 0; d < ndims; ++d) {
    uint8_t b[4];
    in.read_exact(b, 4, fmt::format("the size of dim {}", d));
    const uint32_t size = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
    out.dims.push_back(static_cast<int64_t>(size));
    elements = size == 0 ? 0 : (elements > kMaxElements / size ? kMaxElements + 1 : elements * size);
    const uint32_t stride_size = std::max<uint32_t>(size, 1);
    extent = extent > kMaxElements / stride_size ? kMaxElements + 1 : extent * stride_size;
  }
  const uint64_t header_bytes = in.offset();
  if (elements > kMaxElements || extent > kMaxElements)
    throw IoError(kOp,
                  fmt::format("{}: dims {} in the header (byte offsets 4..{}) describe more than {} elements{}",
                              in_quotes(path), dims_string(out.dims), header_bytes - 1, kMaxElements,
                              elements == 0 ? " (counting sizes of 0 as 1)" : ""),
                  "the header is corrupt; download or reinstall the file");
  // A raw file's size is known up front: check before allocating.
  if (!in.compressed() && in.raw_size() != header_bytes + elements)
    throw_size_mismatch(in, out.dims, header_bytes, elements, in.raw_size(), in.raw_size() > header_bytes + elements);

  // The data ended before `elements` bytes (in.offset() says where).
  const auto data_ends_early = [&] {
    if (in.gzip_truncated())
      throw IoError(kOp,
                    fmt::format("{} is truncated: the gzip stream is cut off at byte offset {} of the decompressed "
                                "data; dims {} need {} data bytes after the {}-byte header",
                                in_quotes(path), in.offset(), dims_string(out.dims), elements, header_bytes),
                    "the download was interrupted; download or reinstall the file");
    throw_size_mismatch(in, out.dims, header_bytes, elements, in.offset(), false);
  };
  // A gzip file cannot inflate to more than kMaxInflateRatio times its size:
  // when the dims ask for more, find where the data ends without allocating.
  std::error_code size_ec;
  const uint64_t file_bytes = in.compressed() ? static_cast<uint64_t>(fs::file_size(path, size_ec)) : 0;
  if (in.compressed() && !size_ec && elements > kMaxInflateRatio * file_bytes) {
    std::vector<uint8_t> sink(kChunk);
    while (in.read_some(sink.data(), sink.size()) != 0) {
    }
    data_ends_early();
  }

  out.data = Tensor::empty(out.dims, DType::u8, Device::cpu(), tracker, MemoryCategory::other);
  const size_t got = in.read_some(out.data.data_ptr(), static_cast<size_t>(elements));
  if (got < elements) data_ends_early();
  uint8_t extra;
  if (in.read_some(&extra, 1) != 0) {
    // Decode the rest first: a damaged gzip stream can decode to extra bytes,
    // and its CRC error is then the better explanation.
    std::vector<uint8_t> sink(kChunk);
    while (in.read_some(sink.data(), sink.size()) != 0) {
    }
    throw_size_mismatch(in, out.dims, header_bytes, elements, in.offset(), true);
  }
  if (in.gzip_truncated())  // all data present, but the gzip trailer (CRC, size) is missing
    throw IoError(kOp,
                  fmt::format("{} is truncated: the gzip stream ends after the data at byte offset {} without its "
                              "trailer (CRC and size)",
                              in_quotes(path), in.offset()),
                  "the download was interrupted; download or reinstall the file");
  return out;
}

Dataset load_fashion_mnist(const std::string& dir, Split split, MemoryTracker* tracker) {
  const char* op = "load_fashion_mnist";
  const std::string prefix = split == Split::train ? "train" : "t10k";
  const auto find = [&](const std::string& name) {
    const fs::path base = fs::path(dir) / name;
    std::error_code ec;
    for (const std::string& candidate : {base.string() + ".gz", base.string()})
      if (fs::exists(candidate, ec)) return candidate;
    throw IoError(op,
                  fmt::format("Fashion-MNIST {} split: neither '{}.gz' nor '{}' exists{}", split_name(split),
                              base.string(), base.string(),
                              fs::is_directory(dir, ec) ? "" : fmt::format(" (no directory '{}')", dir)),
                  std::string(kFashionMnistInstallHint));
  };
  const std::string images_path = find(prefix + "-images-idx3-ubyte");
  const std::string labels_path = find(prefix + "-labels-idx1-ubyte");
  IdxArray images = read_idx(images_path, tracker, kFashionMnistInstallHint);
  IdxArray labels = read_idx(labels_path, tracker, kFashionMnistInstallHint);
  if (images.dims.size() != 3)
    throw IoError(op, fmt::format("'{}' has dims {}; images need 3 dims (N, height, width)", images_path,
                                  dims_string(images.dims)),
                  "pass an images-idx3 file");
  if (labels.dims.size() != 1)
    throw IoError(op, fmt::format("'{}' has dims {}; labels need 1 dim (N)", labels_path, dims_string(labels.dims)),
                  "pass a labels-idx1 file");
  if (images.dims[0] != labels.dims[0])
    throw IoError(op,
                  fmt::format("'{}' holds {} images but '{}' holds {} labels", images_path, images.dims[0],
                              labels_path, labels.dims[0]),
                  "the two files belong to different splits or one is damaged; reinstall the dataset");
  constexpr int64_t kClasses = static_cast<int64_t>(kFashionMnistClasses.size());
  const uint8_t* l = labels.data.data<uint8_t>();
  for (int64_t i = 0; i < labels.dims[0]; ++i)
    if (l[i] >= kClasses)
      throw IoError(op,
                    fmt::format("'{}': label {} of sample {} (byte offset {}) is outside 0..{}", labels_path,
                                int{l[i]}, i, 8 + i, kClasses - 1),
                    "the labels file is damaged; reinstall the dataset");
  Dataset out;
  out.height = images.dims[1];
  out.width = images.dims[2];
  out.num_classes = kClasses;
  out.images = images.data.view({images.dims[0], out.height * out.width});
  out.labels = labels.data;
  out.source = images_path;
  return out;
}

Tensor normalize_pixels(const Tensor& pixels, MemoryTracker* tracker, MemoryCategory category) {
  if (pixels.dtype() != DType::u8)
    throw InvalidArgument("normalize_pixels", fmt::format("pixels of dtype {}", dtype_name(pixels.dtype())),
                          "pass the dataset's u8 pixels");
  const Tensor src = pixels.contiguous();  // a view of contiguous rows stays a view
  Tensor out = Tensor::empty(pixels.shape(), DType::f32, Device::cpu(), tracker, category);
  const uint8_t* in = src.data<uint8_t>();
  float* x = out.data<float>();
  const int64_t n = src.numel();
  for (int64_t i = 0; i < n; ++i) x[i] = normalize_pixel(in[i]);
  return out;
}

}  // namespace meshtrain::data
