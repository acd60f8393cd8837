// LayerNorm over the last dim: y = (x - mean) / sqrt(var + eps) * gamma + beta,
// with the biased variance (as PyTorch).
//
//   nn::LayerNorm ln(768, "h.0.ln_1");   // "h.0.ln_1.weight" (768) = 1, "h.0.ln_1.bias" (768) = 0
//   Tensor y = ln.forward(x);            // (..., 768) -> (..., 768)
//   Tensor dx = ln.backward(dy);
//
// Parameters (affine only): weight (gamma) starts at 1 and bias (beta) at 0,
// so the initial value trivially depends only on (seed, name); both are
// ParamKind::norm with weight_decay false. Mean and variance are accumulated
// in f32 lanes per row (a fixed order); the rest is f32.
//
// RMSNorm (Llama's; torch.nn.RMSNorm): y = x / sqrt(mean(x^2) + eps) * gamma,
// no mean subtracted and no bias; gamma starts at 1 (ParamKind::norm, no
// weight decay). eps defaults to 1e-6 (Llama's rms_norm_eps).
//
//   nn::RMSNorm norm(512, "layers.0.attention_norm");   // "layers.0.attention_norm.weight" (512) = 1
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::nn {

class LayerNorm final : public Module {
 public:
  // dim >= 1, eps > 0. `prefix` is the module's path.
  // defer_init: see LinearOptions::defer_init.
  LayerNorm(int64_t dim, const std::string& prefix, double eps = 1e-5, bool affine = true, bool defer_init = false);
  // Not copyable: a copy would share the parameters' storage.
  LayerNorm(const LayerNorm&) = delete;
  LayerNorm& operator=(const LayerNorm&) = delete;

  // forward: x (..., dim) f32 -> (..., dim). backward accumulates dgamma,
  // dbeta (when affine); notifies bias, then weight.
  // {weight, bias} when affine, else {}.
  std::vector<Parameter*> parameters() override;

  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }
  bool affine() const { return affine_; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  std::string describe() const override { return "LayerNorm '" + name_ + "'"; }

 private:
  struct State {
    std::vector<int64_t> shape;  // input shape of the forward
    Tensor xhat;                 // (R, dim) normalized input
    Tensor rstd;                 // (R) 1 / sqrt(var + eps)
    Tensor dy;                   // (R, dim) kept for the weight pass
    Tensor y, dx;                // buffers
  };
  std::string name_;
  int64_t dim_;
  double eps_;
  bool affine_;
  Parameter weight_;  // gamma (dim)
  Parameter bias_;    // beta (dim)
};

class RMSNorm final : public Module {
 public:
  // dim >= 1, eps > 0 and finite. defer_init: see LinearOptions::defer_init.
  RMSNorm(int64_t dim, const std::string& prefix, double eps = 1e-6, bool defer_init = false);
  RMSNorm(const RMSNorm&) = delete;
  RMSNorm& operator=(const RMSNorm&) = delete;

  // forward: x (..., dim) f32 -> (..., dim). backward accumulates dgamma.
  std::vector<Parameter*> parameters() override { return {&weight_}; }
  Parameter& weight() { return weight_; }
  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  std::string describe() const override { return "RMSNorm '" + name_ + "'"; }

 private:
  struct State {
    std::vector<int64_t> shape;
    Tensor xhat, rstd, dy, y, dx;  // as LayerNorm's
  };
  std::string name_;
  int64_t dim_;
  double eps_;
  Parameter weight_;  // gamma (dim)
};

}  // namespace meshtrain::nn
