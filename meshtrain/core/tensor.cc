#include "meshtrain/core/tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <type_traits>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/core/internal/convert.h"
#include "meshtrain/core/internal/elements.h"
#include "meshtrain/core/parallel_for.h"

namespace meshtrain {
namespace {

using internal::dispatch;

// Aligned operator new with a cache of large freed blocks by exact size
// (see tensor.h). When keeping a block would pass the limit, the largest
// cached ones are released first. Thread-safe (ranks of the threads engine
// share it); small blocks go straight to operator new and delete.
class CpuAllocator final : public DeviceAllocator {
 public:
  static constexpr size_t kMinCached = size_t{1} << 20;

  void* allocate(size_t nbytes, int) override {
    if (nbytes >= kMinCached) {
      std::lock_guard lock(mu_);
      if (auto it = free_.find(nbytes); it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        cached_ -= nbytes;
        return p;
      }
    }
    return ::operator new(nbytes, std::align_val_t{Storage::kAlignment}, std::nothrow);
  }

  void deallocate(void* p, size_t nbytes, int) noexcept override {
    if (nbytes >= kMinCached && nbytes <= kCpuCacheLimit) {
      std::lock_guard lock(mu_);
      while (cached_ + nbytes > kCpuCacheLimit && !free_.empty()) {
        auto largest = std::prev(free_.end());
        release(largest->second);
        cached_ -= largest->first;
        free_.erase(largest);
      }
      free_.emplace(nbytes, p);
      cached_ += nbytes;
      return;
    }
    release(p);
  }

  size_t cached() {
    std::lock_guard lock(mu_);
    return cached_;
  }

 private:
  static void release(void* p) noexcept { ::operator delete(p, std::align_val_t{Storage::kAlignment}); }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // by size
  size_t cached_ = 0;
};

CpuAllocator& builtin_cpu_allocator() {
  static auto* a = new CpuAllocator;  // never destroyed, like the registry
  return *a;
}

// Forwards to the built-in CPU allocator (the registry owns its entries).
class CpuAllocatorHandle final : public DeviceAllocator {
 public:
  void* allocate(size_t nbytes, int index) override { return builtin_cpu_allocator().allocate(nbytes, index); }
  void deallocate(void* p, size_t nbytes, int index) noexcept override {
    builtin_cpu_allocator().deallocate(p, nbytes, index);
  }
};

// The allocators by device type; the CPU's built in. Never destroyed:
// storages may be freed during static destruction.
std::array<std::unique_ptr<DeviceAllocator>, 2>& allocators() {
  static auto* a = [] {
    auto* t = new std::array<std::unique_ptr<DeviceAllocator>, 2>;
    (*t)[static_cast<size_t>(DeviceType::cpu)] = std::make_unique<CpuAllocatorHandle>();
    return t;
  }();
  return *a;
}

// The one place that turns a Device into memory.
void* device_allocate(Device device, size_t nbytes) {
  DeviceAllocator* a = allocators()[static_cast<size_t>(device.type)].get();
  if (a == nullptr)
    throw Unsupported("Storage::allocate", fmt::format("no allocator for device {}", device.to_string()),
                      "use Device::cpu(), or register the device's backend (register_allocator) first");
  void* p = a->allocate(nbytes, device.index);
  if (p == nullptr)
    throw OutOfMemory("Storage::allocate", fmt::format("cannot allocate {} on {}", format_bytes(nbytes), device.to_string()),
                      "reduce the batch size or model size, or shard over more ranks");
  return p;
}

void device_free(Device device, void* p, size_t nbytes) noexcept {
  if (DeviceAllocator* a = allocators()[static_cast<size_t>(device.type)].get()) a->deallocate(p, nbytes, device.index);
}

// Validates sizes and returns the element count; throws naming `op`.
int64_t checked_numel(const std::vector<int64_t>& shape, DType dtype, const char* op) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0)
      throw InvalidArgument(op, fmt::format("negative size {} in shape {}", s, shape_to_string(shape)),
                            "every size must be >= 0");
  }
  for (int64_t s : shape) {
    if (s == 0) return 0;
    if (n > (int64_t{1} << 56) / s / static_cast<int64_t>(dtype_size(dtype)))
      throw InvalidArgument(op, fmt::format("shape {} of {} is too large", shape_to_string(shape),
                                            dtype_name(dtype)),
                            "the byte size must fit in 2^56");
    n *= s;
  }
  return n;
}

void check_cpu(const Tensor& t, const char* op) {
  if (t.device().type != DeviceType::cpu)
    throw Unsupported(op, fmt::format("tensor on {} cannot be accessed from the host", t.device().to_string()),
                      "element access is implemented for cpu tensors only");
}

template <typename T>
bool dtype_matches(DType t) {
  if constexpr (std::is_same_v<T, float>) return t == DType::f32;
  else if constexpr (std::is_same_v<T, double>) return t == DType::f64;
  else if constexpr (std::is_same_v<T, int8_t>) return t == DType::i8;
  else if constexpr (std::is_same_v<T, int32_t>) return t == DType::i32;
  else if constexpr (std::is_same_v<T, int64_t>) return t == DType::i64;
  else if constexpr (std::is_same_v<T, uint8_t>) return t == DType::u8;
  else if constexpr (std::is_same_v<T, uint16_t>) return t == DType::bf16 || t == DType::f16;
  else return false;
}

template <typename T>
const char* cpp_type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, int8_t>) return "int8_t";
  else if constexpr (std::is_same_v<T, int32_t>) return "int32_t";
  else if constexpr (std::is_same_v<T, int64_t>) return "int64_t";
  else if constexpr (std::is_same_v<T, uint8_t>) return "uint8_t";
  else return "uint16_t";
}

const char* cpp_type_for(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::i8: return "int8_t";
    case DType::i32: return "int32_t";
    case DType::i64: return "int64_t";
    case DType::u8: return "uint8_t";
    case DType::bf16:
    case DType::f16: return "uint16_t";
  }
  return "?";
}

// [first, last] element offsets (relative to storage) a tensor may touch.
std::pair<int64_t, int64_t> element_extent(const Tensor& t) {
  int64_t hi = t.storage_offset();
  for (int d = 0; d < t.dim(); ++d) hi += (t.size(d) - 1) * t.stride(d);
  return {t.storage_offset(), hi};
}

template <typename V>
Tensor from_values(const std::vector<V>& values, std::vector<int64_t> shape, DType dtype) {
  const int64_t n = checked_numel(shape, dtype, "Tensor::from_vector");
  if (static_cast<size_t>(n) != values.size())
    throw InvalidArgument("Tensor::from_vector",
                          fmt::format("{} values for shape {} ({} elements)", values.size(),
                                      shape_to_string(shape), n),
                          "pass exactly one value per element, row-major");
  Tensor t = Tensor::empty(std::move(shape), dtype);
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(t.data_ptr());
    for (int64_t i = 0; i < n; ++i) p[i] = internal::convert<T>(values[static_cast<size_t>(i)]);
  });
  return t;
}

}  // namespace

std::string Device::to_string() const {
  if (type == DeviceType::cpu) return "cpu";
  return fmt::format("cuda:{}", index);
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

bool may_overlap(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.storage() != b.storage()) return false;
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = element_extent(a);
  const auto [b0, b1] = element_extent(b);
  const int64_t ea = static_cast<int64_t>(dtype_size(a.dtype()));
  const int64_t eb = static_cast<int64_t>(dtype_size(b.dtype()));
  // Byte ranges [a0*ea, (a1+1)*ea) and [b0*eb, (b1+1)*eb).
  return a0 * ea < (b1 + 1) * eb && b0 * eb < (a1 + 1) * ea;
}

// ---- Storage ----

Storage::Storage(Key, void* data, size_t nbytes, Device device, bool owned, MemoryTracker* tracker,
                 MemoryCategory category)
    : data_(data), nbytes_(nbytes), device_(device), owned_(owned), tracker_(tracker), category_(category) {}

size_t cpu_cached_bytes() { return builtin_cpu_allocator().cached(); }

void register_allocator(DeviceType type, std::unique_ptr<DeviceAllocator> allocator) {
  if (!allocator && type == DeviceType::cpu)
    throw InvalidArgument("register_allocator", "a null allocator for the cpu", "pass a DeviceAllocator");
  allocators()[static_cast<size_t>(type)] = std::move(allocator);
}

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, Device device, MemoryTracker* tracker,
                                           MemoryCategory category) {
  void* p = device_allocate(device, nbytes);
  std::shared_ptr<Storage> s;
  try {
    s = std::make_shared<Storage>(Key{}, p, nbytes, device, true, tracker, category);
  } catch (...) {
    device_free(device, p, nbytes);
    throw;
  }
  if (tracker != nullptr) tracker->allocate(category, nbytes);
  return s;
}

std::shared_ptr<Storage> Storage::wrap(void* data, size_t nbytes, Device device) {
  return std::make_shared<Storage>(Key{}, data, nbytes, device, false, nullptr, MemoryCategory::other);
}

Storage::~Storage() {
  if (!owned_) return;
  device_free(device_, data_, nbytes_);
  if (tracker_ != nullptr) {
    // A destructor must not throw; a mismatch here means the tracker was
    // reset or charged by hand, which the tracker's own tests catch.
    try {
      tracker_->release(category_, nbytes_);
    } catch (const Error&) {
    }
  }
}

// ---- Tensor: creation ----

Tensor::Tensor(std::shared_ptr<Storage> storage, int64_t offset, std::vector<int64_t> shape,
               std::vector<int64_t> strides, DType dtype)
    : storage_(std::move(storage)),
      offset_(offset),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      dtype_(dtype) {}

Tensor Tensor::empty(std::vector<int64_t> shape, DType dtype, Device device, MemoryTracker* tracker,
                     MemoryCategory category) {
  const int64_t n = checked_numel(shape, dtype, "Tensor::empty");
  auto storage = Storage::allocate(static_cast<size_t>(n) * dtype_size(dtype), device, tracker, category);
  std::vector<int64_t> strides = contiguous_strides(shape);
  return Tensor(std::move(storage), 0, std::move(shape), std::move(strides), dtype);
}

Tensor Tensor::zeros(std::vector<int64_t> shape, DType dtype, Device device, MemoryTracker* tracker,
                     MemoryCategory category) {
  Tensor t = empty(std::move(shape), dtype, device, tracker, category);
  t.fill(0.0);  // all-zero bytes are 0 in every dtype, but fill keeps the device switch in one place
  return t;
}

Tensor Tensor::full(std::vector<int64_t> shape, double value, DType dtype, Device device,
                    MemoryTracker* tracker, MemoryCategory category) {
  Tensor t = empty(std::move(shape), dtype, device, tracker, category);
  t.fill(value);
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, std::vector<int64_t> shape, DType dtype) {
  return from_values(values, std::move(shape), dtype);
}
Tensor Tensor::from_vector(const std::vector<double>& values, std::vector<int64_t> shape, DType dtype) {
  return from_values(values, std::move(shape), dtype);
}
Tensor Tensor::from_vector(const std::vector<int64_t>& values, std::vector<int64_t> shape, DType dtype) {
  return from_values(values, std::move(shape), dtype);
}

Tensor Tensor::from_blob(void* data, std::vector<int64_t> shape, DType dtype, Device device) {
  const int64_t n = checked_numel(shape, dtype, "Tensor::from_blob");
  if (data == nullptr && n > 0)
    throw InvalidArgument("Tensor::from_blob",
                          fmt::format("null data for shape {}", shape_to_string(shape)),
                          "pass the address of numel * dtype_size bytes");
  auto storage = Storage::wrap(data, static_cast<size_t>(n) * dtype_size(dtype), device);
  std::vector<int64_t> strides = contiguous_strides(shape);
  return Tensor(std::move(storage), 0, std::move(shape), std::move(strides), dtype);
}

// ---- Tensor: metadata ----

int Tensor::wrap_dim(int d, const char* op) const {
  const int n = dim();
  if (d < -n || d >= n)
    throw InvalidArgument(op, fmt::format("dim {} out of range for a {}-d tensor of shape {}", d, n,
                                          shape_to_string(shape_)),
                          n == 0 ? "a 0-d tensor has no dims" : fmt::format("use a dim in [{}, {}]", -n, n - 1));
  return d < 0 ? d + n : d;
}

void Tensor::check_defined(const char* op) const {
  if (!defined())
    throw InvalidArgument(op, "the tensor is undefined (default-constructed)",
                          "create it with Tensor::empty, zeros, full, from_vector or from_blob");
}

int64_t Tensor::size(int d) const { return shape_[static_cast<size_t>(wrap_dim(d, "Tensor::size"))]; }

int64_t Tensor::stride(int d) const {
  return strides_[static_cast<size_t>(wrap_dim(d, "Tensor::stride"))];
}

int64_t Tensor::numel() const {
  if (!defined()) return 0;
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

Device Tensor::device() const { return storage_ ? storage_->device() : Device{}; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (size_t d = shape_.size(); d-- > 0;) {
    if (shape_[d] != 1 && strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

void* Tensor::data_ptr() const {
  if (!storage_) return nullptr;
  return static_cast<std::byte*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

template <typename T>
T* Tensor::data() const {
  check_defined("Tensor::data");
  if (!dtype_matches<T>(dtype_))
    throw InvalidArgument("Tensor::data", fmt::format("data<{}>() on a {} tensor", cpp_type_name<T>(),
                                                      dtype_name(dtype_)),
                          fmt::format("use data<{}>() or convert with to()", cpp_type_for(dtype_)));
  return static_cast<T*>(data_ptr());
}

template float* Tensor::data<float>() const;
template double* Tensor::data<double>() const;
template int8_t* Tensor::data<int8_t>() const;
template int32_t* Tensor::data<int32_t>() const;
template int64_t* Tensor::data<int64_t>() const;
template uint8_t* Tensor::data<uint8_t>() const;
template uint16_t* Tensor::data<uint16_t>() const;

// ---- Tensor: views ----

Tensor Tensor::narrow(int d, int64_t start, int64_t length) const {
  check_defined("Tensor::narrow");
  const int dd = wrap_dim(d, "Tensor::narrow");
  const int64_t n = shape_[static_cast<size_t>(dd)];
  if (start < 0 || length < 0 || start > n - length)
    throw InvalidArgument("Tensor::narrow",
                          fmt::format("start {} and length {} out of range for size {} of dim {} (shape {})",
                                      start, length, n, dd, shape_to_string(shape_)),
                          "need 0 <= start, 0 <= length and start + length <= size");
  Tensor t = *this;
  t.offset_ += start * strides_[static_cast<size_t>(dd)];
  t.shape_[static_cast<size_t>(dd)] = length;
  return t;
}

Tensor Tensor::slice(int d, int64_t start, int64_t end) const {
  if (end < start)
    throw InvalidArgument("Tensor::slice", fmt::format("end {} < start {} on dim {}", end, start, d),
                          "slice takes [start, end) with start <= end");
  return narrow(d, start, end - start);
}

Tensor Tensor::select(int d, int64_t index) const {
  check_defined("Tensor::select");
  const int dd = wrap_dim(d, "Tensor::select");
  const size_t ud = static_cast<size_t>(dd);
  if (index < 0 || index >= shape_[ud])
    throw InvalidArgument("Tensor::select",
                          fmt::format("index {} out of range for size {} of dim {} (shape {})", index,
                                      shape_[ud], dd, shape_to_string(shape_)),
                          "need 0 <= index < size");
  Tensor t = *this;
  t.offset_ += index * strides_[ud];
  t.shape_.erase(t.shape_.begin() + dd);
  t.strides_.erase(t.strides_.begin() + dd);
  return t;
}

Tensor Tensor::transpose(int d0, int d1) const {
  check_defined("Tensor::transpose");
  const size_t a = static_cast<size_t>(wrap_dim(d0, "Tensor::transpose"));
  const size_t b = static_cast<size_t>(wrap_dim(d1, "Tensor::transpose"));
  Tensor t = *this;
  std::swap(t.shape_[a], t.shape_[b]);
  std::swap(t.strides_[a], t.strides_[b]);
  return t;
}

Tensor Tensor::view(std::vector<int64_t> shape) const {
  check_defined("Tensor::view");
  if (!is_contiguous())
    throw InvalidArgument("Tensor::view",
                          fmt::format("tensor of shape {} with strides {} is not contiguous",
                                      shape_to_string(shape_), shape_to_string(strides_)),
                          "call contiguous() first (it copies)");
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1 && infer < 0) {
      infer = static_cast<int>(i);
    } else if (shape[i] < 0) {
      throw InvalidArgument("Tensor::view", fmt::format("invalid size {} in shape {}", shape[i],
                                                        shape_to_string(shape)),
                            "sizes are >= 0, with at most one -1 to infer");
    } else {
      known *= shape[i];
    }
  }
  const int64_t n = numel();
  if (infer >= 0) {
    if (known == 0 || n % known != 0)
      throw InvalidArgument("Tensor::view",
                            fmt::format("cannot infer -1 in {} for {} elements", shape_to_string(shape), n),
                            "the other sizes must divide the element count");
    shape[static_cast<size_t>(infer)] = n / known;
    known = n;
  }
  if (known != n)
    throw InvalidArgument("Tensor::view",
                          fmt::format("shape {} has {} elements, tensor of shape {} has {}",
                                      shape_to_string(shape), known, shape_to_string(shape_), n),
                          "the element count must stay the same");
  Tensor t = *this;
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  return t;
}

// ---- Tensor: copies ----

Tensor Tensor::contiguous() const {
  check_defined("Tensor::contiguous");
  return is_contiguous() ? *this : clone();
}

Tensor Tensor::clone() const {
  check_defined("Tensor::clone");
  Tensor t = empty(shape_, dtype_, device(), storage_->tracker(), storage_->category());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  check_defined("Tensor::to");
  if (dtype == dtype_) return *this;
  Tensor t = empty(shape_, dtype, device(), storage_->tracker(), storage_->category());
  t.copy_from(*this);
  return t;
}

// Elements per thread below which a contiguous copy or conversion stays on
// the calling thread (parallel_for's grain).
constexpr int64_t kCopyGrain = 1 << 16;

namespace {

// n contiguous elements converted (vector kernels for f32 <-> bf16/f16). A
// function template, not a branch inside copy_from's nested generic
// lambdas, where clang 14 checks the discarded branches too.
template <typename S, typename D>
void convert_run(const S* p, D* d, size_t n) {
  if constexpr (std::is_same_v<D, S>)
    std::copy(p, p + n, d);
  else if constexpr (std::is_same_v<D, internal::F16> && std::is_same_v<S, float>)
    internal::f32_to_f16(p, reinterpret_cast<uint16_t*>(d), n);
  else if constexpr (std::is_same_v<D, internal::Bf16> && std::is_same_v<S, float>)
    internal::f32_to_bf16(p, reinterpret_cast<uint16_t*>(d), n);
  else if constexpr (std::is_same_v<D, float> && std::is_same_v<S, internal::F16>)
    internal::f16_to_f32(reinterpret_cast<const uint16_t*>(p), d, n);
  else if constexpr (std::is_same_v<D, float> && std::is_same_v<S, internal::Bf16>)
    internal::bf16_to_f32(reinterpret_cast<const uint16_t*>(p), d, n);
  else
    for (size_t i = 0; i < n; ++i) d[i] = internal::convert<D>(p[i]);
}

}  // namespace

void Tensor::copy_from(const Tensor& src) const {
  check_defined("Tensor::copy_from");
  src.check_defined("Tensor::copy_from");
  check_cpu(*this, "Tensor::copy_from");
  check_cpu(src, "Tensor::copy_from");
  if (src.shape_ != shape_)
    throw InvalidArgument("Tensor::copy_from",
                          fmt::format("source shape {} differs from destination shape {}",
                                      shape_to_string(src.shape_), shape_to_string(shape_)),
                          "copy between tensors of the same shape (narrow or view one first)");
  if (may_overlap(*this, src)) {
    if (src.dtype_ == dtype_ && src.offset_ == offset_ && src.strides_ == strides_) return;  // self-copy
    copy_from(src.clone());
    return;
  }
  const std::array<const std::vector<int64_t>*, 2> strides{&strides_, &src.strides_};
  dispatch(dtype_, [&](auto dtag) {
    using D = decltype(dtag);
    D* dst = static_cast<D*>(data_ptr());
    dispatch(src.dtype_, [&](auto stag) {
      using S = decltype(stag);
      const S* s = static_cast<const S*>(src.data_ptr());
      internal::for_each_row<2>(shape_, strides, [&](auto off, int64_t len, auto inner) {
        D* d = dst + off[0];
        const S* p = s + off[1];
        if (inner[0] == 1 && inner[1] == 1) {  // unit strides: vector code, long runs over the rank's threads
          const auto run = [&](int64_t b, int64_t e) { convert_run(p + b, d + b, static_cast<size_t>(e - b)); };
          if (len >= 2 * kCopyGrain)
            parallel_for(len, kCopyGrain, run);
          else
            run(0, len);  // short rows (narrowed views): no dispatch per row
          return;
        }
        for (int64_t i = 0; i < len; ++i) d[i * inner[0]] = internal::convert<D>(p[i * inner[1]]);
      });
    });
  });
}

void Tensor::fill(double value) const {
  check_defined("Tensor::fill");
  check_cpu(*this, "Tensor::fill");
  const std::array<const std::vector<int64_t>*, 1> strides{&strides_};
  dispatch(dtype_, [&](auto tag) {
    using T = decltype(tag);
    const T v = internal::from_double<T>(value);
    T* base = static_cast<T*>(data_ptr());
    if (is_contiguous()) {  // a gradient's zeroing: a plain fill over the rank's threads
      parallel_for(numel(), int64_t{1} << 18, [&](int64_t b, int64_t e) { std::fill(base + b, base + e, v); });
      return;
    }
    internal::for_each_row<1>(shape_, strides, [&](auto off, int64_t len, auto inner) {
      T* d = base + off[0];
      for (int64_t i = 0; i < len; ++i) d[i * inner[0]] = v;
    });
  });
}

// ---- Tensor: inspection ----

double Tensor::item(const std::vector<int64_t>& index) const {
  check_defined("Tensor::item");
  check_cpu(*this, "Tensor::item");
  if (index.size() != shape_.size())
    throw InvalidArgument("Tensor::item",
                          fmt::format("index {} has {} entries for a {}-d tensor of shape {}",
                                      shape_to_string(index), index.size(), dim(), shape_to_string(shape_)),
                          "give one index per dim");
  int64_t off = 0;
  for (size_t d = 0; d < index.size(); ++d) {
    if (index[d] < 0 || index[d] >= shape_[d])
      throw InvalidArgument("Tensor::item",
                            fmt::format("index {} out of range for shape {} (dim {})", shape_to_string(index),
                                        shape_to_string(shape_), d),
                            "each index must be in [0, size)");
    off += index[d] * strides_[d];
  }
  return dispatch(dtype_, [&](auto tag) -> double {
    using T = decltype(tag);
    const T v = static_cast<const T*>(data_ptr())[off];
    if constexpr (internal::kIsHalf<T>) return internal::to_double(v);
    else return static_cast<double>(v);
  });
}

std::vector<double> Tensor::to_vector() const {
  check_defined("Tensor::to_vector");
  check_cpu(*this, "Tensor::to_vector");
  std::vector<double> out;
  out.reserve(static_cast<size_t>(numel()));
  const std::array<const std::vector<int64_t>*, 1> strides{&strides_};
  dispatch(dtype_, [&](auto tag) {
    using T = decltype(tag);
    const T* base = static_cast<const T*>(data_ptr());
    internal::for_each_row<1>(shape_, strides, [&](auto off, int64_t len, auto inner) {
      for (int64_t i = 0; i < len; ++i) {
        const T v = base[off[0] + i * inner[0]];
        if constexpr (internal::kIsHalf<T>) out.push_back(internal::to_double(v));
        else out.push_back(static_cast<double>(v));
      }
    });
  });
  return out;
}

std::string Tensor::to_string() const {
  if (!defined()) return "Tensor(undefined)";
  std::string s = fmt::format("Tensor(shape={}, dtype={}, device={})", shape_to_string(shape_),
                              dtype_name(dtype_), device().to_string());
  constexpr int64_t kMaxShown = 1000;
  if (numel() > kMaxShown || device().type != DeviceType::cpu) return s;
  const std::vector<double> v = to_vector();
  const bool integral = !is_floating(dtype_);
  size_t next = 0;
  // Prints dims [d, dim()) of the block starting at v[next], PyTorch style.
  auto print = [&](auto&& self, size_t d) -> std::string {
    if (d == shape_.size()) {
      const double x = v[next++];
      return integral ? fmt::format("{}", static_cast<int64_t>(x)) : fmt::format("{:g}", x);
    }
    std::string out = "[";
    for (int64_t i = 0; i < shape_[d]; ++i) {
      if (i > 0) out += d + 1 == shape_.size() ? ", " : ",\n" + std::string(d + 1, ' ');
      out += self(self, d + 1);
    }
    return out + "]";
  };
  return s + "\n" + print(print, 0);
}

}  // namespace meshtrain
