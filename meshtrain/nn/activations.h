// Element-wise activations: ReLU, GELU, SiLU, Tanh, Sigmoid. Any shape, f32.
//
//   nn::GELU gelu;                    // exact erf form, PyTorch's default
//   Tensor y = gelu.forward(x);       // (...) -> (...)
//   Tensor dx = gelu.backward(dy);    // dy * gelu'(x)
//
// Each class runs one tight loop per call (one virtual call per tensor, none
// per element). Forward keeps handles to x and y until backward; outputs and
// gradients live in buffers reused across steps when the caller no longer
// holds the previous result.
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

#include "meshtrain/nn/module.h"

namespace meshtrain::nn {

// Base of the element-wise activations: forward/backward handle shapes,
// buffers and checks; subclasses give the two kernels.
class Activation : public Module {
 public:
  Tensor forward(const Tensor& x) final;
  Tensor backward(const Tensor& grad_out) final;
  std::vector<Parameter*> parameters() final { return {}; }
  // "ReLU", "GELU", ..., for errors.
  virtual const char* name() const = 0;

 protected:
  // y[i] = f(x[i]) for i in [0, n).
  virtual void apply(const float* x, float* y, int64_t n) const = 0;
  // dx[i] = dy[i] * f'(x[i]) for i in [0, n), given x and y = f(x).
  virtual void apply_backward(const float* x, const float* y, const float* dy, float* dx, int64_t n) const = 0;

 private:
  Tensor x_;   // input of the last forward (contiguous); dropped by backward
  Tensor y_;   // output buffer
  Tensor dx_;  // input-gradient buffer
};

class ReLU final : public Activation {
 public:
  const char* name() const override { return "ReLU"; }

 protected:
  void apply(const float* x, float* y, int64_t n) const override;
  void apply_backward(const float* x, const float* y, const float* dy, float* dx, int64_t n) const override;
};

enum class GeluApproximation : uint8_t { none, tanh };

class GELU final : public Activation {
 public:
  // none: the exact erf form (PyTorch's default); tanh: approximate='tanh' (GPT-2).
  explicit GELU(GeluApproximation approximation = GeluApproximation::none) : approximation_(approximation) {}
  const char* name() const override { return "GELU"; }
  GeluApproximation approximation() const { return approximation_; }

 protected:
  void apply(const float* x, float* y, int64_t n) const override;
  void apply_backward(const float* x, const float* y, const float* dy, float* dx, int64_t n) const override;

 private:
  GeluApproximation approximation_;
};

class SiLU final : public Activation {
 public:
  const char* name() const override { return "SiLU"; }

 protected:
  void apply(const float* x, float* y, int64_t n) const override;
  void apply_backward(const float* x, const float* y, const float* dy, float* dx, int64_t n) const override;
};

class Tanh final : public Activation {
 public:
  const char* name() const override { return "Tanh"; }

 protected:
  void apply(const float* x, float* y, int64_t n) const override;
  void apply_backward(const float* x, const float* y, const float* dy, float* dx, int64_t n) const override;
};

class Sigmoid final : public Activation {
 public:
  const char* name() const override { return "Sigmoid"; }

 protected:
  void apply(const float* x, float* y, int64_t n) const override;
  void apply_backward(const float* x, const float* y, const float* dy, float* dx, int64_t n) const override;
};

}  // namespace meshtrain::nn
