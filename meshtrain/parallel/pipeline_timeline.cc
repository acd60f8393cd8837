#include "meshtrain/parallel/pipeline_timeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::parallel {
namespace {

constexpr size_t kRecord = 6;  // kind, stage, micro_batch, peer, start, end

// "cat" of the Chrome trace and the SVG's class names.
const char* category(ActionKind kind) {
  switch (kind) {
    case ActionKind::forward: return "forward";
    case ActionKind::backward: return "backward";
    case ActionKind::backward_input: return "backward_input";
    case ActionKind::backward_weight: return "backward_weight";
    case ActionKind::send_activation:
    case ActionKind::send_grad: return "send";
    case ActionKind::recv_activation:
    case ActionKind::recv_grad: return "recv";
  }
  return "?";
}

// Microseconds rounded to whole nanoseconds: the trace reads 5814.952, not 5814.951999999999.
double to_ns(double us) { return std::round(us * 1000) / 1000; }

bool is_send(ActionKind kind) { return kind == ActionKind::send_activation || kind == ActionKind::send_grad; }

void check_timelines(const std::vector<RankTimeline>& timelines, const char* op) {
  std::set<int> seen;
  for (const RankTimeline& t : timelines) {
    if (t.rank < 0 || !seen.insert(t.rank).second)
      throw InvalidArgument(op, fmt::format("rank {} is {}", t.rank, t.rank < 0 ? "negative" : "given twice"),
                            "pass one RankTimeline per rank, as gather_timelines returns");
    for (const PipelineEvent& e : t.events)
      if (!std::isfinite(e.start_us) || !std::isfinite(e.end_us) || e.end_us < e.start_us)
        throw InvalidArgument(op,
                              fmt::format("rank {}: {} runs from {} to {} us", t.rank, e.action.to_string(),
                                          e.start_us, e.end_us),
                              "events need finite times with end >= start");
  }
}

// Every compute action's [start, end) over all ranks; {inf, -inf} without one.
std::pair<double, double> compute_span(const std::vector<RankTimeline>& timelines) {
  double first = std::numeric_limits<double>::infinity(), last = -first;
  for (const RankTimeline& t : timelines)
    for (const PipelineEvent& e : t.events)
      if (is_compute(e.action.kind)) first = std::min(first, e.start_us), last = std::max(last, e.end_us);
  return {first, last};
}

double bubble_of(const std::vector<RankTimeline>& timelines, const char* op) {
  const double span = makespan_us(timelines);
  if (!(span > 0))
    throw InvalidArgument(op, "the timelines hold no compute action of positive length",
                          "run the executor first (exec.run()) and gather on rank 0, where the timelines are");
  double busy = 0;
  for (const RankTimeline& t : timelines) busy += busy_us(t);
  return 1.0 - busy / (static_cast<double>(timelines.size()) * span);
}

}  // namespace

std::vector<RankTimeline> gather_timelines(const PipelineExecutor& exec) {
  comm::Communicator& comm = exec.communicator();
  const std::vector<PipelineEvent>& events = exec.timeline();
  const size_t n = static_cast<size_t>(comm.size());
  // Each rank's event count, run() start and whether it ran.
  const double ran = exec.start_time_us() != 0 ? 1.0 : 0.0;
  const double head[3] = {static_cast<double>(events.size()), exec.start_time_us(), ran};
  std::vector<double> heads(3 * n);
  comm.all_gather(head, heads.data(), 3, DType::f64);
  size_t longest = 0;
  double base = std::numeric_limits<double>::infinity();
  for (size_t r = 0; r < n; ++r) {
    longest = std::max(longest, static_cast<size_t>(heads[3 * r]));
    if (heads[3 * r + 2] != 0) base = std::min(base, heads[3 * r + 1]);
  }
  std::vector<double> all(n * longest * kRecord);
  if (longest > 0) {  // every rank saw the same heads, so all skip or all call
    std::vector<double> mine(longest * kRecord, 0.0);
    for (size_t i = 0; i < events.size(); ++i) {
      const PipelineEvent& e = events[i];
      double* rec = &mine[i * kRecord];
      rec[0] = static_cast<double>(e.action.kind);
      rec[1] = e.action.stage;
      rec[2] = e.action.micro_batch;
      rec[3] = e.action.peer;
      rec[4] = e.start_us;
      rec[5] = e.end_us;
    }
    comm.all_gather(mine.data(), all.data(), longest * kRecord, DType::f64);
  }
  if (comm.rank() != 0) return {};
  std::vector<RankTimeline> out(n);
  for (size_t r = 0; r < n; ++r) {
    out[r].rank = static_cast<int>(r);
    const size_t count = static_cast<size_t>(heads[3 * r]);
    const double shift = heads[3 * r + 1] - base;  // this rank's start on the common time base
    for (size_t i = 0; i < count; ++i) {
      const double* rec = &all[(r * longest + i) * kRecord];
      if (rec[0] < 0 || rec[0] > static_cast<double>(ActionKind::recv_grad))
        throw Error("gather_timelines", fmt::format("rank {} sent an event of kind {}", r, rec[0]),
                    "internal: every rank must call gather_timelines after the same run()");
      PipelineEvent e;
      e.action = {static_cast<ActionKind>(static_cast<int>(rec[0])), static_cast<int>(rec[1]),
                  static_cast<int>(rec[2]), static_cast<int>(rec[3])};
      e.start_us = rec[4] + shift;
      e.end_us = rec[5] + shift;
      out[r].events.push_back(e);
    }
  }
  return out;
}

double busy_us(const RankTimeline& timeline) {
  double busy = 0;
  for (const PipelineEvent& e : timeline.events)
    if (is_compute(e.action.kind)) busy += e.end_us - e.start_us;
  return busy;
}

double makespan_us(const std::vector<RankTimeline>& timelines) {
  const auto [first, last] = compute_span(timelines);
  return last > first ? last - first : 0.0;
}

double measured_bubble(const std::vector<RankTimeline>& timelines) {
  check_timelines(timelines, "measured_bubble");
  return bubble_of(timelines, "measured_bubble");
}

std::string chrome_trace_json(const std::vector<RankTimeline>& timelines, const std::string& name) {
  check_timelines(timelines, "chrome_trace_json");
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", name}}}});
  for (const RankTimeline& t : timelines)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", t.rank},
                      {"args", {{"name", fmt::format("rank {}", t.rank)}}}});
  for (const RankTimeline& t : timelines)
    for (const PipelineEvent& e : t.events) {
      nlohmann::ordered_json args = {{"stage", e.action.stage}, {"micro_batch", e.action.micro_batch}};
      if (e.action.peer >= 0) args["peer"] = e.action.peer;
      nlohmann::ordered_json ev = {{"name", e.action.to_string()}, {"cat", category(e.action.kind)}};
      if (is_send(e.action.kind)) {
        ev["ph"] = "i";
        ev["s"] = "t";
        ev["ts"] = to_ns(e.start_us);
      } else {
        ev["ph"] = "X";
        ev["ts"] = to_ns(e.start_us);
        ev["dur"] = to_ns(e.end_us - e.start_us);
      }
      ev["pid"] = 0;
      ev["tid"] = t.rank;
      ev["args"] = std::move(args);
      events.push_back(std::move(ev));
    }
  nlohmann::ordered_json trace = {
      {"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", {{"name", name}}}};
  return trace.dump() + "\n";
}

std::string timeline_svg(const std::vector<RankTimeline>& timelines, const std::string& title) {
  check_timelines(timelines, "timeline_svg");
  const double bubble = bubble_of(timelines, "timeline_svg");
  struct Style {
    const char* label;
    const char* fill;
  };
  auto style = [](ActionKind k) -> Style {
    switch (k) {
      case ActionKind::forward: return {"forward (F)", "#4e79a7"};
      case ActionKind::backward:
      case ActionKind::backward_input: return {"backward (B) / backward_input (I)", "#f28e2b"};
      case ActionKind::backward_weight: return {"backward_weight (W)", "#59a14f"};
      default: return {"recv wait", "#d0d0d0"};
    }
  };
  // The drawn span: compute actions and recv waits.
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  for (const RankTimeline& t : timelines)
    for (const PipelineEvent& e : t.events)
      if (!is_send(e.action.kind)) t0 = std::min(t0, e.start_us), t1 = std::max(t1, e.end_us);
  t0 = std::min(t0, 0.0);  // from the time base's origin (gathered: the first run() start)
  if (!(t1 > t0)) t1 = t0 + 1;
  std::vector<const RankTimeline*> rows;
  for (const RankTimeline& t : timelines) rows.push_back(&t);
  std::sort(rows.begin(), rows.end(), [](const RankTimeline* a, const RankTimeline* b) { return a->rank < b->rank; });

  constexpr double W = 960, L = 64, R = 24, T = 64, RH = 28, Gap = 8;
  const double axis_y = T + static_cast<double>(rows.size()) * (RH + Gap);
  const double H = axis_y + 48;
  auto px = [&](double us) { return L + (us - t0) / (t1 - t0) * (W - L - R); };
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" viewBox=\"0 0 {0:.0f} {1:.0f}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n",
      W, H);
  out += fmt::format("<rect width=\"{:.0f}\" height=\"{:.0f}\" fill=\"white\"/>\n", W, H);
  const std::string head = fmt::format("measured bubble {:.1f}% (makespan {:.3g} ms, {} ranks)", 100 * bubble,
                                       makespan_us(timelines) / 1000, timelines.size());
  out += fmt::format("<text x=\"{:.0f}\" y=\"20\" font-size=\"15\" text-anchor=\"middle\">{}</text>\n", W / 2,
                     escape_xml(title.empty() ? head : title + ": " + head));
  // The legend, one swatch per colour.
  double lx = L;
  for (ActionKind k : {ActionKind::forward, ActionKind::backward, ActionKind::backward_weight, ActionKind::recv_grad}) {
    const Style s = style(k);
    out += fmt::format(
        "<rect class=\"legend\" x=\"{:.1f}\" y=\"32\" width=\"12\" height=\"12\" fill=\"{}\"/>"
        "<text x=\"{:.1f}\" y=\"42\">{}</text>\n",
        lx, s.fill, lx + 16, s.label);
    lx += 24 + 6.5 * static_cast<double>(std::string_view(s.label).size());
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const double y = T + static_cast<double>(i) * (RH + Gap);
    out += fmt::format(
        "<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"{:.0f}\" height=\"{:.0f}\" fill=\"#f6f6f6\"/>"
        "<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\" dominant-baseline=\"middle\">rank {}</text>\n",
        L, y, W - L - R, RH, L - 8, y + RH / 2, rows[i]->rank);
    for (const PipelineEvent& e : rows[i]->events) {
      if (is_send(e.action.kind)) continue;
      const double x = px(e.start_us), w = px(e.end_us) - x;
      const std::string tip = fmt::format("{}: {:.3f} to {:.3f} ms", e.action.to_string(), e.start_us / 1000,
                                          e.end_us / 1000);
      if (!is_compute(e.action.kind)) {  // a recv: its wait, drawn lightly
        if (e.end_us > e.start_us)
          out += fmt::format(
              "<rect class=\"recv\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" fill=\"{}\">"
              "<title>{}</title></rect>\n",
              x, y + RH * 0.35, std::max(w, 0.5), RH * 0.3, style(e.action.kind).fill, escape_xml(tip));
        continue;
      }
      const std::string label = std::to_string(e.action.micro_batch);
      out += fmt::format(
          "<rect class=\"compute {}\" x=\"{:.2f}\" y=\"{:.0f}\" width=\"{:.2f}\" height=\"{:.0f}\" fill=\"{}\" "
          "stroke=\"white\" stroke-width=\"0.5\"><title>{}</title></rect>\n",
          category(e.action.kind), x, y, std::max(w, 0.5), RH, style(e.action.kind).fill, escape_xml(tip));
      if (w >= 7.0 * static_cast<double>(label.size()) + 4)
        out += fmt::format(
            "<text x=\"{:.2f}\" y=\"{:.1f}\" fill=\"white\" font-size=\"11\" text-anchor=\"middle\" "
            "dominant-baseline=\"middle\">{}</text>\n",
            x + w / 2, y + RH / 2, label);
    }
  }
  // The time axis, in ms on the timelines' time base.
  out += fmt::format("<line x1=\"{:.0f}\" y1=\"{:.0f}\" x2=\"{:.0f}\" y2=\"{:.0f}\" stroke=\"#333333\"/>\n", L, axis_y,
                     W - R, axis_y);
  const double step = nice_tick_step((t1 - t0) / 1000, 8);
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step))));
  for (double k = std::ceil(t0 / 1000 / step); k * step <= t1 / 1000 + 1e-9 * step; ++k) {
    const double x = px(k * step * 1000);
    out += fmt::format(
        "<line x1=\"{0:.2f}\" y1=\"{1:.0f}\" x2=\"{0:.2f}\" y2=\"{2:.0f}\" stroke=\"#333333\"/>"
        "<text x=\"{0:.2f}\" y=\"{3:.0f}\" text-anchor=\"middle\">{4:.{5}f}</text>\n",
        x, axis_y, axis_y + 5, axis_y + 18, k * step + 0.0 /* never "-0" */, decimals);
  }
  out += fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\" text-anchor=\"middle\">time (ms)</text>\n", (L + W - R) / 2,
                     axis_y + 38);
  return out + "</svg>\n";
}

}  // namespace meshtrain::parallel
