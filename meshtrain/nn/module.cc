#include "meshtrain/nn/module.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <string_view>

#include "meshtrain/core/strings.h"

namespace meshtrain::nn {

std::vector<std::pair<std::string, std::string>> fold_layer_rows(
    const std::vector<std::pair<std::string, std::string>>& rows) {
  std::vector<std::string> patterns;
  std::map<std::string, std::set<std::string>> descriptions;  // pattern -> those seen
  std::map<std::string, int> count;                           // pattern -> rows
  for (const auto& [name, what] : rows) {
    std::string pattern;
    for (std::string_view part : split(name, '.')) {
      if (!pattern.empty()) pattern += '.';
      if (!part.empty() && std::all_of(part.begin(), part.end(), ::isdigit))
        pattern += '*';
      else
        pattern.append(part);
    }
    descriptions[pattern].insert(what);
    ++count[pattern];
    patterns.push_back(std::move(pattern));
  }
  std::vector<std::pair<std::string, std::string>> out;
  std::set<std::string> done;
  for (size_t i = 0; i < rows.size(); ++i) {
    const bool fold = descriptions[patterns[i]].size() == 1 && count[patterns[i]] > 1;
    if (fold && !done.insert(patterns[i]).second) continue;
    out.emplace_back(fold ? patterns[i] : rows[i].first, rows[i].second);
  }
  return out;
}

bool Module::owns_parameters() {
  if (owns_parameters_ < 0) {
    std::vector<Parameter*> listed;
    for (Module* c : children())
      for (Parameter* p : c->parameters()) listed.push_back(p);
    const std::vector<Parameter*> mine = parameters();
    owns_parameters_ = std::any_of(mine.begin(), mine.end(), [&](Parameter* p) {
                         return std::find(listed.begin(), listed.end(), p) == listed.end();
                       })
                           ? 1
                           : 0;
  }
  return owns_parameters_ == 1;
}

void Module::add_hook(ParamHook* hook) {
  if (hook == nullptr) throw InvalidArgument("Module::add_hook", "hook is null", "pass a hook object");
  if (std::find(hooks_.begin(), hooks_.end(), hook) != hooks_.end())
    throw InvalidArgument("Module::add_hook", fmt::format("{}: this hook is already installed", describe()),
                          "install each hook once (remove_hook first to move it)");
  hooks_.push_back(hook);
  for (Module* c : children()) c->add_hook(hook);
}

void Module::remove_hook(ParamHook* hook) {
  std::erase(hooks_, hook);
  for (Module* c : children()) c->remove_hook(hook);
}

void Module::set_param_hook(ParamHook* hook) {
  hooks_.clear();
  if (hook != nullptr) hooks_.push_back(hook);
  for (Module* c : children()) c->set_param_hook(hook);
}

void Module::begin_scope(Pass pass) {
  for (ParamHook* h : hooks_)
    if (h->scopes(*this)) h->before_use(*this, pass);
}

void Module::end_scope(Pass pass) {
  for (auto it = hooks_.rbegin(); it != hooks_.rend(); ++it)
    if ((*it)->scopes(*this)) (*it)->after_use(*this, pass);
}

void Module::require_phase(const Saved& saved, Saved::Phase phase, const char* op) const {
  if (saved.phase == phase) return;
  if (phase == Saved::Phase::forwarded)
    throw InvalidArgument(op,
                          fmt::format("{}: no forward to go back through{}", describe(),
                                      saved.phase == Saved::Phase::input_done ? " (its input gradient is done)" : ""),
                          saved.phase == Saved::Phase::input_done
                              ? "finish a split backward with backward_weight"
                              : "call forward before backward, into the same Saved (one backward per forward)");
  throw InvalidArgument(op, fmt::format("{}: backward_weight without backward_input", describe()),
                        "call backward_input(grad_out, saved) first, with the same Saved");
}

Tensor Module::forward(const Tensor& x, Saved& saved) {
  saved.batch = batch_context_;
  saved.phase = Saved::Phase::empty;
  saved.recomputed.reset();
  begin_scope(Pass::forward);
  Tensor y;
  if (recompute_) {
    // Only the input survives the call; the activations die with `scratch`
    // (the output itself lives on in the caller's hands).
    saved.input = x;
    Saved scratch;
    scratch.batch = saved.batch;
    y = do_forward(x, scratch);
  } else {
    y = do_forward(x, saved);
  }
  end_scope(Pass::forward);
  saved.phase = Saved::Phase::forwarded;
  return y;
}

Saved& Module::backward_target(Saved& saved, const char* op) {
  if (!recompute_) return saved;
  if (saved.recomputed) return *saved.recomputed;
  if (!saved.input.defined())
    throw InvalidArgument(op, fmt::format("{}: recompute mode, but the forward kept no input", describe()),
                          "set_recompute before the forward whose backward follows");
  // Replay the forward under the batch context it ran with (dropout masks
  // and noise are keyed by it), then restore the current one.
  const BatchContext now = batch_context_;
  BatchContext replay = saved.batch;
  replay.replay = true;
  set_batch_context(replay);
  saved.recomputed = std::make_unique<Saved>();
  saved.recomputed->batch = saved.batch;
  begin_scope(Pass::forward);
  do_forward(saved.input, *saved.recomputed);
  end_scope(Pass::forward);
  set_batch_context(now);
  return *saved.recomputed;
}

void Module::end_call(Saved& saved) {
  saved.phase = Saved::Phase::empty;
  if (recompute_) {
    saved.recomputed.reset();
    saved.input = Tensor();
  }
}

Tensor Module::backward(const Tensor& grad_out, Saved& saved) {
  const char* op = "Module::backward";
  require_phase(saved, Saved::Phase::forwarded, op);
  Saved& target = backward_target(saved, op);
  begin_scope(Pass::backward);
  Tensor dx = do_backward(grad_out, target);
  end_scope(Pass::backward);
  end_call(saved);
  return dx;
}

Tensor Module::backward_input(const Tensor& grad_out, Saved& saved) {
  const char* op = "Module::backward_input";
  require_phase(saved, Saved::Phase::forwarded, op);
  Saved& target = backward_target(saved, op);
  begin_scope(Pass::backward_input);
  Tensor dx = do_backward_input(grad_out, target);
  end_scope(Pass::backward_input);
  saved.phase = Saved::Phase::input_done;
  return dx;
}

void Module::backward_weight(Saved& saved) {
  const char* op = "Module::backward_weight";
  require_phase(saved, Saved::Phase::input_done, op);
  Saved& target = recompute_ ? *saved.recomputed : saved;
  begin_scope(Pass::backward_weight);
  do_backward_weight(target);
  end_scope(Pass::backward_weight);
  end_call(saved);
}

void fill_box(const Parameter& p, const std::vector<int64_t>& offset, const std::vector<int64_t>& size, float* out) {
  const std::vector<int64_t>& shape = p.info.shape;
  const size_t nd = shape.size();
  bool ok = offset.size() == nd && size.size() == nd && static_cast<bool>(p.init);
  for (size_t d = 0; ok && d < nd; ++d)
    ok = offset[d] >= 0 && size[d] >= 0 && offset[d] + size[d] <= shape[d];
  if (!ok)
    throw InvalidArgument("fill_box",
                          fmt::format("'{}' of shape {}: box offset {} size {}", p.name, shape_to_string(shape),
                                      shape_to_string(offset), shape_to_string(size)),
                          "give an offset and size per dimension that lie inside the parameter (and an init)");
  int64_t total = 1;
  for (int64_t s : size) total *= s;
  if (total == 0) return;
  if (nd == 0) {
    p.init(0, 1, out);
    return;
  }
  // The box is a set of runs along the last dim: walk the other dims' index
  // like an odometer and ask init for each run.
  std::vector<int64_t> strides(nd, 1);
  for (size_t d = nd - 1; d-- > 0;) strides[d] = strides[d + 1] * shape[d + 1];
  std::vector<int64_t> idx(nd - 1, 0);
  const int64_t run = size[nd - 1];
  for (int64_t done = 0; done < total; done += run) {
    int64_t start = offset[nd - 1];
    for (size_t d = 0; d + 1 < nd; ++d) start += (offset[d] + idx[d]) * strides[d];
    p.init(start, run, out + done);
    for (size_t d = nd - 1; d-- > 0;) {
      if (++idx[d] < size[d]) break;
      idx[d] = 0;
    }
  }
}

ParamInit box_init(ParamInit whole, std::vector<int64_t> shape, sharding::Box box) {
  const size_t nd = shape.size();
  bool ok = nd >= 1 && box.offsets.size() == nd && box.sizes.size() == nd && static_cast<bool>(whole);
  for (size_t d = 0; ok && d < nd; ++d)
    ok = box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] + box.sizes[d] <= shape[d];
  if (!ok)
    throw InvalidArgument("box_init", fmt::format("box {} of shape {}", box.to_string(), shape_to_string(shape)),
                          "give a box (offset and size per dimension) inside the shape, and an init");
  return [whole = std::move(whole), shape = std::move(shape), box = std::move(box)](int64_t start, int64_t count,
                                                                                     float* out) {
    // Element e of the block sits at global row-major index sum_d (offset_d +
    // i_d) stride_d, where (i_d) is e's index in the block; the block is runs
    // along the last dim, each one call of `whole`.
    const size_t nd = shape.size();
    std::vector<int64_t> strides(nd, 1);
    for (size_t d = nd - 1; d-- > 0;) strides[d] = strides[d + 1] * shape[d + 1];
    const int64_t run = box.sizes[nd - 1];
    if (run == 0) return;
    int64_t e = start;
    while (e < start + count) {
      int64_t r = e / run, global = box.offsets[nd - 1] + e % run;
      for (size_t d = nd - 1; d-- > 0;) {
        global += (box.offsets[d] + r % box.sizes[d]) * strides[d];
        r /= box.sizes[d];
      }
      const int64_t n = std::min(run - e % run, start + count - e);
      whole(global, n, out + (e - start));
      e += n;
    }
  };
}

}  // namespace meshtrain::nn
