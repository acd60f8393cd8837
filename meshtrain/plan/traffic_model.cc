#include "meshtrain/plan/traffic_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <initializer_list>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/internal/stage_params.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::plan {
namespace {

struct Group {
  std::string name;
  int ranks = 1;
};

// The communicator over `axes` (a subset of data, fsdp, context, tensor,
// pipeline), named by its axes of size > 1 in mesh order.
Group group_of(const TrainingLayout& l, std::initializer_list<std::string_view> axes) {
  Group g;
  for (std::string_view a : kPlannedAxes) {
    if (std::find(axes.begin(), axes.end(), a) == axes.end()) continue;
    const int n = l.axis_size(a);
    if (n == 1) continue;
    if (!g.name.empty()) g.name += '+';
    g.name += a;
    g.ranks *= n;
  }
  return g;
}

class Calls {
 public:
  void add(const Group& g, CommKind kind, double bytes, int64_t calls, const char* what,
           CommOverlap overlap = CommOverlap::none, bool per_micro_batch = false) {
    if (g.ranks <= 1 || calls <= 0 || bytes <= 0) return;
    for (CommCall& c : out_)
      if (c.group == g.name && c.kind == kind && c.bytes == bytes && c.what == what) {
        c.calls += calls;
        return;
      }
    out_.push_back({.group = g.name, .ranks = g.ranks, .kind = kind, .bytes = bytes, .calls = calls, .what = what,
                    .overlap = overlap, .per_micro_batch = per_micro_batch});
  }
  std::vector<CommCall> take() { return std::move(out_); }

 private:
  std::vector<CommCall> out_;
};

// DataParallel's buckets (parallel/data_parallel.h): parameters in reverse
// order, greedily into buffers of at most bucket_bytes (a larger parameter
// gets its own).
std::vector<double> bucket_sizes(const std::vector<internal::StageParam>& ps, double bucket_bytes) {
  std::vector<double> out;
  double cur = 0;
  for (auto it = ps.rbegin(); it != ps.rend(); ++it) {
    const double b = 4.0 * static_cast<double>(it->numel);
    if (cur > 0 && cur + b > bucket_bytes) {
      out.push_back(cur);
      cur = 0;
    }
    cur += b;
  }
  if (cur > 0) out.push_back(cur);
  return out;
}

}  // namespace

std::string_view comm_kind_name(CommKind kind) {
  switch (kind) {
    case CommKind::all_reduce: return "all_reduce";
    case CommKind::all_gather: return "all_gather";
    case CommKind::reduce_scatter: return "reduce_scatter";
    case CommKind::all_to_all: return "all_to_all";
    case CommKind::all_to_all_v: return "all_to_all_v";
    case CommKind::send: return "send";
    case CommKind::recv: return "recv";
  }
  return "?";
}

std::vector<DeviceTraffic> predict_traffic(const GptShape& g, const TrainingLayout& l) {
  check_layout(g, l);
  const int p = l.pipeline, k = l.tensor, v = l.virtual_stages, n = l.context, m = l.micro_batches;
  const int stages = p * v;
  const bool sharded = l.sharding != std::nullopt;
  const Group grad = group_of(l, {mesh::kData, mesh::kFsdp, mesh::kContext});  // the replicas
  const Group losses = group_of(l, {mesh::kData, mesh::kFsdp, mesh::kExpert, mesh::kContext});
  const Group tokens = group_of(l, {mesh::kData, mesh::kFsdp, mesh::kExpert});
  const Group experts = group_of(l, {mesh::kExpert});
  const Group shard = l.hybrid ? group_of(l, {mesh::kFsdp}) : grad;
  const Group replicate = l.hybrid ? group_of(l, {mesh::kData}) : Group{};
  const Group tensor = group_of(l, {mesh::kTensor}), context = group_of(l, {mesh::kContext});
  const Group pipeline = group_of(l, {mesh::kPipeline});
  const int d = l.sharding == layout::ZeroStage::no_shard ? 1 : shard.ranks;
  const double micro = static_cast<double>(l.batch / l.data_ranks() / m);
  const int64_t t = g.seq / n;
  const int64_t t_pad = l.sequence_parallel ? (t + k - 1) / k * k : t;
  const double C = static_cast<double>(g.width);
  const double act = micro * static_cast<double>(t) * C * 4;                   // a region's full activations
  const double act_sp = micro * static_cast<double>(t_pad / k) * C * 4;        // a sequence shard
  const double boundary = l.sequence_parallel ? act_sp : act;                  // what crosses a stage boundary
  const double pb = static_cast<double>(dtype_size(l.param_dtype));
  const double gb = static_cast<double>(dtype_size(l.reduce_dtype));
  const auto holdings = internal::holdings(g, stages, k, l.expert);
  const internal::Holdings& held = *holdings;

  std::vector<DeviceTraffic> out;
  for (int r = 0; r < p; ++r)
    for (int tr = 0; tr < k; ++tr) {
      std::vector<int> chunk_stages;  // the stages this rank runs: r, r + p, ...
      for (int c = 0; c < v; ++c) chunk_stages.push_back(r + c * p);
      // Tensor ranks differ only in their vocabulary shard: one holding what
      // the previous rank holds has the same calls.
      if (held.same_as_previous(chunk_stages, tr)) {
        DeviceTraffic same = out.back();
        same.tensor_rank = tr;
        out.push_back(std::move(same));
        continue;
      }
      Calls calls;
      calls.add(losses, CommKind::all_reduce, 24, 1, "loss, parameter check and stop request");
      if (g.moe.active()) {  // the layers' load, rows of E + 4 f64 up to the last MoE block
        const double load = 8.0 * static_cast<double>(g.layers * (g.moe.experts + 4));
        calls.add(tokens, CommKind::all_reduce, load, 1, "MoE load");
        calls.add(pipeline, CommKind::all_reduce, load, 1, "MoE load");
      }
      if (l.expert > 1) calls.add(experts, CommKind::all_reduce, 8, 1, "gradient check");
      double non_expert = 0;  // elements of the replicated parameters' gradients the strategy holds
      if (p > 1) {
        calls.add(pipeline, CommKind::all_reduce, 24, 1, "loss, parameter check and stop request");
        calls.add(pipeline, CommKind::all_reduce, 4, 1, "gradient check");
      }
      if (k > 1) {
        calls.add(tensor, CommKind::all_reduce, 16, 1, "parameter check and stop request");
        calls.add(tensor, CommKind::all_reduce, 8, 1, "gradient check");
      }
      double sp_replicated = 0;
      for (const int s : chunk_stages) {
        const ModelDescription::Stage& stage = held.model().stages[static_cast<size_t>(s)];
        const bool embed = stage.embed, head = stage.head;
        const int64_t blocks = stage.last_block - stage.first_block;
        const std::vector<internal::StageParam>& ps = held.at(s, tr);
        for (const auto& q : ps)
          if (q.replicated) sp_replicated += static_cast<double>(q.numel);
        for (const auto& q : ps) {
          if (q.expert) continue;
          const bool shards = sharded && l.sharding != layout::ZeroStage::no_shard &&
                              sharding::FSDPStrategy::large_enough(q.numel, l.min_weight_size);
          non_expert += shards ? static_cast<double>(q.numel) / d : static_cast<double>(q.numel);
        }
        // Gradients: DataParallel's buckets, or fully sharded units.
        if (!sharded) {
          for (double b : bucket_sizes(ps, l.bucket_bytes))
            calls.add(grad, CommKind::all_reduce, b, 1, "gradient buckets", CommOverlap::backward);
        } else {
          const int units = static_cast<int>(blocks) + 2;
          std::vector<int64_t> unit_n(static_cast<size_t>(units), 0);
          int64_t replicated = 0;
          for (const auto& q : ps) {
            if (sharding::FSDPStrategy::large_enough(q.numel, l.min_weight_size))
              unit_n[static_cast<size_t>(q.unit)] += q.numel;
            else replicated += q.numel;
          }
          for (int u = 0; u < units; ++u) {
            const int64_t np = (unit_n[static_cast<size_t>(u)] + d - 1) / d * d;
            if (np == 0) continue;
            const double part = static_cast<double>(np / d);
            if (l.sharding == layout::ZeroStage::no_shard) {
              calls.add(shard, CommKind::all_reduce, gb * static_cast<double>(np), 1, "unit gradients",
                        CommOverlap::backward);
              continue;
            }
            const int64_t reductions = l.sharding == layout::ZeroStage::zero1 ? 1 : m;
            calls.add(shard, CommKind::reduce_scatter, gb * part, reductions, "unit gradients", CommOverlap::backward);
            if (l.sharding == layout::ZeroStage::zero3)
              calls.add(shard, CommKind::all_gather, pb * part, m * (l.reshard_after_forward ? 2 : 1),
                        "unit parameters", CommOverlap::forward);
            else
              calls.add(shard, CommKind::all_gather, pb * part, 1, "updated parameters", CommOverlap::step);
            calls.add(replicate, CommKind::all_reduce, gb * part, 1, "gradient shards", CommOverlap::backward);
          }
          calls.add(shard, CommKind::all_reduce, 4.0 * static_cast<double>(replicated), 1,
                    "small parameters' gradients");
          calls.add(replicate, CommKind::all_reduce, 4.0 * static_cast<double>(replicated), 1,
                    "small parameters' gradients");
          calls.add(shard, CommKind::all_reduce, 4, 1, "overflow check");
          calls.add(replicate, CommKind::all_reduce, 4, 1, "overflow check");
        }
        // The tied wte's gradient between the first and the last stage (its
        // optimizer part: the shard of its own unit when fully sharded).
        if (stages > 1 && (embed || head) && g.tie_embeddings) {
          int64_t wte = 0;  // the elements of its own unit (stage_params numbers it `blocks`)
          for (const auto& q : ps)
            if (q.unit == blocks) wte += q.numel;
          const bool unit = sharded && sharding::FSDPStrategy::large_enough(wte, l.min_weight_size);
          const double bytes = unit ? gb * static_cast<double>((wte + d - 1) / d) : 4.0 * static_cast<double>(wte);
          calls.add({"tied", 2}, CommKind::all_reduce, bytes, 1, "tied embedding gradient");
        }
        // Calls on every micro-batch's critical path.
        const auto per_micro = [&](const Group& grp, CommKind kind, double bytes, int64_t n, const char* what,
                               CommOverlap overlap = CommOverlap::none) {
          calls.add(grp, kind, bytes, n, what, overlap, true);
        };
        // Tensor parallelism: per block, the forward's row-parallel outputs
        // and the backward's column-parallel input gradients (a recomputed
        // forward's again).
        const int64_t forwards = l.recompute ? 2 : 1;
        const bool kv_replicated = g.llama() && k > g.key_value_heads();
        const int64_t columns = !g.llama() ? 2 : kv_replicated ? 3 : 5;  // GPT-2: c_attn, c_fc
        int64_t dense = 0, moe = 0;  // blocks of each kind
        for (int64_t b = stage.first_block; b < stage.last_block; ++b) (g.moe_block(b) ? moe : dense) += 1;
        // A MoE block: o's and q, k, v's as a dense block's; its experts' rows.
        const int64_t moe_columns = kv_replicated ? 1 : 3;
        const double rows = micro * static_cast<double>(t) * static_cast<double>(g.moe.top_k);  // n top_k
        const int64_t local = g.moe.active() ? g.moe.experts / l.expert : 0;
        // The rows this rank's experts run: more than its own over an uneven expert axis.
        const double received = l.expert > 1 ? rows * l.expert_imbalance : rows;
        const double expert_rows = local > 0 ? received / static_cast<double>(local) : 0;
        if (!l.sequence_parallel) {
          per_micro(tensor, CommKind::all_reduce, act, m * (dense * (2 * forwards + columns) +
                                                            moe * (forwards + moe_columns)),
                    "block activations");
          per_micro(tensor, CommKind::all_reduce, expert_rows * C * 4, m * moe * local * (forwards + 2),
                    "expert rows");
          if (g.moe.shared_experts > 0)
            per_micro(tensor, CommKind::all_reduce, act, m * moe * (forwards + 2), "shared experts");
          if (embed) per_micro(tensor, CommKind::all_reduce, act, m, "embedding output");
          if (head) per_micro(tensor, CommKind::all_reduce, act, m, "head input gradient");
        } else {  // no MoE layers here (the trainer refuses them with sequence parallelism)
          // (Replicated key/value heads: k and v share one gather of their input.)
          const int64_t gathers = kv_replicated ? columns + 1 : columns;
          per_micro(tensor, CommKind::all_gather, act_sp, m * blocks * (gathers * forwards + 2), "block activations");
          per_micro(tensor, CommKind::reduce_scatter, act_sp, m * blocks * (2 * forwards + columns),
                    "block activations");
          if (embed) {
            per_micro(tensor, CommKind::reduce_scatter, act_sp, m, "embedding output");
            per_micro(tensor, CommKind::all_gather, act_sp, m, "embedding output gradient");
          }
          if (head) {
            per_micro(tensor, CommKind::all_gather, act_sp, m, "head input");
            per_micro(tensor, CommKind::reduce_scatter, act_sp, m, "head input gradient");
          }
        }
        if (head) {
          const double rows = micro * static_cast<double>(t_pad);
          per_micro(tensor, CommKind::all_reduce, 4 * rows, m, "vocabulary-parallel loss: row maxima");
          per_micro(tensor, CommKind::all_reduce, 16 * rows, m, "vocabulary-parallel loss: sums");
        }
        // Expert parallelism: the row counts, then the rows out and back.
        if (l.expert > 1 && moe > 0) {
          per_micro(experts, CommKind::all_to_all, 8.0 * static_cast<double>(local), m * moe * forwards,
                    "MoE row counts");
          // This rank's rows out (dispatch) and its experts' rows back (combine), each way.
          per_micro(experts, CommKind::all_to_all_v, rows * C * 4, m * moe * (forwards + 1), "MoE rows");
          per_micro(experts, CommKind::all_to_all_v, received * C * 4, m * moe * (forwards + 1), "MoE expert rows");
        }
        // Pipeline boundaries.
        const int64_t boundaries = (s < stages - 1 ? 1 : 0) + (s > 0 ? 1 : 0);
        per_micro(pipeline, CommKind::send, boundary, m * boundaries, "stage boundary activations");
        per_micro(pipeline, CommKind::recv, boundary, m * boundaries, "stage boundary activations");
        if (l.cp_comm == layout::ContextComm::ring) {  // ring attention
          const double kv = 2 * micro * static_cast<double>(t) * C / k * 4;
          const int64_t hops = (3 * n - 2) + (l.recompute ? n - 1 : 0);
          per_micro(context, CommKind::send, kv, m * blocks * hops, "ring attention K/V", CommOverlap::attention);
          per_micro(context, CommKind::recv, kv, m * blocks * hops, "ring attention K/V", CommOverlap::attention);
        } else if (n > 1) {  // all_to_all (Ulysses): q, k, v to heads and out back; dout, then dq, dk, dv
          const double block = micro * static_cast<double>(t) * C / k / n * 4;  // one peer's block
          per_micro(context, CommKind::all_to_all, block, m * blocks * 4 * (forwards + 1), "Ulysses q, k, v, out");
        }
      }
      if (l.sequence_parallel)
        calls.add(tensor, CommKind::all_reduce, 4 * sp_replicated, 1, "replicated parameters' gradients");
      if (l.expert > 1)
        calls.add(experts, CommKind::all_reduce, 4 * non_expert, 1, "replicated parameters' gradients");
      out.push_back({.stage = r, .tensor_rank = tr, .calls = calls.take()});
    }
  return out;
}

}  // namespace meshtrain::plan
