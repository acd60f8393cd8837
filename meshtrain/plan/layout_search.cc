#include "meshtrain/plan/layout_search.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/internal/stage_params.h"

namespace meshtrain::plan {
namespace {

constexpr const char* kOp = "plan::search_layouts";
constexpr double kGiB = double(uint64_t{1} << 30);

std::string mesh_of(const TrainingLayout& l) {
  std::string out;
  for (std::string_view a : kPlannedAxes) {
    const int n = l.axis_size(a);
    if (n > 1) out += fmt::format("{}{}={}", out.empty() ? "" : ",", a, n);
  }
  return out.empty() ? "data=1" : out;
}

// Bytes of model state per device at least (parameters, gradients,
// optimizer), without activations: a quick bound to skip what cannot fit.
double state_bound(const GptShape& g, const TrainingLayout& l) {
  double params = 0;  // the model's elements (a routed expert's on 1 / expert of the ranks)
  for (const layout::ModelParameter& p : internal::describe(g, 1)->params)
    params += static_cast<double>(p.info.numel()) / (p.info.routed_expert() ? l.expert : 1);
  const double per = params / (l.tensor * l.pipeline);
  const double pb = dtype_size(l.param_dtype), d = l.shard_ranks();
  const double master = l.param_dtype == DType::f32 ? 0 : 4;
  if (!l.sharding) return per * 16;  // plain data parallelism
  switch (*l.sharding) {
    case layout::ZeroStage::no_shard: return per * (2 * pb + master + 8);
    case layout::ZeroStage::zero1: return per * (2 * pb + (master + 8) / d);
    case layout::ZeroStage::zero2: return per * (pb + (pb + master + 8) / d);
    case layout::ZeroStage::zero3: return per * (2 * pb + master + 8) / d;
  }
  return 0;
}

void price(const GptShape& g, const Hardware& hw, Candidate& c) {
  const TimePrediction t = predict_time(g, c.layout, hw);
  c.step = t.step;
  c.tokens_per_second_per_device = static_cast<double>(c.layout.batch * g.seq) / t.step / c.layout.devices();
  c.model_flops_per_device = t.model_flops / t.step / c.layout.devices();
}

std::vector<std::string> explain(const GptShape& g, const Candidate& c, const SearchOptions& o, const Hardware& hw) {
  const TrainingLayout& l = c.layout;
  const TimePrediction t = predict_time(g, l, hw);
  const DeviceTime& s = t.slowest();
  const double peak = l.param_dtype != DType::f32 && hw.gemm_flops_bf16 > 0 ? hw.gemm_flops_bf16 : hw.gemm_flops;
  std::vector<std::string> why;
  why.push_back(fmt::format("{:.3f} s per step: {:.0f} tokens/s and {:.0f} model TFLOP/s per device ({:.0f}% of "
                            "{}'s sustained GEMM rate); {:.1f} of {:.1f} usable GiB on the fullest device",
                            c.step, c.tokens_per_second_per_device, c.model_flops_per_device / 1e12,
                            100 * c.model_flops_per_device / peak, hw.name, c.memory / kGiB, o.usable() / kGiB));
  auto group_ms = [&](std::string_view group) {
    for (const auto& [name, sec] : s.comm_by_group)
      if (name == group) return sec * 1e3;
    return 0.0;
  };
  if (l.tensor > 1)
    why.push_back(fmt::format("tensor={} within a node of {}: every layer's weights split {} ways; its "
                              "all-reduces{} cost {:.1f} ms per step on the critical path, on the node's link",
                              l.tensor, hw.devices_per_node, l.tensor,
                              l.sequence_parallel ? " (as all-gathers and reduce-scatters: sequence parallel)" : "",
                              group_ms(mesh::kTensor)));
  else
    why.push_back("no tensor split: the layers fit whole, and its per-layer collectives would be on the critical path");
  if (l.pipeline > 1)
    why.push_back(fmt::format("pipeline={} ({} with {} micro-batches{}): {:.1f} ms of the step idle in fill and drain "
                              "({:.1f}%)",
                              l.pipeline, layout::to_string(l.schedule), l.micro_batches,
                              l.virtual_stages > 1 ? fmt::format(", {} chunks per rank", l.virtual_stages) : "",
                              s.bubble * 1e3, 100 * s.bubble / c.step));
  if (l.context > 1)
    why.push_back(fmt::format("context={}: each rank attends over 1/{} of the sequence; {} {:.1f} ms per step",
                              l.context, l.context,
                              l.cp_comm == layout::ContextComm::ring ? "ring exchanges (under attention)"
                                                  : "all_to_alls (Ulysses, on the critical path)",
                              group_ms(mesh::kContext)));
  if (l.expert > 1)
    why.push_back(fmt::format("expert={}: each rank holds {} of the {} experts of every MoE layer; its all-to-alls of "
                              "the routed rows cost {:.1f} ms per step on the critical path",
                              l.expert, g.moe.experts / l.expert, g.moe.experts, group_ms(mesh::kExpert)));
  const int dp = l.data * l.fsdp;
  if (dp > 1) {
    // The model, pipeline and context axes' calls are always exposed (or
    // hidden under attention); the rest is the data-parallel strategy's.
    const double other_ms = group_ms(mesh::kTensor) + group_ms(mesh::kContext) + group_ms(mesh::kPipeline);
    const char* stage = l.sharding == layout::ZeroStage::zero3   ? "zero3 (parameters, gradients and optimizer sharded)"
                        : l.sharding == layout::ZeroStage::zero2 ? "zero2 (gradients and optimizer sharded)"
                        : l.sharding == layout::ZeroStage::zero1 ? "zero1 (optimizer sharded)"
                                                        : "plain data parallelism";
    why.push_back(fmt::format("data-parallel {} with {}: {:.1f} ms of communication per step, {:.1f} ms of it exposed "
                              "after the overlap with compute",
                              dp, stage, s.comm * 1e3 - other_ms, std::max(0.0, s.comm_exposed * 1e3 - other_ms)));
  }
  if (l.recompute) {
    TrainingLayout no = l;
    no.recompute = false;
    const double without = predict_memory(g, no).worst().total();
    why.push_back(without > o.device_memory
                      ? fmt::format("recompute: without it the fullest device would need {:.1f} GiB", without / kGiB)
                      : fmt::format("recompute: it fits without ({:.1f} GiB) but rebuilds activations in {:.0f}% less "
                                    "memory at about a third more compute",
                                    without / kGiB, 100 * (1 - c.memory / without)));
  }
  return why;
}

}  // namespace

std::string describe_layout(const TrainingLayout& l) {
  std::string s = mesh_of(l);
  if (l.sharding) s += fmt::format(" {}", layout::zero_stage_name(*l.sharding));
  if (l.param_dtype != DType::f32) s += fmt::format(" {}", dtype_name(l.param_dtype));
  if (l.pipeline > 1)
    s += fmt::format(", {}{} m={}", layout::to_string(l.schedule),
                     l.virtual_stages > 1 ? fmt::format(" v={}", l.virtual_stages) : "",
                     l.micro_batches);
  else if (l.micro_batches > 1)
    s += fmt::format(", m={}", l.micro_batches);
  if (l.sequence_parallel) s += ", sp";
  if (l.recompute) s += ", recompute";
  return s;
}

Candidate evaluate_layout(const GptShape& g, const TrainingLayout& l, const SearchOptions& o, const Hardware& hw) {
  Candidate c{.layout = l, .mesh = mesh_of(l), .label = describe_layout(l)};
  price(g, hw, c);
  c.memory = predict_memory(g, l).worst().total();
  c.fits = c.memory <= o.usable();
  c.reasons = explain(g, c, o, hw);
  return c;
}

SearchResult search_layouts(const GptShape& g, const SearchOptions& o, const Hardware& hw) {
  if (o.devices < 1 || o.batch < 1 || o.device_memory <= 0 || o.keep < 1 || !(o.reserve >= 0 && o.reserve < 1))
    throw InvalidArgument(kOp,
                          fmt::format("devices {}, batch {}, device memory {}, reserve {}, keep {}", o.devices, o.batch,
                                      o.device_memory, o.reserve, o.keep),
                          "give at least one device, a positive batch and device memory, and 0 <= reserve < 1");
  std::vector<Candidate> all;
  using Stage = std::optional<layout::ZeroStage>;  // nullopt: plain data parallelism
  using enum layout::ZeroStage;
  const std::vector<Stage> stages = o.precision == DType::f32 ? std::vector<Stage>{std::nullopt, zero1, zero2, zero3}
                                                              : std::vector<Stage>{zero1, zero2, zero3};
  for (int t : mesh::divisors(o.devices)) {
    if (t > hw.devices_per_node || g.heads % t != 0 || g.width % t != 0) continue;
    for (int p : mesh::divisors(o.devices / t)) {
      if (p > g.layers) continue;
      for (int c : mesh::divisors(o.devices / t / p)) {
        // Context parallelism for long sequences only: at least 1024 tokens per rank.
        if (c > 1 && (g.seq % (2 * c) != 0 || g.seq / c < 1024)) continue;  // the trainer's rule, long sequences
        if (c > 1 && g.moe.active()) continue;  // the trainer refuses MoE layers with a context axis
        const int d = o.devices / t / p / c;
        if (o.batch % d != 0) continue;
        const int64_t per_rank = o.batch / d;
        // The data-parallel ranks' expert axis (a MoE model: sizes dividing its experts).
        for (int e : mesh::divisors(d)) {
        if (e > 1 && (!g.moe.active() || g.moe.experts % e != 0)) continue;
        const int r = d / e;  // the replicas: data, or fsdp under zero3
        for (const Stage z : stages) {
          if (z != std::nullopt && r * c == 1 && z != layout::ZeroStage::zero1) continue;  // nothing to shard over
          // Micro-batches: powers of two that divide the rank's samples,
          // and one sample each.
          std::vector<int64_t> micro;
          for (int64_t m = 1; m <= per_rank; m *= 2)
            if (per_rank % m == 0) micro.push_back(m);
          if (micro.back() != per_rank) micro.push_back(per_rank);
          for (const int64_t m : micro) {
            for (int v : {1, 2, 4}) {
              if (v > 1 && (p == 1 || m % p != 0 || g.layers % (p * v) != 0)) continue;
              for (bool sp : {t > 1 && !g.moe.active()}) {  // MoE layers: no sequence parallelism
                for (bool recompute : {false, true}) {
                  TrainingLayout l{.data = z == zero3 ? 1 : r, .fsdp = z == zero3 ? r : 1,
                                   .tensor = t, .pipeline = p, .context = c, .expert = e,
                                   .expert_imbalance = o.expert_imbalance, .sharding = z,
                                   .sequence_parallel = sp,
                                   .schedule = v > 1 ? layout::ScheduleKind::interleaved_1f1b
                                                     : layout::ScheduleKind::one_f_one_b,
                                   .virtual_stages = v, .micro_batches = static_cast<int>(m), .cp_comm = o.cp_comm,
                                   .recompute = recompute,
                                   .param_dtype = z == std::nullopt ? DType::f32 : o.precision,
                                   .reduce_dtype = z == std::nullopt ? DType::f32 : o.precision,
                                   .batch = o.batch};
                  Candidate cand{.layout = l, .mesh = mesh_of(l), .label = describe_layout(l)};
                  try {
                    price(g, hw, cand);
                  } catch (const InvalidArgument&) {
                    continue;  // a layout the runtime refuses (check_layout says why)
                  }
                  all.push_back(std::move(cand));
                }
              }
            }
          }
        }
        }
      }
    }
  }
  SearchResult r;
  r.considered = static_cast<int>(all.size());
  std::stable_sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) { return a.step < b.step; });
  for (Candidate& c : all) {
    if (static_cast<int>(r.fitting.size()) >= o.keep) break;
    const double bound = state_bound(g, c.layout);
    if (bound > o.usable()) {
      c.memory = bound;
      c.reasons = {"at least that for its model state alone (parameters, gradients, optimizer)"};
      if (r.not_fitting.size() < static_cast<size_t>(o.keep)) r.not_fitting.push_back(c);
      continue;
    }
    const MemoryPrediction m = predict_memory(g, c.layout);
    c.memory = m.worst().total();
    c.fits = c.memory <= o.usable();
    if (!c.fits) {
      c.reasons = {fmt::format("activations {:.1f} GiB on the fullest device", m.worst().activations / kGiB)};
      if (r.not_fitting.size() < static_cast<size_t>(o.keep)) r.not_fitting.push_back(c);
      continue;
    }
    r.fitting.push_back(c);
  }
  // Equally fast (within 0.1%): the one that needs less memory first.
  std::stable_sort(r.fitting.begin(), r.fitting.end(), [](const Candidate& a, const Candidate& b) {
    if (std::abs(a.step - b.step) > 1e-3 * std::min(a.step, b.step)) return a.step < b.step;
    return a.memory < b.memory;
  });
  for (Candidate& c : r.fitting) c.reasons = explain(g, c, o, hw);
  if (r.fitting.size() > 1)
    r.fitting[0].reasons.push_back(fmt::format("the next, {}, is predicted {:.1f}% slower", r.fitting[1].label,
                                               100 * (r.fitting[1].step / r.fitting[0].step - 1)));
  return r;
}

}  // namespace meshtrain::plan
