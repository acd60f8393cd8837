// Tensor: a strided, runtime-typed view onto shared storage; the unit every
// layer above core passes around.
//
//   MemoryTracker tracker;
//   Tensor w = Tensor::zeros({4, 6}, DType::f32, Device{}, &tracker, MemoryCategory::parameters);
//   Tensor cols = w.narrow(1, 2, 3);        // (4, 3) view: shares w's storage
//   cols.fill(1.0);                         // writes into w
//   Tensor wt = w.transpose(0, 1);          // (6, 4) view, not contiguous
//   Tensor copy = wt.contiguous();          // new storage, row-major
//   Tensor half = w.to(DType::bf16);        // new storage, rounded to nearest even
//   float* p = w.data<float>();             // throws if w is not f32
//
// Aliasing: a Tensor is a value handle (shared_ptr<Storage> + element offset +
// shape + strides + dtype). Copying a Tensor, and every view (narrow, slice,
// select, transpose, view/reshape, contiguous() of a contiguous tensor, to() to
// the same dtype), shares the storage: writes through one are seen by all.
// clone(), contiguous() of a non-contiguous tensor and to() of another dtype
// allocate new storage. Storage lives while any handle refers to it.
//
// Memory accounting: storage allocated with a MemoryTracker is charged to it
// (category given at allocation) and released when the last handle goes.
// clone()/contiguous()/to() charge the new storage to the source storage's
// tracker and category. from_blob() memory is never charged.
//
// Devices: only Device{DeviceType::cpu} is implemented. Allocating on cuda
// throws Unsupported; element access and kernels on non-cpu tensors throw
// Unsupported.
//
// Thread-safety: a Tensor handle is like a shared_ptr: distinct handles may be
// used from different threads, even when they share storage, as long as no
// thread writes elements another thread reads or writes at the same time.
// Methods never touch global state; copy_from (and clone, contiguous, to)
// splits long contiguous runs over the calling thread's compute threads
// (parallel_for.h), which changes no value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/dtype.h"
#include "meshtrain/core/memory.h"

namespace meshtrain {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static constexpr Device cpu() { return Device{DeviceType::cpu, 0}; }
  static constexpr Device cuda(int index) { return Device{DeviceType::cuda, index}; }
  bool operator==(const Device&) const = default;
  // "cpu", "cuda:1".
  std::string to_string() const;
};

// Memory for one device type. The CPU's is built in: 64-byte aligned
// operator new, with freed blocks of 1 MiB or more kept (up to
// kCpuCacheLimit bytes in all) and handed out again for a request of the
// same size: a training step frees and allocates the same large buffers
// (logits, gradients) every step, and memory the kernel must fault in and
// zero again costs more than the step's GEMM on it (docs/benchmarks.md).
// A GPU backend registers its own (a caching allocator) with
// register_allocator, so Storage, Tensor and everything above stay
// device-neutral. MemoryTracker counts what tensors hold, not the cache.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // nbytes on device `index`, aligned to Storage::kAlignment; nullptr when
  // the device is out of memory.
  virtual void* allocate(size_t nbytes, int index) = 0;
  virtual void deallocate(void* p, size_t nbytes, int index) noexcept = 0;
};
// Installs the allocator of `type` (replacing any; nullptr removes a non-cpu
// one). Call at start-up, before tensors of that type exist.
void register_allocator(DeviceType type, std::unique_ptr<DeviceAllocator> allocator);
// The built-in CPU allocator's cache: the most bytes it keeps, and what it
// keeps now (freed blocks waiting for a request of their size).
inline constexpr size_t kCpuCacheLimit = size_t{2} << 30;
size_t cpu_cached_bytes();

// A block of device memory. Owned blocks are 64-byte aligned, charged to an
// optional tracker, and freed (and released from the tracker) when the last
// shared_ptr goes. Wrapped blocks belong to someone else, who must keep them
// alive while any Storage or Tensor refers to them.
// Thread-safety: immutable after construction (the bytes are the caller's).
class Storage {
  struct Key {
    explicit Key() = default;
  };

 public:
  static constexpr size_t kAlignment = 64;

  // Uninitialized bytes on `device` (Unsupported when no allocator is
  // registered for its type, as for cuda without a GPU backend; OutOfMemory
  // when the allocation fails). `tracker`, if given, is charged
  // `nbytes` in `category` and must outlive the Storage.
  static std::shared_ptr<Storage> allocate(size_t nbytes, Device device = Device{},
                                           MemoryTracker* tracker = nullptr,
                                           MemoryCategory category = MemoryCategory::other);
  // Non-owning view of `nbytes` at `data`; never freed, never charged.
  static std::shared_ptr<Storage> wrap(void* data, size_t nbytes, Device device = Device{});

  Storage(Key, void* data, size_t nbytes, Device device, bool owned, MemoryTracker* tracker,
          MemoryCategory category);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  bool owns_memory() const { return owned_; }
  MemoryTracker* tracker() const { return tracker_; }
  MemoryCategory category() const { return category_; }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  bool owned_;
  MemoryTracker* tracker_;
  MemoryCategory category_;
};

class Tensor {
 public:
  // An undefined tensor (no storage): defined() is false, numel() is 0, and
  // every element operation throws InvalidArgument. Useful as a placeholder.
  Tensor() = default;

  // ---- creation. Shapes need sizes >= 0; an empty shape {} is a scalar. ----

  // Uninitialized contiguous tensor.
  static Tensor empty(std::vector<int64_t> shape, DType dtype, Device device = Device{},
                      MemoryTracker* tracker = nullptr,
                      MemoryCategory category = MemoryCategory::other);
  static Tensor zeros(std::vector<int64_t> shape, DType dtype, Device device = Device{},
                      MemoryTracker* tracker = nullptr,
                      MemoryCategory category = MemoryCategory::other);
  // Every element = value converted to dtype (see to() for the rules).
  static Tensor full(std::vector<int64_t> shape, double value, DType dtype, Device device = Device{},
                     MemoryTracker* tracker = nullptr,
                     MemoryCategory category = MemoryCategory::other);
  // Copies `values` (row-major) into a new tensor of `shape` and `dtype`,
  // converting each value. values.size() must equal the shape's element count.
  static Tensor from_vector(const std::vector<float>& values, std::vector<int64_t> shape,
                            DType dtype = DType::f32);
  static Tensor from_vector(const std::vector<double>& values, std::vector<int64_t> shape,
                            DType dtype = DType::f64);
  static Tensor from_vector(const std::vector<int64_t>& values, std::vector<int64_t> shape,
                            DType dtype = DType::i64);
  // Non-owning contiguous tensor over caller memory (numel * dtype_size bytes
  // at `data`), which must outlive every handle and view. Not charged.
  static Tensor from_blob(void* data, std::vector<int64_t> shape, DType dtype,
                          Device device = Device{});

  // ---- metadata. Dimension arguments may be negative (-1 is the last). ----

  bool defined() const { return storage_ != nullptr; }
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const;
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t stride(int d) const;  // in elements
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  // Row-major with no gaps (size-1 dims may have any stride). Empty tensors are contiguous.
  bool is_contiguous() const;
  int64_t storage_offset() const { return offset_; }  // in elements
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // Address of element [0, ..., 0] (storage data + offset); nullptr if undefined.
  void* data_ptr() const;
  // data_ptr() typed; throws InvalidArgument unless T matches dtype():
  // float f32, double f64, int8_t i8, int32_t i32, int64_t i64, uint8_t u8,
  // uint16_t bf16 and f16 (bit patterns; see half.h). Defined in tensor.cc for
  // exactly these T.
  template <typename T>
  T* data() const;

  // ---- views (share storage; see Aliasing above) ----

  // Elements [start, start + length) along dim. Needs 0 <= start,
  // 0 <= length and start + length <= size(dim).
  Tensor narrow(int dim, int64_t start, int64_t length) const;
  // Elements [start, end) along dim; same as narrow(dim, start, end - start).
  Tensor slice(int dim, int64_t start, int64_t end) const;
  // Index `index` of dim, which is removed: (4, 5).select(0, 2) is (5).
  Tensor select(int dim, int64_t index) const;
  // Swaps two dims (strides swap; no data moves).
  Tensor transpose(int d0, int d1) const;
  // Same elements, new shape; needs is_contiguous() (call contiguous() first
  // otherwise). One size may be -1 and is inferred. reshape() is the same
  // function under PyTorch's other name; neither ever copies.
  Tensor view(std::vector<int64_t> shape) const;
  Tensor reshape(std::vector<int64_t> shape) const { return view(std::move(shape)); }

  // ---- copies ----

  // *this when already contiguous (shares storage), else clone().
  Tensor contiguous() const;
  // New contiguous storage with the same values, dtype and device.
  Tensor clone() const;
  // New tensor of `dtype` with converted values; *this (shared) if dtype()
  // already is `dtype`. Rules: float -> float rounds to nearest even
  // (bf16/f16 via half.h; overflow gives inf, NaN stays NaN); float -> int
  // truncates toward zero and saturates at the integer range (NaN -> 0);
  // int -> int wraps (two's complement); int -> float rounds to nearest.
  Tensor to(DType dtype) const;

  // ---- in place (write into the shared storage) ----
  // These are const because const applies to the handle (shape, strides,
  // which storage), not to the elements, as for a const shared_ptr<T>; this
  // lets a temporary view be written: w.narrow(0, 1, 2).fill(0).

  // Copies src's values into this tensor's elements, converting dtype. Shapes
  // must be equal; either side may have any strides. Overlapping src and
  // destination are handled (src is copied aside first).
  void copy_from(const Tensor& src) const;
  // Every element = value converted to dtype (rules as in to()).
  void fill(double value) const;

  // ---- inspection, for tests and debugging ----

  // The element at `index` (one entry per dim, each in [0, size)), as double.
  // i64 values beyond 2^53 are rounded.
  double item(const std::vector<int64_t>& index) const;
  // All elements in row-major order, as doubles.
  std::vector<double> to_vector() const;
  // "Tensor(shape=[2, 3], dtype=f32, device=cpu)\n[[1, 2, 3],\n [4, 5, 6]]"; the
  // values are left out past 1000 elements.
  std::string to_string() const;

 private:
  Tensor(std::shared_ptr<Storage> storage, int64_t offset, std::vector<int64_t> shape,
         std::vector<int64_t> strides, DType dtype);
  // Normalizes a possibly negative dim; throws InvalidArgument naming `op`.
  int wrap_dim(int d, const char* op) const;
  void check_defined(const char* op) const;

  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;            // elements from storage_->data()
  std::vector<int64_t> shape_;    // sizes per dim
  std::vector<int64_t> strides_;  // elements per step of each dim
  DType dtype_ = DType::f32;
};

// True when a and b may share bytes: same storage and intersecting byte
// extents (conservative for interleaved strides). Undefined tensors never overlap.
bool may_overlap(const Tensor& a, const Tensor& b);

// Row-major strides for `shape`: {2, 3, 4} -> {12, 4, 1}.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);
// "[2, 3, 4]", for error messages.
std::string shape_to_string(const std::vector<int64_t>& shape);

}  // namespace meshtrain
