#include "meshtrain/nn/sequential.h"

#include <fmt/format.h>

#include <unordered_set>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/internal/buffers.h"

namespace meshtrain::nn {

std::string Sequential::next_name() const {
  return internal::join_name(prefix_, std::to_string(children_.size()));
}

void Sequential::add_module(std::unique_ptr<Module> child) {
  if (!child) throw InvalidArgument("Sequential::add", "child is null", "pass a constructed module");
  std::unordered_set<std::string> names;
  for (Parameter* p : parameters()) names.insert(p->name);
  for (Parameter* p : child->parameters()) {
    if (!names.insert(p->name).second)
      throw InvalidArgument("Sequential::add",
                            fmt::format("'{}': parameter name '{}' is already taken", prefix_, p->name),
                            "build each child with next_name() as its prefix");
  }
  child->set_training(training_);
  child->set_param_hook(nullptr);
  for (ParamHook* h : hooks()) child->add_hook(h);
  child->set_memory_tracker(tracker_);
  child->set_compute_dtype(compute_dtype_);
  child->set_batch_context(batch_context_);
  children_.push_back(std::move(child));
}

std::string Sequential::describe() const { return fmt::format("Sequential '{}'", prefix_); }

Tensor Sequential::do_forward(const Tensor& x, Saved& saved) {
  Tensor h = x;
  for (size_t i = 0; i < children_.size(); ++i) h = children_[i]->forward(h, saved.child(i));
  return h;
}

// The reverse chain of `step` (a child's backward or backward_input).
template <typename Step>
static Tensor reverse_chain(const std::string& prefix, size_t n, const Tensor& grad_out, Step step) {
  Tensor g = grad_out;
  for (size_t i = n; i-- > 0;) {
    if (!g.defined())
      throw InvalidArgument("Sequential::backward",
                            fmt::format("'{}': child {} got no gradient from child {}", prefix, i, i + 1),
                            "only the first child may skip its input gradient (needs_input_grad = false)");
    g = step(i, g);
  }
  return g;
}

Tensor Sequential::do_backward(const Tensor& grad_out, Saved& saved) {
  return reverse_chain(prefix_, children_.size(), grad_out,
                       [&](size_t i, const Tensor& g) { return children_[i]->backward(g, saved.child(i)); });
}

Tensor Sequential::do_backward_input(const Tensor& grad_out, Saved& saved) {
  return reverse_chain(prefix_, children_.size(), grad_out,
                       [&](size_t i, const Tensor& g) { return children_[i]->backward_input(g, saved.child(i)); });
}

void Sequential::do_backward_weight(Saved& saved) {
  for (size_t i = children_.size(); i-- > 0;) children_[i]->backward_weight(saved.child(i));
}

std::vector<Parameter*> Sequential::parameters() {
  std::vector<Parameter*> all;
  for (auto& child : children_) {
    std::vector<Parameter*> ps = child->parameters();
    all.insert(all.end(), ps.begin(), ps.end());
  }
  return all;
}

std::vector<Module*> Sequential::children() {
  std::vector<Module*> out;
  for (auto& child : children_) out.push_back(child.get());
  return out;
}

}  // namespace meshtrain::nn
