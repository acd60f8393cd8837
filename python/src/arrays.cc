// Arrays as the engines take them, and the GIL turn of the rank threads
// (internal.h).
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <optional>

#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {

// numpy's name of a dtype ("float32").
std::string dtype_name(const py::dtype& t) { return t.attr("name").cast<std::string>(); }

std::optional<DType> engine_dtype(char kind, py::ssize_t size, char byteorder) {
  const bool native =
      byteorder == '=' || byteorder == '|' || byteorder == (std::endian::native == std::endian::little ? '<' : '>');
  if (!native) return std::nullopt;
  if (kind == 'f' && size == 4) return DType::f32;
  if (kind == 'f' && size == 8) return DType::f64;
  if (kind == 'f' && size == 2) return DType::f16;
  if (kind == 'i' && size == 1) return DType::i8;
  if (kind == 'i' && size == 4) return DType::i32;
  if (kind == 'i' && size == 8) return DType::i64;
  if (kind == 'u' && size == 1) return DType::u8;
  return std::nullopt;
}

// The engine dtype of a numpy array's dtype (numpy has no bfloat16): by
// kind and size, native byte order (a per-call lookup without Python calls).
DType dtype_of(const py::array& a, const char* op) {
  const py::dtype t = a.dtype();
  if (const auto d = engine_dtype(t.kind(), t.itemsize(), t.byteorder())) return *d;
  throw InvalidArgument(op, fmt::format("an array of dtype {}", dtype_name(t)),
                        "pass float32, float64, float16, int8, int32, int64 or uint8 (native byte order)");
}

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// The array as the engines take it: C-contiguous (and writable when `written`).
void check_layout(const py::array& a, const char* op, const char* what, bool written) {
  if (!(a.flags() & py::array::c_style))
    throw InvalidArgument(op, fmt::format("{} {} is not C-contiguous", what, shape_of(a)),
                          "pass numpy.ascontiguousarray(x) (a collective never copies)");
  if (written && !a.writeable())
    throw InvalidArgument(op, fmt::format("{} {} is read-only", what, shape_of(a)),
                          "pass a writable array (the collective writes the result into it)");
}



// The numpy dtype of an engine dtype (numpy has no bfloat16).
py::dtype numpy_dtype(DType t, const char* op) {
  switch (t) {
    case DType::f32: return py::dtype::of<float>();
    case DType::f64: return py::dtype::of<double>();
    case DType::f16: return py::dtype("float16");
    case DType::i8: return py::dtype::of<int8_t>();
    case DType::i32: return py::dtype::of<int32_t>();
    case DType::i64: return py::dtype::of<int64_t>();
    case DType::u8: return py::dtype::of<uint8_t>();
    case DType::bf16: break;
  }
  throw InvalidArgument(op, fmt::format("a {} tensor", dtype_name(t)), "numpy has no bfloat16: convert it first");
}

// A tensor over the array's memory (no copy; the array must outlive it).
Tensor tensor_view(const py::array& a, const char* op) {
  check_layout(a, op, "array", false);
  std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
  return Tensor::from_blob(const_cast<void*>(a.data()), std::move(shape), dtype_of(a, op));
}

// A numpy array over the tensor's memory (no copy; the array keeps it alive).
py::array numpy_view(const Tensor& t, const char* op) {
  const Tensor c = t.contiguous();
  auto* keep = new Tensor(c);
  py::capsule owner(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  std::vector<py::ssize_t> shape(c.shape().begin(), c.shape().end());
  return py::array(numpy_dtype(c.dtype(), op), shape, c.data_ptr(), owner);
}

std::chrono::milliseconds to_ms(double seconds, const char* op) {
  if (!(seconds > 0) || !std::isfinite(seconds))
    throw InvalidArgument(op, fmt::format("timeout {} s", seconds), "pass a deadline in seconds > 0");
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
}

// ---- the GIL turn ----

constexpr std::chrono::microseconds kTurnSpin{200};
std::atomic<bool> g_spin{false};
thread_local bool t_rank = false;

namespace {
std::atomic<bool> g_turn{false};      // a rank thread holds the GIL (or is taking it) by its turn
thread_local bool t_turn = false;     // this thread holds the turn
}  // namespace

void take_turn() {
  if (!t_rank || !g_spin.load(std::memory_order_relaxed)) return;
  const auto until = std::chrono::steady_clock::now() + kTurnSpin;
  for (int i = 0;; ++i) {
    if (!g_turn.load(std::memory_order_relaxed) && !g_turn.exchange(true, std::memory_order_acquire)) {
      t_turn = true;
      return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return;
  }
}

void give_turn() {
  if (!t_turn) return;
  t_turn = false;
  g_turn.store(false, std::memory_order_release);
}

}  // namespace meshtrain::python
