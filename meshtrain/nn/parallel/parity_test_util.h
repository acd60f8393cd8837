// Helpers of the tensor-parallel parity tests (nn_tensor_parallel_test,
// nn_llama_parallel_test): deterministic inputs, a placement's block of a
// whole tensor, and element-wise comparison. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/random.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/module.h"

namespace meshtrain::nn::parity_test {

// N(0, 1) values keyed by `key` (the same on every rank).
inline Tensor randn(std::vector<int64_t> shape, const char* key) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32);
  fill_normal(t, 9, key_from_name(key), 0.0, 1.0);
  return t;
}

// The elements of t that placement pl holds (its block, row-major).
inline std::vector<double> block_of(const Tensor& t, const Placement& pl) {
  const sharding::Box box = pl.block_box();
  Tensor v = t.contiguous().view(pl.view_shape());
  for (size_t d = 0; d < box.sizes.size(); ++d) v = v.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
  return v.contiguous().to_vector();
}

inline void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol) << what << " element " << i;
}

}  // namespace meshtrain::nn::parity_test
