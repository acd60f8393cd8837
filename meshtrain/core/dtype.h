// Runtime element types. Kernels switch on DType inside .cc files (ggml style);
// no public class is templated on the element type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace meshtrain {

enum class DType : uint8_t { f32, bf16, f16, f64, i8, i32, i64, u8 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::bf16, DType::f16, DType::f64,
                                       DType::i8,  DType::i32,  DType::i64, DType::u8};

// Bytes per element: 4, 2, 2, 8, 1, 4, 8, 1.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::f64: return 8;
    case DType::i8: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16 || t == DType::f64;
}

// "f32", "bf16", ... as used in configs, CLI flags and error messages.
std::string_view dtype_name(DType t);
// Inverse of dtype_name; throws InvalidArgument listing the valid names.
DType parse_dtype(std::string_view name);

}  // namespace meshtrain
