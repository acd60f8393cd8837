// Pipeline timelines: every pipeline rank's executed actions
// (PipelineExecutor::timeline()) gathered to rank 0 on one time base, written
// as a Chrome trace (Perfetto, chrome://tracing) or an SVG picture, and the
// bubble they measure.
//
//   PipelineExecutor exec(schedule, pp, stages);
//   exec.run();
//   std::vector<RankTimeline> all = gather_timelines(exec);  // collective; empty except on rank 0
//   if (pp.rank() == 0) {
//     write_file_atomic("pipeline.trace.json", chrome_trace_json(all, "1f1b p=2 m=4"));
//     write_file_atomic("pipeline.svg", timeline_svg(all, "1f1b p=2 m=4"));
//     measured_bubble(all);  // ~ theoretical_bubble(one_f_one_b, 2, 4) when F and B take 1 : 2
//   }
//
// Time base: each rank's executor times its actions from its own run()
// start. gather_timelines shifts every rank's events by (its run() start -
// the earliest rank's run() start), both read from steady_clock
// (PipelineExecutor::start_time_us()), so the gathered times are microseconds
// since the first rank began run(). That is exact for ranks that share a
// steady_clock: threads of one process (the threads engine) and processes of
// one host (mpirun on one machine). Across hosts (mpirun on several
// machines) steady_clocks are not synchronized and their epochs differ
// (typically each host's boot): the shift is then meaningless and the
// cross-rank alignment (and measured_bubble's makespan) with it; each rank's
// own events stay correct relative to each other.
//
// Contracts:
// - gather_timelines is a collective over the executor's pipeline
//   communicator (two all_gathers: each rank's event count and start, then
//   the events as f64 records kind, stage, micro_batch, peer, start, end,
//   padded to the longest, so every rank briefly holds ranks x longest x 48
//   bytes). Call it on every rank after the same run().
//   Rank 0 gets one RankTimeline per rank in rank order; other ranks get an
//   empty vector. A rank that never ran contributes no events.
// - chrome_trace_json, timeline_svg and measured_bubble take any timelines
//   (gathered or hand-made) and throw InvalidArgument for a negative or
//   repeated rank, or an event whose start or end is not finite or whose end
//   precedes its start; timeline_svg and measured_bubble also need at least
//   one compute action.
// - Chrome trace (the JSON object format of the Trace Event Format): one
//   complete event ("ph": "X", "ts" and "dur" in microseconds, rounded to
//   whole nanoseconds) per compute action and per recv (its wait, "dur"
//   about 0 when the data was there), "pid" 0, "tid" the rank, "name" the action's text ("F3@s1", "RECV_B3@s1<-r2"),
//   "cat" forward, backward, backward_input, backward_weight or recv, and
//   "args" {"stage", "micro_batch"} (and "peer" for a transfer). Sends take
//   no time, so each is an instant event ("ph": "i", thread scope "s": "t",
//   "cat" send) at its posting time rather than a zero-width box. Metadata
//   events ("ph": "M") name process 0 `name` and each thread "rank N".
// - Measured bubble: makespan = the last compute end - the first compute
//   start over all ranks; busy = the sum of a rank's compute durations (its
//   recv waits and sends are not work); bubble = 1 - sum of busy / (ranks x
//   makespan), with ranks the number of timelines passed. It is the idle
//   share of the step that simulated_bubble predicts, but with real
//   durations: communication, sleeps overshooting and unequal stage costs
//   all show in it.
// Thread-safety: gather_timelines as the communicator; the rest are pure.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/parallel/pipeline_executor.h"

namespace meshtrain::parallel {

// One pipeline rank's events, times on the gathered time base.
struct RankTimeline {
  int rank = 0;
  std::vector<PipelineEvent> events;
};

// Collective over exec.communicator(): every rank's last run() timeline, on
// rank 0 and on the time base above; an empty vector on the other ranks.
std::vector<RankTimeline> gather_timelines(const PipelineExecutor& exec);

// The time a rank spent in compute actions (forward, backward,
// backward_input, backward_weight), in microseconds.
double busy_us(const RankTimeline& timeline);

// The last compute end minus the first compute start over all ranks, in
// microseconds; 0 without compute actions.
double makespan_us(const std::vector<RankTimeline>& timelines);

// 1 - sum of busy_us / (timelines.size() x makespan_us): the idle share.
// InvalidArgument without a compute action of positive total length.
double measured_bubble(const std::vector<RankTimeline>& timelines);

// The Chrome trace of the timelines (see Contracts), an object with
// "traceEvents", "displayTimeUnit": "ms" and "otherData": {"name": name}.
// Open it at https://ui.perfetto.dev or chrome://tracing.
std::string chrome_trace_json(const std::vector<RankTimeline>& timelines, const std::string& name);

// A standalone SVG document: one row per rank (top to bottom in rank order),
// time on the x axis (ticks in ms on the timelines' time base, from 0 or the
// earliest event if that is negative), one rectangle per compute action coloured
// by kind (forward; backward and backward_input; backward_weight) with its
// micro-batch number inside when it fits and a <title> naming the action and
// its times, each recv's wait as a light grey bar, a legend, and the title
// followed by "measured bubble N.N%". Sends are not drawn.
std::string timeline_svg(const std::vector<RankTimeline>& timelines, const std::string& title);

}  // namespace meshtrain::parallel
