// Pipeline schedules: which compute and point-to-point actions each pipeline
// rank runs, in which order, lowered to one action list per rank (as
// torch.distributed.pipelining's PipelineScheduleMulti does with its
// _Action lists), a checker that simulates the lists, and the simulated
// timeline with its bubble.
//
//   Schedule s = make_schedule(ScheduleKind::one_f_one_b, /*ranks=*/2, /*micro_batches=*/4);
//   s.programs[1];                 // RECV_F0@s1<-r0 F0@s1 B0@s1 SEND_B0@s1->r0 RECV_F1@s1<-r0 ...
//   check_schedule(s);             // throws InvalidArgument on a deadlock or a bad list
//   simulated_bubble(s);           // 0.2 == theoretical_bubble(one_f_one_b, 2, 4, 1)
//   peak_in_flight(s, 0);          // 2: micro-batches holding activations on rank 0
//   format_schedule(s);            // "r0 F0 F1 .  .  B0 B0 F2 B1 B1 ...\nr1 .  F0 B0 B0 F1 ...\n"
//   make_schedule(parse_schedule_kind("interleaved"), 4, 8, /*virtual_stages=*/2);
//
// Stages: the model is cut into num_stages() = ranks * virtual_stages
// consecutive stages (chunks). Stage s lives on rank s % ranks (Megatron's
// and PyTorch's interleaved "loop" placement); with one chunk per rank stage
// s is rank s. Forward runs stage 0 -> num_stages-1, backward the reverse.
//
// Schedules (compute order per rank; every kind is deadlock-free, checked by
// the tests for ranks 1..6 and micro_batches 1..12):
//   gpipe        all forwards, then all fused backwards, micro-batches in order
//                (GPipe, Huang et al. 2019; PyTorch's ScheduleGPipe).
//   1f1b         min(ranks - rank - 1, m) warm-up forwards, then one forward
//                one fused backward, then the remaining backwards (PipeDream-
//                Flush / Megatron's 1F1B; PyTorch's Schedule1F1B).
//   interleaved  Megatron's interleaved 1F1B over virtual_stages >= 2 chunks per
//                rank (Narayanan et al. 2021; PyTorch's ScheduleInterleaved1F1B):
//                the k-th forward of a rank runs chunk (k / ranks) % v on
//                micro-batch (k / (ranks v)) ranks + k % ranks, the k-th backward
//                chunk v - 1 - (k / ranks) % v on the same micro-batch rule;
//                warm-up min((v - 1) ranks + 2 (ranks - rank - 1), v m) forwards,
//                then 1F1B, then the remaining backwards. Needs micro_batches a
//                multiple of ranks (as Megatron does).
//   zb           ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
//                2024): 1F1B's order with the backward split into
//                backward_input (I) and backward_weight (W); rank r defers its
//                first r W's (each later I is followed by the oldest pending W,
//                the rest run at the end), as PyTorch's
//                ScheduleInterleavedZeroBubble does with one chunk. Same warm-up,
//                so the same peak activations as 1F1B.
//
// Action lists: every compute action is preceded by the receive it needs and
// followed by the send its consumer needs:
//   RECV_F before a forward of stage s > 0 whose stage s-1 is on another rank,
//   SEND_F after a forward of stage s < last whose stage s+1 is on another rank,
//   RECV_B before a backward / backward_input of stage s < last whose stage s+1
//     is on another rank, SEND_B after one of stage s > 0 whose stage s-1 is.
// Stage 0's forward reads the input (no RECV_F); the last stage's backward
// starts from the loss (no RECV_B). When both stages of a transfer live on one
// rank (only with ranks == 1: the loop placement puts neighbours on different
// ranks otherwise) there is no send or recv: the executor hands the tensor
// over locally, from the producing action's output to the consuming action.
// Send and recv actions name the stage they belong to: a send the producing
// stage, a recv the consuming one ("SEND_F3@s1->r2" pairs with
// "RECV_F3@s2<-r1").
//
// Execution model (check_schedule, simulate_schedule): each rank runs its
// list in order; a send never blocks (unbounded buffering, like isend); a
// recv blocks until the matching send has run; a compute action never waits:
// its inputs must already be on the rank (received earlier in its list, or
// computed earlier on it), otherwise the list is wrong. Costs are in unit
// time steps (StepCosts; sends and recvs take no time), so the timeline is the
// earliest start of every action under the lists' order.
//
// Errors: InvalidArgument (op "make_schedule", "check_schedule", ...) with a
// hint. Thread-safety: pure functions over values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/layout/vocabulary.h"

namespace meshtrain::parallel {

enum class ActionKind : uint8_t {
  forward,          // "F": the stage's forward on a micro-batch
  backward_input,   // "I": gradient w.r.t. the stage's input (zero-bubble schedules' B)
  backward_weight,  // "W": gradient w.r.t. the stage's weights, after its I
  backward,         // "B": fused backward (input and weight gradients)
  send_activation,  // "SEND_F": the stage's output to the rank of stage + 1
  recv_activation,  // "RECV_F": the stage's input from the rank of stage - 1
  send_grad,        // "SEND_B": the stage's input gradient to the rank of stage - 1
  recv_grad,        // "RECV_B": the stage's output gradient from the rank of stage + 1
};

// True for forward, backward_input, backward_weight and backward.
bool is_compute(ActionKind kind);

struct Action {
  ActionKind kind = ActionKind::forward;
  int stage = 0;        // the model stage (chunk), 0..num_stages-1
  int micro_batch = 0;  // 0..micro_batches-1
  int peer = -1;        // the other rank of a send or recv, else -1
  // "F3@s1", "I3@s1", "W3@s1", "B3@s1", "SEND_F3@s1->r2", "RECV_F3@s2<-r1",
  // "SEND_B3@s2->r1", "RECV_B3@s1<-r2". I is backward_input (PyTorch's
  // current name; the zero-bubble paper calls it B), so every kind prints
  // differently.
  std::string to_string() const;
  bool operator==(const Action&) const = default;
};

// The schedules' names are the layout vocabulary's (layout/vocabulary.h).
using layout::parse_schedule_kind;
using layout::ScheduleKind;
using layout::to_string;

struct Schedule {
  ScheduleKind kind = ScheduleKind::gpipe;
  int ranks = 1;
  int micro_batches = 1;
  int virtual_stages = 1;  // chunks per rank
  // One list per rank, in execution order, sends and recvs included.
  std::vector<std::vector<Action>> programs;

  int num_stages() const { return ranks * virtual_stages; }
  // The rank stage lives on: stage % ranks. InvalidArgument unless 0 <= stage < num_stages().
  int stage_rank(int stage) const;
};

// The schedule of `kind` for `ranks` pipeline ranks, `micro_batches` per step
// and `virtual_stages` chunks per rank. ranks, micro_batches, virtual_stages
// >= 1; virtual_stages == 1 unless interleaved, which needs virtual_stages >=
// 2 and micro_batches a multiple of ranks; ranks * virtual_stages *
// micro_batches <= 2^22. InvalidArgument otherwise.
Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages = 1);

// Runs the lists under the execution model above and throws InvalidArgument
// describing the first fault: a deadlock (which rank waits on what, the first
// actions still pending per rank), an action with a stage, micro-batch or peer
// that does not fit the schedule, an action run twice, a compute action or send
// before its input, a missing action (every (stage, micro-batch) needs one
// forward and either one backward or one backward_input plus one
// backward_weight), a send nobody receives. The schedule's kind is not used:
// any lists over ranks, micro_batches and virtual_stages can be checked.
void check_schedule(const Schedule& schedule);

// Time steps per compute action (each >= 1); sends and recvs take none.
struct StepCosts {
  int forward = 1;
  int backward_input = 1;
  int backward_weight = 1;
  int backward = 2;  // fused: input + weight
};

// One action of the simulated timeline: compute runs in [start, end); a
// recv waits in [start, end) (start == end when its data was there); a send
// has start == end.
struct TimedAction {
  Action action;
  int64_t start = 0;
  int64_t end = 0;
};

struct Timeline {
  int64_t makespan = 0;  // the latest end over all ranks
  std::vector<std::vector<TimedAction>> ranks;  // every rank's list, in order
  // Time steps `rank` spends computing.
  int64_t busy(int rank) const;
};

// The timeline of the lists under the execution model (checks them as
// check_schedule does, with the same errors).
Timeline simulate_schedule(const Schedule& schedule, const StepCosts& costs = {});

// (ranks * makespan - busy time of all ranks) / (ranks * makespan) of
// simulate_schedule(schedule, costs): the idle share of the step.
double simulated_bubble(const Schedule& schedule, const StepCosts& costs = {});

// The bubble share of kind's schedule for p ranks, m micro-batches and v
// chunks per rank under the default StepCosts (F = I = W = 1, fused B = 2),
// validated as make_schedule validates:
//   gpipe, 1f1b   (p - 1) / (m + p - 1)
//                 GPipe's bubble overhead (K - 1) / (M + K - 1) (Huang et al.
//                 2019); Narayanan et al. 2021 (Megatron-LM, sec. 2.2.1) give it
//                 as (p - 1) / m of the ideal time m (tf + tb), i.e. (p - 1) /
//                 (m + p - 1) of the step, whatever tf and tb.
//   interleaved   (p - 1) / (v m + p - 1)
//                 Narayanan et al. 2021 sec. 2.2.2: the bubble shrinks to
//                 (1 / v) (p - 1) / m of the ideal time.
//   zb (ZB-H1)    1 - 3 m / T with T = 2 m + p - 1 + max(m, p) time steps.
//                 For m >= p, T = 3 m + p - 1 and the share is
//                 (p - 1) / (3 m + p - 1): Qi et al. 2024 (sec. 2.1, with TF =
//                 TB = TW) cut 1F1B's bubble to a third, (p - 1) / (3 m) of the
//                 ideal time, i.e. p - 1 steps instead of 3 (p - 1). For m < p
//                 no schedule beats T = 2 m + 2 p - 1 (our bound, the paper
//                 assumes m >= p): rank 0's first I cannot start before step
//                 2 p - 1 (a forward and a backward_input through every stage),
//                 and it still has m I's and m W's to run.
// The schedules make_schedule builds reach these exactly (tested).
double theoretical_bubble(ScheduleKind kind, int p, int m, int v = 1);

// The most (stage, micro-batch) pairs whose forward ran on `rank` and whose
// backward (fused, or its input part) has not yet, along the rank's list: the
// activations it holds at its peak. With one chunk per rank a pair is a
// micro-batch: min(m, p) on rank 0 under 1f1b and zb, m under gpipe; with v
// chunks a pair holds 1/v of a rank's layers (interleaved rank 0:
// min((v + 1) p - 1, v m) pairs). InvalidArgument unless 0 <= rank < ranks.
int peak_in_flight(const Schedule& schedule, int rank);

// The timeline under the default StepCosts as a text grid: one line per rank
// ("r0 ", "r1 ", ...), one column per time step, each cell the compute action
// running then ("F3", "I3", "W3", "B3"; a fused backward fills two cells;
// with virtual_stages > 1 the stage follows: "F3s5") or "." when idle; cells
// padded to one width and separated by one space, lines right-trimmed and
// ending in '\n'. Sends and recvs take no time and do not show. Meant for
// small schedules (docs, debugging): the text has ranks x makespan cells.
std::string format_schedule(const Schedule& schedule);

}  // namespace meshtrain::parallel
