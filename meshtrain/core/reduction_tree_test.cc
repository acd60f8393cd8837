#include "meshtrain/core/reduction_tree.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "meshtrain/core/exact_squares.h"
#include "meshtrain/core/matmul.h"
#include "meshtrain/core/random.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain {
namespace {

TEST(ReductionTree, NodesAreAlignedPowerOfTwoRunsAndTheirUnions) {
  EXPECT_EQ(tree_left(2), 1);
  EXPECT_EQ(tree_left(3), 2);
  EXPECT_EQ(tree_left(4), 2);
  EXPECT_EQ(tree_left(6), 4);
  EXPECT_EQ(tree_left(9), 8);
  // Over 6: ((0 1) (2 3)) (4 5).
  for (auto [first, count] : {std::pair{0, 6}, {0, 4}, {4, 2}, {0, 2}, {2, 2}, {3, 1}, {5, 1}})
    EXPECT_TRUE(is_tree_node(6, first, count)) << first << "+" << count;
  for (auto [first, count] : {std::pair{0, 3}, {1, 2}, {3, 2}, {2, 4}, {0, 5}, {5, 2}, {0, 0}})
    EXPECT_FALSE(is_tree_node(6, first, count)) << first << "+" << count;
  // Equal power-of-two shares are nodes for any number of shares.
  for (int64_t shares = 1; shares <= 12; ++shares)
    for (int64_t k : {1, 2, 4, 8})
      for (int64_t s = 0; s < shares; ++s) EXPECT_TRUE(is_tree_node(shares * k, s * k, k)) << shares << " " << k;
}

// Values whose sum depends on the grouping in f32.
std::vector<float> awkward(int64_t n, uint32_t key) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_normal(v.data(), v.size(), 7, key, 0, 0.0f, 1.0f);
  for (size_t i = 0; i < v.size(); ++i) v[i] *= std::ldexp(1.0f, static_cast<int>(i % 7) * 4 - 12);
  return v;
}

TEST(ReductionTree, SharesSummedAloneThenTheirSumsEqualTheWholeTree) {
  const int64_t parts = 12, len = 1000;
  std::vector<std::vector<float>> p;
  for (int64_t i = 0; i < parts; ++i) p.push_back(awkward(len, static_cast<uint32_t>(i)));
  auto tree = [&](int64_t first, int64_t count) {
    std::vector<std::vector<float>> copy(p.begin() + first, p.begin() + first + count);
    std::vector<float*> ptrs;
    for (auto& c : copy) ptrs.push_back(c.data());
    tree_sum(ptrs, len);
    return copy.front();
  };
  const std::vector<float> whole = tree(0, parts);
  // 3 shares of 4 parts: each share's own tree, then the tree over the 3 sums.
  std::vector<std::vector<float>> sums = {tree(0, 4), tree(4, 4), tree(8, 4)};
  std::vector<float*> ptrs = {sums[0].data(), sums[1].data(), sums[2].data()};
  tree_sum(ptrs, len, /*threads=*/false);
  EXPECT_EQ(sums[0], whole);
  // A TreeStack fed the parts in order gives the same bits.
  TreeStack stack(parts, len);
  for (int64_t i = 0; i < parts; ++i) {
    std::copy(p[static_cast<size_t>(i)].begin(), p[static_cast<size_t>(i)].end(), stack.next());
    stack.push();
  }
  EXPECT_EQ(std::vector<float>(stack.result(), stack.result() + len), whole);
  // A sequential sum differs somewhere (the grouping matters here).
  std::vector<float> seq(static_cast<size_t>(len), 0.0f);
  for (const auto& v : p)
    for (int64_t j = 0; j < len; ++j) seq[static_cast<size_t>(j)] += v[static_cast<size_t>(j)];
  EXPECT_NE(seq, whole);
  std::vector<double> d = {1e16, 1.0, -1e16, 1.0};
  EXPECT_EQ(tree_sum(d), 0.0);  // (1e16 + 1) + (-1e16 + 1): each 1 lost in its pair
}

TEST(ExactSquares, TheSumIsExactAndTheSameInAnyOrderOrSplit) {
  std::vector<float> v = awkward(100000, 9);
  v[17] = 1e-40f;  // a subnormal
  v[18] = 3e38f;   // near the top: its square only fits in double
  ExactSquares whole;
  whole.add(v.data(), static_cast<int64_t>(v.size()));
  // Reversed, in uneven pieces merged in another order: the same words.
  std::vector<float> r(v.rbegin(), v.rend());
  ExactSquares a, b, c;
  a.add(r.data(), 12345);
  b.add(r.data() + 12345, 50000);
  c.add(r.data() + 62345, static_cast<int64_t>(r.size()) - 62345);
  c.merge(a);
  c.merge(b);
  EXPECT_EQ(c.words(), whole.words());
  EXPECT_EQ(c.value(), whole.value());
  EXPECT_EQ(ExactSquares::from_words(whole.words()).value(), whole.value());
  // Against a sum in long double (to its precision).
  long double ref = 0;
  for (float x : v) ref += static_cast<long double>(x) * x;
  EXPECT_NEAR(whole.value() / static_cast<double>(ref), 1.0, 1e-15);
  const float bad[] = {1.0f, std::numeric_limits<float>::infinity()};
  ExactSquares inf;
  inf.add(bad, 2);
  EXPECT_TRUE(std::isinf(inf.value()));
  const float nan[] = {std::numeric_limits<float>::quiet_NaN()};
  inf.add(nan, 1);
  EXPECT_TRUE(std::isnan(inf.value()));
}

Tensor random_matrix(int64_t r, int64_t c, uint32_t key) {
  std::vector<float> v = awkward(r * c, key);
  return Tensor::from_vector(v, {r, c});
}

// out (M, N) against op(a) @ op(b) in double: within f32's rounding of the
// sum of |terms| (the values span 2^24, so plain relative bounds fail).
void expect_product(const Tensor& out, const Tensor& a, bool ta, const Tensor& b, bool tb) {
  const int64_t m = out.size(0), n = out.size(1), k = ta ? a.size(0) : a.size(1);
  const auto o = out.to_vector(), av = a.contiguous().to_vector(), bv = b.contiguous().to_vector();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = av[static_cast<size_t>(ta ? p * m + i : i * k + p)];
        const double y = bv[static_cast<size_t>(tb ? j * k + p : p * n + j)];
        ref += x * y;
        mag += std::fabs(x * y);
      }
      ASSERT_LE(std::fabs(o[static_cast<size_t>(i * n + j)] - ref), 1e-5 * mag + 1e-30) << i << "," << j;
    }
}

TEST(DeterministicMatmul, ARowsResultDoesNotDependOnTheOtherRowsOrTheThreads) {
  const int64_t block = 8, k = 300, n = 700;  // n: 3 column blocks, the last partial
  const Tensor a = random_matrix(4 * block, k, 1), b = random_matrix(k, n, 2), bt = random_matrix(n, k, 3);
  for (bool trans_b : {false, true}) {
    const Tensor& w = trans_b ? bt : b;
    Tensor all = Tensor::zeros({4 * block, n}, DType::f32);
    matmul_fixed_blocks(a, w, all, trans_b, 0.0, block);
    // Rows [8, 24) alone, with 1 and 2 threads: the same bits as inside the whole call.
    for (int threads : {1, 2}) {
      const int previous = blas_threads();
      set_blas_threads(threads);
      Tensor part = Tensor::zeros({2 * block, n}, DType::f32);
      matmul_fixed_blocks(a.narrow(0, block, 2 * block).contiguous(), w, part, trans_b, 0.0, block);
      set_blas_threads(previous);
      EXPECT_EQ(part.to_vector(), all.narrow(0, block, 2 * block).contiguous().to_vector()) << threads;
    }
    expect_product(all, a, false, w, trans_b);  // and the product is the product
  }
}

TEST(DeterministicMatmul, AWeightGradientIsTheTreeOverBlocksWhateverTheSplit) {
  const int64_t block = 8, m = 200, n = 300;  // 2 x 2 tiles, partial
  const Tensor x = random_matrix(6 * block, m, 4), dy = random_matrix(6 * block, n, 5);
  // Whole: the tree over 6 blocks; in shares of 2 blocks: each share's node,
  // then the tree over the 3 nodes (as 3 ranks would).
  Tensor whole = Tensor::zeros({m, n}, DType::f32);
  matmul_tn_tree(x, dy, whole, block);
  std::vector<Tensor> nodes;
  for (int s = 0; s < 3; ++s) {
    nodes.push_back(Tensor::zeros({m, n}, DType::f32));
    matmul_tn_tree(x.narrow(0, 2 * block * s, 2 * block).contiguous(),
                   dy.narrow(0, 2 * block * s, 2 * block).contiguous(), nodes.back(), block);
  }
  std::vector<float*> ptrs = {nodes[0].data<float>(), nodes[1].data<float>(), nodes[2].data<float>()};
  tree_sum(ptrs, m * n);
  EXPECT_EQ(nodes[0].to_vector(), whole.to_vector());
  expect_product(whole, x, true, dy, false);
}

}  // namespace
}  // namespace meshtrain
