// The deterministic mode's forms of the CPU kernels (deterministic_kernels.h).
#include "meshtrain/nn/internal/deterministic_kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/nn/functional.h"

namespace meshtrain::nn::internal {

// The deterministic mode's rows per block (functional::set_deterministic_rows),
// checked against a call's rows: 0 when the mode is off.
int64_t deterministic_block(int64_t rows, const char* op) {
  const int64_t block = functional::deterministic_rows();
  if (block > 0 && rows % block != 0)
    throw InvalidArgument(op, fmt::format("{} rows are not a whole number of the deterministic mode's blocks of {}",
                                          rows, block),
                          "give every call whole blocks (the trainer's start-up check does)");
  return block;
}

// db (C) += the canonical tree over blocks of `block` rows of each block's
// column sums of dy (R, C) f32, each in row order.
void add_column_sums_tree(const Tensor& dy, const Tensor& db, int64_t block) {
  const int64_t rows = dy.size(0), cols = dy.size(1);
  if (rows == 0) return;
  const float* m = dy.data<float>();
  TreeStack sum(rows / block, cols);
  for (int64_t first = 0; first < rows; first += block) {
    float* acc = sum.next();
    std::fill(acc, acc + cols, 0.0f);
    for (int64_t r = first; r < first + block; ++r) {
      const float* row = m + r * cols;
      for (int64_t j = 0; j < cols; ++j) acc[j] += row[j];
    }
    sum.push();
  }
  const float* total = sum.result();
  float* out = db.data<float>();
  for (int64_t j = 0; j < cols; ++j) out[j] += total[j];
}

// dgamma += the tree over blocks of sum dy * xhat, dbeta (when defined) +=
// that of sum dy, each block in row order (the mode's form of
// layer_norm_backward_weight).
void layer_norm_weight_tree(const Tensor& dyt, const Tensor& xhat, const Tensor& dgamma, const Tensor& dbeta,
                            int64_t block) {
  const int64_t rows = xhat.size(0), dim = xhat.size(1);
  if (rows == 0) return;
  const float* pdy = dyt.data<float>();
  const float* ph = xhat.data<float>();
  const bool beta = dbeta.defined();
  TreeStack sum(rows / block, (beta ? 2 : 1) * dim);  // [gamma | beta]
  for (int64_t first = 0; first < rows; first += block) {
    float* acc = sum.next();
    std::fill(acc, acc + (beta ? 2 : 1) * dim, 0.0f);
    for (int64_t r = first; r < first + block; ++r) {
      const float* dyr = pdy + r * dim;
      const float* hr = ph + r * dim;
      for (int64_t j = 0; j < dim; ++j) acc[j] += dyr[j] * hr[j];
      if (beta)
        for (int64_t j = 0; j < dim; ++j) acc[dim + j] += dyr[j];
    }
    sum.push();
  }
  const float* total = sum.result();
  if (beta) {
    float* gb = dbeta.data<float>();
    for (int64_t j = 0; j < dim; ++j) gb[j] += total[dim + j];
  }
  float* gg = dgamma.data<float>();
  for (int64_t j = 0; j < dim; ++j) gg[j] += total[j];
}

bool distinct_ids(const Tensor& ids) {
  std::vector<int64_t> v(static_cast<size_t>(ids.size(0)));
  for (int64_t i = 0; i < ids.size(0); ++i)
    v[static_cast<size_t>(i)] = ids.dtype() == DType::i64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i];
  std::sort(v.begin(), v.end());
  return std::adjacent_find(v.begin(), v.end()) == v.end();
}

// dweight[id] += the canonical tree over blocks of `block` rows of each
// block's sum of its rows with that id (in row order, from +0): the dense
// tree with the blocks that lack the id adding nothing (a block's sum is
// never -0, so x + (+0) = x there).
void embedding_backward_tree(const Tensor& ids, const Tensor& dy, const Tensor& dweight, int64_t begin,
                             int64_t block) {
  const int64_t n = ids.size(0), rows = dweight.size(0), c = dweight.size(1);
  const float* g = dy.data<float>();
  float* dw = dweight.data<float>();
  // The rows of each id, in row order.
  std::vector<std::pair<int64_t, int64_t>> order;  // (row of dweight, row of dy)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = (ids.dtype() == DType::i64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i]) - begin;
    if (r >= 0 && r < rows) order.emplace_back(r, i);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const int64_t blocks = n / block;
  std::vector<float> sums;        // one id's block sums, c each
  std::vector<int64_t> present;   // their blocks
  for (size_t a = 0; a < order.size();) {
    size_t b = a;
    while (b < order.size() && order[b].first == order[a].first) ++b;
    sums.clear();
    present.clear();
    for (size_t k = a; k < b; ++k) {
      const int64_t blk = order[k].second / block;
      if (present.empty() || present.back() != blk) {
        present.push_back(blk);
        sums.resize(sums.size() + static_cast<size_t>(c), 0.0f);
      }
      float* s = sums.data() + (present.size() - 1) * static_cast<size_t>(c);
      const float* gi = g + order[k].second * c;
      for (int64_t j = 0; j < c; ++j) s[j] += gi[j];
    }
    // The tree over [0, blocks) with absent blocks skipped; the result in
    // the first present block's sum.
    const std::function<int(int64_t, int64_t, size_t&)> tree = [&](int64_t lo, int64_t count, size_t& next) -> int {
      if (next >= present.size() || present[next] >= lo + count) return -1;  // none here
      if (count == 1) return static_cast<int>(next++);
      const int64_t left = tree_left(count);
      const int l = tree(lo, left, next), r = tree(lo + left, count - left, next);
      if (l < 0 || r < 0) return l < 0 ? r : l;
      float* x = sums.data() + static_cast<size_t>(l) * static_cast<size_t>(c);
      const float* y = sums.data() + static_cast<size_t>(r) * static_cast<size_t>(c);
      for (int64_t j = 0; j < c; ++j) x[j] += y[j];
      return l;
    };
    size_t next = 0;
    const int root = tree(0, blocks, next);
    float* row = dw + order[a].first * c;
    const float* s = sums.data() + static_cast<size_t>(root) * static_cast<size_t>(c);
    for (int64_t j = 0; j < c; ++j) row[j] += s[j];
    a = b;
  }
}

// The sum of per-row terms divided by `normalizer`: in row order, then
// divided; or in the deterministic mode the canonical tree over blocks of
// `block` rows, each summed in row order and divided.
double sum_rows(const std::vector<double>& terms, int64_t block, double normalizer) {
  if (block <= 0 || terms.empty()) {
    double total = 0.0;
    for (double t : terms) total += t;
    return total / normalizer;
  }
  std::vector<double> blocks;
  for (size_t first = 0; first < terms.size(); first += static_cast<size_t>(block)) {
    double s = 0.0;
    for (size_t r = first; r < first + static_cast<size_t>(block); ++r) s += terms[r];
    blocks.push_back(s / normalizer);
  }
  return tree_sum(blocks);
}
}  // namespace meshtrain::nn::internal
