#include "cli/plan_pictures.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string_view>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/plan/mesh_planning.h"

namespace meshtrain::cli {
namespace {

constexpr const char* kOp = "cli::mesh_svg";

// Pipeline stages' fills (sharding/visualize.cc's palette: light, so the
// rank numbers read in dark text).
constexpr std::array<const char*, 12> kStageColors = {"#8dd3c7", "#ffffb3", "#bebada", "#fb8072",
                                                      "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
                                                      "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"};
constexpr const char* kGroupStroke = "#222222";
constexpr const char* kSplitStroke = "#d62728";

struct Axis {
  std::string name;
  int size = 1;
  int64_t stride = 1;  // ranks between neighbours along the axis
  int coord(int64_t rank) const { return static_cast<int>(rank / stride % size); }
};

// The mesh as the runtime numbers it: axes slowest first, row-major.
struct Mesh {
  std::vector<Axis> axes;
  int64_t devices = 1;
  int per_node = 8;
  int64_t node_of(int64_t rank) const { return rank / per_node; }
  const Axis& axis(std::string_view name) const {
    return *std::find_if(axes.begin(), axes.end(), [&](const Axis& a) { return a.name == name; });
  }
  // "pipeline=2,data=4,tensor=8": the axes of size > 1, as --mesh takes them.
  std::string spec() const {
    std::string out;
    for (const Axis& a : axes)
      if (a.size > 1) out += fmt::format("{}{}={}", out.empty() ? "" : ",", a.name, a.size);
    return out.empty() ? "data=1" : out;
  }
};

bool known(std::string_view name) {
  return std::find(mesh::kMeshAxisOrder.begin(), mesh::kMeshAxisOrder.end(), name) != mesh::kMeshAxisOrder.end();
}

Mesh mesh_of(const plan::TrainingLayout& l, const MeshPictureOptions& o) {
  if (o.devices_per_node < 1)
    throw InvalidArgument(kOp, fmt::format("devices_per_node {}", o.devices_per_node), "give at least 1");
  if (o.max_nodes < 1) throw InvalidArgument(kOp, fmt::format("max_nodes {}", o.max_nodes), "give at least 1");
  std::vector<std::string> names;
  const std::vector<std::string>& order = o.order.empty() ? l.axis_order : o.order;
  for (const std::string& a : order) {
    if (!known(a))
      throw InvalidArgument(kOp, fmt::format("axis '{}' in the order", a),
                            "use pipeline, data, fsdp, context and tensor");
    if (std::find(names.begin(), names.end(), a) != names.end())
      throw InvalidArgument(kOp, fmt::format("axis '{}' appears twice in the order", a), "give each axis once");
    names.push_back(a);
  }
  for (std::string_view a : mesh::kMeshAxisOrder) {
    if (std::find(names.begin(), names.end(), a) != names.end()) continue;
    if (!order.empty() && l.axis_size(a) > 1)
      throw InvalidArgument(kOp, fmt::format("the order leaves out axis {} of size {}", a, l.axis_size(a)),
                            "list every axis of size > 1");
    names.emplace_back(a);
  }
  Mesh m;
  m.per_node = o.devices_per_node;
  for (const std::string& n : names) {
    const int size = l.axis_size(n);
    if (size < 1) throw InvalidArgument(kOp, fmt::format("axis {} has size {}", n, size), "use sizes >= 1");
    m.axes.push_back({.name = n, .size = size, .stride = 1});
  }
  int64_t stride = 1;
  for (auto it = m.axes.rbegin(); it != m.axes.rend(); ++it) {
    it->stride = stride;
    stride *= it->size;
  }
  m.devices = stride;
  return m;
}

// Where an axis's groups (the ranks that differ only along it) sit.
struct Placement {
  int64_t groups = 0;
  int64_t split = 0;  // groups on more than one node
  int64_t min_nodes = std::numeric_limits<int64_t>::max(), max_nodes = 0;
  int64_t min_per_node = std::numeric_limits<int64_t>::max(), max_per_node = 0;  // a group's ranks on one node
};

Placement placement(const Mesh& m, const Axis& a) {
  Placement p;
  for (int64_t r = 0; r < m.devices; ++r) {
    if (a.coord(r) != 0) continue;
    int64_t nodes = 1, run = 1;
    for (int i = 1; i < a.size; ++i) {
      if (m.node_of(r + i * a.stride) == m.node_of(r + (i - 1) * a.stride)) {
        ++run;
        continue;
      }
      p.min_per_node = std::min(p.min_per_node, run);
      p.max_per_node = std::max(p.max_per_node, run);
      ++nodes;
      run = 1;
    }
    p.min_per_node = std::min(p.min_per_node, run);
    p.max_per_node = std::max(p.max_per_node, run);
    ++p.groups;
    if (nodes > 1) ++p.split;
    p.min_nodes = std::min(p.min_nodes, nodes);
    p.max_nodes = std::max(p.max_nodes, nodes);
  }
  return p;
}

// What the axis's groups exchange (plan/mesh_planning.h's order by traffic).
std::string role(const plan::TrainingLayout& l, std::string_view axis) {
  if (axis == mesh::kPipeline)
    return l.virtual_stages > 1
               ? fmt::format("activations to the next stage every micro-batch ({} model chunks per rank)",
                             l.virtual_stages)
               : "activations to the next stage every micro-batch";
  if (axis == mesh::kData) return "gradients reduced once a step";
  if (axis == mesh::kFsdp) return "weights gathered and gradients reduced every layer";
  if (axis == mesh::kContext) return "keys and values passed on every attention layer";
  return "activations all-reduced in every layer";
}

std::string caption(const plan::TrainingLayout& l, const Mesh& m, const Axis& a) {
  const Placement p = placement(m, a);
  const std::string ranks = a.stride == 1 ? "consecutive ranks" : fmt::format("ranks {} apart", a.stride);
  const std::string groups = p.groups == 1 ? fmt::format("one group of {} {}", a.size, ranks)
                                           : fmt::format("{} groups of {} {}", p.groups, a.size, ranks);
  std::string where;
  if (p.max_nodes == 1)
    where = "within a node";
  else if (p.min_nodes == a.size)
    where = "across nodes (one rank per node)";
  else if (p.split == p.groups && p.min_nodes == p.max_nodes && p.min_per_node == p.max_per_node)
    where = fmt::format("across {} nodes{} ({} ranks per node)", p.max_nodes, p.groups > 1 ? " each" : "",
                        p.max_per_node);
  else if (p.split == p.groups)
    where = fmt::format("across {} to {} nodes each", p.min_nodes, p.max_nodes);
  else
    where = fmt::format("{} of the {} groups split over nodes", p.split, p.groups);
  return fmt::format("{}={}: {}, {}; {}", a.name, a.size, groups, where, role(l, a.name));
}

std::string range(int64_t first, int64_t last) {
  return first == last ? fmt::format("{}", first) : fmt::format("{}-{}", first, last);
}

struct Line {
  std::string text;
  bool alarm = false;  // drawn red
};

struct LegendItem {
  const char* fill;    // a swatch, or nullptr for an outline
  const char* stroke;  // an outline's colour
  std::string text;
};

double text_width(const std::string& s, double font) { return 0.58 * font * static_cast<double>(s.size()); }

}  // namespace

std::vector<std::string> mesh_axis_captions(const plan::TrainingLayout& layout, const MeshPictureOptions& options) {
  const Mesh m = mesh_of(layout, options);
  std::vector<std::string> out;
  for (const Axis& a : m.axes)
    if (a.size > 1) out.push_back(caption(layout, m, a));
  if (out.empty()) out.emplace_back("one device");
  return out;
}

int tensor_groups_split_over_nodes(const plan::TrainingLayout& layout, const MeshPictureOptions& options) {
  const Mesh m = mesh_of(layout, options);
  const Axis& tp = m.axis(mesh::kTensor);
  return tp.size > 1 ? static_cast<int>(placement(m, tp).split) : 0;
}

std::string mesh_svg(const plan::TrainingLayout& layout, const MeshPictureOptions& options) {
  const Mesh m = mesh_of(layout, options);
  const Axis& tp = m.axis(mesh::kTensor);
  const Axis& pp = m.axis(mesh::kPipeline);
  const Placement tensor = tp.size > 1 ? placement(m, tp) : Placement{};
  const int64_t split = tensor.split;

  // The node grid: each node a row of up to 16 devices (more wrap).
  const int64_t nodes = (m.devices + m.per_node - 1) / m.per_node;
  const int64_t drawn = std::min<int64_t>(nodes, options.max_nodes);
  const int64_t end = std::min<int64_t>(drawn * m.per_node, m.devices);  // ranks drawn: [0, end)
  const int slots = static_cast<int>(std::min<int64_t>(m.per_node, m.devices));
  const int cols = std::min(slots, 16);
  const int rows = (slots + cols - 1) / cols;
  const double sq = 28, gap = 6, pad = 10, head = 20, node_gap = 14, margin = 12;
  const double node_w = std::max(2 * pad + cols * sq + (cols - 1) * gap, 72.0);
  const double node_h = head + rows * (sq + gap) - gap + pad;
  const int per_row = static_cast<int>(
      std::clamp<int64_t>(static_cast<int64_t>((1240 + node_gap) / (node_w + node_gap)), 1, drawn));
  const int64_t grid_rows = (drawn + per_row - 1) / per_row;

  // The words: how ranks are numbered, a line per axis, the note.
  std::vector<Line> lines;
  lines.push_back({fmt::format("world ranks in mesh order {} (row-major, the last axis varies fastest); {}", m.spec(),
                               m.per_node == 1 ? "a node holds one rank"
                                               : fmt::format("a node holds {} consecutive ranks", m.per_node))});
  for (const Axis& a : m.axes)
    if (a.size > 1) lines.push_back({caption(layout, m, a), a.name == mesh::kTensor && split > 0});
  if (split > 0)
    lines.push_back({fmt::format("{} tensor-parallel groups are split over nodes (red): their all-reduces "
                                 "leave the node in every layer",
                                 split == tensor.groups ? fmt::format("all {}", split)
                                                        : fmt::format("{} of the {}", split, tensor.groups)),
                     true});
  if (!options.note.empty()) lines.push_back({options.note});

  std::vector<LegendItem> legend;
  if (pp.size == 1) {
    legend.push_back({kStageColors[0], nullptr, "one pipeline stage"});
  } else {
    const int shown = std::min<int>(pp.size, static_cast<int>(kStageColors.size()));
    for (int s = 0; s < shown; ++s) legend.push_back({kStageColors[static_cast<size_t>(s)], nullptr,
                                                      fmt::format("stage {}", s)});
    if (pp.size > shown)
      legend.push_back({nullptr, nullptr, fmt::format("(colours repeat: stage s as stage s mod {})", shown)});
  }
  if (tp.size > 1) {
    legend.push_back({nullptr, kGroupStroke, "tensor-parallel group"});
    if (split > 0) legend.push_back({nullptr, kSplitStroke, "tensor-parallel group split over nodes"});
  } else {
    legend.push_back({nullptr, nullptr, "no tensor axis"});
  }

  double width = 2 * margin + per_row * node_w + (per_row - 1) * node_gap;
  width = std::max(width, 2 * margin + text_width(options.title, 13));
  for (const Line& l : lines) width = std::max(width, 2 * margin + text_width(l.text, 11));
  width = std::max(width, 420.0);

  std::string body;
  double y = 20;
  body += fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\" font-size=\"13\">{}</text>\n", margin, y,
                      escape_xml(options.title));
  y += 6;
  for (const Line& l : lines) {
    y += 16;
    body += fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\"{}>{}</text>\n", margin, y,
                        l.alarm ? fmt::format(" fill=\"{}\"", kSplitStroke) : "", escape_xml(l.text));
  }
  // The legend, wrapped to the width.
  y += 24;
  double x = margin;
  for (const LegendItem& it : legend) {
    const double w = (it.fill || it.stroke ? 18 : 0) + text_width(it.text, 11) + 18;
    if (x > margin && x + w > width - margin) {
      x = margin;
      y += 20;
    }
    if (it.fill)
      body += fmt::format("<rect x=\"{:.1f}\" y=\"{:.0f}\" width=\"12\" height=\"12\" fill=\"{}\" stroke=\"#666666\" "
                          "stroke-width=\"0.5\"/>",
                          x, y - 10, it.fill);
    else if (it.stroke)
      body += fmt::format("<rect x=\"{:.1f}\" y=\"{:.0f}\" width=\"12\" height=\"12\" rx=\"3\" fill=\"none\" "
                          "stroke=\"{}\" stroke-width=\"2\"/>",
                          x, y - 10, it.stroke);
    body += fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\">{}</text>\n", x + (it.fill || it.stroke ? 18 : 0), y,
                        escape_xml(it.text));
    x += w;
  }
  const double top = y + 16;

  // Nodes and their devices.
  const auto node_x = [&](int64_t n) { return margin + static_cast<double>(n % per_row) * (node_w + node_gap); };
  const auto node_y = [&](int64_t n) { return top + static_cast<double>(n / per_row) * (node_h + node_gap); };
  const auto slot_x = [&](int64_t rank) {
    return node_x(m.node_of(rank)) + pad + static_cast<double>(rank % m.per_node % cols) * (sq + gap);
  };
  const auto slot_y = [&](int64_t rank) {
    return node_y(m.node_of(rank)) + head + static_cast<double>(rank % m.per_node / cols) * (sq + gap);
  };
  const size_t digits = fmt::format("{}", m.devices - 1).size();
  const double font = std::min(10.0, (sq - 3) / (0.6 * static_cast<double>(digits)));
  for (int64_t n = 0; n < drawn; ++n) {
    const int64_t first = n * m.per_node, last = std::min<int64_t>(first + m.per_node, m.devices) - 1;
    const std::string ranks = fmt::format("node {}: ranks {}", n, range(first, last));
    std::string label = ranks;
    if (pp.size > 1) {  // its stages: the colours repeat after 12
      std::vector<int> stages;
      for (int64_t r = first; r <= last; ++r) stages.push_back(pp.coord(r));
      std::sort(stages.begin(), stages.end());
      stages.erase(std::unique(stages.begin(), stages.end()), stages.end());
      if (stages.size() == 1)
        label += fmt::format(", stage {}", stages[0]);
      else if (stages.back() - stages.front() + 1 == static_cast<int>(stages.size()))
        label += fmt::format(", stages {}", range(stages.front(), stages.back()));
      else
        label += fmt::format(", {} stages", stages.size());
    }
    if (text_width(label, 11) + 2 * pad > node_w) label = ranks;
    if (text_width(label, 11) + 2 * pad > node_w) label = fmt::format("node {}", n);
    body += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" rx=\"8\" "
                        "fill=\"#f7f7f7\" stroke=\"#999999\"/><text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n",
                        node_x(n), node_y(n), node_w, node_h, node_x(n) + pad, node_y(n) + 14, label);
    for (int64_t r = first; r <= last; ++r) {
      std::string where;
      for (const Axis& a : m.axes)
        if (a.size > 1) where += fmt::format("{}{} {}", where.empty() ? ": " : ", ", a.name, a.coord(r));
      body += fmt::format("<g><title>rank {} on node {}{}</title><rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.0f}\" "
                          "height=\"{:.0f}\" fill=\"{}\" stroke=\"#666666\" stroke-width=\"0.5\"/><text x=\"{:.1f}\" "
                          "y=\"{:.1f}\" font-size=\"{:.1f}\" text-anchor=\"middle\" dominant-baseline=\"central\">{}"
                          "</text></g>\n",
                          r, n, where, slot_x(r), slot_y(r), sq, sq,
                          kStageColors[static_cast<size_t>(pp.coord(r)) % kStageColors.size()], slot_x(r) + sq / 2,
                          slot_y(r) + sq / 2, font, r);
    }
  }
  // Tensor-parallel groups: one outline per run of neighbouring squares.
  if (tp.size > 1) {
    for (int64_t base = 0; base < end; ++base) {
      if (tp.coord(base) != 0) continue;
      const int64_t last = base + (tp.size - 1) * tp.stride;
      const bool apart = m.node_of(base) != m.node_of(last);
      std::vector<std::pair<int64_t, int64_t>> runs;  // [first, last] ranks of neighbouring squares
      for (int i = 0; i < tp.size && base + i * tp.stride < end; ++i) {
        const int64_t r = base + i * tp.stride;
        if (!runs.empty()) {
          const int64_t prev = runs.back().second;
          if (r == prev + 1 && m.node_of(r) == m.node_of(prev) && slot_y(r) == slot_y(prev)) {
            runs.back().second = r;
            continue;
          }
        }
        runs.emplace_back(r, r);
      }
      for (const auto& [a, b] : runs)
        body += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.0f}\" rx=\"4\" fill=\"none\" "
                            "stroke=\"{}\" stroke-width=\"{}\"/>\n",
                            slot_x(a) - 2, slot_y(a) - 2, slot_x(b) - slot_x(a) + sq + 4, sq + 4,
                            apart ? kSplitStroke : kGroupStroke, apart ? "2.5" : "1.5");
    }
  }
  double bottom = top + static_cast<double>(grid_rows) * (node_h + node_gap) - node_gap;
  if (drawn < nodes) {
    std::string stages;
    if (pp.size > 1) {
      int lo = pp.size, hi = -1;
      for (int64_t r = end; r < m.devices; ++r) {
        lo = std::min(lo, pp.coord(r));
        hi = std::max(hi, pp.coord(r));
      }
      stages = lo == 0 && hi == pp.size - 1 ? ", every pipeline stage"
                                            : fmt::format(", pipeline stages {}", range(lo, hi));
    }
    bottom += 22;
    body += fmt::format("<text x=\"{:.0f}\" y=\"{:.0f}\">... and {} more nodes not drawn: nodes {}, ranks {}{}</text>\n",
                        margin, bottom, nodes - drawn, range(drawn, nodes - 1), range(end, m.devices - 1), stages);
  }
  const double height = bottom + margin;
  return fmt::format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" "
                     "viewBox=\"0 0 {0:.0f} {1:.0f}\" font-family=\"sans-serif\" font-size=\"11\">\n"
                     "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{2}</svg>\n",
                     width, height, body);
}

void write_picture(const PictureFile& file, const std::string& svg) {
  std::ofstream out(file.path);
  out << svg;
  if (!out) throw IoError("meshtrain plan", fmt::format("{} {}: cannot write it", file.flag, file.path), "check the path");
}

}  // namespace meshtrain::cli
