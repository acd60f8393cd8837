#include "meshtrain/core/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/half.h"

namespace meshtrain {
namespace {

// (rows, cols) f32 tensor with element (i, j) = 10 * i + j.
Tensor iota2d(int64_t rows, int64_t cols, DType dtype = DType::f32) {
  std::vector<double> v;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) v.push_back(static_cast<double>(10 * i + j));
  return Tensor::from_vector(v, {rows, cols}, dtype);
}

// Runs f, expects InvalidArgument from `op` whose message mentions `needle`.
template <typename F>
void expect_invalid(F f, const std::string& op, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected InvalidArgument from " << op;
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_FALSE(e.hint().empty()) << e.what();
  }
}

TEST(TensorTest, EmptyHasShapeStridesAndSizes) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::bf16);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.dtype(), DType::bf16);
  EXPECT_EQ(t.device(), Device::cpu());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % Storage::kAlignment, 0u);
}

TEST(TensorTest, ScalarAndZeroSizedShapes) {
  Tensor s = Tensor::full({}, 2.5, DType::f64);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.item({}), 2.5);
  Tensor z = Tensor::zeros({3, 0}, DType::f32);
  EXPECT_EQ(z.numel(), 0);
  EXPECT_TRUE(z.is_contiguous());
  EXPECT_TRUE(z.to_vector().empty());
  EXPECT_EQ(Tensor().numel(), 0);
  EXPECT_FALSE(Tensor().defined());
}

TEST(TensorTest, CreationChecksArguments) {
  expect_invalid([] { Tensor::empty({2, -3}, DType::f32); }, "Tensor::empty", "-3");
  expect_invalid([] { Tensor::from_vector(std::vector<float>{1, 2, 3}, {2, 2}); }, "Tensor::from_vector",
                 "3 values");
  expect_invalid([] { Tensor::from_blob(nullptr, {4}, DType::f32); }, "Tensor::from_blob", "null");
  expect_invalid([] { Tensor::empty({int64_t{1} << 40, int64_t{1} << 30}, DType::f32); }, "Tensor::empty",
                 "too large");
  expect_invalid([] { Tensor().clone(); }, "Tensor::clone", "undefined");
}

TEST(TensorTest, CudaAllocationIsUnsupportedForNow) {
  EXPECT_THROW(Tensor::empty({4}, DType::f32, Device::cuda(0)), Unsupported);
  EXPECT_EQ(Device::cuda(1).to_string(), "cuda:1");
  float host[2] = {1, 2};
  Tensor wrapped = Tensor::from_blob(host, {2}, DType::f32, Device::cuda(0));
  EXPECT_THROW(wrapped.item({0}), Unsupported);
}

TEST(TensorTest, FromVectorConvertsToAnyDType) {
  const std::vector<float> v{1.5f, -2.75f, 3.0f};
  EXPECT_EQ(Tensor::from_vector(v, {3}).to_vector(), (std::vector<double>{1.5, -2.75, 3.0}));
  EXPECT_EQ(Tensor::from_vector(v, {3}, DType::i32).to_vector(), (std::vector<double>{1, -2, 3}));
  EXPECT_EQ(Tensor::from_vector(v, {3}, DType::bf16).to_vector(), (std::vector<double>{1.5, -2.75, 3.0}));
  const std::vector<int64_t> big{int64_t{1} << 60, -7};
  Tensor i = Tensor::from_vector(big, {2});
  EXPECT_EQ(i.dtype(), DType::i64);
  EXPECT_EQ(i.data<int64_t>()[0], int64_t{1} << 60);
  EXPECT_EQ(i.data<int64_t>()[1], -7);
  Tensor d = Tensor::from_vector(std::vector<double>{0.1, 0.2}, {1, 2});
  EXPECT_EQ(d.dtype(), DType::f64);
  EXPECT_EQ(d.item({0, 1}), 0.2);
}

TEST(TensorTest, TypedDataChecksTheDType) {
  Tensor f = Tensor::zeros({2}, DType::f32);
  EXPECT_EQ(f.data<float>(), f.data_ptr());
  expect_invalid([&] { f.data<double>(); }, "Tensor::data", "data<double>() on a f32 tensor");
  Tensor h = Tensor::full({2}, 1.0, DType::bf16);
  EXPECT_EQ(h.data<uint16_t>()[0], 0x3f80);
  EXPECT_EQ(Tensor::full({1}, 1.0, DType::f16).data<uint16_t>()[0], 0x3c00);
  EXPECT_THROW(h.data<float>(), InvalidArgument);
  EXPECT_EQ(Tensor::full({1}, -3, DType::i8).data<int8_t>()[0], -3);
  EXPECT_EQ(Tensor::full({1}, 200, DType::u8).data<uint8_t>()[0], 200);
  EXPECT_EQ(Tensor::full({1}, 7, DType::i32).data<int32_t>()[0], 7);
}

TEST(TensorTest, StorageIsChargedToTrackerAndReleasedWithLastHandle) {
  MemoryTracker tracker;
  {
    Tensor w = Tensor::empty({8, 16}, DType::f32, Device{}, &tracker, MemoryCategory::parameters);
    EXPECT_EQ(tracker.in_use(MemoryCategory::parameters), 512u);
    Tensor view = w.narrow(0, 2, 3).transpose(0, 1);  // views are free
    Tensor alias = w;
    EXPECT_EQ(tracker.total_in_use(), 512u);
    Tensor copy = view.clone();  // same tracker and category as the source
    EXPECT_EQ(tracker.in_use(MemoryCategory::parameters), 512u + 3 * 16 * 4);
    Tensor half = w.to(DType::bf16);
    EXPECT_EQ(tracker.in_use(MemoryCategory::parameters), 512u + 192u + 256u);
    Tensor act = Tensor::zeros({10}, DType::f64, Device{}, &tracker, MemoryCategory::activations);
    EXPECT_EQ(tracker.in_use(MemoryCategory::activations), 80u);
    w = Tensor();
    alias = Tensor();
    EXPECT_EQ(tracker.in_use(MemoryCategory::parameters), 960u);  // `view` keeps w's storage
  }
  EXPECT_EQ(tracker.total_in_use(), 0u);
  EXPECT_EQ(tracker.total_peak(), 960u + 80u);
  EXPECT_EQ(tracker.peak(MemoryCategory::parameters), 960u);
}

TEST(TensorTest, FromBlobSharesCallerMemoryAndIsNotCharged) {
  std::vector<float> host(6, 0.0f);
  Tensor t = Tensor::from_blob(host.data(), {2, 3}, DType::f32);
  EXPECT_FALSE(t.storage()->owns_memory());
  EXPECT_EQ(t.storage()->tracker(), nullptr);
  t.narrow(1, 1, 1).fill(4.0);
  EXPECT_EQ(host, (std::vector<float>{0, 4, 0, 0, 4, 0}));
  host[5] = 9.0f;
  EXPECT_EQ(t.item({1, 2}), 9.0);
}

TEST(TensorTest, CopiesOfAHandleAndViewsShareStorage) {
  Tensor a = iota2d(3, 4);
  Tensor b = a;
  b.fill(1.0);
  EXPECT_EQ(a.item({2, 3}), 1.0);
  Tensor c = a.clone();
  c.fill(5.0);
  EXPECT_EQ(a.item({2, 3}), 1.0);
  EXPECT_NE(c.storage(), a.storage());
}

TEST(TensorTest, NarrowAlongEveryDim) {
  Tensor t = iota2d(4, 5);
  Tensor rows = t.narrow(0, 1, 2);
  EXPECT_EQ(rows.shape(), (std::vector<int64_t>{2, 5}));
  EXPECT_TRUE(rows.is_contiguous());
  EXPECT_EQ(rows.storage_offset(), 5);
  EXPECT_EQ(rows.item({1, 4}), 24.0);
  Tensor cols = t.narrow(-1, 2, 3);
  EXPECT_EQ(cols.shape(), (std::vector<int64_t>{4, 3}));
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(cols.to_vector(), (std::vector<double>{2, 3, 4, 12, 13, 14, 22, 23, 24, 32, 33, 34}));
  EXPECT_EQ(static_cast<float*>(cols.data_ptr()), t.data<float>() + 2);
  EXPECT_EQ(t.narrow(1, 5, 0).numel(), 0);  // empty at the end is fine
  expect_invalid([&] { t.narrow(1, 3, 3); }, "Tensor::narrow", "start 3 and length 3");
  expect_invalid([&] { t.narrow(0, -1, 2); }, "Tensor::narrow", "start -1");
  expect_invalid([&] { t.narrow(2, 0, 1); }, "Tensor::narrow", "dim 2 out of range");
}

TEST(TensorTest, SliceSelectAndTranspose) {
  Tensor t = iota2d(4, 5);
  EXPECT_EQ(t.slice(1, 1, 3).to_vector(), (std::vector<double>{1, 2, 11, 12, 21, 22, 31, 32}));
  expect_invalid([&] { t.slice(0, 3, 2); }, "Tensor::slice", "end 2 < start 3");
  Tensor col = t.select(1, 3);
  EXPECT_EQ(col.shape(), (std::vector<int64_t>{4}));
  EXPECT_EQ(col.to_vector(), (std::vector<double>{3, 13, 23, 33}));
  expect_invalid([&] { t.select(0, 4); }, "Tensor::select", "index 4");
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.shape(), (std::vector<int64_t>{5, 4}));
  EXPECT_EQ(tt.strides(), (std::vector<int64_t>{1, 5}));
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.item({3, 2}), 23.0);
  EXPECT_TRUE(tt.transpose(1, 0).is_contiguous());
}

TEST(TensorTest, ViewNeedsContiguousAndInfersOneSize) {
  Tensor t = iota2d(4, 6);
  Tensor v = t.view({2, -1, 3});
  EXPECT_EQ(v.shape(), (std::vector<int64_t>{2, 4, 3}));
  EXPECT_EQ(v.storage(), t.storage());
  EXPECT_EQ(v.item({1, 3, 2}), 35.0);
  EXPECT_EQ(t.reshape({24}).item({23}), 35.0);
  expect_invalid([&] { t.view({5, -1}); }, "Tensor::view", "cannot infer");
  expect_invalid([&] { t.view({5, 5}); }, "Tensor::view", "25 elements");
  expect_invalid([&] { t.transpose(0, 1).view({24}); }, "Tensor::view", "not contiguous");
  try {
    t.transpose(0, 1).reshape({24});
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.hint().find("contiguous()"), std::string::npos);
  }
}

TEST(TensorTest, ContiguousCopiesOnlyWhenNeeded) {
  Tensor t = iota2d(3, 4);
  EXPECT_EQ(t.contiguous().storage(), t.storage());
  Tensor c = t.transpose(0, 1).contiguous();
  EXPECT_NE(c.storage(), t.storage());
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_vector(), (std::vector<double>{0, 10, 20, 1, 11, 21, 2, 12, 22, 3, 13, 23}));
}

TEST(TensorTest, CopyFromAnyStridesConvertsDType) {
  Tensor src = iota2d(3, 4, DType::f64).transpose(0, 1);  // (4, 3), strided
  Tensor base = Tensor::zeros({4, 6}, DType::i32);
  Tensor dst = base.narrow(1, 1, 3);
  dst.copy_from(src);
  EXPECT_EQ(dst.to_vector(), (std::vector<double>{0, 10, 20, 1, 11, 21, 2, 12, 22, 3, 13, 23}));
  EXPECT_EQ(base.select(1, 0).to_vector(), (std::vector<double>{0, 0, 0, 0}));  // untouched
  EXPECT_EQ(base.select(1, 4).to_vector(), (std::vector<double>{0, 0, 0, 0}));
  expect_invalid([&] { dst.copy_from(iota2d(3, 4)); }, "Tensor::copy_from", "[3, 4]");
}

TEST(TensorTest, OverlappingCopyBehavesLikeMemmove) {
  Tensor t = Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {6});
  t.narrow(0, 1, 5).copy_from(t.narrow(0, 0, 5));
  EXPECT_EQ(t.to_vector(), (std::vector<double>{0, 0, 1, 2, 3, 4}));
  Tensor m = iota2d(3, 3);
  m.copy_from(m.transpose(0, 1));  // in-place transpose via a copy aside
  EXPECT_EQ(m.to_vector(), (std::vector<double>{0, 10, 20, 1, 11, 21, 2, 12, 22}));
}

TEST(TensorTest, ToFloatingRoundsToNearestEven) {
  Tensor f = Tensor::from_vector(std::vector<float>{1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 70000.0f, -0.0f}, {4});
  Tensor b = f.to(DType::bf16);
  EXPECT_EQ(b.data<uint16_t>()[0], 0x3f80);
  EXPECT_EQ(b.data<uint16_t>()[1], 0x3f82);
  Tensor h = f.to(DType::f16);
  EXPECT_TRUE(std::isinf(h.item({2})));
  EXPECT_EQ(h.data<uint16_t>()[3], 0x8000);
  EXPECT_EQ(f.to(DType::f32).storage(), f.storage());  // same dtype: shared
  EXPECT_EQ(h.to(DType::f32).item({0}), 1.0 + 0x1p-8);  // exact in f16 (10 mantissa bits)
}

// f64 -> bf16 must round once: 1 + 2^-8 + 2^-30 is above the tie between 1
// and 1 + 2^-7, but rounding through f32 first would land on the tie itself.
TEST(TensorTest, DoubleToHalfAvoidsDoubleRounding) {
  const double x = 1.0 + 0x1p-8 + 0x1p-30;
  EXPECT_EQ(float_to_bf16(static_cast<float>(x)), 0x3f80);  // the naive path is wrong
  Tensor d = Tensor::from_vector(std::vector<double>{x, -x, 1.0 + 0x1p-11 + 0x1p-40}, {3});
  Tensor b = d.to(DType::bf16);
  EXPECT_EQ(b.data<uint16_t>()[0], 0x3f81);
  EXPECT_EQ(b.data<uint16_t>()[1], 0xbf81);
  EXPECT_EQ(d.to(DType::f16).data<uint16_t>()[2], 0x3c01);
  EXPECT_EQ(Tensor::full({1}, 1e300, DType::bf16).data<uint16_t>()[0], 0x7f80);
  EXPECT_EQ(Tensor::full({1}, 1e300, DType::f32).item({0}), std::numeric_limits<double>::infinity());
}

TEST(TensorTest, FloatToIntTruncatesAndSaturates) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor f = Tensor::from_vector(std::vector<double>{2.9, -2.9, 1e10, -1e10, nan, 255.5, -0.5}, {7});
  EXPECT_EQ(f.to(DType::i32).to_vector(),
            (std::vector<double>{2, -2, 2147483647.0, -2147483648.0, 0, 255, 0}));
  EXPECT_EQ(f.to(DType::u8).to_vector(), (std::vector<double>{2, 0, 255, 0, 0, 255, 0}));
  EXPECT_EQ(f.to(DType::i8).to_vector(), (std::vector<double>{2, -2, 127, -128, 0, 127, 0}));
  EXPECT_EQ(Tensor::full({1}, 1e30, DType::i64).data<int64_t>()[0], std::numeric_limits<int64_t>::max());
}

TEST(TensorTest, IntToIntWrapsAndIntToFloatIsExact) {
  Tensor i = Tensor::from_vector(std::vector<int64_t>{300, -129, (int64_t{1} << 40) + 1}, {3});
  EXPECT_EQ(i.to(DType::i8).to_vector(), (std::vector<double>{44, 127, 1}));
  EXPECT_EQ(i.to(DType::u8).to_vector(), (std::vector<double>{44, 127, 1}));
  EXPECT_EQ(i.to(DType::f64).item({2}), static_cast<double>((int64_t{1} << 40) + 1));
  EXPECT_EQ(i.to(DType::bf16).item({0}), 300.0);  // 300 is exact in bf16 (9 bits: 100101100)
}

TEST(TensorTest, FillWritesOnlyTheView) {
  Tensor t = Tensor::zeros({3, 4}, DType::f16);
  t.transpose(0, 1).narrow(1, 1, 1).fill(0.1);  // row 1 of t
  const double tenth = f16_to_float(float_to_f16(0.1f));
  EXPECT_EQ(t.to_vector(), (std::vector<double>{0, 0, 0, 0, tenth, tenth, tenth, tenth, 0, 0, 0, 0}));
}

TEST(TensorTest, ItemChecksTheIndex) {
  Tensor t = iota2d(2, 3);
  EXPECT_EQ(t.item({1, 2}), 12.0);
  expect_invalid([&] { t.item({1}); }, "Tensor::item", "1 entries");
  expect_invalid([&] { t.item({2, 0}); }, "Tensor::item", "out of range");
  expect_invalid([&] { t.size(2); }, "Tensor::size", "dim 2");
}

TEST(TensorTest, ToStringShowsMetadataAndValues) {
  EXPECT_EQ(iota2d(2, 3).to_string(), "Tensor(shape=[2, 3], dtype=f32, device=cpu)\n[[0, 1, 2],\n [10, 11, 12]]");
  EXPECT_EQ(Tensor::full({2}, -1.5, DType::bf16).to_string(), "Tensor(shape=[2], dtype=bf16, device=cpu)\n[-1.5, -1.5]");
  EXPECT_EQ(Tensor::full({}, 7, DType::i32).to_string(), "Tensor(shape=[], dtype=i32, device=cpu)\n7");
  EXPECT_EQ(Tensor::zeros({2000}, DType::u8).to_string(), "Tensor(shape=[2000], dtype=u8, device=cpu)");
  EXPECT_EQ(Tensor().to_string(), "Tensor(undefined)");
}

TEST(TensorTest, MayOverlap) {
  Tensor t = iota2d(4, 4);
  EXPECT_TRUE(may_overlap(t, t.narrow(0, 3, 1)));
  EXPECT_FALSE(may_overlap(t.narrow(0, 0, 2), t.narrow(0, 2, 2)));
  EXPECT_FALSE(may_overlap(t, t.clone()));
  EXPECT_FALSE(may_overlap(t, Tensor()));
}

// The allocator registry: storages of a device type come from the allocator
// registered for it (here a counting one over host memory, standing in for
// a GPU backend's), and go back to it with their size.
class CountingAllocator final : public DeviceAllocator {
 public:
  explicit CountingAllocator(int* live) : live_(live) {}
  void* allocate(size_t nbytes, int index) override {
    EXPECT_EQ(index, 1);
    ++*live_;
    return ::operator new(nbytes, std::align_val_t{Storage::kAlignment});
  }
  void deallocate(void* p, size_t nbytes, int) noexcept override {
    --*live_;
    EXPECT_EQ(nbytes, 16u);
    ::operator delete(p, std::align_val_t{Storage::kAlignment});
  }

 private:
  int* live_;
};

TEST(TensorTest, StorageComesFromTheAllocatorRegisteredForItsDevice) {
  int live = 0;
  register_allocator(DeviceType::cuda, std::make_unique<CountingAllocator>(&live));
  {
    Tensor t = Tensor::empty({4}, DType::f32, Device::cuda(1));
    EXPECT_EQ(t.device(), Device::cuda(1));
    EXPECT_EQ(live, 1);
  }
  EXPECT_EQ(live, 0);
  register_allocator(DeviceType::cuda, nullptr);
  EXPECT_THROW(Tensor::empty({4}, DType::f32, Device::cuda(0)), Unsupported);
  EXPECT_THROW(register_allocator(DeviceType::cpu, nullptr), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain

// Large freed blocks wait in the CPU allocator's cache and come back for a
// request of their size (the same memory: no page faults the second time);
// small ones and other sizes do not.
namespace meshtrain {
namespace {
TEST(CpuAllocatorCache, ReusesALargeBlockOfTheSameSize) {
  const size_t before = cpu_cached_bytes();
  const int64_t n = (3 << 20) / 4;  // 3 MiB of f32
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({n}, DType::f32);
    first = t.data_ptr();
  }
  EXPECT_EQ(cpu_cached_bytes(), before + (size_t{3} << 20));
  Tensor other = Tensor::empty({n + 1}, DType::f32);  // another size: not from the cache
  EXPECT_NE(other.data_ptr(), first);
  Tensor again = Tensor::empty({n}, DType::f32);
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_EQ(cpu_cached_bytes(), before);
  { Tensor small = Tensor::empty({1000}, DType::f32); }
  EXPECT_EQ(cpu_cached_bytes(), before);  // small blocks go back to operator delete
}
}  // namespace
}  // namespace meshtrain
