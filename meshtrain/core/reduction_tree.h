// The canonical reduction tree of the deterministic mode
// (docs/determinism.md): one fixed way to add n parts, so that a sum gives
// the same bits however its parts were spread over calls, micro-batches,
// threads and ranks.
//
// Over parts [first, first + count), a node of count >= 2 splits into a
// left child of the largest power of two below count and a right child of
// the rest; a node of count 1 is a part. Any aligned power-of-two run of
// parts (a rank's or a micro-batch's share when shares are powers of two)
// is a node, and the tree above such equal shares is the same tree over
// the shares, so a rank sums its own parts in its subtree and the ranks'
// sums continue the tree across ranks:
//
//   tree over 6:  ((p0 + p1) + (p2 + p3)) + (p4 + p5)
//   2 ranks of 2 parts + 1 of 2: rank sums s0 = p0+p1, s1 = p2+p3, s2 = p4+p5,
//   then the tree over 3: (s0 + s1) + s2: the same additions.
//
//   float* parts[] = {a, b, c};
//   tree_sum(parts, len);            // a = (a + b) + c element-wise; b, c clobbered
//   TreeStack acc(n, len);           // parts arriving in order, O(log n) buffers
//
// IEEE addition is commutative, so only the grouping matters: a node's two
// children may be added in either order.
// Thread-safety: pure functions; a TreeStack belongs to one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <vector>

namespace meshtrain {

// The left child's count of a node of `count` >= 2 parts: the largest power
// of two below count.
int64_t tree_left(int64_t count);

// Whether parts [first, first + count) form one node of the tree over
// `total` parts (count >= 1).
bool is_tree_node(int64_t total, int64_t first, int64_t count);

// parts[0][i] = the tree sum of parts[j][i] over j, for i < len (the other
// parts are clobbered). Element-wise over the rank's threads when
// `threads`, else on the calling thread.
void tree_sum(std::span<float* const> parts, int64_t len, bool threads = true);
// The tree sum of v (v clobbered).
double tree_sum(std::span<double> v);

// A tree sum of `total` equal-length f32 parts that arrive in order (part 0
// first): push(part) adds part k; after the last, result() holds the sum.
// Keeps one buffer per pending level (at most log2(total) + 1); adds on the
// calling thread (it serves one tile of a parallel loop).
class TreeStack {
 public:
  TreeStack(int64_t total, int64_t len);
  // The buffer to write the next part into (len elements), then push().
  float* next();
  void push();
  // After `total` pushes: the sum (len elements).
  const float* result() const;
  int64_t pushed() const { return pushed_; }

 private:
  struct Node {
    int64_t first, count;
    std::vector<float>* buf;
  };
  int64_t total_, len_;
  int64_t pushed_ = 0;
  std::deque<std::vector<float>> pool_;  // stable addresses
  std::vector<Node> stack_;
  std::vector<float>* spare_ = nullptr;
};

}  // namespace meshtrain
