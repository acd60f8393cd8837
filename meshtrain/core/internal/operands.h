// Implementation detail of the core layer; do not include outside meshtrain/core.
//
// The operand check every core kernel (ops.cc, matmul.cc) starts with.
#pragma once

#include <fmt/format.h>

#include "meshtrain/core/error.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::internal {

// InvalidArgument for an undefined tensor, Unsupported for one not on the
// cpu; both name `op` and the operand `what`.
inline void check_operand(const Tensor& t, const char* op, const char* what) {
  if (!t.defined())
    throw InvalidArgument(op, fmt::format("{} is undefined (default-constructed)", what),
                          "pass a tensor created with Tensor::empty, zeros, ...");
  if (t.device().type != DeviceType::cpu)
    throw Unsupported(op, fmt::format("{} is on {}", what, t.device().to_string()),
                      "these kernels run on cpu tensors only");
}

}  // namespace meshtrain::internal
