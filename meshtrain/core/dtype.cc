#include "meshtrain/core/dtype.h"

#include "meshtrain/core/error.h"

namespace meshtrain {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f64: return "f64";
    case DType::i8: return "i8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  for (DType t : kAllDTypes)
    if (dtype_name(t) == name) return t;
  throw InvalidArgument("parse_dtype", "unknown dtype '" + std::string(name) + "'",
                        "use one of f32, bf16, f16, f64, i8, i32, i64, u8");
}

}  // namespace meshtrain
