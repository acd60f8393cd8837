// Tests for pipeline_schedule.h: hand-checked orders of every kind, the
// checker against broken lists, and a property sweep (every kind, ranks 1..6,
// micro-batches 1..12) of deadlock freedom, peak activations and bubbles.
#include "meshtrain/parallel/pipeline_schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::parallel {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

constexpr ScheduleKind kAllKinds[] = {ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                                      ScheduleKind::interleaved_1f1b, ScheduleKind::zero_bubble};

// The compute actions of `rank`'s list, space-separated; "F3" instead of
// "F3@s1" when short (one chunk per rank, where the stage is the rank).
std::string compute_order(const Schedule& s, int rank, bool short_names = true) {
  std::string out;
  for (const Action& a : s.programs[rank]) {
    if (!is_compute(a.kind)) continue;
    const std::string text = a.to_string();
    if (!out.empty()) out += ' ';
    out += short_names ? text.substr(0, text.find('@')) : text;
  }
  return out;
}

// Every action of `rank`'s list, space-separated.
std::string program(const Schedule& s, int rank) {
  std::string out;
  for (const Action& a : s.programs[rank]) {
    if (!out.empty()) out += ' ';
    out += a.to_string();
  }
  return out;
}

std::string check_error(const Schedule& s) { return error_of([&] { check_schedule(s); }); }

// ------------------------------------------------------------------ names

TEST(PipelineSchedule, ActionStrings) {
  EXPECT_EQ((Action{ActionKind::forward, 1, 3}).to_string(), "F3@s1");
  EXPECT_EQ((Action{ActionKind::backward, 1, 3}).to_string(), "B3@s1");
  EXPECT_EQ((Action{ActionKind::backward_input, 1, 3}).to_string(), "I3@s1");
  EXPECT_EQ((Action{ActionKind::backward_weight, 1, 3}).to_string(), "W3@s1");
  EXPECT_EQ((Action{ActionKind::send_activation, 1, 3, 2}).to_string(), "SEND_F3@s1->r2");
  EXPECT_EQ((Action{ActionKind::recv_activation, 2, 3, 1}).to_string(), "RECV_F3@s2<-r1");
  EXPECT_EQ((Action{ActionKind::send_grad, 2, 3, 1}).to_string(), "SEND_B3@s2->r1");
  EXPECT_EQ((Action{ActionKind::recv_grad, 1, 3, 2}).to_string(), "RECV_B3@s1<-r2");
  EXPECT_TRUE(is_compute(ActionKind::backward_weight));
  EXPECT_FALSE(is_compute(ActionKind::recv_grad));
}

TEST(PipelineSchedule, KindNamesRoundTripAndUnknownNamesListTheValidOnes) {
  for (ScheduleKind k : kAllKinds) EXPECT_EQ(parse_schedule_kind(to_string(k)), k);
  EXPECT_EQ(parse_schedule_kind("1f1b"), ScheduleKind::one_f_one_b);
  EXPECT_EQ(parse_schedule_kind("interleaved"), ScheduleKind::interleaved_1f1b);
  EXPECT_EQ(parse_schedule_kind("zb"), ScheduleKind::zero_bubble);
  const std::string e = error_of([] { parse_schedule_kind("pipedream"); });
  EXPECT_THAT(e, HasSubstr("unknown pipeline schedule 'pipedream'"));
  EXPECT_THAT(e, HasSubstr("gpipe, 1f1b, interleaved or zb"));
  EXPECT_THAT(error_of([] { parse_schedule_kind("1F1B"); }), HasSubstr("unknown"));
}

TEST(PipelineSchedule, StagesLoopOverTheRanks) {
  const Schedule s = make_schedule(ScheduleKind::interleaved_1f1b, 4, 8, 3);
  EXPECT_EQ(s.num_stages(), 12);
  EXPECT_EQ(s.stage_rank(0), 0);
  EXPECT_EQ(s.stage_rank(5), 1);
  EXPECT_EQ(s.stage_rank(11), 3);
  EXPECT_THAT(error_of([&] { s.stage_rank(12); }), HasSubstr("stage 12 is not in [0, 12)"));
  EXPECT_EQ(make_schedule(ScheduleKind::one_f_one_b, 4, 8).stage_rank(2), 2);
}

// ------------------------------------------------------------------ validation

TEST(PipelineSchedule, MakeScheduleValidates) {
  EXPECT_THAT(error_of([] { make_schedule(ScheduleKind::gpipe, 0, 4); }), HasSubstr("ranks 0"));
  EXPECT_THAT(error_of([] { make_schedule(ScheduleKind::gpipe, 2, 0); }), HasSubstr("micro_batches 0"));
  EXPECT_THAT(error_of([] { make_schedule(ScheduleKind::interleaved_1f1b, 2, 2, 0); }),
              HasSubstr("virtual_stages 0"));
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zero_bubble}) {
    const std::string e = error_of([&] { make_schedule(k, 2, 4, 2); });
    EXPECT_THAT(e, HasSubstr("virtual_stages 2 with the " + std::string(to_string(k)) + " schedule"));
    EXPECT_THAT(e, HasSubstr("only the interleaved schedule runs several chunks per rank"));
  }
  EXPECT_THAT(error_of([] { make_schedule(ScheduleKind::interleaved_1f1b, 2, 4, 1); }),
              HasSubstr("interleaved runs at least 2 chunks per rank"));
  const std::string e = error_of([] { make_schedule(ScheduleKind::interleaved_1f1b, 4, 6, 2); });
  EXPECT_THAT(e, HasSubstr("micro_batches 6 is not a multiple of ranks 4"));
  EXPECT_THAT(e, HasSubstr("as Megatron-LM and PyTorch require: use a multiple of 4"));
  EXPECT_THAT(error_of([] { make_schedule(ScheduleKind::gpipe, 1024, 1 << 13); }), HasSubstr("more than 4194304"));
  EXPECT_THAT(error_of([] { theoretical_bubble(ScheduleKind::interleaved_1f1b, 4, 6, 2); }),
              HasSubstr("not a multiple of ranks 4"));
  EXPECT_THAT(error_of([] { theoretical_bubble(ScheduleKind::one_f_one_b, 4, 8, 2); }),
              HasSubstr("virtual_stages 2"));
}

// ------------------------------------------------------------------ hand-checked orders

TEST(PipelineSchedule, GPipeRunsAllForwardsThenAllBackwards) {
  const Schedule s = make_schedule(ScheduleKind::gpipe, 2, 3);
  EXPECT_EQ(compute_order(s, 0), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(compute_order(s, 1), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(program(s, 1),
            "RECV_F0@s1<-r0 F0@s1 RECV_F1@s1<-r0 F1@s1 RECV_F2@s1<-r0 F2@s1 "
            "B0@s1 SEND_B0@s1->r0 B1@s1 SEND_B1@s1->r0 B2@s1 SEND_B2@s1->r0");
}

TEST(PipelineSchedule, OneFOneBWarmsUpThenAlternates) {
  const Schedule s = make_schedule(ScheduleKind::one_f_one_b, 2, 4);
  EXPECT_EQ(compute_order(s, 0), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(compute_order(s, 1), "F0 B0 F1 B1 F2 B2 F3 B3");
  const Schedule small = make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  EXPECT_EQ(program(small, 0), "F0@s0 SEND_F0@s0->r1 F1@s0 SEND_F1@s0->r1 RECV_B0@s0<-r1 B0@s0 RECV_B1@s0<-r1 B1@s0");
  EXPECT_EQ(program(small, 1),
            "RECV_F0@s1<-r0 F0@s1 B0@s1 SEND_B0@s1->r0 RECV_F1@s1<-r0 F1@s1 B1@s1 SEND_B1@s1->r0");
  // Fewer micro-batches than ranks: the warm-up is capped at m.
  const Schedule few = make_schedule(ScheduleKind::one_f_one_b, 4, 2);
  EXPECT_EQ(compute_order(few, 0), "F0 F1 B0 B1");
  EXPECT_EQ(compute_order(few, 2), "F0 F1 B0 B1");
  EXPECT_EQ(compute_order(few, 3), "F0 B0 F1 B1");
}

TEST(PipelineSchedule, InterleavedFollowsMegatronsOrder) {
  // p = 2, v = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
  // Rank 0 warms up with (v-1) p + 2 (p-1) = 4 forwards, rank 1 with 2.
  const Schedule s = make_schedule(ScheduleKind::interleaved_1f1b, 2, 4, 2);
  EXPECT_EQ(compute_order(s, 0, false),
            "F0@s0 F1@s0 F0@s2 F1@s2 F2@s0 B0@s2 F3@s0 B1@s2 F2@s2 B0@s0 F3@s2 B1@s0 B2@s2 B3@s2 B2@s0 B3@s0");
  EXPECT_EQ(compute_order(s, 1, false),
            "F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 F2@s1 B0@s1 F3@s1 B1@s1 F2@s3 B2@s3 F3@s3 B3@s3 B2@s1 B3@s1");
  // Stage 1 -> 2 loops back from rank 1 to rank 0 over the wire.
  EXPECT_THAT(program(s, 1), HasSubstr("F0@s1 SEND_F0@s1->r0"));
  EXPECT_THAT(program(s, 0), HasSubstr("RECV_F0@s2<-r1 F0@s2"));
  EXPECT_THAT(program(s, 0), HasSubstr("RECV_B0@s2<-r1 B0@s2 SEND_B0@s2->r1"));
}

TEST(PipelineSchedule, InterleavedOnOneRankHandsTensorsOverLocally) {
  const Schedule s = make_schedule(ScheduleKind::interleaved_1f1b, 1, 2, 2);
  EXPECT_EQ(program(s, 0), "F0@s0 F0@s1 B0@s1 F1@s0 B0@s0 F1@s1 B1@s1 B1@s0");
  check_schedule(s);
}

TEST(PipelineSchedule, ZeroBubbleSplitsBackwardAndDefersWeights) {
  // Rank r defers its first r W's: rank 0 none, the last rank p - 1.
  const Schedule s = make_schedule(ScheduleKind::zero_bubble, 2, 4);
  EXPECT_EQ(compute_order(s, 0), "F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3");
  EXPECT_EQ(compute_order(s, 1), "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3");
  const Schedule three = make_schedule(ScheduleKind::zero_bubble, 3, 4);
  EXPECT_EQ(compute_order(three, 0), "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3");
  EXPECT_EQ(compute_order(three, 1), "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3");
  EXPECT_EQ(compute_order(three, 2), "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3");
  // The gradient goes upstream right after I; W sends nothing.
  EXPECT_THAT(program(s, 1), HasSubstr("I0@s1 SEND_B0@s1->r0 RECV_F1@s1<-r0 F1@s1"));
  EXPECT_THAT(program(s, 0), HasSubstr("RECV_B0@s0<-r1 I0@s0 W0@s0"));
}

TEST(PipelineSchedule, OneRankHasNoCommunication) {
  for (ScheduleKind k : kAllKinds) {
    const Schedule s = make_schedule(k, 1, 3, k == ScheduleKind::interleaved_1f1b ? 3 : 1);
    for (const Action& a : s.programs[0]) EXPECT_TRUE(is_compute(a.kind)) << a.to_string();
  }
}

// ------------------------------------------------------------------ timeline and grid

TEST(PipelineSchedule, TimelineRecordsWaitsAndCosts) {
  const Timeline t = simulate_schedule(make_schedule(ScheduleKind::one_f_one_b, 2, 2));
  EXPECT_EQ(t.makespan, 9);
  ASSERT_EQ(t.ranks[0].size(), 8u);
  // Rank 0: F0 [0,1), F1 [1,2), then waits for rank 1's B0 (done at 4), B0 [4,6).
  EXPECT_EQ(t.ranks[0][4].action.to_string(), "RECV_B0@s0<-r1");
  EXPECT_EQ(t.ranks[0][4].start, 2);
  EXPECT_EQ(t.ranks[0][4].end, 4);
  EXPECT_EQ(t.ranks[0][5].start, 4);
  EXPECT_EQ(t.ranks[0][5].end, 6);
  EXPECT_EQ(t.ranks[0][7].end, 9);
  EXPECT_EQ(t.busy(0), 6);
  EXPECT_EQ(t.busy(1), 6);
  EXPECT_DOUBLE_EQ(simulated_bubble(make_schedule(ScheduleKind::one_f_one_b, 2, 2)), 6.0 / 18.0);
  EXPECT_THAT(error_of([&] { t.busy(2); }), HasSubstr("rank 2 of 2"));
  // Costs scale the timeline: F = 2, B = 4 doubles it.
  const Timeline doubled =
      simulate_schedule(make_schedule(ScheduleKind::one_f_one_b, 2, 2), {.forward = 2, .backward = 4});
  EXPECT_EQ(doubled.makespan, 18);
  EXPECT_THAT(error_of([] { simulate_schedule(make_schedule(ScheduleKind::gpipe, 1, 1), {.forward = 0}); }),
              HasSubstr("step cost 0"));
}

TEST(PipelineSchedule, FormatScheduleDrawsTheTimeline) {
  EXPECT_EQ(format_schedule(make_schedule(ScheduleKind::one_f_one_b, 2, 2)),
            "r0 F0 F1 .  .  B0 B0 .  B1 B1\n"
            "r1 .  F0 B0 B0 F1 B1 B1 .  .\n");
  // docs/pipeline.md's 1F1B grid.
  EXPECT_EQ(format_schedule(make_schedule(ScheduleKind::one_f_one_b, 2, 4)),
            "r0 F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3\n"
            "r1 .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .\n");
  EXPECT_EQ(format_schedule(make_schedule(ScheduleKind::zero_bubble, 2, 2)),
            "r0 F0 F1 .  I0 W0 I1 W1\n"
            "r1 .  F0 I0 F1 I1 W0 W1\n");
  EXPECT_EQ(format_schedule(make_schedule(ScheduleKind::interleaved_1f1b, 1, 1, 2)),
            "r0 F0s0 F0s1 B0s1 B0s1 B0s0 B0s0\n");
}

// ------------------------------------------------------------------ the checker

// 1F1B for p = 2, m = 2 with `rank`'s list edited by `edit`.
Schedule edited(int rank, const std::function<void(std::vector<Action>&)>& edit,
                ScheduleKind kind = ScheduleKind::one_f_one_b) {
  Schedule s = make_schedule(kind, 2, 2);
  edit(s.programs[rank]);
  return s;
}

TEST(PipelineScheduleChecker, CatchesADeadlock) {
  // Both ranks start with a recv whose send comes later on the other.
  Schedule s{.kind = ScheduleKind::one_f_one_b, .ranks = 2, .micro_batches = 1, .virtual_stages = 1,
             .programs = {{{ActionKind::recv_grad, 0, 0, 1},
                 {ActionKind::forward, 0, 0},
                 {ActionKind::send_activation, 0, 0, 1},
                 {ActionKind::backward, 0, 0}},
                {{ActionKind::recv_activation, 1, 0, 0},
                 {ActionKind::forward, 1, 0},
                 {ActionKind::backward, 1, 0},
                 {ActionKind::send_grad, 1, 0, 0}}}};
  const std::string e = check_error(s);
  EXPECT_THAT(e, HasSubstr("deadlock"));
  EXPECT_THAT(e, HasSubstr("rank 0 waits at action #0 RECV_B0@s0<-r1 for SEND_B0@s1->r0 on rank 1"));
  EXPECT_THAT(e, HasSubstr("rank 1 waits at action #0 RECV_F0@s1<-r0 for SEND_F0@s0->r1 on rank 0"));
  EXPECT_THAT(e, HasSubstr("Pending: rank 0: RECV_B0@s0<-r1 F0@s0 SEND_F0@s0->r1 B0@s0"));
  // The same lists with rank 0's recv moved before its backward run.
  std::swap(s.programs[0][0], s.programs[0][2]);
  std::swap(s.programs[0][0], s.programs[0][1]);
  check_schedule(s);
}

TEST(PipelineScheduleChecker, CatchesADeadlockDeeperInTheLists) {
  // Rank 1 receives micro-batch 1 before micro-batch 0; rank 0 sends 1 only
  // after receiving 0's gradient.
  Schedule s{.kind = ScheduleKind::gpipe, .ranks = 2, .micro_batches = 2, .virtual_stages = 1,
             .programs = {{{ActionKind::forward, 0, 0},
                           {ActionKind::send_activation, 0, 0, 1},
                           {ActionKind::recv_grad, 0, 0, 1},
                           {ActionKind::backward, 0, 0},
                           {ActionKind::forward, 0, 1},
                           {ActionKind::send_activation, 0, 1, 1},
                           {ActionKind::recv_grad, 0, 1, 1},
                           {ActionKind::backward, 0, 1}},
                          {{ActionKind::recv_activation, 1, 1, 0},
                           {ActionKind::recv_activation, 1, 0, 0},
                           {ActionKind::forward, 1, 0},
                           {ActionKind::forward, 1, 1},
                           {ActionKind::backward, 1, 0},
                           {ActionKind::send_grad, 1, 0, 0},
                           {ActionKind::backward, 1, 1},
                           {ActionKind::send_grad, 1, 1, 0}}}};
  const std::string e = check_error(s);
  EXPECT_THAT(e, HasSubstr("rank 0 waits at action #2 RECV_B0@s0<-r1 for SEND_B0@s1->r0 on rank 1"));
  EXPECT_THAT(e, HasSubstr("rank 1 waits at action #0 RECV_F1@s1<-r0 for SEND_F1@s0->r1 on rank 0"));
  EXPECT_THAT(e, HasSubstr("rank 1: RECV_F1@s1<-r0 RECV_F0@s1<-r0 F0@s1 F1@s1 (+4 more)"));
  // Receiving in order is not enough (rank 1 still wants both forwards before
  // a backward); taking micro-batch 0 through first is.
  std::swap(s.programs[1][0], s.programs[1][1]);
  EXPECT_THAT(check_error(s), HasSubstr("rank 1 waits at action #1 RECV_F1@s1<-r0"));
  s.programs[1] = {{ActionKind::recv_activation, 1, 0, 0}, {ActionKind::forward, 1, 0},
                   {ActionKind::backward, 1, 0},          {ActionKind::send_grad, 1, 0, 0},
                   {ActionKind::recv_activation, 1, 1, 0}, {ActionKind::forward, 1, 1},
                   {ActionKind::backward, 1, 1},          {ActionKind::send_grad, 1, 1, 0}};
  check_schedule(s);
}

TEST(PipelineScheduleChecker, CatchesMissingActions) {
  Schedule one = make_schedule(ScheduleKind::gpipe, 1, 2);
  one.programs[0].pop_back();  // B1@s0
  EXPECT_THAT(check_error(one), HasSubstr("1 action(s) missing: a backward (B1@s0 or I1@s0) on rank 0"));

  // Drop micro-batch 1's backward on both ranks, with its transfer.
  Schedule two = make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  for (std::vector<Action>& p : two.programs)
    std::erase_if(p, [](const Action& a) { return a.micro_batch == 1 && a.kind != ActionKind::forward &&
                                                  a.kind != ActionKind::send_activation &&
                                                  a.kind != ActionKind::recv_activation; });
  const std::string e = check_error(two);
  EXPECT_THAT(e, HasSubstr("2 action(s) missing"));
  EXPECT_THAT(e, HasSubstr("B1@s0 or I1@s0"));
  EXPECT_THAT(e, HasSubstr("B1@s1 or I1@s1"));

  const Schedule no_w = edited(0, [](std::vector<Action>& p) {
    std::erase_if(p, [](const Action& a) { return a.to_string() == "W1@s0"; });
  }, ScheduleKind::zero_bubble);
  EXPECT_THAT(check_error(no_w), HasSubstr("missing: W1@s0 on rank 0"));

  // Rank 1 never takes micro-batch 1: rank 0's send of it has no recv.
  Schedule unreceived = make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  std::erase_if(unreceived.programs[1], [](const Action& a) { return a.micro_batch == 1; });
  std::erase_if(unreceived.programs[0], [](const Action& a) {
    return a.micro_batch == 1 && a.kind != ActionKind::forward && a.kind != ActionKind::send_activation;
  });
  const std::string u = check_error(unreceived);
  EXPECT_THAT(u, HasSubstr("4 action(s) missing: a backward (B1@s0 or I1@s0) on rank 0, the recv of "
                           "SEND_F1@s0->r1 on rank 0, F1@s1 on rank 1, a backward (B1@s1 or I1@s1) on rank 1"));
}

TEST(PipelineScheduleChecker, CatchesDuplicates) {
  const Schedule twice = edited(0, [](std::vector<Action>& p) { p.insert(p.begin() + 1, p[0]); });
  EXPECT_THAT(check_error(twice), HasSubstr("rank 0, action #1 F0@s0: runs twice"));
  Schedule gpipe = make_schedule(ScheduleKind::gpipe, 1, 2);
  gpipe.programs[0].push_back({ActionKind::forward, 0, 1});
  EXPECT_THAT(check_error(gpipe), HasSubstr("action #4 F1@s0: runs twice"));
  const Schedule sent_twice = edited(0, [](std::vector<Action>& p) { p.insert(p.begin() + 2, p[1]); });
  EXPECT_THAT(check_error(sent_twice), HasSubstr("SEND_F0@s0->r1: runs twice"));
  // A fused backward and a split one for the same pair.
  Schedule mixed = make_schedule(ScheduleKind::gpipe, 1, 1);
  mixed.programs[0].push_back({ActionKind::backward_input, 0, 0});
  EXPECT_THAT(check_error(mixed), HasSubstr("I0@s0: the other backward kind already ran for it"));
  Schedule fused_w = make_schedule(ScheduleKind::gpipe, 1, 1);
  fused_w.programs[0].push_back({ActionKind::backward_weight, 0, 0});
  EXPECT_THAT(check_error(fused_w), HasSubstr("B0@s0 was a fused backward, which computed the weight gradient"));
}

TEST(PipelineScheduleChecker, CatchesActionsBeforeTheirInputs) {
  // Backward before its forward on one rank.
  Schedule b_first = make_schedule(ScheduleKind::gpipe, 1, 1);
  std::swap(b_first.programs[0][0], b_first.programs[0][1]);
  EXPECT_THAT(check_error(b_first), HasSubstr("action #0 B0@s0: runs before F0@s0"));
  // A forward whose input was never received.
  const Schedule no_recv = edited(1, [](std::vector<Action>& p) { p.erase(p.begin()); });
  EXPECT_THAT(check_error(no_recv), HasSubstr("rank 1, action #0 F0@s1: runs before RECV_F0@s1<-r0"));
  // A send before the forward that produces it.
  const Schedule early_send = edited(0, [](std::vector<Action>& p) { std::swap(p[0], p[1]); });
  EXPECT_THAT(check_error(early_send), HasSubstr("action #0 SEND_F0@s0->r1: runs before F0@s0"));
  // W before its I; a local chunk order broken (ranks == 1, interleaved).
  const Schedule w_first = edited(1, [](std::vector<Action>& p) {
    auto w = std::find_if(p.begin(), p.end(), [](const Action& a) { return a.kind == ActionKind::backward_weight; });
    std::rotate(p.begin(), w, w + 1);
  }, ScheduleKind::zero_bubble);
  EXPECT_THAT(check_error(w_first), HasSubstr("action #0 W0@s1: runs before I0@s1"));
  Schedule local = make_schedule(ScheduleKind::interleaved_1f1b, 1, 1, 2);
  std::swap(local.programs[0][0], local.programs[0][1]);
  EXPECT_THAT(check_error(local), HasSubstr("action #0 F0@s1: runs before F0@s0"));
  Schedule local_b = make_schedule(ScheduleKind::interleaved_1f1b, 1, 1, 2);  // F0s0 F0s1 B0s1 B0s0
  std::swap(local_b.programs[0][2], local_b.programs[0][3]);
  EXPECT_THAT(check_error(local_b), HasSubstr("B0@s0: runs before the backward of stage 1 (micro-batch 0)"));
}

TEST(PipelineScheduleChecker, CatchesActionsThatDoNotFit) {
  const Schedule wrong_rank = edited(0, [](std::vector<Action>& p) { p[0].stage = 1; });
  EXPECT_THAT(check_error(wrong_rank), HasSubstr("F0@s1: stage 1 lives on rank 1"));
  const Schedule bad_mb = edited(0, [](std::vector<Action>& p) { p[0].micro_batch = 2; });
  EXPECT_THAT(check_error(bad_mb), HasSubstr("micro-batch 2 is not in [0, 2)"));
  const Schedule bad_peer = edited(0, [](std::vector<Action>& p) { p[1].peer = 0; });
  EXPECT_THAT(check_error(bad_peer), HasSubstr("SEND_F0@s0->r0: peer 0, but stage 1 lives on rank 1"));
  const Schedule peer_on_compute = edited(0, [](std::vector<Action>& p) { p[0].peer = 1; });
  EXPECT_THAT(check_error(peer_on_compute), HasSubstr("a compute action has peer 1"));
  const Schedule loss_recv = edited(1, [](std::vector<Action>& p) {
    p.insert(p.begin() + 1, Action{ActionKind::recv_grad, 1, 0, 0});
  });
  EXPECT_THAT(check_error(loss_recv), HasSubstr("stage 1 has no stage 2 to exchange with"));
  Schedule local = make_schedule(ScheduleKind::interleaved_1f1b, 1, 1, 2);
  local.programs[0].insert(local.programs[0].begin() + 1, Action{ActionKind::send_activation, 0, 0, 0});
  EXPECT_THAT(check_error(local), HasSubstr("stage 1 is on this rank too"));
  Schedule three = make_schedule(ScheduleKind::one_f_one_b, 3, 1);
  three.programs[0][1].peer = 2;  // SEND_F0@s0 to rank 2 instead of 1
  EXPECT_THAT(check_error(three), HasSubstr("peer 2, but stage 1 lives on rank 1"));
  Schedule short_programs = make_schedule(ScheduleKind::gpipe, 2, 1);
  short_programs.programs.pop_back();
  EXPECT_THAT(check_error(short_programs), HasSubstr("1 programs for 2 ranks"));
}

// ------------------------------------------------------------------ properties

struct Shape {
  ScheduleKind kind;
  int p, m, v;
};

// Every kind, ranks 1..6, micro-batches 1..12 (interleaved: v 2..3, m a multiple of p).
std::vector<Shape> all_shapes() {
  std::vector<Shape> out;
  for (ScheduleKind k : kAllKinds)
    for (int p = 1; p <= 6; ++p)
      for (int m = 1; m <= 12; ++m) {
        if (k != ScheduleKind::interleaved_1f1b) {
          out.push_back({k, p, m, 1});
          continue;
        }
        if (m % p == 0)
          for (int v = 2; v <= 3; ++v) out.push_back({k, p, m, v});
      }
  return out;
}

TEST(PipelineScheduleProperty, EveryScheduleChecksAndMatchesTheTheory) {
  int count = 0;
  for (const Shape& sh : all_shapes()) {
    SCOPED_TRACE(fmt::format("{} p={} m={} v={}", to_string(sh.kind), sh.p, sh.m, sh.v));
    const Schedule s = make_schedule(sh.kind, sh.p, sh.m, sh.v);
    ASSERT_EQ(s.programs.size(), static_cast<size_t>(sh.p));
    ASSERT_EQ(check_error(s), "");
    ++count;

    // The makespan in whole steps: 3 per (chunk, micro-batch) plus the bubble.
    const int64_t p = sh.p, m = sh.m, v = sh.v;
    const int64_t expected = sh.kind == ScheduleKind::zero_bubble ? 2 * m + p - 1 + std::max(m, p)
                                                                  : 3 * (v * m + p - 1);
    const Timeline t = simulate_schedule(s);
    EXPECT_EQ(t.makespan, expected);
    for (int r = 0; r < sh.p; ++r) EXPECT_EQ(t.busy(r), 3 * v * m);

    const double bubble = simulated_bubble(s);
    EXPECT_NEAR(bubble, theoretical_bubble(sh.kind, sh.p, sh.m, sh.v), 1e-12);
    // Interleaving and zero bubble never lose to 1F1B.
    EXPECT_LE(bubble, theoretical_bubble(ScheduleKind::one_f_one_b, sh.p, sh.m) + 1e-12);
    if (sh.kind == ScheduleKind::zero_bubble && sh.m >= sh.p) {
      EXPECT_NEAR(bubble, (p - 1.0) / (3.0 * m + p - 1.0), 1e-12);
    }

    // Peak activations (pairs of chunk and micro-batch) on rank 0 and every rank.
    int peak0 = 0;
    switch (sh.kind) {
      case ScheduleKind::gpipe: peak0 = sh.m; break;
      case ScheduleKind::one_f_one_b:
      case ScheduleKind::zero_bubble: peak0 = std::min(sh.m, sh.p); break;
      case ScheduleKind::interleaved_1f1b: peak0 = std::min((sh.v + 1) * sh.p - 1, sh.v * sh.m); break;
    }
    EXPECT_EQ(peak_in_flight(s, 0), peak0);
    for (int r = 0; r < sh.p; ++r) {
      if (sh.kind == ScheduleKind::one_f_one_b || sh.kind == ScheduleKind::zero_bubble) {
        EXPECT_EQ(peak_in_flight(s, r), std::min(sh.m, sh.p - r)) << "rank " << r;
      }
      EXPECT_LE(peak_in_flight(s, r), peak0) << "rank " << r;
    }

    // Communication: every send is one hop between different ranks; none on one rank.
    for (int r = 0; r < sh.p; ++r)
      for (const Action& a : s.programs[r])
        if (!is_compute(a.kind)) {
          EXPECT_GT(sh.p, 1);
          EXPECT_NE(a.peer, r);
        }
  }
  EXPECT_EQ(count, 3 * 6 * 12 + 2 * (12 + 6 + 4 + 3 + 2 + 2));
}

TEST(PipelineScheduleProperty, GPipeAndOneFOneBBubbleHoldsForOtherCosts) {
  // (p - 1) / (m + p - 1) for any forward and fused backward cost (Megatron-LM sec. 2.2.1).
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 10; ++m)
      for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b}) {
        const Schedule s = make_schedule(k, p, m);
        EXPECT_NEAR(simulated_bubble(s, {.forward = 2, .backward = 5}), (p - 1.0) / (m + p - 1.0), 1e-12)
            << to_string(k) << " p=" << p << " m=" << m;
      }
}

TEST(PipelineScheduleProperty, PeakInFlightValidatesTheRank) {
  const Schedule s = make_schedule(ScheduleKind::gpipe, 2, 3);
  EXPECT_EQ(peak_in_flight(s, 1), 3);
  EXPECT_THAT(error_of([&] { peak_in_flight(s, 2); }), HasSubstr("rank 2 of 2"));
  EXPECT_THAT(error_of([&] { peak_in_flight(s, -1); }), HasSubstr("rank -1"));
}

}  // namespace
}  // namespace meshtrain::parallel
