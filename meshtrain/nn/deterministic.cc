#include "meshtrain/nn/deterministic.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/reduction_tree.h"
#include "meshtrain/nn/functional.h"

namespace meshtrain::nn {
namespace {

struct Pending {
  TreeNode node;
  Tensor buf;  // p.grad itself for the node that holds it
};

struct ParamState {
  int grad_user = -1;                   // the user whose first node went into p.grad
  std::map<int, std::vector<Pending>> users;
  int complete = 0;                     // users whose nodes cover the rank's share
};

struct Step {
  int64_t block = 0;  // samples
  int64_t total = 0;
  TreeNode rank;
  std::map<const Parameter*, ParamState> params;
  std::map<const Parameter*, std::vector<Tensor>> others;  // complete tied users' sums, for take_other_users
};
thread_local Step t_step;

// The sibling of `n` in the tree over `total` blocks, and their parent;
// false for the root.
bool sibling_of(int64_t total, TreeNode n, TreeNode& sibling, TreeNode& parent) {
  TreeNode at{0, total};
  while (at.count >= 2) {
    const int64_t left = tree_left(at.count);
    const TreeNode l{at.first, left}, r{at.first + left, at.count - left};
    if (n == l || n == r) {
      sibling = n == l ? r : l;
      parent = at;
      return true;
    }
    at = n.first < r.first ? l : r;
  }
  return false;
}

// a += b, element-wise, as every addition of the tree (core's tree_sum).
void add_into(const Tensor& a, const Tensor& b) {
  float* parts[] = {a.data<float>(), b.data<float>()};
  tree_sum(parts, a.numel());
}

std::string describe(TreeNode n) { return fmt::format("blocks [{}, {})", n.first, n.first + n.count); }

}  // namespace

void begin_deterministic_step(int64_t block, int64_t total, TreeNode rank) {
  if (block < 1 || !is_tree_node(total, rank.first, rank.count))
    throw InvalidArgument("nn::begin_deterministic_step",
                          fmt::format("this rank's {} are not one node of the tree over {} blocks", describe(rank),
                                      total),
                          "give each rank a power-of-two number of the global batch's blocks (docs/determinism.md)");
  t_step.block = block;
  t_step.total = total;
  t_step.rank = rank;
  t_step.params.clear();
  t_step.others.clear();
}

int64_t deterministic_block() { return functional::deterministic_rows() > 0 ? t_step.block : 0; }

TreeNode call_node(const BatchContext& batch, int64_t samples) {
  const int64_t block = t_step.block;
  if (functional::deterministic_rows() <= 0 || block <= 0) return {};
  if (batch.samples > 0) samples = batch.samples;
  if (samples <= 0 || samples % block != 0 || batch.first_global_sample % block != 0)
    throw InvalidArgument("nn::call_node",
                          fmt::format("{} samples from global sample {} are not whole blocks of {} samples", samples,
                                      batch.first_global_sample, block),
                          "give every micro-batch a whole number of the deterministic mode's blocks");
  return {batch.first_global_sample / block, samples / block};
}

void add_gradient(Parameter& p, int user, TreeNode node, const std::function<void(const Tensor&)>& add) {
  if (functional::deterministic_rows() <= 0) return add(p.grad);
  const char* op = "nn::add_gradient";
  Step& st = t_step;
  if (st.total <= 0)
    throw InvalidArgument(op, fmt::format("no deterministic step began before '{}''s gradient", p.name),
                          "call nn::begin_deterministic_step before each step's forward");
  if (!is_tree_node(st.total, node.first, node.count) || node.first < st.rank.first ||
      node.first + node.count > st.rank.first + st.rank.count)
    throw InvalidArgument(op,
                          fmt::format("'{}': a call's {} are not one node of the tree over {} blocks inside this "
                                      "rank's {}",
                                      p.name, describe(node), st.total, describe(st.rank)),
                          "give every micro-batch a power-of-two number of blocks (docs/determinism.md)");
  ParamState& ps = st.params[&p];
  std::vector<Pending>& pending = ps.users[user];
  Pending mine{node, Tensor()};
  if (ps.grad_user < 0) {
    ps.grad_user = user;  // p.grad is zero at a step's start (zero_grad)
    mine.buf = p.grad;
  } else {
    mine.buf = Tensor::zeros(p.grad.shape(), DType::f32);
  }
  add(mine.buf);
  // Add siblings as long as one is pending.
  for (;;) {
    TreeNode sibling, parent;
    if (!sibling_of(st.total, mine.node, sibling, parent)) break;
    const auto it = std::find_if(pending.begin(), pending.end(), [&](const Pending& q) { return q.node == sibling; });
    if (it == pending.end()) break;
    Pending other = std::move(*it);
    pending.erase(it);
    // Into p.grad when one of the two is it (IEEE addition is commutative).
    if (other.buf.data_ptr() == p.grad.data_ptr()) std::swap(mine.buf, other.buf);
    add_into(mine.buf, other.buf);
    mine.node = parent;
  }
  pending.push_back(std::move(mine));
  if (!(pending.size() == 1 && pending.front().node == st.rank)) return;
  if (++ps.complete < p.users) return;
  // Every user's tree is complete: the others' sums wait for the strategy.
  std::vector<Tensor> others;
  for (auto& [u, nodes] : ps.users)
    if (u != ps.grad_user) others.push_back(nodes.front().buf);
  if (!others.empty()) st.others[&p] = std::move(others);
  st.params.erase(&p);
}

std::vector<Tensor> take_other_users(const Parameter& p) {
  const auto it = t_step.others.find(&p);
  if (it == t_step.others.end()) return {};
  std::vector<Tensor> out = std::move(it->second);
  t_step.others.erase(it);
  return out;
}

}  // namespace meshtrain::nn
