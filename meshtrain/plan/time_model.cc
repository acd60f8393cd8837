#include "meshtrain/plan/time_model.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/internal/stage_params.h"
#include "meshtrain/plan/traffic_model.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::plan {
namespace {

constexpr const char* kOp = "plan::predict_time";

// Whether a group name ("data+context") has axis a.
bool has_axis(std::string_view group, std::string_view a) {
  for (size_t at = 0; at <= group.size();) {
    const size_t plus = std::min(group.find('+', at), group.size());
    if (group.substr(at, plus - at) == a) return true;
    at = plus + 1;
  }
  return false;
}

// Ranks of a group (its axes joined by '+', or "tied": two pipeline stages)
// that share a node of `per_node` consecutive ranks, in the layout's rank
// order.
int ranks_per_node(const TrainingLayout& l, const std::string& group, int per_node) {
  int stride = 1, together = 1;
  const std::vector<std::string> order = l.rank_order();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const std::string_view a = *it;
    const int n = l.axis_size(a);
    const bool in = group == "tied" ? a == mesh::kPipeline : has_axis(group, a);
    if (in) together *= std::clamp(per_node / stride, 1, group == "tied" ? 2 : n);
    stride *= n;
  }
  return together;
}

// Seconds of one call on its link.
double call_seconds(const CommCall& c, const TrainingLayout& l, const Hardware& hw) {
  const double n = c.ranks;
  double wire = c.bytes;
  if (c.kind == CommKind::all_reduce) wire = 2 * (n - 1) / n * c.bytes;
  else if (c.kind == CommKind::all_gather || c.kind == CommKind::reduce_scatter) wire = (n - 1) * c.bytes;
  else if (c.kind == CommKind::all_to_all) wire = (n - 1) * c.bytes;  // c.bytes: one peer's block
  else if (c.kind == CommKind::all_to_all_v) wire = (n - 1) / n * c.bytes;  // c.bytes: all it sends
  else if (c.kind == CommKind::recv) return 0;  // paired with a send
  const int together = ranks_per_node(l, c.group, hw.devices_per_node);
  if (together >= c.ranks) return hw.intra.latency + wire / hw.intra.bandwidth;
  // Across nodes each of a node's ranks in the group drives its own link.
  const double bw = std::min(hw.intra.bandwidth, hw.inter.bandwidth * together);
  return hw.inter.latency + wire / bw;
}

}  // namespace

double pipeline_bubble(layout::ScheduleKind schedule, int p, int m, int v) {
  const double dp = p, dm = m, dv = v;
  switch (schedule) {
    case layout::ScheduleKind::gpipe:
    case layout::ScheduleKind::one_f_one_b: return (dp - 1) / (dm + dp - 1);
    case layout::ScheduleKind::interleaved_1f1b: return (dp - 1) / (dv * dm + dp - 1);
    case layout::ScheduleKind::zero_bubble: return 1 - 3 * dm / (2 * dm + dp - 1 + std::max(dm, dp));
  }
  return 0;
}

const DeviceTime& TimePrediction::slowest() const {
  return *std::max_element(devices.begin(), devices.end(),
                           [](const DeviceTime& a, const DeviceTime& b) { return a.step < b.step; });
}

std::vector<std::string> hardware_preset_names() { return {"A100", "H100"}; }

Hardware hardware_preset(std::string_view name) {
  Hardware h;
  h.name = std::string(name);
  h.overlap = true;
  h.devices_per_node = 8;
  if (name == "A100") {
    // 312 TFLOP/s bf16 and 156 TF32 dense peak; large bf16 GEMMs sustain
    // 86% (268 TFLOP/s measured); 2039 GB/s HBM2e; NVLink 3 at 600 GB/s
    // (all_reduce bus bandwidth about 230 GB/s measured on 8 GPUs); one
    // 200 Gb/s HDR InfiniBand port per GPU.
    h.gemm_flops_bf16 = 268e12;
    h.gemm_flops = 134e12;
    h.elementwise_bandwidth = 0.7 * 2039e9;
    h.intra = {.latency = 10e-6, .bandwidth = 230e9};
    h.inter = {.latency = 20e-6, .bandwidth = 24e9};
    h.source = "NVIDIA A100 datasheet; NCCL tests; GEMM efficiency from published measurements (docs/planner.md)";
  } else if (name == "H100") {
    // 989 TFLOP/s bf16 and 494 TF32 dense peak (SXM); large bf16 GEMMs
    // sustain 80% (792 TFLOP/s measured); 3.35 TB/s HBM3; NVLink 4 at
    // 900 GB/s (all_reduce bus bandwidth about 370 GB/s without SHARP on 8
    // GPUs); one 400 Gb/s NDR port per GPU.
    h.gemm_flops_bf16 = 792e12;
    h.gemm_flops = 396e12;
    h.elementwise_bandwidth = 0.7 * 3350e9;
    h.intra = {.latency = 10e-6, .bandwidth = 370e9};
    h.inter = {.latency = 20e-6, .bandwidth = 48e9};
    h.source = "NVIDIA H100 datasheet; NCCL tests; GEMM efficiency from published measurements (docs/planner.md)";
  } else {
    throw InvalidArgument(kOp, fmt::format("hardware '{}'", name),
                          "use A100 or H100, or a file written by meshtrain plan --calibrate");
  }
  h.gemm_overhead_flops = h.gemm_flops_bf16 * 5e-6;  // about 5 us of a GEMM's launch and tail
  h.attention_efficiency = 0.6;                       // flash attention's share of the GEMM rate
  return h;
}

TimePrediction predict_time(const GptShape& g, const TrainingLayout& l, const Hardware& hw) {
  if (hw.gemm_flops <= 0 || hw.elementwise_bandwidth <= 0 || hw.intra.bandwidth <= 0 || hw.inter.bandwidth <= 0)
    throw InvalidArgument(kOp, fmt::format("hardware '{}' without rates", hw.name),
                          "give gemm_flops, elementwise_bandwidth and both links' bandwidth");
  const std::vector<DeviceTraffic> traffic = predict_traffic(g, l);  // checks the layout
  const int p = l.pipeline, k = l.tensor, v = l.virtual_stages, m = l.micro_batches, stages = p * v;
  const bool sharded = l.sharding != std::nullopt;
  const bool half = sharded && l.param_dtype != DType::f32;
  const double compute_bytes = half ? 2.0 : 4.0;
  double rate = half && hw.gemm_flops_bf16 > 0 ? hw.gemm_flops_bf16 : hw.gemm_flops;
  double bw = hw.elementwise_bandwidth, other_rate = hw.attention_efficiency;  // other_rate: of `rate`
  const bool shared = hw.cores > 0 && l.devices() > hw.cores;  // devices take turns on the cores
  if (hw.cores > 0 && !shared) {
    const double threads = std::max(1, hw.cores / l.devices());
    if (threads > 1) {
      rate *= threads * hw.thread_efficiency;
      bw *= threads * hw.other_thread_efficiency;
      other_rate *= hw.other_thread_efficiency / hw.thread_efficiency;
    }
  }
  const double B = static_cast<double>(l.batch / l.data_ranks() / m);
  const double T = static_cast<double>(g.seq), t = T / l.context, C = static_cast<double>(g.width);
  const double V = static_cast<double>(g.vocab), K = k;
  const int d = l.sharding == layout::ZeroStage::no_shard ? 1 : l.shard_ranks();
  const auto gemm = [&](double flops) { return (flops + hw.gemm_overhead_flops) / rate; };
  const auto holdings = internal::holdings(g, stages, k, l.expert);
  const internal::Holdings& held = *holdings;

  // Llama's: key/value features (all heads', this rank's), the SwiGLU's
  // hidden features; MoE layers: top_k, an expert's and the shared experts'
  // features, this rank's experts.
  const double KV = static_cast<double>(g.key_value_heads() * (g.width / g.heads));
  const double kvl = g.llama() && k > g.key_value_heads() ? KV / g.key_value_heads() : KV / K;
  const double F = static_cast<double>(g.mlp_hidden()), E = static_cast<double>(g.moe.experts);
  const double top = static_cast<double>(g.moe.top_k), Fe = static_cast<double>(g.expert_hidden());
  const double Fs = static_cast<double>(g.moe.shared_experts) * Fe;
  const double local = g.moe.active() ? E / l.expert : 0;

  TimePrediction out;
  // 6 FLOPs per active parameter and token (a MoE block's: the router, top_k
  // experts, the shared ones), and attention's 12 T C per token and layer.
  double active = 0;
  for (int64_t b = 0; b < g.layers; ++b)
    active += !g.llama()      ? 12 * C * C
              : g.moe_block(b) ? 2 * C * C + 2 * C * KV + C * E + 3 * C * (top * Fe + Fs)
                               : 2 * C * C + 2 * C * KV + 3 * C * F;
  out.model_flops = 6.0 * (active + V * C) * static_cast<double>(l.batch) * T +
                    12.0 * g.layers * T * C * static_cast<double>(l.batch) * T;
  double bubble_share = 0;
  if (p > 1) bubble_share = pipeline_bubble(l.schedule, p, m, v);
  std::vector<double> per_micro_work(traffic.size()), step_work(traffic.size());
  for (size_t i = 0; i < traffic.size(); ++i) {
    const DeviceTraffic& tr = traffic[i];
    std::vector<int> chunk_stages;  // the stages this rank runs: stage, stage + p, ...
    for (int c = 0; c < v; ++c) chunk_stages.push_back(tr.stage + c * p);
    if (i > 0 && tr.stage == traffic[i - 1].stage &&
        held.same_as_previous(chunk_stages, tr.tensor_rank)) {
      out.devices.push_back(out.devices.back());  // the same shard: the same times
      out.devices.back().tensor_rank = tr.tensor_rank;
      per_micro_work[i] = per_micro_work[i - 1];
      step_work[i] = step_work[i - 1];
      continue;
    }
    DeviceTime dt;
    dt.stage = tr.stage;
    dt.tensor_rank = tr.tensor_rank;
    double backward = 0, attention = 0;  // compute that communication may hide under
    int64_t elements = 0;                // what the optimizer updates
    for (const int s : chunk_stages) {
      const ModelDescription::Stage& stage = held.model().stages[static_cast<size_t>(s)];
      const double blocks = stage.last_block - stage.first_block;
      const bool embed = stage.embed, head = stage.head;
      const double passes = l.recompute ? 2 : 1;  // forwards per micro-batch
      const double tokens = B * t;
      // A block's GEMMs, each once per forward and twice backward: GPT-2's
      // 4 (6, 2, 8, 8 B t C^2 / k FLOPs); Llama's q, k, v, o and the
      // SwiGLU's 3 (or a MoE layer's router, each of this rank's experts'
      // 3 on its B t top_k / local rows, evenly routed, the shared ones' 3).
      std::vector<double> flops;  // one block's GEMMs' FLOPs, forward
      double block_bytes = 0;     // one block's elementwise traffic, forward and backward
      for (int64_t b = stage.first_block; b < stage.last_block; ++b) {
        flops.clear();
        if (!g.llama()) {
          flops = {6 * tokens * C * C / K, 2 * tokens * C * C / K, 8 * tokens * C * C / K, 8 * tokens * C * C / K};
          block_bytes = tokens * (10 * C + 16 * C / K) * compute_bytes;
        } else {
          flops = {2 * tokens * C * C / K, 2 * tokens * C * kvl, 2 * tokens * C * kvl, 2 * tokens * C * C / K};
          if (!g.moe_block(b)) {
            for (int i = 0; i < 3; ++i) flops.push_back(2 * tokens * C * F / K);
            block_bytes = tokens * (10 * C + 6 * F / K) * compute_bytes;
          } else {
            flops.push_back(2 * tokens * C * E);
            const double rows = tokens * top * (l.expert > 1 ? l.expert_imbalance : 1.0) / local;  // per local expert
            for (int e = 0; e < static_cast<int>(local); ++e)
              for (int i = 0; i < 3; ++i) flops.push_back(2 * rows * C * Fe / K);
            if (Fs > 0)
              for (int i = 0; i < 3; ++i) flops.push_back(2 * tokens * C * Fs / K);
            // Routing, the rows' copies out and back (4 C per assignment), the experts' SwiGLU.
            block_bytes = tokens * (10 * C + 2 * E + top * (4 * C + 6 * Fe / K) + 6 * Fs / K) * compute_bytes;
          }
        }
        for (double f : flops) {
          const double one = gemm(f);
          dt.gemm += m * (passes + 2) * one;
          backward += m * 2 * one;
        }
        dt.elementwise += m * (passes + 2) * block_bytes / bw;
        backward += m * 2 * block_bytes / bw;
      }
      if (head) {
        const double one = gemm(2 * tokens * C * V / K);
        dt.gemm += m * 3 * one;
        backward += m * 2 * one;
      }
      const double att = 4 * B * (C / K) * T * (T + 1) / 2 / l.context / (rate * other_rate);
      dt.attention += m * blocks * (passes + 2.5) * att;
      attention += m * blocks * (passes + 2.5) * att;
      backward += m * blocks * 2.5 * att;
      double bytes = 0;
      if (head) bytes += m * tokens * 5 * V / K * 4;
      if (embed) bytes += m * tokens * 3 * C * 4;
      dt.elementwise += bytes / bw;
      for (const internal::StageParam& q : held.at(s, tr.tensor_rank))
        elements += sharded && l.sharding != layout::ZeroStage::no_shard &&
                            sharding::FSDPStrategy::large_enough(q.numel, l.min_weight_size)
                        ? (q.numel + d - 1) / d
                        : q.numel;
    }
    dt.optimizer = 32.0 * static_cast<double>(elements) / bw;
    dt.bytes = (dt.elementwise + dt.optimizer) * bw;
    // Communication: per micro-batch (tensor, context, pipeline) or per step.
    double micro_comm = 0, step_comm = 0;
    double hide_backward = 0, hide_forward = 0, hide_attention = 0;
    for (const CommCall& c : tr.calls) {
      const double s = static_cast<double>(c.calls) * call_seconds(c, l, hw);
      dt.comm += s;
      auto it = std::find_if(dt.comm_by_group.begin(), dt.comm_by_group.end(),
                             [&](const auto& e) { return e.first == c.group; });
      if (it == dt.comm_by_group.end()) dt.comm_by_group.emplace_back(c.group, s);
      else it->second += s;
      if (!hw.overlap || c.overlap == CommOverlap::none || c.overlap == CommOverlap::step) {
        (c.per_micro_batch ? micro_comm : step_comm) += s;
      } else if (c.overlap == CommOverlap::backward) {
        hide_backward += s;
      } else if (c.overlap == CommOverlap::forward) {
        hide_forward += s;
      } else {
        hide_attention += s;
      }
    }
    const double exposed_attention = std::max(0.0, hide_attention - attention);
    micro_comm += exposed_attention;
    step_comm += std::max(0.0, hide_backward - backward) + std::max(0.0, hide_forward - dt.compute());
    dt.comm_exposed = micro_comm + step_comm;
    per_micro_work[i] = dt.gemm + dt.attention + dt.elementwise + micro_comm;
    step_work[i] = dt.optimizer + step_comm;
    out.devices.push_back(std::move(dt));
  }
  const double pipe = *std::max_element(per_micro_work.begin(), per_micro_work.end());
  double all_work = 0;  // every device's, for shared cores
  for (size_t i = 0; i < out.devices.size(); ++i) {
    DeviceTime& dt = out.devices[i];
    const double span = p > 1 ? pipe / (1 - bubble_share) : per_micro_work[i];
    dt.bubble = span - per_micro_work[i];
    dt.step = span + step_work[i];
    out.step = std::max(out.step, dt.step);
    all_work += (per_micro_work[i] + step_work[i]) * (l.devices() / (p * k));
  }
  if (shared) {
    // Each device's share of the cores: a waiting device yields its core.
    out.step = std::max(out.step, all_work / hw.cores);
    for (size_t i = 0; i < out.devices.size(); ++i) {
      out.devices[i].step = out.step;  // waiting for the cores or for the pipeline alike
      out.devices[i].bubble = out.step - per_micro_work[i] - step_work[i];
    }
  }
  return out;
}

}  // namespace meshtrain::plan
