#include "meshtrain/parallel/pipeline_schedule.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/time_model.h"

namespace meshtrain::parallel {

namespace {

// The largest ranks * virtual_stages * micro_batches a schedule may have.
constexpr int64_t kMaxPairs = int64_t{1} << 22;
// Actions and pending lists quoted per rank in a deadlock message.
constexpr int kQuoted = 4;

// ---- Validation ---------------------------------------------------------------

// The numbers every schedule needs, whatever its kind.
void check_shape(const char* op, int ranks, int micro_batches, int virtual_stages) {
  if (ranks < 1)
    throw InvalidArgument(op, fmt::format("ranks {}", ranks), "a pipeline has at least one rank");
  if (micro_batches < 1)
    throw InvalidArgument(op, fmt::format("micro_batches {}", micro_batches),
                          "split the batch into at least one micro-batch");
  if (virtual_stages < 1)
    throw InvalidArgument(op, fmt::format("virtual_stages {}", virtual_stages),
                          "every rank holds at least one chunk of the model");
  const int64_t pairs = int64_t{ranks} * virtual_stages * micro_batches;
  if (pairs > kMaxPairs)
    throw InvalidArgument(op,
                          fmt::format("ranks {} x virtual_stages {} x micro_batches {} = {} (stage, micro-batch) "
                                      "pairs, more than {}",
                                      ranks, virtual_stages, micro_batches, pairs, kMaxPairs),
                          "use fewer micro-batches or stages");
}

// check_shape plus what `kind` requires.
void check_kind_shape(const char* op, ScheduleKind kind, int ranks, int micro_batches, int virtual_stages) {
  check_shape(op, ranks, micro_batches, virtual_stages);
  if (kind != ScheduleKind::interleaved_1f1b) {
    if (virtual_stages != 1)
      throw InvalidArgument(op, fmt::format("virtual_stages {} with the {} schedule", virtual_stages, to_string(kind)),
                            "only the interleaved schedule runs several chunks per rank: pass 1, or use interleaved");
    return;
  }
  if (virtual_stages < 2)
    throw InvalidArgument(op, fmt::format("virtual_stages {} with the interleaved schedule", virtual_stages),
                          "interleaved runs at least 2 chunks per rank; with 1 use 1f1b");
  if (micro_batches % ranks != 0)
    throw InvalidArgument(op,
                          fmt::format("micro_batches {} is not a multiple of ranks {} (interleaved schedule)",
                                      micro_batches, ranks),
                          fmt::format("interleaved 1F1B runs micro-batches in rounds of one per rank, as Megatron-LM "
                                      "and PyTorch require: use a multiple of {}",
                                      ranks));
}

// ---- Building ---------------------------------------------------------------

// Appends a compute action of `rank` with the recv it needs before it and
// the send its consumer needs after it (see the header's lowering rules).
class Lowering {
 public:
  explicit Lowering(Schedule& s) : s_(s), last_(s.num_stages() - 1) {}

  void add(int rank, ActionKind kind, int stage, int mb) {
    std::vector<Action>& out = s_.programs[rank];
    const bool input_grad = kind == ActionKind::backward || kind == ActionKind::backward_input;
    if (kind == ActionKind::forward && stage > 0 && remote(rank, stage - 1))
      out.push_back({ActionKind::recv_activation, stage, mb, s_.stage_rank(stage - 1)});
    if (input_grad && stage < last_ && remote(rank, stage + 1))
      out.push_back({ActionKind::recv_grad, stage, mb, s_.stage_rank(stage + 1)});
    out.push_back({kind, stage, mb, -1});
    if (kind == ActionKind::forward && stage < last_ && remote(rank, stage + 1))
      out.push_back({ActionKind::send_activation, stage, mb, s_.stage_rank(stage + 1)});
    if (input_grad && stage > 0 && remote(rank, stage - 1))
      out.push_back({ActionKind::send_grad, stage, mb, s_.stage_rank(stage - 1)});
  }

 private:
  bool remote(int rank, int stage) const { return s_.stage_rank(stage) != rank; }

  Schedule& s_;
  int last_;
};

void build_gpipe(Schedule& s, Lowering& low) {
  for (int r = 0; r < s.ranks; ++r) {
    for (int i = 0; i < s.micro_batches; ++i) low.add(r, ActionKind::forward, r, i);
    for (int i = 0; i < s.micro_batches; ++i) low.add(r, ActionKind::backward, r, i);
  }
}

// 1F1B, and ZB-H1 when split: the same F/B order, the backward split into I
// and W with rank r's first r W's deferred (see the header).
void build_one_f_one_b(Schedule& s, Lowering& low, bool split) {
  const int m = s.micro_batches;
  for (int r = 0; r < s.ranks; ++r) {
    const int warmup = std::min(s.ranks - r - 1, m);
    std::deque<int> pending_w;  // micro-batches whose I ran and W has not
    int inputs_done = 0;
    auto backward = [&](int i) {
      if (!split) {
        low.add(r, ActionKind::backward, r, i);
        return;
      }
      low.add(r, ActionKind::backward_input, r, i);
      pending_w.push_back(i);
      if (++inputs_done > r) {
        low.add(r, ActionKind::backward_weight, r, pending_w.front());
        pending_w.pop_front();
      }
    };
    for (int i = 0; i < warmup; ++i) low.add(r, ActionKind::forward, r, i);
    for (int i = warmup; i < m; ++i) {
      low.add(r, ActionKind::forward, r, i);
      backward(i - warmup);
    }
    for (int i = m - warmup; i < m; ++i) backward(i);
    for (int i : pending_w) low.add(r, ActionKind::backward_weight, r, i);
  }
}

// Megatron's interleaved 1F1B (the header's rule for the k-th forward and
// backward of a rank).
void build_interleaved(Schedule& s, Lowering& low) {
  const int p = s.ranks, v = s.virtual_stages;
  const int total = v * s.micro_batches;  // forwards (and backwards) per rank
  const auto micro_batch = [&](int k) { return (k / (p * v)) * p + k % p; };
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min((v - 1) * p + 2 * (p - r - 1), total);
    const auto forward = [&](int k) { low.add(r, ActionKind::forward, ((k / p) % v) * p + r, micro_batch(k)); };
    const auto backward = [&](int k) {
      low.add(r, ActionKind::backward, (v - 1 - (k / p) % v) * p + r, micro_batch(k));
    };
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int k = 0; k < total - warmup; ++k) {
      forward(warmup + k);
      backward(k);
    }
    for (int k = total - warmup; k < total; ++k) backward(k);
  }
}

// ---- Simulation ---------------------------------------------------------------

// Runs the lists under the header's execution model, recording times.
class Simulator {
 public:
  Simulator(const Schedule& s, const StepCosts& costs)
      : s_(s),
        costs_(costs),
        stages_(s.num_stages()),
        m_(s.micro_batches),
        pairs_(static_cast<size_t>(stages_) * m_) {}

  Timeline run() {
    const int ranks = s_.ranks;
    Timeline t;
    t.ranks.resize(ranks);
    std::vector<size_t> pc(ranks, 0);
    std::vector<int64_t> clock(ranks, 0);
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < ranks; ++r) {
        const std::vector<Action>& prog = s_.programs[r];
        while (pc[r] < prog.size()) {
          const std::optional<TimedAction> done = step(r, pc[r], clock[r]);
          if (!done) break;
          t.ranks[r].push_back(*done);
          clock[r] = done->end;
          ++pc[r];
          progress = true;
        }
      }
    }
    for (int r = 0; r < ranks; ++r)
      if (pc[r] < s_.programs[r].size()) throw deadlock(pc);
    check_complete();
    for (int r = 0; r < ranks; ++r) t.makespan = std::max(t.makespan, clock[r]);
    return t;
  }

 private:
  static constexpr int64_t kNotRun = -1;

  size_t at(int stage, int mb) const { return static_cast<size_t>(stage) * m_ + mb; }

  std::string where(int rank, size_t index) const {
    return fmt::format("rank {}, action #{} {}", rank, index, s_.programs[rank][index].to_string());
  }
  [[noreturn]] void fail(int rank, size_t index, const std::string& what, const std::string& hint) const {
    throw InvalidArgument("check_schedule", fmt::format("{}: {}", where(rank, index), what), hint);
  }

  // The producer of a transfer a recv waits for, as the matching send.
  Action matching_send(int rank, const Action& a) const {
    if (a.kind == ActionKind::recv_activation) return {ActionKind::send_activation, a.stage - 1, a.micro_batch, rank};
    return {ActionKind::send_grad, a.stage + 1, a.micro_batch, rank};
  }

  // Stage, micro-batch and peer fit the schedule and the rank.
  void check_fields(int rank, size_t index, const Action& a) const {
    if (a.stage < 0 || a.stage >= stages_)
      fail(rank, index, fmt::format("stage {} is not in [0, {})", a.stage, stages_),
           "stages run 0..ranks * virtual_stages - 1");
    if (a.micro_batch < 0 || a.micro_batch >= m_)
      fail(rank, index, fmt::format("micro-batch {} is not in [0, {})", a.micro_batch, m_),
           "micro-batches run 0..micro_batches - 1");
    if (s_.stage_rank(a.stage) != rank)
      fail(rank, index, fmt::format("stage {} lives on rank {}", a.stage, s_.stage_rank(a.stage)),
           "stage s runs on rank s % ranks: move the action to that rank's list");
    if (is_compute(a.kind)) {
      if (a.peer != -1)
        fail(rank, index, fmt::format("a compute action has peer {}", a.peer), "set peer -1 on compute actions");
      return;
    }
    const bool forward = a.kind == ActionKind::send_activation || a.kind == ActionKind::recv_activation;
    const bool send = a.kind == ActionKind::send_activation || a.kind == ActionKind::send_grad;
    // The other stage of the transfer: the consumer of a send, the producer of a recv.
    const int other = (forward == send) ? a.stage + 1 : a.stage - 1;
    if (other < 0 || other >= stages_)
      fail(rank, index, fmt::format("stage {} has no stage {} to exchange with", a.stage, other),
           "stage 0's forward reads the input and the last stage's backward starts from the loss: "
           "neither sends nor receives there");
    const int expected = s_.stage_rank(other);
    if (expected == rank)
      fail(rank, index, fmt::format("stage {} is on this rank too", other),
           "a transfer between stages of one rank is handed over locally: drop the send/recv");
    if (a.peer != expected)
      fail(rank, index, fmt::format("peer {}, but stage {} lives on rank {}", a.peer, other, expected),
           "set peer to the rank of the other stage of the transfer");
  }

  // Runs action `index` of `rank` at `clock`, or returns nullopt when it is
  // a recv whose send has not run.
  std::optional<TimedAction> step(int rank, size_t index, int64_t clock) {
    const Action& a = s_.programs[rank][index];
    check_fields(rank, index, a);
    const size_t k = at(a.stage, a.micro_batch);
    const auto once = [&](std::vector<int64_t>& slot) {
      if (slot[k] != kNotRun) fail(rank, index, "runs twice", "every action runs exactly once");
    };
    const auto need = [&](bool ok, const std::string& what) {
      if (!ok)
        fail(rank, index, fmt::format("runs before {}", what),
             "a compute action or send never waits: put what it needs earlier in the rank's list");
    };
    const auto local = [&](int stage) { return s_.stage_rank(stage) == rank; };
    const auto label = [&](ActionKind kind, int stage) { return Action{kind, stage, a.micro_batch, -1}.to_string(); };
    const auto recv_label = [&](ActionKind kind, int other) {
      return Action{kind, a.stage, a.micro_batch, s_.stage_rank(other)}.to_string();
    };
    switch (a.kind) {
      case ActionKind::forward:
        once(forward_);
        if (a.stage > 0) {
          if (local(a.stage - 1))
            need(forward_[at(a.stage - 1, a.micro_batch)] != kNotRun, label(ActionKind::forward, a.stage - 1));
          else
            need(act_recv_[k] != kNotRun, recv_label(ActionKind::recv_activation, a.stage - 1));
        }
        forward_[k] = clock + costs_.forward;
        return TimedAction{a, clock, forward_[k]};
      case ActionKind::backward:
      case ActionKind::backward_input: {
        const bool fused = a.kind == ActionKind::backward;
        if (input_grad_[k] != kNotRun)
          fail(rank, index, fused_[k] != fused ? "the other backward kind already ran for it" : "runs twice",
               "every (stage, micro-batch) gets one fused backward, or one backward_input and one backward_weight");
        need(forward_[k] != kNotRun, label(ActionKind::forward, a.stage));
        if (a.stage + 1 < stages_) {
          if (local(a.stage + 1))
            need(input_grad_[at(a.stage + 1, a.micro_batch)] != kNotRun,
                 fmt::format("the backward of stage {} (micro-batch {})", a.stage + 1, a.micro_batch));
          else
            need(grad_recv_[k] != kNotRun, recv_label(ActionKind::recv_grad, a.stage + 1));
        }
        fused_[k] = fused;
        input_grad_[k] = clock + (fused ? costs_.backward : costs_.backward_input);
        return TimedAction{a, clock, input_grad_[k]};
      }
      case ActionKind::backward_weight:
        once(weight_);
        if (input_grad_[k] != kNotRun && fused_[k])
          fail(rank, index, fmt::format("{} was a fused backward, which computed the weight gradient",
                                        label(ActionKind::backward, a.stage)),
               "use backward_input + backward_weight, or one fused backward");
        need(input_grad_[k] != kNotRun, label(ActionKind::backward_input, a.stage));
        weight_[k] = clock + costs_.backward_weight;
        return TimedAction{a, clock, weight_[k]};
      case ActionKind::send_activation:
        once(act_sent_);
        need(forward_[k] != kNotRun, label(ActionKind::forward, a.stage));
        act_sent_[k] = clock;
        return TimedAction{a, clock, clock};
      case ActionKind::send_grad:
        once(grad_sent_);
        need(input_grad_[k] != kNotRun,
             fmt::format("the backward of stage {} (micro-batch {})", a.stage, a.micro_batch));
        grad_sent_[k] = clock;
        return TimedAction{a, clock, clock};
      case ActionKind::recv_activation:
      case ActionKind::recv_grad: {
        const bool act = a.kind == ActionKind::recv_activation;
        std::vector<int64_t>& received = act ? act_recv_ : grad_recv_;
        once(received);
        const Action send = matching_send(rank, a);
        const int64_t sent = (act ? act_sent_ : grad_sent_)[at(send.stage, send.micro_batch)];
        if (sent == kNotRun) return std::nullopt;
        received[k] = std::max(clock, sent);
        return TimedAction{a, clock, received[k]};
      }
    }
    fail(rank, index, "unknown action kind", "use an ActionKind enumerator");
  }

  InvalidArgument deadlock(const std::vector<size_t>& pc) const {
    std::string waits, pending;
    for (int r = 0; r < s_.ranks; ++r) {
      const std::vector<Action>& prog = s_.programs[r];
      if (pc[r] >= prog.size()) continue;
      const Action send = matching_send(r, prog[pc[r]]);
      const int from = s_.stage_rank(send.stage);
      waits += fmt::format("{}rank {} waits at action #{} {} for {} on rank {}, which has not run",
                           waits.empty() ? "" : "; ", r, pc[r], prog[pc[r]].to_string(), send.to_string(), from);
      pending += fmt::format("{}rank {}:", pending.empty() ? "" : "; ", r);
      const size_t end = std::min(prog.size(), pc[r] + kQuoted);
      for (size_t i = pc[r]; i < end; ++i) {
        pending += ' ';
        pending += prog[i].to_string();
      }
      if (prog.size() > end) pending += fmt::format(" (+{} more)", prog.size() - end);
    }
    return InvalidArgument("check_schedule", fmt::format("deadlock: {}. Pending: {}", waits, pending),
                           "a recv blocks until its send has run, sends never block: order the lists so that "
                           "every rank's next recv has its send reachable");
  }

  // Every (stage, micro-batch) has its forward and backward, every send its recv.
  void check_complete() const {
    std::vector<std::string> missing;
    size_t count = 0;
    const auto add = [&](std::string what) {
      if (missing.size() < kQuoted) missing.push_back(std::move(what));
      ++count;
    };
    for (int s = 0; s < stages_; ++s)
      for (int i = 0; i < m_; ++i) {
        const size_t k = at(s, i);
        const int r = s_.stage_rank(s);
        if (forward_[k] == kNotRun) add(fmt::format("{} on rank {}", Action{ActionKind::forward, s, i}.to_string(), r));
        if (input_grad_[k] == kNotRun)
          add(fmt::format("a backward ({} or {}) on rank {}", Action{ActionKind::backward, s, i}.to_string(),
                          Action{ActionKind::backward_input, s, i}.to_string(), r));
        else if (!fused_[k] && weight_[k] == kNotRun)
          add(fmt::format("{} on rank {}", Action{ActionKind::backward_weight, s, i}.to_string(), r));
        if (act_sent_[k] != kNotRun && act_recv_[at(s + 1, i)] == kNotRun)
          add(fmt::format("the recv of {} on rank {}",
                          Action{ActionKind::send_activation, s, i, s_.stage_rank(s + 1)}.to_string(), r));
        if (grad_sent_[k] != kNotRun && grad_recv_[at(s - 1, i)] == kNotRun)
          add(fmt::format("the recv of {} on rank {}",
                          Action{ActionKind::send_grad, s, i, s_.stage_rank(s - 1)}.to_string(), r));
      }
    if (count == 0) return;
    throw InvalidArgument("check_schedule",
                          fmt::format("{} action(s) missing: {}{}", count, fmt::join(missing, ", "),
                                      count > missing.size() ? ", ..." : ""),
                          "every (stage, micro-batch) needs one forward and one fused backward (or backward_input "
                          "plus backward_weight), and every send a recv");
  }

  const Schedule& s_;
  const StepCosts& costs_;
  int stages_;
  int m_;
  size_t pairs_;
  // Per (stage, micro-batch), the end time of what ran (kNotRun if nothing).
  std::vector<int64_t> forward_ = std::vector<int64_t>(pairs_, kNotRun);
  std::vector<int64_t> input_grad_ = std::vector<int64_t>(pairs_, kNotRun);  // fused backward or backward_input
  std::vector<char> fused_ = std::vector<char>(pairs_, 0);
  std::vector<int64_t> weight_ = std::vector<int64_t>(pairs_, kNotRun);
  std::vector<int64_t> act_sent_ = std::vector<int64_t>(pairs_, kNotRun);   // by the producing stage
  std::vector<int64_t> grad_sent_ = std::vector<int64_t>(pairs_, kNotRun);  // by the producing stage
  std::vector<int64_t> act_recv_ = std::vector<int64_t>(pairs_, kNotRun);   // by the consuming stage
  std::vector<int64_t> grad_recv_ = std::vector<int64_t>(pairs_, kNotRun);  // by the consuming stage
};

void check_schedule_shape(const Schedule& s) {
  check_shape("check_schedule", s.ranks, s.micro_batches, s.virtual_stages);
  if (s.programs.size() != static_cast<size_t>(s.ranks))
    throw InvalidArgument("check_schedule", fmt::format("{} programs for {} ranks", s.programs.size(), s.ranks),
                          "give one action list per rank");
}

char letter(ActionKind kind) {
  switch (kind) {
    case ActionKind::forward: return 'F';
    case ActionKind::backward_input: return 'I';
    case ActionKind::backward_weight: return 'W';
    case ActionKind::backward: return 'B';
    default: return '?';
  }
}

}  // namespace

bool is_compute(ActionKind kind) {
  return kind == ActionKind::forward || kind == ActionKind::backward_input || kind == ActionKind::backward_weight ||
         kind == ActionKind::backward;
}

std::string Action::to_string() const {
  switch (kind) {
    case ActionKind::send_activation: return fmt::format("SEND_F{}@s{}->r{}", micro_batch, stage, peer);
    case ActionKind::recv_activation: return fmt::format("RECV_F{}@s{}<-r{}", micro_batch, stage, peer);
    case ActionKind::send_grad: return fmt::format("SEND_B{}@s{}->r{}", micro_batch, stage, peer);
    case ActionKind::recv_grad: return fmt::format("RECV_B{}@s{}<-r{}", micro_batch, stage, peer);
    default: return fmt::format("{}{}@s{}", letter(kind), micro_batch, stage);
  }
}


int Schedule::stage_rank(int stage) const {
  if (ranks < 1 || stage < 0 || stage >= num_stages())
    throw InvalidArgument("Schedule::stage_rank", fmt::format("stage {} is not in [0, {})", stage, num_stages()),
                          "stages run 0..ranks * virtual_stages - 1");
  return stage % ranks;
}

Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages) {
  check_kind_shape("make_schedule", kind, ranks, micro_batches, virtual_stages);
  Schedule s{.kind = kind, .ranks = ranks, .micro_batches = micro_batches, .virtual_stages = virtual_stages,
             .programs = std::vector<std::vector<Action>>(ranks)};
  Lowering low(s);
  switch (kind) {
    case ScheduleKind::gpipe: build_gpipe(s, low); break;
    case ScheduleKind::one_f_one_b: build_one_f_one_b(s, low, /*split=*/false); break;
    case ScheduleKind::interleaved_1f1b: build_interleaved(s, low); break;
    case ScheduleKind::zero_bubble: build_one_f_one_b(s, low, /*split=*/true); break;
  }
  return s;
}

int64_t Timeline::busy(int rank) const {
  if (rank < 0 || static_cast<size_t>(rank) >= ranks.size())
    throw InvalidArgument("Timeline::busy", fmt::format("rank {} of {}", rank, ranks.size()),
                          "ask for a rank in [0, ranks)");
  int64_t total = 0;
  for (const TimedAction& t : ranks[rank])
    if (is_compute(t.action.kind)) total += t.end - t.start;
  return total;
}

void check_schedule(const Schedule& schedule) { simulate_schedule(schedule); }

Timeline simulate_schedule(const Schedule& schedule, const StepCosts& costs) {
  check_schedule_shape(schedule);
  for (int c : {costs.forward, costs.backward_input, costs.backward_weight, costs.backward})
    if (c < 1)
      throw InvalidArgument("simulate_schedule", fmt::format("step cost {}", c),
                            "every compute action takes at least one time step");
  return Simulator(schedule, costs).run();
}

double simulated_bubble(const Schedule& schedule, const StepCosts& costs) {
  const Timeline t = simulate_schedule(schedule, costs);
  const double total = static_cast<double>(t.makespan) * schedule.ranks;
  double busy = 0;
  for (int r = 0; r < schedule.ranks; ++r) busy += static_cast<double>(t.busy(r));
  return (total - busy) / total;
}

double theoretical_bubble(ScheduleKind kind, int p, int m, int v) {
  check_kind_shape("theoretical_bubble", kind, p, m, v);
  return plan::pipeline_bubble(kind, p, m, v);
}

int peak_in_flight(const Schedule& schedule, int rank) {
  if (rank < 0 || rank >= schedule.ranks || static_cast<size_t>(rank) >= schedule.programs.size())
    throw InvalidArgument("peak_in_flight", fmt::format("rank {} of {}", rank, schedule.programs.size()),
                          "ask for a rank in [0, ranks)");
  int now = 0, peak = 0;
  for (const Action& a : schedule.programs[rank]) {
    if (a.kind == ActionKind::forward) peak = std::max(peak, ++now);
    if (a.kind == ActionKind::backward || a.kind == ActionKind::backward_input) --now;
  }
  return peak;
}

std::string format_schedule(const Schedule& schedule) {
  const Timeline t = simulate_schedule(schedule);
  const auto cell_text = [&](const Action& a) {
    return schedule.virtual_stages == 1 ? fmt::format("{}{}", letter(a.kind), a.micro_batch)
                                        : fmt::format("{}{}s{}", letter(a.kind), a.micro_batch, a.stage);
  };
  std::vector<std::vector<std::string>> grid(schedule.ranks, std::vector<std::string>(t.makespan, "."));
  size_t width = 1;
  for (int r = 0; r < schedule.ranks; ++r)
    for (const TimedAction& ta : t.ranks[r]) {
      if (!is_compute(ta.action.kind)) continue;
      const std::string text = cell_text(ta.action);
      width = std::max(width, text.size());
      for (int64_t step = ta.start; step < ta.end; ++step) grid[r][step] = text;
    }
  const size_t label_width = fmt::format("r{}", schedule.ranks - 1).size();
  std::string out;
  for (int r = 0; r < schedule.ranks; ++r) {
    std::string line = fmt::format("{:<{}}", fmt::format("r{}", r), label_width);
    for (const std::string& c : grid[r]) line += fmt::format(" {:<{}}", c, width);
    line.erase(line.find_last_not_of(' ') + 1);
    out += line + "\n";
  }
  return out;
}

}  // namespace meshtrain::parallel
