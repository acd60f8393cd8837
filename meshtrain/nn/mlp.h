// MLP classifier: Linear -> ReLU [-> Dropout] -> ... -> Linear (logits).
// The Fashion-MNIST default is 784-512-512-256-10.
//
//   nn::MLP mlp(nn::MLPConfig{.sizes = {784, 512, 512, 10}, .dropout = 0.1, .seed = 42});
//   nn::CrossEntropyLoss ce;
//   mlp.set_batch_context(step, first_global_sample);   // keys the dropout masks
//   double loss = ce.forward(mlp.forward(x), labels);   // x (B, 784) -> logits (B, 10)
//   mlp.backward(ce.backward());                        // grads += ...; returns undefined
//
// An MLP is a Sequential: children are "0", "1", ... (PyTorch's numbering),
// so with dropout the Linears are "0", "3", "6", ... and without it "0", "2",
// "4", ...; parameters are "<prefix>.<i>.weight" (in, out) and ".bias".
// The first Linear skips dX unless needs_input_grad (its input is data), so
// backward returns an undefined Tensor by default: one GEMM fewer per step.
// Tensor parallelism (config.tensor of k > 1 ranks): Megatron's pairs,
// "0" column- and the next Linear row-parallel, and so on (with an odd
// count the smaller end Linear stays whole: tensor_parallel.h's
// chain_roles); the ReLU and dropout
// between the two of a pair see this rank's hidden features (the dropout
// draws its columns of the one-device mask). Every rank returns the whole
// logits.
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/nn/sequential.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::nn {

struct MLPConfig {
  std::vector<int64_t> sizes = {784, 512, 512, 256, 10};  // input, hidden..., classes; >= 2 entries, each >= 1
  double dropout = 0.0;           // after every hidden ReLU when > 0 (0 <= dropout <= 1)
  uint64_t seed = 0;              // initialization and dropout seed
  bool needs_input_grad = false;  // true: backward returns d loss / d x
  bool defer_init = false;        // leave parameter values to be built later (LinearOptions::defer_init)
  std::string prefix;             // module path of the MLP ("" at the root)
  TensorParallelGroup tensor = {};  // split over these ranks (see above)
  // Pipeline parallelism: only Linear layers [first_layer, last_layer)
  // (last_layer < 0: to the end) with the ReLU and dropout after each, named
  // as in the whole MLP ("3.weight"), so a part holds those layers' values.
  // Forward takes the previous part's output. Under tensor parallelism a
  // part may not cut a column/row pair (InvalidArgument).
  int64_t first_layer = 0, last_layer = -1;
};

class MLP final : public Sequential {
 public:
  explicit MLP(MLPConfig config = {});
  const MLPConfig& config() const { return config_; }

 private:
  MLPConfig config_;
};

}  // namespace meshtrain::nn
