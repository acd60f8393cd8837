#include "meshtrain/plan/memory_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/sharding/stage_assignment.h"

namespace meshtrain::plan {
namespace {

constexpr const char* kOp = "plan::predict_memory";

// torch.chunk's rule (nn::shard_range): n over k ranks, ceil(n / k) each,
// the last ones shorter or empty.
int64_t chunk_size(int64_t n, int rank, int k) {
  const int64_t c = (n + k - 1) / k;
  return std::clamp<int64_t>(n - rank * c, 0, c);
}

// One parameter this device holds: its local element count and the fully
// sharded unit it belongs to (0..blocks-1: the blocks; blocks: wte as a unit
// of its own; blocks + 1: the rest of the stage).
struct Param {
  int64_t numel = 0;
  int unit = 0;
};

// The blocks [first, last) of each stage: the trainer's cut by forward
// FLOPs per token (train/gpt_recipe.cc: 24 C^2 + 2 T C per block, the tied
// head's 2 C V on the last).
std::vector<std::pair<int, int>> stage_blocks(const GptShape& g, int stages) {
  const double c = static_cast<double>(g.width), t = static_cast<double>(g.seq);
  std::vector<double> costs(static_cast<size_t>(g.layers), 24 * c * c + 2 * t * c);
  costs.back() += 2 * c * static_cast<double>(g.vocab);
  const sharding::PipelineParallelStrategy pp("pipeline", stages);
  const std::vector<int> counts = pp.assign_layers_to_stages(costs);
  std::vector<std::pair<int, int>> out;
  for (int s = 0; s < stages; ++s) out.push_back(pp.layer_range(s, counts));
  return out;
}

// What stage `first..last` (with the embeddings / the head) of tensor rank
// r of k holds (nn/gpt.h: column-parallel q|k|v and c_fc, row-parallel
// projections with replicated biases, vocabulary-parallel wte).
std::vector<Param> stage_params(const GptShape& g, int first, int last, bool embed, bool head, int r, int k,
                                bool pipelined) {
  const int64_t C = g.width;
  const int own_wte = pipelined && embed != head ? 1 : 0;  // wte is a unit of its own on a pipeline
  const int blocks = last - first;
  const int rest = blocks + 1;
  std::vector<Param> ps;
  const int64_t wte = chunk_size(g.vocab, r, k) * C;
  if (embed) {
    ps.push_back({wte, own_wte ? blocks : rest});
    ps.push_back({g.seq * C, rest});  // wpe: block_size rows (the run's sequence length)
  }
  for (int b = 0; b < blocks; ++b) {
    for (int64_t n : {C, C,                      // ln_1
                      C * 3 * C / k, 3 * C / k,  // c_attn
                      C / k * C, C,              // attn.c_proj (bias replicated)
                      C, C,                      // ln_2
                      C * 4 * C / k, 4 * C / k,  // c_fc
                      4 * C / k * C, C})         // mlp.c_proj
      ps.push_back({n, b});
  }
  if (head) {
    ps.push_back({C, rest});  // ln_f
    ps.push_back({C, rest});
    if (!embed) ps.push_back({wte, own_wte ? blocks : rest});  // the tied head's copy
  }
  return ps;
}

// In-flight micro-batches (schedule chunks) of pipeline rank r of p.
int in_flight(const TrainingLayout& l, int r) {
  const int p = l.pipeline, m = l.micro_batches, v = l.virtual_stages;
  if (p == 1) return 1;
  if (l.schedule == "gpipe") return m;
  if (l.schedule == "1f1b" || l.schedule == "zb") return std::min(p - r, m);
  if (l.schedule == "interleaved") return std::min((v - 1) * p + 2 * (p - r - 1) + 1, v * m);
  throw InvalidArgument(kOp, fmt::format("pipeline schedule '{}'", l.schedule), "use gpipe, 1f1b, interleaved or zb");
}

// Fully sharded data parallelism's working memory (MemoryCategory::working)
// through the hook calls of a micro-batch, by parallel/fully_sharded.cc's
// rules: stage 3 all-gathers a unit into a padded param_dtype copy before
// its use (prefetching the next one as configured) and frees it after;
// a unit's backward allocates a padded f32 gradient (unless gradients
// persist in f32: stage <= 1 with f32 reductions), which stages 2 and 3
// round to reduce_dtype (the copy beside the f32 one for a moment) and
// reduce-scatter asynchronously, holding the buffer until the reduction
// completes; launching one beyond max_reductions_in_flight first completes
// the oldest. The runtime frees a reduction's buffer at the first poll (at
// the hooks) that finds it done, and when it is done is up to the
// communication threads: this takes the deterministic bound, that it is
// done only once it must be: waited for (the rate limit, finish()), or
// once FSDP waited for a later collective on the same communicator (a
// zero3 gather: collectives complete in issue order, comm/communicator.h).
// Units in FSDP's order (parallel/fully_sharded.cc: the root first, then
// the blocks), with their padded sizes (0: nothing sharded, no hooks).
class FsdpWorking {
 public:
  FsdpWorking(const TrainingLayout& l, const std::vector<int64_t>& padded)
      : l_(l),
        zero3_(l.sharding == Sharding::zero3),
        values_persistent_(l.param_dtype == DType::f32 && !zero3_),
        grads_persistent_(l.reduce_dtype == DType::f32 && l.sharding <= Sharding::zero1),
        pb_(static_cast<double>(dtype_size(l.param_dtype))),
        gb_(static_cast<double>(dtype_size(l.reduce_dtype))) {
    for (int64_t n : padded) units_.push_back({.np = static_cast<double>(n)});
  }

  void begin_micro_batch(int index, int count) {
    index_ = index;
    count_ = count;
  }
  void before_use(int u, ScopePass pass) {
    Unit& x = units_[static_cast<size_t>(u)];
    if (x.np == 0) return;
    poll();
    const bool uses_values = pass != ScopePass::backward_weight;
    const bool uses_grads = pass == ScopePass::backward || pass == ScopePass::backward_weight;
    if (pass != ScopePass::forward && uses_values && zero3_ && l_.backward_prefetch == BackwardPrefetch::pre) {
      if (!x.materialized) start_gather(u);
      start_gather(neighbour(u, -1));
    }
    if (uses_values) materialize(u);
    if (pass == ScopePass::forward) {
      if (l_.forward_prefetch) start_gather(neighbour(u, +1));
      return;
    }
    if (!uses_grads || grads_persistent_) return;
    alloc(4 * x.np);  // the f32 working gradient
    free(x.grad);
    x.grad = 4 * x.np;
  }
  void after_use(int u, ScopePass pass) {
    if (units_[static_cast<size_t>(u)].np == 0) return;
    if (pass == ScopePass::forward) {
      if (l_.reshard_after_forward) release_values(u);
      return;
    }
    if (pass != ScopePass::backward_weight) {
      release_values(u);
      if (zero3_ && l_.backward_prefetch == BackwardPrefetch::post) start_gather(neighbour(u, -1));
    }
    if (pass == ScopePass::backward_input) return;
    reduce(u);
    poll();
  }
  // finish() (every reduction completes) and after_step()'s reshard()
  // (prefetched units never used are freed).
  void end_step() {
    if (l_.sharding <= Sharding::zero1)
      for (size_t u = 0; u < units_.size(); ++u)
        if (units_[u].np > 0) launch_full(static_cast<int>(u));
    while (!in_flight_.empty()) complete_oldest();
    for (size_t u = 0; u < units_.size(); ++u) {
      Unit& x = units_[u];
      x.reduced = false;
      if (x.gathering) free(pb_ * x.np);
      x.gathering = false;
      release_values(static_cast<int>(u));
    }
  }
  double now() const { return now_; }
  // The most since the last reset_peak().
  double peak() const { return peak_; }
  void reset_peak() { peak_ = now_; }

 private:
  struct Unit {
    double np = 0;  // padded elements
    bool gathering = false, materialized = false, reduced = false;
    double grad = 0;  // bytes of the working gradient held
    int64_t gather = 0;  // the issue number of its last gather
  };
  struct Reduction {
    double bytes = 0;  // the buffer it holds
    int64_t issued = 0;
    bool done = false;
  };

  void alloc(double b) {
    now_ += b;
    peak_ = std::max(peak_, now_);
  }
  void free(double b) { now_ -= b; }
  int neighbour(int u, int step) const {
    for (int i = u + step; i >= 0 && i < static_cast<int>(units_.size()); i += step)
      if (units_[static_cast<size_t>(i)].np > 0) return i;
    return -1;
  }
  void start_gather(int u) {
    if (u < 0) return;
    Unit& x = units_[static_cast<size_t>(u)];
    if (!zero3_ || x.gathering || x.materialized) return;
    alloc(pb_ * x.np);
    x.gathering = true;
    x.gather = ++issued_;
  }
  // Stages 1-2 view the persistent param_dtype copy: nothing allocated.
  void materialize(int u) {
    Unit& x = units_[static_cast<size_t>(u)];
    if (values_persistent_ || x.materialized) return;
    if (zero3_) {
      start_gather(u);
      for (Reduction& r : in_flight_) r.done = r.done || r.issued < x.gather;  // waited for the gather
    }
    x.gathering = false;  // the gathered copy becomes the values
    x.materialized = true;
  }
  void release_values(int u) {
    Unit& x = units_[static_cast<size_t>(u)];
    if (values_persistent_) return;
    if (x.materialized && zero3_) free(pb_ * x.np);
    x.materialized = false;
  }
  void reduce(int u) {
    Unit& x = units_[static_cast<size_t>(u)];
    if (l_.sharding <= Sharding::zero1) {  // accumulated into the persistent gradient
      free(x.grad);
      x.grad = 0;
      if (index_ == count_ - 1) launch_full(u);
      return;
    }
    double buf = x.grad;
    x.grad = 0;
    if (l_.reduce_dtype != DType::f32) {
      alloc(gb_ * x.np);
      free(buf);
      buf = gb_ * x.np;
    }
    make_room();
    in_flight_.push_back({.bytes = buf, .issued = ++issued_, .done = l_.eager_reductions});
  }
  void launch_full(int u) {  // in place: no buffer
    Unit& x = units_[static_cast<size_t>(u)];
    if (x.reduced) return;
    x.reduced = true;
    make_room();
    in_flight_.push_back({.issued = ++issued_, .done = l_.eager_reductions});
  }
  void make_room() {
    while (static_cast<int>(in_flight_.size()) >= l_.max_reductions_in_flight) complete_oldest();
  }
  void complete_oldest() {
    free(in_flight_.front().bytes);
    in_flight_.pop_front();
  }
  // Oldest first, up to the first not known to be done (the runtime's poll).
  void poll() {
    while (!in_flight_.empty() && in_flight_.front().done) complete_oldest();
  }

  const TrainingLayout& l_;
  const bool zero3_, values_persistent_, grads_persistent_;
  const double pb_, gb_;
  std::vector<Unit> units_;
  std::deque<Reduction> in_flight_;  // oldest first
  int64_t issued_ = 0;               // collectives issued on the shard communicator
  int index_ = 0, count_ = 1;
  double now_ = 0, peak_ = 0;
};

std::string moment_name(const ActivationMoment& m) {
  static const char* const kPass[] = {"forward", "backward", "backward_input", "backward_weight"};
  const std::string where = m.block < 0 ? std::string("GPT") : fmt::format("h.{}", m.block);
  if (m.event == ScopeEvent::start) return "start of the forward";
  return fmt::format("{} {} ({})", kPass[static_cast<int>(m.pass)], where,
                     m.event == ScopeEvent::before_use ? "before_use" : "after_use");
}

// Without a pipeline: the trainer's micro-batches through one Saved (the
// first step's first cold, every other warm), two steps, each moment's
// activations beside the working memory then; the largest total wins.
// `padded`: FSDP's units (root first), empty without fully sharded data
// parallelism; blocks start at `first`.
void walk_steps(const TrainingLayout& l, const ActivationEstimate& e, const std::vector<int64_t>& padded,
                int64_t first, double batch, DeviceMemory& dev) {
  std::optional<FsdpWorking> fsdp;
  if (!padded.empty()) fsdp.emplace(l, padded);
  double best = -1;
  const auto consider = [&](double act, double work, const ActivationMoment& m, bool in_hook) {
    if (act + work <= best) return;
    best = act + work;
    dev.activations = act + batch;
    dev.working = work;
    dev.peak_at = moment_name(m) + (in_hook ? ", in the hook" : "");
  };
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < l.micro_batches; ++i) {
      const std::vector<ActivationMoment>& timeline = step == 0 && i == 0 ? e.timeline : e.timeline_warm;
      if (fsdp) fsdp->begin_micro_batch(i, l.micro_batches);
      for (const ActivationMoment& m : timeline) {
        if (fsdp && m.event != ScopeEvent::start) {
          const int unit = m.block < 0 ? 0 : static_cast<int>(m.block - first) + 1;
          fsdp->reset_peak();
          if (m.event == ScopeEvent::before_use)
            fsdp->before_use(unit, m.pass);
          else
            fsdp->after_use(unit, m.pass);
          consider(m.at, fsdp->peak(), m, true);
        }
        consider(m.peak, fsdp ? fsdp->now() : 0.0, m, false);
      }
    }
    if (fsdp) fsdp->end_step();
  }
}

}  // namespace

const DeviceMemory& MemoryPrediction::worst() const {
  if (devices.empty()) throw InvalidArgument("MemoryPrediction::worst", "no devices", "call predict_memory first");
  return *std::max_element(devices.begin(), devices.end(),
                           [](const DeviceMemory& a, const DeviceMemory& b) { return a.total() < b.total(); });
}

void TrainingLayout::set_mesh(const NamedShape& mesh) {
  for (const std::string& a : mesh.axis_names)
    if (a != "data" && a != "fsdp" && a != "tensor" && a != "pipeline" && a != "context")
      throw InvalidArgument("plan::TrainingLayout::set_mesh", fmt::format("mesh {}: axis '{}'", mesh.to_spec(), a),
                            "use data, fsdp, tensor, pipeline and context axes");
  data = mesh.size_of("data");
  fsdp = mesh.size_of("fsdp");
  tensor = mesh.size_of("tensor");
  pipeline = mesh.size_of("pipeline");
  context = mesh.size_of("context");
}

void parse_sharding(const std::string& name, TrainingLayout& l) {
  static const std::pair<const char*, std::pair<Sharding, bool>> kNames[] = {
      {"", {Sharding::none, false}},          {"no_shard", {Sharding::no_shard, false}},
      {"zero1", {Sharding::zero1, false}},    {"zero2", {Sharding::zero2, false}},
      {"shard_grad_op", {Sharding::zero2, false}}, {"zero3", {Sharding::zero3, false}},
      {"full", {Sharding::zero3, false}},     {"hybrid_full", {Sharding::zero3, true}},
      {"hybrid_shard_grad_op", {Sharding::zero2, true}}};
  for (const auto& [n, v] : kNames)
    if (name == n) {
      l.sharding = v.first;
      l.hybrid = v.second;
      return;
    }
  throw InvalidArgument("plan::parse_sharding", fmt::format("unknown fsdp strategy '{}'", name),
                        "use full, shard_grad_op, no_shard, zero1, zero2, zero3, hybrid_full or hybrid_shard_grad_op");
}

void check_layout(const GptShape& g, const TrainingLayout& l) {
  for (auto [v, flag] : {std::pair{l.data, "data"}, {l.fsdp, "fsdp"}, {l.tensor, "tensor"}, {l.pipeline, "pipeline"},
                         {l.context, "context"}, {l.micro_batches, "micro-batches"}, {l.virtual_stages, "virtual stages"}})
    if (v < 1) throw InvalidArgument(kOp, fmt::format("{} = {}", flag, v), "give every axis a size of at least 1");
  if (g.vocab < 1 || g.seq < 1 || g.layers < 1 || g.heads < 1 || g.width < 1 || g.width % g.heads != 0)
    throw InvalidArgument(kOp,
                          fmt::format("GPT vocab {} seq {} layers {} heads {} width {}", g.vocab, g.seq, g.layers,
                                      g.heads, g.width),
                          "give positive sizes with heads dividing width");
  if (g.heads % l.tensor != 0)
    throw InvalidArgument(kOp, fmt::format("tensor = {} does not divide {} heads", l.tensor, g.heads),
                          "use a tensor axis that divides the heads");
  if (g.layers < static_cast<int64_t>(l.pipeline) * l.virtual_stages)
    throw InvalidArgument(kOp,
                          fmt::format("{} layers over pipeline = {} x {} virtual stages: a stage would be empty",
                                      g.layers, l.pipeline, l.virtual_stages),
                          "use fewer pipeline stages");
  const int64_t dp = l.data_ranks();
  if (l.batch % dp != 0 || l.batch / dp < l.micro_batches)
    throw InvalidArgument(kOp,
                          fmt::format("a batch of {} over {} data-parallel ranks in {} micro-batches", l.batch, dp,
                                      l.micro_batches),
                          "use a batch that the data-parallel ranks divide, with at least one sample per micro-batch");
  if (l.context > 1 && g.seq % (2 * l.context) != 0)
    throw InvalidArgument(kOp, fmt::format("context = {} does not split a sequence of {} into 2 x {} chunks",
                                           l.context, g.seq, l.context),
                          "use a sequence length divisible by twice the context axis");
  if (l.max_reductions_in_flight < 1)
    throw InvalidArgument(kOp, fmt::format("max_reductions_in_flight = {}", l.max_reductions_in_flight),
                          "allow at least one gradient reduction in flight");
  if (l.sharding == Sharding::none && l.param_dtype != DType::f32)
    throw InvalidArgument(kOp, "mixed precision without fully sharded data parallelism",
                          "plain data parallelism is f32 (the trainer runs it as no_shard)");
}

MemoryPrediction predict_memory(const GptShape& g, const TrainingLayout& l) {
  check_layout(g, l);
  const int p = l.pipeline, k = l.tensor, v = l.virtual_stages;
  const bool sharded = l.sharding != Sharding::none;
  const int d = l.sharding == Sharding::no_shard ? 1 : (l.hybrid ? l.fsdp : l.data_ranks());
  const int64_t per_rank = l.batch / l.data_ranks();  // samples per data-parallel rank per step
  const int64_t micro = per_rank / l.micro_batches;   // the trainer's micro-batch (the last may be larger)
  const double pb = static_cast<double>(dtype_size(l.param_dtype));
  const double gb = static_cast<double>(dtype_size(l.reduce_dtype));
  const double state = l.adamw ? 8.0 : 4.0;
  const auto cut = stage_blocks(g, p * v);
  MemoryPrediction out;
  for (int r = 0; r < p; ++r) {
    for (int t = 0; t < k; ++t) {
      DeviceMemory dev;
      dev.stage = r;
      dev.tensor_rank = t;
      const int flight = in_flight(l, r);
      dev.in_flight = flight;
      double saved_sum = 0, peak_max = 0, batch = 0;
      int64_t largest_unit = 0;
      std::vector<int64_t> padded;  // FSDP's units in its order (one chunk: the root, then the blocks)
      ActivationEstimate last_estimate;
      for (int c = 0; c < v; ++c) {  // the chunks this rank runs: stages r, r + p, ...
        const int s = r + c * p;
        const auto [first, last] = cut[static_cast<size_t>(s)];
        const bool embed = s == 0, head = s == p * v - 1;
        const std::vector<Param> ps = stage_params(g, first, last, embed, head, t, k, p > 1);
        const int units = last - first + 2;
        std::vector<int64_t> unit_n(static_cast<size_t>(units), 0);
        int64_t replicated = 0;
        for (const Param& q : ps) {
          dev.elements += q.numel;
          if (sharded && q.numel >= l.min_weight_size) unit_n[static_cast<size_t>(q.unit)] += q.numel;
          else replicated += q.numel;
        }
        if (!sharded) {
          const double n = static_cast<double>(dev.elements);
          dev.parameters = 4 * n;
          dev.comm_buffers = 4 * n;
          dev.optimizer = state * n;
        } else {
          for (int u = 0; u < units; ++u) {
            const int64_t np = (unit_n[static_cast<size_t>(u)] + d - 1) / d * d;
            const double P = static_cast<double>(np), dd = static_cast<double>(d);
            const double master = l.param_dtype == DType::f32 ? 0.0 : 4.0;
            dev.parameters += l.sharding == Sharding::zero3 ? pb * P / dd : pb * P;
            dev.gradients += l.sharding >= Sharding::zero2 ? gb * P / dd : gb * P;
            dev.optimizer += (master + state) * P / dd;
            largest_unit = std::max(largest_unit, np);
            if (u == units - 1) padded.insert(padded.begin(), np);  // the rest of the stage: the root's unit
            else if (u < last - first) padded.push_back(np);
          }
          const double rep = static_cast<double>(replicated);
          dev.parameters += 4 * rep;
          dev.gradients += 4 * rep;
          dev.optimizer += state * rep;
        }
        ActivationLayout al{.micro_batch = micro,
                            .batch_rows = per_rank,
                            .tensor = k,
                            .tensor_rank = t,
                            .sequence_parallel = l.sequence_parallel,
                            .context = l.context,
                            .cp_comm = l.cp_comm,
                            .recompute = l.recompute,
                            .compute = sharded ? l.param_dtype : DType::f32,
                            .dropout = l.dropout,
                            .first_block = first,
                            .last_block = last,
                            .embed = embed,
                            .head = head};
        const ActivationEstimate e = estimate_activations(g, al);
        // Without a pipeline the trainer reuses one Saved (warm); a
        // pipeline gives each micro-batch a fresh one (cold).
        const double saved = p > 1 ? e.saved_per_micro_batch : e.saved_warm;
        const double peak = p > 1 ? e.peak_one_micro_batch : e.peak_warm;
        saved_sum += saved;
        peak_max = std::max(peak_max, peak - saved);
        batch = e.batch_bytes;
        last_estimate = e;
      }
      if (p == 1 && v == 1) {
        // One chunk, no pipeline: the total moment by moment.
        walk_steps(l, last_estimate, padded, cut[0].first, 2 * batch, dev);
        out.devices.push_back(dev);
        continue;
      }
      // flight - 1 micro-batches (chunks) saved, one at its peak; chunks
      // counted at their mean size.
      dev.activations = (flight - 1) * saved_sum / v + saved_sum / v + peak_max + 2 * batch;
      if (sharded && largest_unit > 0) {
        // A bound, added to the activations' peak: the largest unit's f32
        // working gradient (none when f32 gradients persist: stage <= 1)
        // with its reduce_dtype copy, the reductions in flight (stages 2
        // and 3), stage 3's gathered unit and the prefetched next one.
        const bool grads_persist = l.reduce_dtype == DType::f32 && l.sharding <= Sharding::zero1;
        double per = grads_persist ? 0 : 4 + (l.sharding >= Sharding::zero2 && gb < 4 ? gb : 0);
        if (l.sharding >= Sharding::zero2) per += gb * l.max_reductions_in_flight;
        if (l.sharding == Sharding::zero3) per += 2 * pb;
        dev.working = per * static_cast<double>(largest_unit);
      }
      out.devices.push_back(dev);
    }
  }
  return out;
}

}  // namespace meshtrain::plan
