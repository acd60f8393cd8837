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
  child->set_param_hook(hook_);
  child->set_memory_tracker(tracker_);
  child->set_compute_dtype(compute_dtype_);
  child->set_batch_context(batch_context_.step, batch_context_.first_global_sample);
  children_.push_back(std::move(child));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& child : children_) h = child->forward(h);
  return h;
}

Tensor Sequential::backward(const Tensor& grad_out) {
  Tensor g = grad_out;
  for (size_t i = children_.size(); i-- > 0;) {
    if (!g.defined())
      throw InvalidArgument("Sequential::backward",
                            fmt::format("'{}': child {} got no gradient from child {}", prefix_, i, i + 1),
                            "only the first child may skip its input gradient (needs_input_grad = false)");
    g = children_[i]->backward(g);
  }
  return g;
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
