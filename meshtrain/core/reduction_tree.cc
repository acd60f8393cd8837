#include "meshtrain/core/reduction_tree.h"

#include <algorithm>
#include <bit>

#include "meshtrain/core/error.h"
#include "meshtrain/core/parallel_for.h"

namespace meshtrain {
namespace {

// a[i] += b[i]: one IEEE addition per element (nn and core build without
// FMA contraction; an addition has no other rounding anyway).
void add_into(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

// parts[0] = the tree sum of parts[0..count), elements [b, e).
void tree_sum_range(float* const* parts, int64_t count, int64_t b, int64_t e) {
  if (count < 2) return;
  const int64_t left = tree_left(count);
  tree_sum_range(parts, left, b, e);
  tree_sum_range(parts + left, count - left, b, e);
  add_into(parts[0] + b, parts[left] + b, e - b);
}

double tree_sum_doubles(double* v, int64_t count) {
  if (count == 1) return v[0];
  const int64_t left = tree_left(count);
  return tree_sum_doubles(v, left) + tree_sum_doubles(v + left, count - left);
}

}  // namespace

int64_t tree_left(int64_t count) {
  if (count < 2) throw InvalidArgument("tree_left", "a node of fewer than 2 parts has no children", "");
  return int64_t{1} << (std::bit_width(static_cast<uint64_t>(count - 1)) - 1);
}

bool is_tree_node(int64_t total, int64_t first, int64_t count) {
  if (count < 1 || first < 0 || first + count > total) return false;
  int64_t lo = 0, n = total;
  while (true) {
    if (lo == first && n == count) return true;
    if (n < 2) return false;
    const int64_t left = tree_left(n);
    if (first + count <= lo + left) {
      n = left;
    } else if (first >= lo + left) {
      lo += left;
      n -= left;
    } else {
      return false;  // straddles the split
    }
  }
}

void tree_sum(std::span<float* const> parts, int64_t len, bool threads) {
  const auto count = static_cast<int64_t>(parts.size());
  if (count < 2 || len <= 0) return;
  if (!threads) return tree_sum_range(parts.data(), count, 0, len);
  parallel_for(len, int64_t{1} << 14, [&](int64_t b, int64_t e) { tree_sum_range(parts.data(), count, b, e); });
}

double tree_sum(std::span<double> v) {
  if (v.empty()) return 0.0;
  return tree_sum_doubles(v.data(), static_cast<int64_t>(v.size()));
}

TreeStack::TreeStack(int64_t total, int64_t len) : total_(total), len_(len) {
  if (total < 1 || len < 0)
    throw InvalidArgument("TreeStack", "total " + std::to_string(total) + ", len " + std::to_string(len),
                          "need at least one part");
}

float* TreeStack::next() {
  if (pushed_ >= total_) throw InvalidArgument("TreeStack::next", "every part was pushed", "");
  if (spare_ == nullptr) {
    // A buffer no pending node uses.
    for (auto& b : pool_) {
      const bool used = std::any_of(stack_.begin(), stack_.end(), [&](const Node& n) { return n.buf == &b; });
      if (!used) {
        spare_ = &b;
        break;
      }
    }
    if (spare_ == nullptr) {
      pool_.emplace_back(static_cast<size_t>(len_));
      spare_ = &pool_.back();
    }
  }
  return spare_->data();
}

void TreeStack::push() {
  if (spare_ == nullptr) next();
  stack_.push_back({pushed_, 1, spare_});
  spare_ = nullptr;
  ++pushed_;
  // Merge the top two while they are the two children of one node.
  while (stack_.size() >= 2) {
    const Node& l = stack_[stack_.size() - 2];
    const Node& r = stack_.back();
    const int64_t count = l.count + r.count;
    if (!is_tree_node(total_, l.first, count) || tree_left(count) != l.count) break;
    add_into(l.buf->data(), r.buf->data(), len_);
    stack_[stack_.size() - 2].count = count;
    stack_.pop_back();
  }
}

const float* TreeStack::result() const {
  if (pushed_ != total_ || stack_.size() != 1)
    throw InvalidArgument("TreeStack::result", "pushed " + std::to_string(pushed_) + " of " +
                                                   std::to_string(total_) + " parts",
                          "push every part first");
  return stack_.front().buf->data();
}

}  // namespace meshtrain
