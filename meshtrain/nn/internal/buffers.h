// Helpers shared by nn's layers: reusable buffers, input checks, and the
// random-stream key of a (name, step) pair. Not for use outside nn.
//
//   Tensor& y = internal::reuse_or_allocate(y_, {batch, out});  // no malloc when y_ is free
//   Tensor x32 = internal::f32_contiguous(x, "Linear::forward", "input");
//
// Thread-safety: pure functions of their arguments (buffers belong to the caller).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::nn::internal {

// Returns `buf` after making it a contiguous tensor of `shape` and `dtype`
// (f32 unless given: a half-precision layer keeps bf16 copies). The old
// storage is reused when `buf` is the only handle that refers to it (nobody
// kept a previous result or a view of it); otherwise new storage is
// allocated, so a result the caller still holds is never overwritten. New
// storage is charged to `tracker` (may be null) as activations.
Tensor& reuse_or_allocate(Tensor& buf, const std::vector<int64_t>& shape, MemoryTracker* tracker = nullptr,
                          DType dtype = DType::f32);

// x itself when it is f32 and contiguous, else a contiguous copy. Throws
// InvalidArgument naming `op` when x is undefined or not f32.
Tensor f32_contiguous(const Tensor& x, const char* op, const char* what);

// Throws InvalidArgument naming `op` unless got.shape() == want.
void check_shape(const Tensor& got, const std::vector<int64_t>& want, const char* op, const char* what);

// Throws InvalidArgument naming `op` unless the parameter gradient `t` is
// f32 and contiguous (layers accumulate into it through raw pointers).
void check_param_grad(const Tensor& t, const char* op, const std::string_view name);

// A parameter's value `v` (of the parameter `name`) in `dtype` for a kernel:
// v itself when it has that dtype, else a converted copy (not charged to a
// tracker: transient, like a GEMM's packing buffers). Values are f32
// masters, or bf16/f16 views while fully sharded data parallelism's mixed
// precision uses them (parallel/fully_sharded.h). Throws InvalidArgument
// naming `op` unless v is a contiguous f32, bf16 or f16 tensor.
Tensor param_value(const Tensor& v, DType dtype, const char* op, const std::string_view name);

// The counter-based generator key of the random stream `name` at `step`:
// key_from_name("<name>@step=<step>"). Dropout masks and VAE noise use it.
uint64_t step_key(std::string_view name, uint64_t step);

// "prefix.leaf", or "leaf" when prefix is empty.
std::string join_name(std::string_view prefix, std::string_view leaf);

}  // namespace meshtrain::nn::internal
