// IDX files (the MNIST / Fashion-MNIST container) and the Fashion-MNIST
// dataset built from them.
//
//   IdxArray labels = read_idx("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz");
//   labels.dims;                                    // {10000}
//   Dataset train = load_fashion_mnist();           // Debian's dataset-fashion-mnist
//   train.images;                                   // (60000, 784) u8, 0..255
//   train.labels;                                   // (60000) u8, 0..9
//
// IDX format (big-endian): bytes 0-1 are zero, byte 2 is the element type
// (0x08 = unsigned byte, the only type read here), byte 3 the number of dims
// n (1..4 here); then n u32 sizes; then prod(sizes) elements, row-major, and
// nothing after them. Files may be gzip-compressed (recognized by the gzip
// magic 1f 8b; several members are read one after another, as gzip -d does)
// or raw. Byte offsets in error messages count bytes of the decompressed IDX
// stream; corrupt gzip data also gives the compressed offset where zlib's
// inflate stopped.
//
// Memory: a Dataset keeps the pixels as u8 (47 MB for the 60000 training
// images instead of 188 MB as f32); batches are converted to f32 in [0, 1]
// (x / 255, as torchvision's ToTensor) and labels to i64 only when assembled
// (see sampler.h, load_batch). Tensors are charged to the tracker, if given,
// under MemoryCategory::other.
//
// Errors are IoError naming the file: missing (with the install hint), a
// directory, unreadable, corrupt gzip data or CRC, bad magic (including 0 or
// more than 4 dims), an element type other than u8, truncated (a short read:
// the offset where the data ended, also for a gzip stream cut off before its
// trailer), more data than the dims say, labels out of range, or image and
// label counts that differ.
//
// Thread-safety: functions are pure apart from reading the files; a Dataset
// is read-only after loading and may be shared between threads.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::data {

// Where Debian's dataset-fashion-mnist package installs the files.
inline constexpr std::string_view kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// What to tell a user whose dataset is missing.
inline constexpr std::string_view kFashionMnistInstallHint =
    "install it with `sudo apt install dataset-fashion-mnist` (or run scripts/install-deps.sh), or "
    "pass the directory holding the IDX files";

struct IdxArray {
  std::vector<int64_t> dims;  // sizes from the header
  Tensor data;                // u8, shape dims, contiguous
};

// Reads one IDX file, gzip-compressed or raw. `tracker` (may be null) is
// charged for data. Throws IoError as described above; the missing-file error
// carries `missing_hint` (default: check the path).
IdxArray read_idx(const std::string& path, MemoryTracker* tracker = nullptr,
                  std::string_view missing_hint = {});

enum class Split : uint8_t { train, test };
// "train" or "test".
std::string_view split_name(Split split);

struct Dataset {
  Tensor images;            // (N, height * width) u8, 0..255, contiguous
  Tensor labels;            // (N) u8, in [0, num_classes)
  int64_t height = 0;       // 28 for Fashion-MNIST
  int64_t width = 0;        // 28
  int64_t num_classes = 0;  // 10
  std::string source;       // the images file, for messages

  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
  int64_t features() const { return height * width; }
};

// The Fashion-MNIST split from `dir`: train (60000 samples) or test (10000),
// files {train,t10k}-{images-idx3,labels-idx1}-ubyte with or without .gz
// (.gz is preferred when both exist). Throws IoError: a missing file names
// the paths tried and says how to install the dataset; images must be 3-D
// (N, H, W), labels 1-D (N) with the same N and values 0..9.
Dataset load_fashion_mnist(const std::string& dir = std::string(kFashionMnistDir), Split split = Split::train,
                           MemoryTracker* tracker = nullptr);

// The one rule from a stored pixel to a model input, for training batches
// (load_batch) and evaluation alike: x / 255 in f32, as torchvision's
// ToTensor (a division, not a multiply by the rounded f32(1/255), which
// differs in the last bit for some values).
inline float normalize_pixel(uint8_t value) { return static_cast<float>(value) / 255.0f; }

// normalize_pixel of every element: a u8 tensor (any shape and strides,
// e.g. Dataset::images.narrow(0, a, n)) -> a new contiguous f32 tensor of
// the same shape, charged to `tracker` (may be null) under `category`.
// Throws InvalidArgument for another dtype.
Tensor normalize_pixels(const Tensor& pixels, MemoryTracker* tracker = nullptr,
                        MemoryCategory category = MemoryCategory::activations);

// Features per Fashion-MNIST image (28 x 28 pixels), known before loading
// (the recipes' start-up checks size their models with it).
inline constexpr int64_t kFashionMnistFeatures = 28 * 28;

// Class names of Fashion-MNIST, indexed by label.
inline constexpr std::array<std::string_view, 10> kFashionMnistClasses = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};

}  // namespace meshtrain::data
