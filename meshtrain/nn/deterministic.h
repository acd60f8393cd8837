// The deterministic mode's gradient accumulation (docs/determinism.md): a
// rank's gradients are the canonical tree's sums (core/reduction_tree.h)
// over its blocks of the global batch, whatever its micro-batches.
//
// In the mode (functional::set_deterministic_rows), a call of a module sums
// its blocks in the tree, so what it adds to a parameter's gradient is the
// node over its blocks. add_gradient places each call's node: the step's
// first goes into p.grad itself, later ones into buffers of their own, and
// two nodes that are the children of one node are added as soon as both
// are there. After the rank's last call p.grad holds the node over the
// rank's share, for any split of that share into micro-batches, in any
// order of arrival. A tied parameter's users (the GPT's embedding and head)
// each have their own tree; their sums are added last, in user order.
//
//   nn::begin_deterministic_step(/*block=*/16, /*total=*/8, {.first = 2, .count = 2});  // each step
//   nn::add_gradient(p, /*user=*/0, nn::call_node(saved.batch, x.size(0)),
//                    [&](const Tensor& g) { functional::linear_backward_weight(x, dy, g, Tensor()); });
//
// Outside the mode add_gradient is add(p.grad). Thread-safety: the state is
// the calling thread's (a rank's).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::nn {

// Blocks [first, first + count) of the step's tree.
struct TreeNode {
  int64_t first = 0, count = 0;
  bool operator==(const TreeNode&) const = default;
};

// Starts a step in the mode on this thread: blocks of `block` samples, the
// tree has `total` blocks (the global batch's), this rank's share is
// `rank` (a node of it: InvalidArgument otherwise). Drops the previous
// step's pending nodes.
void begin_deterministic_step(int64_t block, int64_t total, TreeNode rank);

// Samples per block of this thread's step in the mode; 0 outside it.
int64_t deterministic_block();

// The node of a call over the batch context's samples (BatchContext::
// samples, else `samples`: the input's first dim), the first at its
// first_global_sample. {} outside the mode.
TreeNode call_node(const BatchContext& batch, int64_t samples);

// Adds one call's contribution to p's gradient: add(target) accumulates
// (+=) the call's node sum into target, a zeroed tensor of p.grad's shape
// (or p.grad). `user` numbers the modules that share p (0 unless tied).
void add_gradient(Parameter& p, int user, TreeNode node, const std::function<void(const Tensor&)>& add);

// In the mode, after the rank's last call: the sums of p's users beyond
// the one p.grad holds, in user order, handed over once (the caller sums
// each over the ranks like p.grad, then adds it to p.grad). Empty for a
// parameter with one user, or outside the mode.
std::vector<Tensor> take_other_users(const Parameter& p);

}  // namespace meshtrain::nn
