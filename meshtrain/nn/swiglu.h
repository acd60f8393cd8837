// SwiGLU feed-forward (Llama's MLP; Shazeer 2020): y = down(silu(gate(x)) * up(x)),
// three Linears without bias, Hugging Face Llama's names:
//
//   nn::SwiGLUMLP mlp({.width = 512, .hidden = 1376, .prefix = "model.layers.0.mlp", .seed = 7});
//   // "model.layers.0.mlp.gate_proj.weight" (512, 1376), ".up_proj.weight" (512, 1376),
//   // ".down_proj.weight" (1376, 512)
//   Tensor y = mlp.forward(x);          // (..., 512) -> (..., 512)
//   Tensor dx = mlp.backward(dy);
//
// Tensor parallelism (config.tensor): gate_proj and up_proj are
// column-parallel (each rank holds its hidden features of both, so the
// product stays local) and down_proj is row-parallel (tensor_parallel.h's
// ColumnParallelLinear and RowParallelLinear, with sequence parallelism
// and communication overlap as the group says): one all-reduce (or
// reduce-scatter) per forward, as Megatron splits a Llama MLP. Initial
// values: init_std > 0 draws N(0, init_std) weights, else PyTorch's
// default (nn/linear.h); either way keyed by name, the same on any split.
// Memory: keeps gate(x), up(x) and silu(gate(x)) (R x hidden / k each) for
// backward. Under a half-precision compute dtype the product is rounded
// to it, as a Linear's output.
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/nn/module.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::nn {

struct SwiGLUConfig {
  int64_t width = 0;              // input and output features, >= 1
  int64_t hidden = 0;             // hidden features, >= 1 (Llama: about 8/3 width, rounded)
  std::string prefix = "";        // module path ("" at the root)
  uint64_t seed = 0;              // initialization seed
  double init_std = 0.0;          // > 0: N(0, init_std) weights (see above)
  double out_std = 0.0;           // > 0: down_proj's std instead (a residual projection's, scaled by depth)
  bool defer_init = false;        // LinearOptions::defer_init
  TensorParallelGroup tensor = {};  // split over these ranks (see above)
};

class SwiGLUMLP final : public Module {
 public:
  explicit SwiGLUMLP(const SwiGLUConfig& config);
  // gate_proj, up_proj, down_proj: their weights (each rank's blocks).
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override { return {gate_.get(), up_.get(), down_.get()}; }
  const SwiGLUConfig& config() const { return config_; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  std::string describe() const override { return "SwiGLUMLP '" + config_.prefix + "'"; }

 private:
  struct State {
    Tensor g, u, s;  // gate(x), up(x), silu(gate(x))
    Tensor h;        // s * u: down_proj's input buffer
  };
  SwiGLUConfig config_;
  std::unique_ptr<Module> gate_, up_, down_;
};

}  // namespace meshtrain::nn
