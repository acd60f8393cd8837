#include "meshtrain/plan/memory_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/internal/stage_params.h"
#include "meshtrain/sharding/strategy.h"

namespace meshtrain::plan {
namespace {

constexpr const char* kOp = "plan::predict_memory";

using internal::StageParam;

// Model chunks per pipeline rank, as the trainer resolves them: 1 without
// a pipeline axis (the whole model), at least 2 for the interleaved schedule.
int chunks_per_rank(const TrainingLayout& l) {
  if (l.pipeline == 1) return 1;
  return l.schedule == layout::ScheduleKind::interleaved_1f1b ? std::max(l.virtual_stages, 2) : l.virtual_stages;
}

// One compute action of a pipeline rank: F (forward), B (fused backward),
// I (backward_input), W (backward_weight) of chunk `chunk` (the rank's
// stages r, r + p, ...) on micro-batch `mb`.
struct Work {
  char kind = 'F';
  int chunk = 0, mb = 0;
};

// Pipeline rank r's compute actions in order, as parallel/pipeline_schedule.cc
// builds them (the sends and receives left out).
std::vector<Work> rank_program(const TrainingLayout& l, int r) {
  const int p = l.pipeline, m = l.micro_batches, v = chunks_per_rank(l);
  std::vector<Work> out;
  if (l.schedule == layout::ScheduleKind::gpipe) {
    for (int i = 0; i < m; ++i) out.push_back({'F', 0, i});
    for (int i = 0; i < m; ++i) out.push_back({'B', 0, i});
  } else if (l.schedule == layout::ScheduleKind::one_f_one_b || l.schedule == layout::ScheduleKind::zero_bubble) {
    // zb (ZB-H1): 1F1B's order, the backward split, rank r's first r W's deferred.
    const bool split = l.schedule == layout::ScheduleKind::zero_bubble;
    const int warmup = std::min(p - r - 1, m);
    std::deque<int> pending;
    int inputs = 0;
    const auto backward = [&](int i) {
      if (!split) {
        out.push_back({'B', 0, i});
        return;
      }
      out.push_back({'I', 0, i});
      pending.push_back(i);
      if (++inputs > r) {
        out.push_back({'W', 0, pending.front()});
        pending.pop_front();
      }
    };
    for (int i = 0; i < warmup; ++i) out.push_back({'F', 0, i});
    for (int i = warmup; i < m; ++i) {
      out.push_back({'F', 0, i});
      backward(i - warmup);
    }
    for (int i = m - warmup; i < m; ++i) backward(i);
    for (int i : pending) out.push_back({'W', 0, i});
  } else if (l.schedule == layout::ScheduleKind::interleaved_1f1b) {
    const int total = v * m;
    const int warmup = std::min((v - 1) * p + 2 * (p - r - 1), total);
    const auto mb = [&](int k) { return (k / (p * v)) * p + k % p; };
    const auto forward = [&](int k) { out.push_back({'F', (k / p) % v, mb(k)}); };
    const auto backward = [&](int k) { out.push_back({'B', v - 1 - (k / p) % v, mb(k)}); };
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int k = 0; k < total - warmup; ++k) {
      forward(warmup + k);
      backward(k);
    }
    for (int k = total - warmup; k < total; ++k) backward(k);
  }
  return out;
}

// FSDP's units of a stage in its order (parallel/fully_sharded.cc: the
// model's definition order): the root (the GPT's part less its blocks and,
// on a pipeline, wte: wpe, ln_f), wte (a unit of its own on a pipeline's
// first and last stage, else empty), block `first` + i at kUnitBlocks + i.
constexpr int kUnitRoot = 0, kUnitWte = 1, kUnitBlocks = 2;

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
// Units in FSDP's order (below), with their padded sizes (0: nothing
// sharded, no hooks).
class FsdpWorking {
 public:
  FsdpWorking(const TrainingLayout& l, const std::vector<int64_t>& padded)
      : l_(l),
        zero3_(l.sharding == layout::ZeroStage::zero3),
        values_persistent_(l.param_dtype == DType::f32 && !zero3_),
        grads_persistent_(l.reduce_dtype == DType::f32 && l.sharding <= layout::ZeroStage::zero1),
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
    if (pass != ScopePass::forward && uses_values && zero3_ && l_.backward_prefetch == layout::BackwardPrefetch::pre) {
      if (!x.materialized) start_gather(u);
      start_gather(neighbour(u, -1));
    }
    if (uses_values) materialize(u);
    if (pass == ScopePass::forward) {
      if (x.use_position < 0) {
        x.use_position = static_cast<int>(use_order_.size());
        use_order_.push_back(u);
      }
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
      if (zero3_ && l_.backward_prefetch == layout::BackwardPrefetch::post) start_gather(neighbour(u, -1));
    }
    if (pass == ScopePass::backward_input) return;
    reduce(u);
    poll();
  }
  // finish() (every reduction completes) and after_step()'s reshard()
  // (prefetched units never used are freed).
  void end_step() {
    if (l_.sharding <= layout::ZeroStage::zero1)
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
    int use_position = -1;  // in use_order_
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
  // The unit used after (step +1) or before (-1) u in the forward, in the
  // order units were first used in one (none before it is known).
  int neighbour(int u, int step) const {
    const int at = units_[static_cast<size_t>(u)].use_position;
    if (at < 0) return -1;
    const int i = at + step;
    return i >= 0 && i < static_cast<int>(use_order_.size()) ? use_order_[static_cast<size_t>(i)] : -1;
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
    if (l_.sharding <= layout::ZeroStage::zero1) {  // accumulated into the persistent gradient
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
  std::vector<int> use_order_;  // units by first forward use (parallel/fully_sharded.cc's order)
  std::deque<Reduction> in_flight_;  // oldest first
  int64_t issued_ = 0;               // collectives issued on the shard communicator
  int index_ = 0, count_ = 1;
  double now_ = 0, peak_ = 0;
};

// "backward_input h.1 (before_use)": a hook call of `unit` ("GPT", "wte", "h.1").
std::string hook_name(ScopePass pass, const std::string& unit, ScopeEvent event) {
  static const char* const kPass[] = {"forward", "backward", "backward_input", "backward_weight"};
  return fmt::format("{} {} ({})", kPass[static_cast<int>(pass)], unit,
                     event == ScopeEvent::before_use ? "before_use" : "after_use");
}

std::string block_name(int64_t block) { return block < 0 ? std::string("GPT") : fmt::format("h.{}", block); }

std::string moment_name(const ActivationMoment& m) {
  if (m.event == ScopeEvent::start) return "start of the forward";
  return hook_name(m.pass, block_name(m.block), m.event);
}

// Without a pipeline: the trainer's micro-batches through one Saved (the
// first step's first cold, every other warm), two steps, each moment's
// activations beside the working memory then; the largest total wins.
// `padded`: FSDP's units (FsdpWorking's order), empty without fully
// sharded data parallelism; blocks start at `first`.
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
          const int unit = m.block < 0 ? kUnitRoot : static_cast<int>(m.block - first) + kUnitBlocks;
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

// One step of a pipeline action: a hook call of FSDP's unit `unit` (-1:
// none, the action's start), this micro-batch's activation bytes then
// (`at`) and the most until the next step (`peak`).
struct HookStep {
  int unit = -1;
  ScopeEvent event = ScopeEvent::start;
  ScopePass pass = ScopePass::forward;
  double at = 0, peak = 0;
  std::string where;  // for DeviceMemory::peak_at
};

// A stage's micro-batch as the pipeline runs it: a fresh Saved (the cold
// timeline), its forward (F), its fused backward (B: `input`, `weight`
// empty) or its input pass (I) and weight pass (W) of a zero-bubble
// schedule, and what it holds between them.
struct PipelinePasses {
  std::vector<HookStep> forward, input, weight;
  double saved = 0;        // from F to I: saved_per_micro_batch
  double after_input = 0;  // from I to W
  double output = 0;       // F's output (a stage that is not the last), held until its send completes
};

// The cold timeline cut into the pipeline's actions, with the hooks of wte,
// a unit of its own on a pipeline: used inside the embeddings' forward and
// backward (the first stage: the embedding's own scope; a split backward's
// input and weight passes) or by the tied head (the last: nn::GPT::head_use,
// its input and weight passes first in the backward). At the added hooks
// the activations are the most of the stretch they fall in (the level there
// when nothing is allocated in it, as without dropout), but for the
// embedding's last pass: the level after it (it frees nothing, and the
// blocks have freed what they rebuilt).
PipelinePasses pipeline_passes(const ActivationEstimate& e, int64_t first, bool embed_wte, bool head_wte,
                               bool last_stage, bool split) {
  const std::vector<ActivationMoment>& t = e.timeline;
  const auto is_root = [&](size_t i, ScopeEvent ev, ScopePass pass) {
    return t[i].block < 0 && t[i].event == ev && t[i].pass == pass;
  };
  size_t k = 0, j = 0;  // the GPT's forward after_use; its backward_input after_use (split)
  for (size_t i = 0; i < t.size(); ++i) {
    if (k == 0 && is_root(i, ScopeEvent::after_use, ScopePass::forward)) k = i;
    if (split && is_root(i, ScopeEvent::after_use, ScopePass::backward_input)) j = i;
  }
  const ScopePass last_pass = split ? ScopePass::backward_weight : ScopePass::backward;
  if (k < 2 || k + 2 >= t.size() || (split && (j <= k + 1 || j + 2 >= t.size())) ||
      !is_root(k + 1, ScopeEvent::before_use, split ? ScopePass::backward_input : ScopePass::backward) ||
      !is_root(t.size() - 1, ScopeEvent::after_use, last_pass))
    throw InvalidArgument(kOp, "an activation timeline without the GPT's forward and backward scopes",
                          "report this: plan::estimate_activations and the memory model disagree");
  const auto from = [&](const ActivationMoment& m) {
    const int unit = m.event == ScopeEvent::start ? -1
                     : m.block < 0                ? kUnitRoot
                                                  : static_cast<int>(m.block - first) + kUnitBlocks;
    return HookStep{.unit = unit, .event = m.event, .pass = m.pass, .at = m.at, .peak = m.peak,
                    .where = m.event == ScopeEvent::start ? "start" : hook_name(m.pass, block_name(m.block), m.event)};
  };
  const auto wte = [](std::vector<HookStep>& out, ScopePass pass, double level) {
    for (ScopeEvent ev : {ScopeEvent::before_use, ScopeEvent::after_use})
      out.push_back({.unit = kUnitWte, .event = ev, .pass = pass, .at = level, .peak = level,
                     .where = hook_name(pass, "wte", ev)});
  };
  // Moments [a, b] of the timeline into `out`: the head's use of wte
  // (`head_passes`) after the first, the embedding's (`embed_pass`) before
  // the last.
  const auto cut = [&](std::vector<HookStep>& out, size_t a, size_t b, std::vector<ScopePass> head_passes,
                       ScopePass embed_pass, double embed_level) {
    for (size_t i = a; i <= b; ++i) {
      if (embed_wte && i == b) wte(out, embed_pass, embed_level);
      out.push_back(from(t[i]));
      if (head_wte && i == a)
        for (ScopePass p : head_passes) wte(out, p, t[a].peak);
    }
  };
  PipelinePasses c;
  for (size_t i = 0; i <= k; ++i) {
    if (head_wte && i == k) wte(c.forward, ScopePass::forward, t[k - 1].peak);  // the head, after the blocks
    c.forward.push_back(from(t[i]));
    if (embed_wte && i == 1) wte(c.forward, ScopePass::forward, t[1].peak);  // the embedding, first
  }
  if (split) {
    cut(c.input, k + 1, j, {ScopePass::backward_input}, ScopePass::backward_input, t[j - 1].peak);
    cut(c.weight, j + 1, t.size() - 1, {ScopePass::backward_weight}, ScopePass::backward_weight, t.back().at);
    c.after_input = t[j].at;
  } else {
    cut(c.input, k + 1, t.size() - 1, {ScopePass::backward_input, ScopePass::backward_weight}, ScopePass::backward,
        t.back().at);
  }
  c.saved = e.saved_per_micro_batch;
  c.output = last_stage ? 0.0 : e.stage_output;
  return c;
}

// A pipeline rank's chunk (one stage of the model): its micro-batch's
// passes and FSDP's units (FsdpWorking's order; empty without fully
// sharded data parallelism).
struct StageReplay {
  PipelinePasses passes;
  std::vector<int64_t> padded;
  int stage = 0;
};

// On a pipeline: rank r's compute actions (rank_program) through two
// steps, each (chunk, micro-batch) holding its activations from its F to
// the end of its B or W (the executor then frees its Saved), F's output
// until the end of the rank's next action (the send completes once the
// next stage posted its receive, which it does after its own work; the
// executor frees finished sends after each action), beside FSDP's working
// memory of every chunk (one FullyShardedDataParallel per stage; the
// weight pass starts its micro-batch window) at every hook call.
void walk_pipeline(const TrainingLayout& l, int r, const std::vector<StageReplay>& chunks, double batch,
                   DeviceMemory& dev) {
  std::deque<FsdpWorking> fsdp;
  for (const StageReplay& c : chunks) fsdp.emplace_back(l, c.padded);
  const std::vector<Work> program = rank_program(l, r);
  std::map<std::pair<int, int>, double> held;  // (chunk, micro-batch) -> its activation bytes
  double outputs = 0;                          // F's outputs whose sends may still be in flight
  double best = -1;
  for (int step = 0; step < 2; ++step) {
    for (const Work& w : program) {
      const StageReplay& c = chunks[static_cast<size_t>(w.chunk)];
      FsdpWorking& f = fsdp[static_cast<size_t>(w.chunk)];
      const bool sharded = !c.padded.empty();
      const std::pair<int, int> mine{w.chunk, w.mb};
      double others = batch + outputs, work_others = 0;
      for (const auto& [key, bytes] : held)
        if (key != mine) others += bytes;
      dev.in_flight = std::max(dev.in_flight, static_cast<int>(held.size() + (held.count(mine) > 0 ? 0 : 1)));
      for (size_t i = 0; i < fsdp.size(); ++i)
        if (static_cast<int>(i) != w.chunk && !chunks[i].padded.empty()) work_others += fsdp[i].now();
      const auto consider = [&](double act, double work, const HookStep& s, bool in_hook) {
        if (act + work <= best) return;
        best = act + work;
        dev.activations = act;
        dev.working = work;
        dev.peak_at = fmt::format("{}{}{} {}{}", w.kind, w.mb,
                                  chunks.size() > 1 ? fmt::format(" of stage {}", c.stage) : std::string(), s.where,
                                  in_hook ? ", in the hook" : "");
      };
      const auto run = [&](const std::vector<HookStep>& steps) {
        for (const HookStep& s : steps) {
          if (sharded && s.unit >= 0) {
            f.reset_peak();
            if (s.event == ScopeEvent::before_use)
              f.before_use(s.unit, s.pass);
            else
              f.after_use(s.unit, s.pass);
            consider(others + s.at, work_others + f.peak(), s, true);
          }
          consider(others + s.peak, work_others + (sharded ? f.now() : 0.0), s, false);
        }
      };
      if (w.kind == 'B' || w.kind == 'W') f.begin_micro_batch(w.mb, l.micro_batches);
      if (w.kind == 'F') run(c.passes.forward);
      if (w.kind == 'B' || w.kind == 'I') run(c.passes.input);
      if (w.kind == 'B' || w.kind == 'W') run(c.passes.weight);
      outputs = 0;  // the sends before this action are done
      if (w.kind == 'F') {
        held[mine] = c.passes.saved;
        outputs = c.passes.output;
      } else if (w.kind == 'I') {
        held[mine] = c.passes.after_input;
      } else {
        held.erase(mine);
      }
    }
    for (FsdpWorking& f : fsdp) f.end_step();
  }
}

}  // namespace

const DeviceMemory& MemoryPrediction::worst() const {
  if (devices.empty()) throw InvalidArgument("MemoryPrediction::worst", "no devices", "call predict_memory first");
  return *std::max_element(devices.begin(), devices.end(),
                           [](const DeviceMemory& a, const DeviceMemory& b) { return a.total() < b.total(); });
}

int TrainingLayout::axis_size(std::string_view name) const {
  if (name == mesh::kData) return data;
  if (name == mesh::kFsdp) return fsdp;
  if (name == mesh::kTensor) return tensor;
  if (name == mesh::kPipeline) return pipeline;
  if (name == mesh::kContext) return context;
  if (name == mesh::kExpert) return expert;
  throw InvalidArgument("TrainingLayout::axis_size", fmt::format("axis '{}'", name),
                        "use data, fsdp, expert, tensor, pipeline or context");
}

std::vector<std::string> TrainingLayout::rank_order() const {
  std::vector<std::string> out = axis_order;
  for (std::string_view a : kPlannedAxes)
    if (std::find(out.begin(), out.end(), a) == out.end()) out.emplace_back(a);
  return out;
}

void TrainingLayout::set_mesh(const mesh::NamedShape& mesh) {
  for (const std::string& a : mesh.axis_names)
    if (std::find(kPlannedAxes.begin(), kPlannedAxes.end(), a) == kPlannedAxes.end())
      throw InvalidArgument("plan::TrainingLayout::set_mesh", fmt::format("mesh {}: axis '{}'", mesh.to_spec(), a),
                            "use data, fsdp, expert, tensor, pipeline and context axes");
  axis_order = mesh.axis_names;
  data = mesh.size_of(mesh::kData);
  fsdp = mesh.size_of(mesh::kFsdp);
  tensor = mesh.size_of(mesh::kTensor);
  pipeline = mesh.size_of(mesh::kPipeline);
  context = mesh.size_of(mesh::kContext);
  expert = mesh.size_of(mesh::kExpert);
}

void TrainingLayout::set_layout(const layout::TrainingLayout& l) {
  set_mesh(l.mesh);
  sharding = l.fsdp ? std::optional(l.fsdp->stage) : std::nullopt;
  hybrid = l.fsdp && l.fsdp->hybrid;
  min_weight_size = l.fsdp_min_weight_size;
  param_dtype = l.fsdp ? l.param_dtype : DType::f32;  // plain data parallelism is f32 only
  reduce_dtype = l.reduce_dtype.value_or(param_dtype);
  sequence_parallel = l.sequence_parallel;
  schedule = l.schedule;
  virtual_stages = l.virtual_stages;
  micro_batches = l.micro_batches;
  cp_comm = l.cp_comm;
}

void check_layout(const GptShape& g, const TrainingLayout& l) {
  for (auto [v, flag] : {std::pair{l.data, "data"}, {l.fsdp, "fsdp"}, {l.expert, "expert"}, {l.tensor, "tensor"},
                         {l.pipeline, "pipeline"}, {l.context, "context"}, {l.micro_batches, "micro-batches"},
                         {l.virtual_stages, "virtual stages"}})
    if (v < 1) throw InvalidArgument(kOp, fmt::format("{} = {}", flag, v), "give every axis a size of at least 1");
  if (g.vocab < 1 || g.seq < 1 || g.layers < 1 || g.heads < 1 || g.width < 1 || g.width % g.heads != 0)
    throw InvalidArgument(kOp,
                          fmt::format("GPT vocab {} seq {} layers {} heads {} width {}", g.vocab, g.seq, g.layers,
                                      g.heads, g.width),
                          "give positive sizes with heads dividing width");
  if (g.heads % l.tensor != 0)
    throw InvalidArgument(kOp, fmt::format("tensor = {} does not divide {} heads", l.tensor, g.heads),
                          "use a tensor axis that divides the heads");
  if (g.moe.active() && !g.llama())
    throw InvalidArgument(kOp, fmt::format("{} experts with GPT-2's blocks", g.moe.experts),
                          "mixture-of-experts layers replace Llama's MLPs: set arch llama");
  if (!(l.expert_imbalance >= 1.0))
    throw InvalidArgument(kOp, fmt::format("expert imbalance {}", l.expert_imbalance),
                          "give the fullest expert rank's rows over the even share: at least 1");
  if (l.expert > 1 && (!g.moe.active() || g.moe.experts % l.expert != 0))
    throw InvalidArgument(kOp, fmt::format("expert = {} for {} experts", l.expert, g.moe.experts),
                          "use an expert axis that divides the experts (a model without experts has no use for one)");
  if (g.layers < static_cast<int64_t>(l.pipeline) * chunks_per_rank(l))
    throw InvalidArgument(kOp,
                          fmt::format("{} layers over pipeline = {} x {} virtual stages: a stage would be empty",
                                      g.layers, l.pipeline, chunks_per_rank(l)),
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
  if (l.pipeline > 1) {  // as parallel::make_schedule checks the schedule
    if (l.schedule != layout::ScheduleKind::interleaved_1f1b && l.virtual_stages != 1)
      throw InvalidArgument(kOp,
                            fmt::format("{} virtual stages with the {} schedule", l.virtual_stages,
                                        layout::to_string(l.schedule)),
                            "only the interleaved schedule runs several chunks per rank: use 1, or interleaved");
    if (l.schedule == layout::ScheduleKind::interleaved_1f1b && l.micro_batches % l.pipeline != 0)
      throw InvalidArgument(kOp,
                            fmt::format("the interleaved schedule with {} micro-batches over pipeline = {}",
                                        l.micro_batches, l.pipeline),
                            "use a multiple of the pipeline axis's size of micro-batches");
  }
  if (l.max_reductions_in_flight < 1)
    throw InvalidArgument(kOp, fmt::format("max_reductions_in_flight = {}", l.max_reductions_in_flight),
                          "allow at least one gradient reduction in flight");
  if (l.sharding == std::nullopt && l.param_dtype != DType::f32)
    throw InvalidArgument(kOp, "mixed precision without fully sharded data parallelism",
                          "plain data parallelism is f32 (the trainer runs it as no_shard)");
}

std::vector<ParamElements> device_parameters(const GptShape& g, const TrainingLayout& l, int pipeline_rank,
                                             int tensor_rank) {
  const int p = l.pipeline, v = chunks_per_rank(l);
  const auto holdings = internal::holdings(g, p * v, l.tensor, l.expert);
  const internal::Holdings& held = *holdings;
  std::vector<ParamElements> out;
  for (int c = 0; c < v; ++c)
    for (const StageParam& q : held.at(pipeline_rank + c * p, tensor_rank))
      out.push_back({q.numel, q.replicated});
  return out;
}

MemoryPrediction predict_memory(const GptShape& g, const TrainingLayout& l) {
  check_layout(g, l);
  // Without a pipeline axis the trainer runs the whole model: no chunks.
  const int p = l.pipeline, k = l.tensor, v = chunks_per_rank(l);
  const bool sharded = l.sharding != std::nullopt;
  const int d = l.sharding == layout::ZeroStage::no_shard ? 1 : l.shard_ranks();
  const int64_t per_rank = l.batch / l.data_ranks();  // samples per data-parallel rank per step
  const int64_t micro = per_rank / l.micro_batches;   // the trainer's micro-batch (the last may be larger)
  const double pb = static_cast<double>(dtype_size(l.param_dtype));
  const double gb = static_cast<double>(dtype_size(l.reduce_dtype));
  const double state = l.adamw ? 8.0 : 4.0;
  const auto holdings = internal::holdings(g, p * v, k, l.expert);
  const internal::Holdings& held = *holdings;
  MemoryPrediction out;
  for (int r = 0; r < p; ++r) {
    std::vector<int> chunk_stages;  // the stages this rank runs: r, r + p, ...
    for (int c = 0; c < v; ++c) chunk_stages.push_back(r + c * p);
    for (int t = 0; t < k; ++t) {
      // Tensor ranks differ only in their vocabulary shard: one holding what
      // the previous rank holds needs the same bytes.
      if (held.same_as_previous(chunk_stages, t)) {
        out.devices.push_back(out.devices.back());
        out.devices.back().tensor_rank = t;
        continue;
      }
      DeviceMemory dev;
      dev.stage = r;
      dev.tensor_rank = t;
      double batch = 0;
      std::vector<StageReplay> chunks;
      for (const int s : chunk_stages) {
        const ModelDescription::Stage& stage = held.model().stages[static_cast<size_t>(s)];
        const int first = stage.first_block, last = stage.last_block;
        const bool embed = stage.embed, head = stage.head;
        const std::vector<StageParam>& ps = held.at(s, t);
        const int blocks = last - first;
        std::vector<int64_t> unit_n(static_cast<size_t>(blocks + 2), 0);  // stage_params' unit numbers
        int64_t replicated = 0;
        for (const StageParam& q : ps) {
          dev.elements += q.numel;
          if (sharded && sharding::FSDPStrategy::large_enough(q.numel, l.min_weight_size))
            unit_n[static_cast<size_t>(q.unit)] += q.numel;
          else replicated += q.numel;
        }
        // FSDP's units in its order (FsdpWorking): the root (the rest of
        // the stage), wte, the blocks.
        std::vector<int64_t> padded;
        if (!sharded) {
          const double n = static_cast<double>(dev.elements);
          dev.parameters = 4 * n;
          dev.comm_buffers = 4 * n;
          dev.optimizer = state * n;
        } else {
          padded.resize(static_cast<size_t>(blocks + 2), 0);
          for (int u = 0; u < blocks + 2; ++u) {
            const int64_t np = (unit_n[static_cast<size_t>(u)] + d - 1) / d * d;
            const double P = static_cast<double>(np), dd = static_cast<double>(d);
            const double master = l.param_dtype == DType::f32 ? 0.0 : 4.0;
            dev.parameters += l.sharding == layout::ZeroStage::zero3 ? pb * P / dd : pb * P;
            dev.gradients += l.sharding >= layout::ZeroStage::zero2 ? gb * P / dd : gb * P;
            dev.optimizer += (master + state) * P / dd;
            const int at = u < blocks ? kUnitBlocks + u : u == blocks ? kUnitWte : kUnitRoot;
            padded[static_cast<size_t>(at)] = np;
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
                            .expert = l.expert,
                            .expert_imbalance = l.expert_imbalance,
                            .cp_comm = l.cp_comm,
                            .recompute = l.recompute,
                            .split_backward = p > 1 && l.schedule == layout::ScheduleKind::zero_bubble,
                            .compute = sharded ? l.param_dtype : DType::f32,
                            .dropout = l.dropout,
                            .first_block = first,
                            .last_block = last,
                            .embed = embed,
                            .head = head};
        const ActivationEstimate e = estimate_activations(g, al);
        batch = e.batch_bytes;
        if (p == 1) {
          // No pipeline: the total moment by moment, one Saved reused (warm).
          walk_steps(l, e, padded, first, 2 * batch, dev);
          continue;
        }
        // A pipeline: a fresh Saved per micro-batch (cold); wte is a unit
        // of its own on the first and the last stage.
        const bool own_wte = embed != head;
        chunks.push_back({.passes = pipeline_passes(e, first, own_wte && embed, own_wte && head, head, al.split_backward),
                          .padded = std::move(padded),
                          .stage = s});
      }
      if (p > 1) walk_pipeline(l, r, chunks, 2 * batch, dev);
      out.devices.push_back(dev);
    }
  }
  return out;
}

}  // namespace meshtrain::plan
