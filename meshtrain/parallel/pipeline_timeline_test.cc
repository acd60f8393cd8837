// Pipeline timelines: the measured bubble, the Chrome trace (parsed back) and
// the SVG of a hand-made two-rank timeline with known numbers; then a real
// 1F1B run of the executor over stages that sleep (forward 2 ms, backward
// 2 + 2 ms) on 2 threads-engine ranks, 4 micro-batches, gathered to rank 0:
// every action of the lists once, the ranks on one time base (rank 1 starts
// 3 ms late, which only the shift by the run() starts puts right), every recv
// ending after its send, and the measured bubble near the theoretical 0.2.
#include "meshtrain/parallel/pipeline_timeline.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::parallel {
namespace {

using ::testing::HasSubstr;

PipelineEvent ev(ActionKind kind, int stage, int mb, int peer, double start, double end) {
  return {{kind, stage, mb, peer}, start, end};
}

// Rank 0 runs stage 0 (fused backward), rank 1 stage 1 (split backward).
// Busy: rank 0 100 + 200 = 300 us, rank 1 100 + 110 + 70 = 280 us; compute
// spans 10 .. 530 us, so the bubble is 1 - 580 / (2 x 520).
std::vector<RankTimeline> hand_made() {
  using K = ActionKind;
  return {{0,
           {ev(K::forward, 0, 0, -1, 10, 110), ev(K::send_activation, 0, 0, 1, 110, 110),
            ev(K::recv_grad, 0, 0, 1, 115, 330), ev(K::backward, 0, 0, -1, 330, 530)}},
          {1,
           {ev(K::recv_activation, 1, 0, 0, 60, 112), ev(K::forward, 1, 0, -1, 120, 220),
            ev(K::backward_input, 1, 0, -1, 220, 330), ev(K::send_grad, 1, 0, 0, 330, 330),
            ev(K::backward_weight, 1, 0, -1, 330, 400)}}};
}

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(PipelineTimeline, MeasuredBubbleOfKnownTimes) {
  const std::vector<RankTimeline> t = hand_made();
  EXPECT_DOUBLE_EQ(busy_us(t[0]), 300);
  EXPECT_DOUBLE_EQ(busy_us(t[1]), 280);
  EXPECT_DOUBLE_EQ(makespan_us(t), 520);
  EXPECT_DOUBLE_EQ(measured_bubble(t), 1 - 580.0 / 1040.0);
  // One rank alone: busy 300 of 520.
  EXPECT_DOUBLE_EQ(measured_bubble({t[0]}), 1 - 300.0 / 520.0);
}

TEST(PipelineTimeline, RefusesBadTimelines) {
  EXPECT_THAT(testing::error_of([] { measured_bubble({}); }), HasSubstr("no compute action"));
  EXPECT_THAT(testing::error_of([] { measured_bubble({{0, {ev(ActionKind::send_grad, 1, 0, 0, 5, 5)}}}); }),
              HasSubstr("no compute action"));
  std::vector<RankTimeline> t = hand_made();
  t[1].rank = 0;
  EXPECT_THAT(testing::error_of([&] { chrome_trace_json(t, "x"); }), HasSubstr("rank 0 is given twice"));
  t = hand_made();
  t[1].events[1].end_us = 100;  // before its start
  EXPECT_THAT(testing::error_of([&] { timeline_svg(t, "x"); }), HasSubstr("F0@s1 runs from 120 to 100 us"));
}

TEST(PipelineTimeline, ChromeTraceHasEveryEvent) {
  const nlohmann::json j = nlohmann::json::parse(chrome_trace_json(hand_made(), "1f1b p=2 m=1"));
  EXPECT_EQ(j["otherData"]["name"], "1f1b p=2 m=1");
  const nlohmann::json& evs = j["traceEvents"];
  // Process name, two thread names, nine actions.
  ASSERT_EQ(evs.size(), 12u);
  std::map<int, std::string> threads;
  std::map<std::string, nlohmann::json> by_name;
  for (const nlohmann::json& e : evs) {
    EXPECT_EQ(e["pid"], 0);
    if (e["ph"] == "M") {
      if (e["name"] == "thread_name") threads[e["tid"].get<int>()] = e["args"]["name"];
      else EXPECT_EQ(e["args"]["name"], "1f1b p=2 m=1");
      continue;
    }
    by_name[e["name"].get<std::string>() + "/r" + std::to_string(e["tid"].get<int>())] = e;
  }
  EXPECT_EQ(threads, (std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}}));
  ASSERT_EQ(by_name.size(), 9u);
  const nlohmann::json& b = by_name.at("B0@s0/r0");
  EXPECT_EQ(b["ph"], "X");
  EXPECT_EQ(b["cat"], "backward");
  EXPECT_DOUBLE_EQ(b["ts"].get<double>(), 330);
  EXPECT_DOUBLE_EQ(b["dur"].get<double>(), 200);
  EXPECT_EQ(b["args"]["stage"], 0);
  EXPECT_EQ(b["args"]["micro_batch"], 0);
  EXPECT_FALSE(b["args"].contains("peer"));
  EXPECT_EQ(by_name.at("F0@s1/r1")["cat"], "forward");
  EXPECT_EQ(by_name.at("I0@s1/r1")["cat"], "backward_input");
  EXPECT_EQ(by_name.at("W0@s1/r1")["cat"], "backward_weight");
  EXPECT_DOUBLE_EQ(by_name.at("W0@s1/r1")["dur"].get<double>(), 70);
  const nlohmann::json& recv = by_name.at("RECV_B0@s0<-r1/r0");
  EXPECT_EQ(recv["ph"], "X");
  EXPECT_EQ(recv["cat"], "recv");
  EXPECT_DOUBLE_EQ(recv["ts"].get<double>(), 115);
  EXPECT_DOUBLE_EQ(recv["dur"].get<double>(), 215);
  EXPECT_EQ(recv["args"]["peer"], 1);
  // Sends take no time: instant events on their rank's thread.
  const nlohmann::json& send = by_name.at("SEND_B0@s1->r0/r1");
  EXPECT_EQ(send["ph"], "i");
  EXPECT_EQ(send["s"], "t");
  EXPECT_EQ(send["cat"], "send");
  EXPECT_DOUBLE_EQ(send["ts"].get<double>(), 330);
  EXPECT_FALSE(send.contains("dur"));
  EXPECT_EQ(send["args"]["stage"], 1);
  EXPECT_EQ(send["args"]["peer"], 0);
}

TEST(PipelineTimeline, SvgDrawsEveryComputeActionAndTheBubble) {
  const std::string svg = timeline_svg(hand_made(), "1f1b <p=2>");
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(occurrences(svg, "<rect class=\"compute "), 5u);
  EXPECT_EQ(occurrences(svg, "<rect class=\"compute forward\""), 2u);
  EXPECT_EQ(occurrences(svg, "<rect class=\"compute backward\""), 1u);
  EXPECT_EQ(occurrences(svg, "<rect class=\"compute backward_input\""), 1u);
  EXPECT_EQ(occurrences(svg, "<rect class=\"compute backward_weight\""), 1u);
  EXPECT_EQ(occurrences(svg, "<rect class=\"recv\""), 2u);
  EXPECT_EQ(occurrences(svg, "<rect class=\"legend\""), 4u);
  for (const char* label : {">forward (F)<", ">backward (B) / backward_input (I)<", ">backward_weight (W)<",
                            ">recv wait<", ">rank 0<", ">rank 1<", ">time (ms)<", "<title>B0@s0: 0.330 to 0.530 ms"})
    EXPECT_THAT(svg, HasSubstr(label));
  EXPECT_THAT(svg, HasSubstr(fmt::format("1f1b &lt;p=2&gt;: measured bubble {:.1f}%", 100 * (1 - 580.0 / 1040.0))));
  EXPECT_THAT(svg, HasSubstr("44.2%"));
  // The micro-batch number inside every box wide enough (all are here).
  EXPECT_EQ(occurrences(svg, "dominant-baseline=\"middle\">0</text>"), 5u);
}

// A stage that passes a 2-float tensor through and sleeps: forward 20 ms,
// backward_input 20 ms, backward_weight 20 ms (a fused backward 40 ms).
// Long enough that a loaded machine's late wake-ups (a few ms) leave the
// measured bubble near the schedule's.
class SleepStage final : public PipelineStage {
 public:
  Tensor forward(int, const Tensor& input, nn::Saved&) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return input.defined() ? input : Tensor::from_vector(std::vector<float>{1, 2}, {2});
  }
  Tensor backward_input(int, const Tensor& grad, nn::Saved&) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return grad.defined() ? grad : Tensor::from_vector(std::vector<float>{3, 4}, {2});
  }
  void backward_weight(int, nn::Saved&) override { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }
  std::vector<int64_t> input_shape(int) const override { return {2}; }
};

TEST(PipelineTimeline, RealOneFOneBRunOnOneTimeBase) {
  const Schedule schedule = make_schedule(ScheduleKind::one_f_one_b, 2, 4);
  std::vector<RankTimeline> got;
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 SleepStage stage;
                 PipelineExecutor exec(schedule, world, {{world.rank(), &stage}});
                 world.barrier();
                 // Rank 1 starts late: its own clock reads its first forward as early,
                 // the common time base as after rank 0's.
                 if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
                 exec.run();
                 std::vector<RankTimeline> all = gather_timelines(exec);
                 if (world.rank() == 0) got = std::move(all);
                 else EXPECT_TRUE(all.empty());
               });
  ASSERT_EQ(got.size(), 2u);
  // Where each action ran (rank), and when, on the gathered time base.
  std::map<std::string, PipelineEvent> at;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(got[r].rank, r);
    const auto& program = schedule.programs[static_cast<size_t>(r)];
    ASSERT_EQ(got[r].events.size(), program.size()) << "rank " << r;
    for (size_t i = 0; i < program.size(); ++i) {
      const PipelineEvent& e = got[r].events[i];
      EXPECT_EQ(e.action, program[i]) << "rank " << r << " action " << i;
      EXPECT_GE(e.start_us, 0);
      EXPECT_GE(e.end_us, e.start_us);
      // At least the stage's sleeps: forward 20 ms, fused backward 40 ms.
      const double least = e.action.kind == ActionKind::forward ? 20000 : e.action.kind == ActionKind::backward ? 40000 : 0;
      EXPECT_GE(e.end_us - e.start_us, least) << e.action.to_string();
      at[e.action.to_string()] = e;
    }
  }
  EXPECT_GE(at.at("F0@s1").start_us, at.at("F0@s0").end_us);
  // Each recv spans its wait, which ends after its data was sent.
  for (int mb = 0; mb < 4; ++mb) {
    EXPECT_GE(at.at(fmt::format("RECV_F{}@s1<-r0", mb)).end_us, at.at(fmt::format("SEND_F{}@s0->r1", mb)).start_us);
    EXPECT_GE(at.at(fmt::format("RECV_B{}@s0<-r1", mb)).end_us, at.at(fmt::format("SEND_B{}@s1->r0", mb)).start_us);
    EXPECT_GE(at.at(fmt::format("B{}@s0", mb)).start_us, at.at(fmt::format("RECV_B{}@s0<-r1", mb)).end_us);
  }
  // Rank 0 waits for B0's gradient at least through rank 1's F0 and B0
  // (60 ms), less the forward it runs meanwhile (F1, 20 ms).
  const PipelineEvent& wait = at.at("RECV_B0@s0<-r1");
  EXPECT_GE(wait.end_us - wait.start_us, 20000);
  const double bubble = measured_bubble(got);
  EXPECT_NEAR(bubble, theoretical_bubble(ScheduleKind::one_f_one_b, 2, 4), 0.1);
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(got, "1f1b"));
  EXPECT_EQ(trace["traceEvents"].size(), 3 + schedule.programs[0].size() + schedule.programs[1].size());
  const std::string svg = timeline_svg(got, "1f1b p=2 m=4");
  EXPECT_EQ(occurrences(svg, "<rect class=\"compute "), 16u);
  EXPECT_THAT(svg, HasSubstr(fmt::format("measured bubble {:.1f}%", 100 * bubble)));
}

}  // namespace
}  // namespace meshtrain::parallel
