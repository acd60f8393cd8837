#include "meshtrain/plan/mesh_planning.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::plan {
namespace {

std::string join_ints(const std::vector<int>& v, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out.append(sep);
    out += fmt::to_string(v[i]);
  }
  return out;
}

// "<number><suffix>" -> (number, suffix). The number is a plain decimal.
std::pair<double, std::string> split_number(std::string_view text, const std::string& op, const char* example) {
  const std::string_view s = trim(text);
  if (s.empty()) throw InvalidArgument(op, "empty size", fmt::format("write a size like {}", example));
  if (s.front() == '-')
    throw InvalidArgument(op, fmt::format("'{}' is negative", text), fmt::format("write a positive size like {}", example));
  if (!std::isdigit(static_cast<unsigned char>(s.front())) && s.front() != '.')
    throw InvalidArgument(op, fmt::format("'{}' does not start with a number", text),
                          fmt::format("write a size like {}", example));
  double value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value, std::chars_format::fixed);
  if (ec != std::errc() || !std::isfinite(value))
    throw InvalidArgument(op, fmt::format("'{}' is not a number", text), fmt::format("write a size like {}", example));
  return {value, std::string(trim(std::string_view(end, s.data() + s.size() - end)))};
}

std::string gb(double bytes) { return fmt::format("{:.1f} GB", bytes / 1e9); }

std::string count_name(double p) {
  if (p >= 1e12) return fmt::format("{:.3g}T", p / 1e12);
  if (p >= 1e9) return fmt::format("{:.3g}B", p / 1e9);
  if (p >= 1e6) return fmt::format("{:.3g}M", p / 1e6);
  if (p >= 1e3) return fmt::format("{:.3g}K", p / 1e3);
  return fmt::format("{:.3g}", p);
}

// One candidate mesh and its memory estimate.
struct Candidate {
  int pipeline = 1, tensor = 1, context = 1, fsdp = 1, data = 1;
  double state = 0, activations = 0;  // per device

  double bytes() const { return state + activations; }
  auto key() const { return std::tie(pipeline, tensor, context, fsdp); }
};

struct Workload {
  int n = 1, per_node = 8;
  int64_t seq = 1;
  double params = 0, memory = 0, usable = 0;
  double hidden = 1;
  int layers = 1;
  double state_total = 0, act_total = 0;  // unsharded

  bool tensor_ok(int t) const { return n <= per_node ? n % t == 0 : per_node % t == 0 && n % t == 0; }
  bool context_ok(int c) const { return c == 1 || (seq >= kLongSequence && c <= seq); }

  Candidate make(int p, int t, int c, int f) const {
    Candidate k{p, t, c, f, n / (p * t * c * f)};
    k.state = state_total / (static_cast<double>(t) * p * f);
    k.activations = act_total / (static_cast<double>(t) * c);
    return k;
  }
};

// The counterfactual for an axis of `best`: the axis at the next smaller
// allowed size, the freed factor moved to data.
std::optional<Candidate> smaller(const Workload& w, const Candidate& best, int Candidate::*axis) {
  const int v = best.*axis;
  const std::vector<int> dv = mesh::divisors(v);
  for (auto it = dv.rbegin(); it != dv.rend(); ++it) {
    const int u = *it;
    if (u == v) continue;
    if (axis == &Candidate::tensor && !w.tensor_ok(u)) continue;
    Candidate c = best;
    c.*axis = u;
    return w.make(c.pipeline, c.tensor, c.context, c.fsdp);
  }
  return std::nullopt;
}

std::string why_not_smaller(const Workload& w, const Candidate& best, int Candidate::*axis, const char* name) {
  auto c = smaller(w, best, axis);
  if (!c) return "";
  return fmt::format("; {}={} with the other axes unchanged would need {} > {}", name, (*c).*axis, gb(c->bytes()),
                     gb(w.usable));
}

void explain(const Workload& w, const Candidate& b, bool fits, std::vector<std::string>& r) {
  // Pipeline.
  r.push_back("pipeline=1: pipeline stages would divide the model state exactly like fsdp does, but add a "
              "bubble and keep as many activations in flight (1F1B); they pay off when links between nodes "
              "are too slow for fsdp's all-gathers, which this memory model does not estimate");
  // Tensor.
  const std::string node_rule =
      w.n <= w.per_node
          ? fmt::format("all {} devices share one node ({} per node), so any tensor size dividing {} stays on it",
                        w.n, w.per_node, w.n)
          : fmt::format("tensor sizes divide {} devices per node, so every tensor group (consecutive ranks) "
                        "stays inside one node",
                        w.per_node);
  r.push_back(fmt::format("tensor={}: tensor parallelism all-reduces activations in every layer and needs the "
                          "fast links inside a node: {}{}",
                          b.tensor, node_rule,
                          b.tensor > 1 && fits ? why_not_smaller(w, b, &Candidate::tensor, "tensor") : ""));
  // Context.
  if (w.seq < kLongSequence)
    r.push_back(fmt::format("context=1: sequence {} < {}; context parallelism is only used for long sequences",
                            w.seq, kLongSequence));
  else if (b.context == 1)
    r.push_back(fmt::format("context=1: sequence {} >= {} allows context parallelism, but activations fit without it",
                            w.seq, kLongSequence));
  else
    r.push_back(fmt::format("context={}: sequence {} >= {} is split into {} chunks of {} tokens; activations {} / "
                            "(tensor {} x context {}) = {} per device{}",
                            b.context, w.seq, kLongSequence, b.context, (w.seq + b.context - 1) / b.context,
                            gb(w.act_total), b.tensor, b.context, gb(b.activations),
                            fits ? why_not_smaller(w, b, &Candidate::context, "context") : ""));
  // FSDP and data.
  if (b.fsdp == 1)
    r.push_back(fmt::format("fsdp=1: the model state fits unsharded ({} / (tensor {} x pipeline {}) = {})",
                            gb(w.state_total), b.tensor, b.pipeline, gb(b.state)));
  else
    r.push_back(fmt::format("fsdp={}: shards the model state to {} / (tensor {} x pipeline {} x fsdp {}) = {}{}",
                            b.fsdp, gb(w.state_total), b.tensor, b.pipeline, b.fsdp, gb(b.state),
                            fits ? why_not_smaller(w, b, &Candidate::fsdp, "fsdp") : ""));
  r.push_back(fmt::format("data={}: the remaining devices replicate; pipeline {} x data {} x fsdp {} x context {} "
                          "x tensor {} = {}, every device used",
                          b.data, b.pipeline, b.data, b.fsdp, b.context, b.tensor, w.n));
  if (fits)
    r.push_back(fmt::format("per device: state {} + activations {} = {} <= {} usable", gb(b.state),
                            gb(b.activations), gb(b.bytes()), gb(w.usable)));
  else
    r.push_back(fmt::format("does not fit: even the least-memory mesh needs {} per device > {} usable; enable "
                            "activation recomputation, use devices with more memory, or more devices",
                            gb(b.bytes()), gb(w.usable)));
}

}  // namespace

double parse_model_size(std::string_view text, std::string_view what) {
  const std::string op(what);
  const char* example = "7B, 7b, 350M, 1.5T or 125K";
  auto [value, suffix] = split_number(text, op, example);
  const std::string s = to_lower(suffix);
  double scale = 0;
  if (s.empty()) scale = 1;
  else if (s == "k") scale = 1e3;
  else if (s == "m") scale = 1e6;
  else if (s == "b" || s == "g") scale = 1e9;
  else if (s == "t") scale = 1e12;
  else
    throw InvalidArgument(op, fmt::format("'{}' has unknown suffix '{}'", text, suffix),
                          fmt::format("use K, M, B or T (any case), e.g. {}", example));
  if (value <= 0) throw InvalidArgument(op, fmt::format("'{}' is zero", text), fmt::format("write e.g. {}", example));
  return value * scale;
}

double parse_memory_size(std::string_view text, std::string_view what) {
  const std::string op(what);
  const char* example = "80GB, 80G, 24GiB or 512MB";
  auto [value, unit] = split_number(text, op, example);
  std::string u = to_lower(unit);
  double scale = 0;
  if (u.empty() || u == "b") scale = 1;
  else if (u.size() == 3 && u.substr(1) == "ib") {
    const std::string_view prefixes = "kmgt";
    const size_t i = prefixes.find(u[0]);
    if (i != std::string_view::npos) scale = std::ldexp(1.0, 10 * static_cast<int>(i + 1));
  } else {
    if (u.size() == 2 && u[1] == 'b') u.pop_back();
    if (u == "k") scale = 1e3;
    else if (u == "m") scale = 1e6;
    else if (u == "g") scale = 1e9;
    else if (u == "t") scale = 1e12;
  }
  if (scale == 0)
    throw InvalidArgument(op, fmt::format("'{}' has unknown unit '{}'", text, unit),
                          fmt::format("use KB/MB/GB/TB (decimal) or KiB/MiB/GiB/TiB (binary), e.g. {}", example));
  if (value <= 0) throw InvalidArgument(op, fmt::format("'{}' is zero", text), fmt::format("write e.g. {}", example));
  return value * scale;
}

std::string MeshPlan::to_spec() const { return named_shape().to_spec(); }

MeshPlan optimize_for_transformer(int n_devices, std::string_view model_size, int64_t sequence_length,
                                  std::string_view device_memory, int devices_per_node) {
  const char* op = "optimize_for_transformer";
  if (n_devices < 1)
    throw InvalidArgument(op, fmt::format("device count {} < 1", n_devices), "pass the number of devices, at least 1");
  if (sequence_length < 1)
    throw InvalidArgument(op, fmt::format("sequence length {} < 1", sequence_length),
                          "pass the training sequence length in tokens, e.g. 4096");
  if (devices_per_node < 1)
    throw InvalidArgument(op, fmt::format("devices per node {} < 1", devices_per_node),
                          "pass how many devices one node holds, e.g. 8");
  Workload w;
  w.n = n_devices;
  w.per_node = devices_per_node;
  w.seq = sequence_length;
  w.params = parse_model_size(model_size, "model_size");
  w.memory = parse_memory_size(device_memory, "device_memory");
  w.usable = kUsableMemoryFraction * w.memory;
  w.hidden = std::max(1.0, std::cbrt(128.0 * w.params / 12.0));
  w.layers = std::max(1, static_cast<int>(std::lround(w.hidden / 128.0)));
  w.state_total = kBytesPerParameter * w.params;
  w.act_total = kActivationBytesPerToken * static_cast<double>(w.seq) * w.hidden * w.layers;

  std::optional<Candidate> best_fit, least;
  const std::vector<int> divs = mesh::divisors(n_devices);
  // Pipeline stays 1: in this memory model it divides the model state exactly
  // like fsdp but adds a bubble (see the pipeline reason below).
  for (int t : divs) {
    if (!w.tensor_ok(t)) continue;
    for (int c : divs) {
      if ((n_devices / t) % c != 0 || !w.context_ok(c)) continue;
      for (int f : divs) {
        if ((n_devices / t / c) % f != 0) continue;
        const Candidate k = w.make(1, t, c, f);
        if (k.bytes() <= w.usable && (!best_fit || k.key() < best_fit->key())) best_fit = k;
        if (!least || k.bytes() < least->bytes() || (k.bytes() == least->bytes() && k.key() < least->key()))
          least = k;
      }
    }
  }
  const bool fits = best_fit.has_value();
  const Candidate b = fits ? *best_fit : *least;  // least always exists: (1,1,1,1) is a candidate

  MeshPlan plan;
  plan.pipeline = b.pipeline;
  plan.data = b.data;
  plan.fsdp = b.fsdp;
  plan.context = b.context;
  plan.tensor = b.tensor;
  plan.fits = fits;
  plan.bytes_per_device = b.bytes();
  plan.usable_bytes = w.usable;
  const int sizes[] = {b.pipeline, b.data, b.fsdp, b.context, b.tensor};
  for (size_t i = 0; i < mesh::kMeshAxisOrder.size(); ++i)
    if (sizes[i] > 1) {
      plan.shape.push_back(sizes[i]);
      plan.axis_names.emplace_back(mesh::kMeshAxisOrder[i]);
    }
  if (plan.shape.empty()) {
    plan.shape = {1};
    plan.axis_names = {std::string(mesh::kData)};
  }

  auto& r = plan.reasons;
  r.push_back(fmt::format("model {} = {:.3g} parameters; assumed hidden {:.0f}, {} layers (params = 12 x layers x "
                          "hidden^2, hidden = 128 x layers)",
                          count_name(w.params), w.params, w.hidden, w.layers));
  r.push_back(fmt::format("model state {} bytes/parameter (bf16 weights and gradients, fp32 master weights, Adam m "
                          "and v) = {}",
                          kBytesPerParameter, gb(w.state_total)));
  r.push_back(fmt::format("activations {} bytes x sequence {} x hidden {:.0f} x {} layers = {} per sequence "
                          "(micro-batch 1, bf16, flash attention, no recomputation), divided by tensor x context",
                          kActivationBytesPerToken, w.seq, w.hidden, w.layers, gb(w.act_total)));
  r.push_back(fmt::format("usable memory per device: {:.0f}% of {} = {}", kUsableMemoryFraction * 100,
                          gb(w.memory), gb(w.usable)));
  explain(w, b, fits, r);
  return plan;
}

std::string mesh_planning_table(int max_devices) {
  struct Load {
    const char* model;
    int64_t seq;
    const char* title;
  };
  const Load loads[] = {{"350M", 2048, "350M, seq 2K"},
                            {"7B", 4096, "7B, seq 4K"},
                            {"70B", 4096, "70B, seq 4K"},
                            {"7B", 131072, "7B, seq 128K"}};
  auto x = [](const std::vector<int>& s) { return join_ints(s, "x"); };
  std::string out = "| n | 2 axes | 3 axes | 4 axes |";
  std::string rule = "|---:|---|---|---|";
  for (const auto& l : loads) {
    out += fmt::format(" {} |", l.title);
    rule += "---|";
  }
  out += "\n" + rule + "\n";
  for (int n = 1; n <= max_devices; ++n) {
    out += fmt::format("| {} | {} | {} | {} |", n, x(mesh::get_optimal_mesh_shape(n, 2)),
                       x(mesh::get_optimal_mesh_shape(n, 3)), x(mesh::get_optimal_mesh_shape(n, 4)));
    for (const auto& l : loads) {
      const MeshPlan p = optimize_for_transformer(n, l.model, l.seq);
      out += fmt::format(" {}{} |", p.to_spec(), p.fits ? "" : " *");
    }
    out += "\n";
  }
  return out;
}

}  // namespace meshtrain::plan
