// Sequential: owns child modules and runs them in order (forward) and in
// reverse (backward). Children are named "<prefix>.0", "<prefix>.1", ... (or
// "0", "1", ... without a prefix), as PyTorch's nn.Sequential, so the first
// Linear's parameters are "0.weight" and "0.bias".
//
//   nn::Sequential net;                                        // prefix ""
//   net.add(std::make_unique<nn::Linear>(784, 512, net.next_name(), seed));  // "0"
//   net.add(std::make_unique<nn::ReLU>());                                   // "1"
//   net.add(std::make_unique<nn::Linear>(512, 10, net.next_name(), seed));   // "2"
//   Tensor logits = net.forward(x);   // (B, 784) -> (B, 10)
//   net.backward(dlogits);            // hooks fire for 2.bias, 2.weight, 0.bias, 0.weight
//
// Child i's per-call state is saved.child(i). The split backward runs every
// child's backward_input (last to first), then every child's
// backward_weight in the same order, so grad_ready comes in the fused order.
//
// A child's parameter names are fixed when it is built (they key its
// initialization), so build each child with next_name() as its prefix.
// add() rejects a child whose parameter names repeat one already present.
// set_training, set_param_hook and set_batch_context reach every child.
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::nn {

class Sequential : public Module {
 public:
  explicit Sequential(std::string prefix = "") : prefix_(std::move(prefix)) {}
  Sequential(const Sequential&) = delete;
  Sequential& operator=(const Sequential&) = delete;

  // Appends `child` (non-null) and returns it. Throws InvalidArgument when a
  // parameter name repeats. Settings made on this container (training,
  // hook, batch context) are applied to the child.
  template <typename M>
  M& add(std::unique_ptr<M> child) {
    M& ref = *child;
    add_module(std::unique_ptr<Module>(std::move(child)));
    return ref;
  }
  // The path the next child should get: "<prefix>.<size()>".
  std::string next_name() const;
  const std::string& prefix() const { return prefix_; }
  size_t size() const { return children_.size(); }
  Module& operator[](size_t i) { return *children_.at(i); }

  // forward chains the children: x -> children[0] -> ... -> children[n-1];
  // backward the reverse chain, returning what the first child returns
  // (undefined when it skips its input gradient).
  std::vector<Parameter*> parameters() override;

  std::vector<Module*> children() override;

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  Tensor do_backward(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override;

 private:
  void add_module(std::unique_ptr<Module> child);

  std::string prefix_;
  std::vector<std::unique_ptr<Module>> children_;
};

}  // namespace meshtrain::nn
