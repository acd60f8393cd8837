// The pre-norm residual block shared by GPT-2's and Llama's blocks:
// h = x + f(n1(x)), y = h + g(n2(h)), the four modules' calls in the
// block's Saved children 0 (n1), 1 (f), 2 (n2), 3 (g). Not for use outside nn.
#pragma once

#include "meshtrain/core/memory.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::nn::internal {

struct PreNormBlock {
  Module &n1, &f, &n2, &g;

  // The sums are new tensors (the branches keep what they need themselves).
  Tensor forward(const Tensor& x, Saved& saved, MemoryTracker* tracker) const {
    const Tensor a = f.forward(n1.forward(x, saved.child(0)), saved.child(1));
    Tensor h = Tensor::empty(x.shape(), DType::f32, Device{}, tracker, MemoryCategory::activations);
    add(x.contiguous(), a, h);
    const Tensor m = g.forward(n2.forward(h, saved.child(2)), saved.child(3));
    Tensor y = Tensor::empty(x.shape(), DType::f32, Device{}, tracker, MemoryCategory::activations);
    add(h, m, y);
    return y;
  }

  // The residual backward, `step(module, dy, saved)` running each branch's
  // backward (fused) or backward_input; the residual passes dy straight through.
  template <typename Step>
  Tensor backward(const Tensor& dy, Saved& saved, Step step) const {
    const Tensor gy = dy.contiguous();
    const Tensor dm = step(n2, step(g, gy, saved.child(3)), saved.child(2));
    Tensor dh = Tensor::empty(gy.shape(), DType::f32);
    add(gy, dm, dh);
    const Tensor da = step(n1, step(f, dh, saved.child(1)), saved.child(0));
    Tensor dx = Tensor::empty(gy.shape(), DType::f32);
    add(dh, da, dx);
    return dx;
  }
  Tensor backward(const Tensor& dy, Saved& saved) const {
    return backward(dy, saved, [](Module& m, const Tensor& d, Saved& s) { return m.backward(d, s); });
  }
  Tensor backward_input(const Tensor& dy, Saved& saved) const {
    return backward(dy, saved, [](Module& m, const Tensor& d, Saved& s) { return m.backward_input(d, s); });
  }
  // The weight passes in reverse order: g, n2, f, n1.
  void backward_weight(Saved& saved) const {
    g.backward_weight(saved.child(3));
    n2.backward_weight(saved.child(2));
    f.backward_weight(saved.child(1));
    n1.backward_weight(saved.child(0));
  }
};

}  // namespace meshtrain::nn::internal
