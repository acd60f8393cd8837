#include "meshtrain/sharding/visualize.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::sharding {
namespace {

// A non-empty shard of one dimension.
struct Segment {
  int shard = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// The blocks of a 1-D or 2-D layout: rows (dim 0 of a 2-D tensor; one
// pseudo-row for 1-D) by columns (the last dim), and who holds each.
struct Grid {
  std::vector<Segment> rows, cols;
  int64_t row_extent = 1, col_extent = 1;
  std::vector<std::vector<std::vector<int>>> holders;  // [row][col] -> world ranks
  std::vector<int> empty_ranks;
};

std::vector<Segment> segments(const Layout& l, int dim) {
  std::vector<Segment> out;
  for (int j = 0; j < l.num_shards(dim); ++j) {
    const auto [b, e] = l.shard_range(dim, j);
    if (e > b) out.push_back({j, b, e});
  }
  return out;
}

size_t segment_of(const std::vector<Segment>& segs, int shard) {
  for (size_t i = 0; i < segs.size(); ++i)
    if (segs[i].shard == shard) return i;
  // A non-empty box lies in a non-empty shard; anything else is a bug, never an index -1.
  throw Error("visualize_sharding", fmt::format("shard {} has no block", shard), "internal: report this layout");
}

Grid build_grid(const Layout& l, const char* op) {
  if (l.ndim() != 1 && l.ndim() != 2)
    throw InvalidArgument(op, fmt::format("{} is {}-D", l.to_string(), l.ndim()),
                          "pictures are drawn for 1-D and 2-D tensors; print Layout::to_string() otherwise");
  if (l.num_ranks() > kMaxPictureRanks)
    throw InvalidArgument(op, fmt::format("a mesh of {} ranks is too large to draw (at most {})", l.num_ranks(),
                                          kMaxPictureRanks),
                          "print Layout::to_string() and local_box(rank) instead");
  Grid g;
  const int cd = l.ndim() - 1;
  g.cols = segments(l, cd);
  g.col_extent = l.global_shape()[cd];
  if (l.ndim() == 2) {
    g.rows = segments(l, 0);
    g.row_extent = l.global_shape()[0];
  } else {
    g.rows = {{0, 0, 1}};
  }
  g.holders.assign(g.rows.size(), std::vector<std::vector<int>>(g.cols.size()));
  for (int r = 0; r < l.num_ranks(); ++r) {
    if (l.local_box(r).empty()) {
      g.empty_ranks.push_back(r);
      continue;
    }
    const size_t row = l.ndim() == 2 ? segment_of(g.rows, l.shard_index(r, 0)) : 0;
    const size_t col = segment_of(g.cols, l.shard_index(r, cd));
    g.holders[row][col].push_back(r);
  }
  return g;
}

// "0,1", "0-3", "0-3,8-11", "0,2,4,6".
std::string format_ranks(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (j - i >= 2) {
      parts.push_back(fmt::format("{}-{}", ranks[i], ranks[j]));
    } else {
      for (size_t k = i; k <= j; ++k) parts.push_back(fmt::format("{}", ranks[k]));
    }
    i = j + 1;
  }
  return fmt::format("{}", fmt::join(parts, ","));
}

std::string header(const Layout& l) {
  std::string s = fmt::format("{} on mesh {}, shape {}", l.spec().to_string(),
                              mesh::format_mesh(l.mesh_shape(), l.axis_names()), shape_to_string(l.global_shape()));
  if (l.has_partial()) {
    std::vector<std::string> parts;
    for (const auto& [axis, op] : l.partial()) parts.push_back(fmt::format("{} ({})", axis, comm::reduce_op_name(op)));
    s += fmt::format(", partial over {}", fmt::join(parts, ", "));
  }
  return s;
}

// "dim 0 (size 5) over (data, tensor): 4 shards, sizes 2 x2, 1, 0" per split dim,
// then "empty blocks on ranks 3,7" when some are empty.
std::vector<std::string> footer(const Layout& l, const Grid& g) {
  std::vector<std::string> lines;
  for (int d = 0; d < l.ndim(); ++d) {
    const int k = l.num_shards(d);
    if (l.spec().axes(d).empty()) continue;
    std::vector<std::string> runs;
    for (int j = 0; j < k;) {
      const auto size = [&](int s) { return l.shard_range(d, s).second - l.shard_range(d, s).first; };
      int m = j;
      while (m + 1 < k && size(m + 1) == size(j)) ++m;
      runs.push_back(m > j ? fmt::format("{} x{}", size(j), m - j + 1) : fmt::format("{}", size(j)));
      j = m + 1;
    }
    lines.push_back(fmt::format("dim {} (size {}) over ({}): {} shard{}, sizes {}", d, l.global_shape()[d],
                                fmt::join(l.spec().axes(d), ", "), k, k == 1 ? "" : "s", fmt::join(runs, ", ")));
  }
  if (!g.empty_ranks.empty())
    lines.push_back(fmt::format("empty blocks on rank{} {}", g.empty_ranks.size() == 1 ? "" : "s",
                                format_ranks(g.empty_ranks)));
  return lines;
}

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

int scaled(int64_t extent, int64_t total, int span) {
  return static_cast<int>(std::llround(static_cast<double>(extent) * span / static_cast<double>(total)));
}

std::string rule(const std::vector<int>& widths, const char* left, const char* mid, const char* right) {
  std::string s = left;
  for (size_t j = 0; j < widths.size(); ++j) s += repeat("─", widths[j]) + (j + 1 < widths.size() ? mid : "");
  return s + right + "\n";
}

void check_options(const VisualizeOptions& o, const char* op) {
  if (o.width < 1 || o.width > kMaxPictureWidth)
    throw InvalidArgument(op, fmt::format("width {} is outside [1, {}]", o.width, kMaxPictureWidth),
                          "draw at most 1000 columns");
  if (o.height < 1 || o.height > kMaxPictureHeight)
    throw InvalidArgument(op, fmt::format("height {} is outside [1, {}]", o.height, kMaxPictureHeight),
                          "draw at most 200 lines");
}

}  // namespace

std::string visualize_sharding(const Layout& layout, const VisualizeOptions& options) {
  check_options(options, "visualize_sharding");
  const Grid g = build_grid(layout, "visualize_sharding");
  std::string out = header(layout) + "\n";
  if (g.cols.empty() || g.rows.empty()) {
    out += "(no elements)\n";
  } else {
    std::vector<int> widths(g.cols.size()), heights(g.rows.size(), 1);
    for (size_t j = 0; j < g.cols.size(); ++j) {
      size_t label = 1;
      for (size_t i = 0; i < g.rows.size(); ++i) label = std::max(label, format_ranks(g.holders[i][j]).size());
      widths[j] = std::max(static_cast<int>(label) + 2,
                           scaled(g.cols[j].end - g.cols[j].begin, g.col_extent, std::max(options.width, 1)));
    }
    if (layout.ndim() == 2)
      for (size_t i = 0; i < g.rows.size(); ++i)
        heights[i] = std::max(1, scaled(g.rows[i].end - g.rows[i].begin, g.row_extent, std::max(options.height, 1)));
    out += rule(widths, "┌", "┬", "┐");
    for (size_t i = 0; i < g.rows.size(); ++i) {
      for (int line = 0; line < heights[i]; ++line) {
        out += "│";
        for (size_t j = 0; j < g.cols.size(); ++j) {
          const std::string label = line == (heights[i] - 1) / 2 ? format_ranks(g.holders[i][j]) : "";
          const int pad = widths[j] - static_cast<int>(label.size());
          out += std::string(pad / 2, ' ') + label + std::string(pad - pad / 2, ' ') + "│";
        }
        out += "\n";
      }
      out += i + 1 < g.rows.size() ? rule(widths, "├", "┼", "┤") : rule(widths, "└", "┴", "┘");
    }
  }
  for (const auto& line : footer(layout, g)) out += line + "\n";
  return out;
}

std::string visualize_sharding_svg(const Layout& layout, const VisualizeOptions& options) {
  check_options(options, "visualize_sharding_svg");
  static constexpr const char* kColors[] = {"#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
                                            "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"};
  const Grid g = build_grid(layout, "visualize_sharding_svg");
  const double width = 10.0 * std::max(options.width, 1);
  double height = 48;
  if (layout.ndim() == 2 && g.col_extent > 0) {
    const double aspect = static_cast<double>(g.row_extent) / static_cast<double>(g.col_extent);
    height = std::clamp(width * aspect, 96.0, std::max(width, 96.0));
  }
  const std::vector<std::string> notes = footer(layout, g);
  const double top = 28, margin = 8;
  const double total_h = top + height + 8 + 18 * static_cast<double>(notes.size()) + margin;
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" viewBox=\"0 0 {0:.0f} {1:.0f}\" "
      "font-family=\"monospace\">\n",
      width + 2 * margin, total_h);
  out += fmt::format("<text x=\"{}\" y=\"18\" font-size=\"13\">{}</text>\n", margin, escape_xml(header(layout)));
  int color = 0;
  for (size_t i = 0; i < g.rows.size(); ++i) {
    for (size_t j = 0; j < g.cols.size(); ++j) {
      const auto& row = g.rows[i];
      const auto& col = g.cols[j];
      const double x = margin + width * static_cast<double>(col.begin) / static_cast<double>(g.col_extent);
      const double w = width * static_cast<double>(col.end - col.begin) / static_cast<double>(g.col_extent);
      const double y = top + height * static_cast<double>(row.begin) / static_cast<double>(g.row_extent);
      const double h = height * static_cast<double>(row.end - row.begin) / static_cast<double>(g.row_extent);
      const std::string label = format_ranks(g.holders[i][j]);
      const std::string range = layout.ndim() == 2
                                    ? fmt::format("[{}:{}, {}:{}]", row.begin, row.end, col.begin, col.end)
                                    : fmt::format("[{}:{}]", col.begin, col.end);
      const double font = std::min(14.0, std::max(6.0, w / (0.62 * static_cast<double>(label.size()) + 1)));
      out += fmt::format(
          "<g><title>{} ranks {}</title><rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" "
          "fill=\"{}\" stroke=\"#333333\" stroke-width=\"1\"/>"
          "<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"{:.1f}\" text-anchor=\"middle\" "
          "dominant-baseline=\"middle\">{}</text></g>\n",
          range, label, x, y, w, h, kColors[color++ % std::size(kColors)], x + w / 2, y + h / 2, font, label);
    }
  }
  double y = top + height + 8 + 13;
  for (const auto& line : notes) {
    out += fmt::format("<text x=\"{}\" y=\"{:.0f}\" font-size=\"12\">{}</text>\n", margin, y, escape_xml(line));
    y += 18;
  }
  return out + "</svg>\n";
}

}  // namespace meshtrain::sharding
