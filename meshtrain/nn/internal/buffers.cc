#include "meshtrain/nn/internal/buffers.h"

#include <fmt/format.h>

#include <string>

#include "meshtrain/core/error.h"
#include "meshtrain/core/random.h"

namespace meshtrain::nn::internal {

Tensor& reuse_or_allocate(Tensor& buf, const std::vector<int64_t>& shape, MemoryTracker* tracker, DType dtype) {
  const bool reusable = buf.defined() && buf.storage().use_count() == 1 && buf.dtype() == dtype &&
                        buf.shape() == shape && buf.storage_offset() == 0 && buf.is_contiguous();
  if (!reusable) buf = Tensor::empty(shape, dtype, Device{}, tracker, MemoryCategory::activations);
  return buf;
}

Tensor f32_contiguous(const Tensor& x, const char* op, const char* what) {
  if (!x.defined())
    throw InvalidArgument(op, fmt::format("{} is undefined", what),
                          "pass a tensor (an undefined gradient means the layer below skipped it)");
  if (x.dtype() != DType::f32)
    throw InvalidArgument(op, fmt::format("{} has dtype {}", what, dtype_name(x.dtype())),
                          "nn computes in f32; convert with to(DType::f32)");
  return x.contiguous();
}

void check_shape(const Tensor& got, const std::vector<int64_t>& want, const char* op, const char* what) {
  if (got.shape() != want)
    throw InvalidArgument(op,
                          fmt::format("{} has shape {}, expected {}", what, meshtrain::shape_to_string(got.shape()),
                                      meshtrain::shape_to_string(want)),
                          "the gradient has the shape of forward's output; call forward on this batch first");
}

void check_param_grad(const Tensor& t, const char* op, const std::string_view name) {
  if (!t.defined() || t.dtype() != DType::f32 || !t.is_contiguous())
    throw InvalidArgument(op, fmt::format("gradient of parameter '{}' is not a contiguous f32 tensor", name),
                          "keep Parameter::grad contiguous f32 (views into a flat buffer are fine)");
}

Tensor param_value(const Tensor& v, DType dtype, const char* op, const std::string_view name) {
  if (!v.defined() || !v.is_contiguous() ||
      (v.dtype() != DType::f32 && v.dtype() != DType::bf16 && v.dtype() != DType::f16))
    throw InvalidArgument(op,
                          fmt::format("value of parameter '{}' is {}", name,
                                      v.defined() ? fmt::format("{} {}", dtype_name(v.dtype()),
                                                                v.is_contiguous() ? "contiguous" : "strided")
                                                  : std::string("undefined")),
                          "keep Parameter::value a contiguous f32 tensor (or a bf16/f16 one under mixed precision)");
  if (v.dtype() == dtype) return v;
  Tensor out = Tensor::empty(v.shape(), dtype);
  out.copy_from(v);
  return out;
}

uint64_t step_key(std::string_view name, uint64_t step) {
  return key_from_name(fmt::format("{}@step={}", name, step));
}

std::string join_name(std::string_view prefix, std::string_view leaf) {
  if (prefix.empty()) return std::string(leaf);
  return fmt::format("{}.{}", prefix, leaf);
}

}  // namespace meshtrain::nn::internal
