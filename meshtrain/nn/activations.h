// Element-wise activations: ReLU, GELU, SiLU, Tanh, Sigmoid. Any shape, f32.
//
//   nn::GELU gelu;                    // exact erf form, PyTorch's default
//   Tensor y = gelu.forward(x);       // (...) -> (...)
//   Tensor dx = gelu.backward(dy);    // dy * gelu'(x)
//
// Each class runs one nn::functional kernel per call (one loop per tensor).
// Forward keeps handles to x and y in the call's Saved until backward;
// outputs and gradients live in buffers there, reused across steps when the
// caller no longer holds the previous result.
//
// Formulas (f' is used by backward):
//   ReLU     max(x, 0); f' = 1 for x > 0, else 0 (0 at x = 0, as PyTorch)
//   GELU     none: x Phi(x) = 0.5 x (1 + erf(x / sqrt 2));
//            tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   SiLU     x sigmoid(x)
//   Tanh     tanh(x)
//   Sigmoid  1 / (1 + exp(-x))
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::nn {

// Base of the element-wise activations: forward/backward handle shapes,
// buffers and checks; subclasses name their functional kernel.
class Activation : public Module {
 public:
  std::vector<Parameter*> parameters() final { return {}; }
  // "ReLU", "GELU", ..., for errors.
  virtual const char* name() const = 0;
  virtual functional::ActivationKind kind() const = 0;

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) final;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) final;
  std::string describe() const final { return name(); }

 private:
  struct State {
    Tensor x;   // input of the forward (contiguous); dropped by backward
    Tensor y;   // output buffer
    Tensor dx;  // input-gradient buffer
  };
};

class ReLU final : public Activation {
 public:
  const char* name() const override { return "ReLU"; }
  functional::ActivationKind kind() const override { return functional::ActivationKind::relu; }
};

enum class GeluApproximation : uint8_t { none, tanh };

class GELU final : public Activation {
 public:
  // none: the exact erf form (PyTorch's default); tanh: approximate='tanh' (GPT-2).
  explicit GELU(GeluApproximation approximation = GeluApproximation::none) : approximation_(approximation) {}
  const char* name() const override { return "GELU"; }
  functional::ActivationKind kind() const override {
    return approximation_ == GeluApproximation::none ? functional::ActivationKind::gelu
                                                     : functional::ActivationKind::gelu_tanh;
  }
  GeluApproximation approximation() const { return approximation_; }

 private:
  GeluApproximation approximation_;
};

class SiLU final : public Activation {
 public:
  const char* name() const override { return "SiLU"; }
  functional::ActivationKind kind() const override { return functional::ActivationKind::silu; }
};

class Tanh final : public Activation {
 public:
  const char* name() const override { return "Tanh"; }
  functional::ActivationKind kind() const override { return functional::ActivationKind::tanh; }
};

class Sigmoid final : public Activation {
 public:
  const char* name() const override { return "Sigmoid"; }
  functional::ActivationKind kind() const override { return functional::ActivationKind::sigmoid; }
};

}  // namespace meshtrain::nn
