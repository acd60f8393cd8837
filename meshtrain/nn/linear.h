// Linear: y = x W + b with W (in, out), the weight convention of
// sharding/strategy.h (PyTorch's nn.Linear stores W^T: transpose on import).
//
//   nn::Linear fc(784, 512, "encoder.0", /*seed=*/42);  // "encoder.0.weight" (784, 512), "encoder.0.bias" (512)
//   nn::Saved s;
//   Tensor y = fc.forward(x, s);                         // (B, 784) -> (B, 512)
//   Tensor dx = fc.backward(dy, s);                      // (B, 512) -> (B, 784); grads += x^T dy, sum(dy)
//
// Initialization (PyTorch's default, kaiming-uniform with a = sqrt(5)): weight
// and bias ~ U(-1/sqrt(in), 1/sqrt(in)), drawn by the counter-based generator
// with key = key_from_name(full parameter name), so every value depends only
// on (seed, name, index) and any shard can be built alone.
//
// Inputs may have any number of leading dims: (..., in) -> (..., out); every
// leading index is one row of the GEMM. With a half-precision compute dtype
// (Module::set_compute_dtype) the three GEMMs run in it: x, dy and the weight
// are converted to bf16/f16 (round to nearest even; fully sharded data
// parallelism gathers weights already exact in that dtype), multiplied with
// f32 accumulation (core/matmul.h: oneDNN's bf16 kernels, AVX512-BF16 where
// the CPU has it), and y and dX are rounded to the compute dtype as a
// half-precision result. The saved input is the bf16/f16 copy (half the
// bytes); the converted weight is a per-thread scratch, made again for dX.
// Compute: nn::functional's linear kernels (GEMMs on the CPU):
// forward 1 GEMM, backward 2 (dW, and dX unless needs_input_grad is false;
// then backward returns an undefined Tensor, which the first layer of a model
// wants since its input needs no gradient). Split backward: backward_input
// computes dX and keeps dy; backward_weight accumulates db, dW.
//
// Row blocks (tensor parallelism's communication overlap,
// nn/parallel/tensor_parallel.h): set_next_forward_blocks /
// set_next_backward_blocks make the next forward (resp. backward or
// backward_input) run its GEMM (forward's y, backward's dX) over equal
// blocks of the input's rows, in a given order, calling ready(j) before
// block j's input rows are read and done(j, rows) once its output rows are
// final (rounded to the compute dtype), so that a caller can move block j's
// neighbours while block j multiplies. The input must then be an f32
// contiguous tensor (the caller fills its rows in ready()). A blocked
// backward computes dX before the weight gradients. Each row's result is the
// one-GEMM result up to the GEMM library's order of a dot product's terms,
// which may depend on the row count.
//
// Buffers: the output and dX buffers live in the call's Saved and are reused
// by the next forward into it when the caller no longer holds the previous
// result (see internal/buffers.h); forward keeps a handle to x until backward.
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::nn {

struct LinearOptions {
  bool bias = true;
  // false: backward skips dX (saves one GEMM) and returns an undefined Tensor.
  bool needs_input_grad = true;
  // Metadata for tensor parallelism (see sharding::LinearRole); no effect here.
  sharding::LinearRole role = sharding::LinearRole::none;
  // Leave the parameters' values undefined (Parameter::init still describes
  // them): fully sharded data parallelism then builds only each rank's shard.
  // nn::materialize(p) builds a whole one. Values are the same either way.
  bool defer_init = false;
  // > 0: weight ~ N(0, init_std) and bias = 0 (GPT-2's initialization);
  // 0: PyTorch's default (kaiming-uniform, see above).
  double init_std = 0.0;
};

// The blocks of one blocked call (see "Row blocks" above): block j is rows
// [j R / n, (j + 1) R / n) of the (R, in) input with n = order.size(); R
// divisible by n. order: each of 0..n-1 once; empty: one GEMM, no calls.
struct RowBlocks {
  std::vector<int64_t> order{};
  std::function<void(int64_t block)> ready{};                     // may be empty
  std::function<void(int64_t block, const Tensor& rows)> done{};  // may be empty
};

class Linear final : public Module {
 public:
  // in, out >= 1. `prefix` is the module's path ("" gives "weight", "bias").
  Linear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed, bool bias = true);
  Linear(int64_t in, int64_t out, const std::string& prefix, uint64_t seed, const LinearOptions& options);
  // Not copyable: a copy would share the parameters' storage.
  Linear(const Linear&) = delete;
  Linear& operator=(const Linear&) = delete;

  // forward: x (..., in) f32 -> (..., out).
  // backward: grad_out (..., out) -> dX (..., in), or undefined when
  // !needs_input_grad(). Accumulates dW and db; notifies bias, then weight
  // (reverse definition order).
  // {weight, bias} (bias only when enabled).
  std::vector<Parameter*> parameters() override;

  Parameter& weight() { return weight_; }
  Parameter& bias();  // throws InvalidArgument when built without bias
  bool has_bias() const { return has_bias_; }
  bool needs_input_grad() const { return needs_input_grad_; }
  void set_needs_input_grad(bool needs) { needs_input_grad_ = needs; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  // The next forward / the next backward or backward_input runs in row
  // blocks (see above); that call clears it.
  void set_next_forward_blocks(RowBlocks blocks) { next_forward_ = std::move(blocks); }
  void set_next_backward_blocks(RowBlocks blocks) { next_backward_ = std::move(blocks); }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override;

 private:
  struct State;
  // dy as (R, out), rounded to the compute dtype; checks its shape.
  // (convert = false: left in f32, for a blocked call to convert by block.)
  Tensor prepare_grad(const Tensor& grad_out, State& st, const char* op, bool convert = true);
  Tensor input_grad(const Tensor& dy, State& st);
  // The blocked backward's first part: dy in the compute dtype (converted
  // block by block) and dX (undefined unless needs_input_grad()).
  std::pair<Tensor, Tensor> blocked_input_grad(const RowBlocks& blocks, const Tensor& dy, State& st);
  // The weight and bias gradients of a call (saved: its batch context).
  void weight_grads(const Tensor& dy, const Tensor& x, Saved& saved);

  std::string name_;  // module path, for errors
  int64_t in_;
  int64_t out_;
  bool has_bias_;
  bool needs_input_grad_;
  Parameter weight_;  // value, grad: (in, out)
  Parameter bias_;    // value, grad: (out); undefined tensors without bias
  RowBlocks next_forward_, next_backward_;
};

}  // namespace meshtrain::nn
