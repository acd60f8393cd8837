// The deterministic mode's forms of the CPU kernels (docs/determinism.md):
// sums over rows per block of `block` rows in row order, then over blocks in
// the canonical tree (core/reduction_tree.h). cpu_backend.cc calls them
// while functional::set_deterministic_rows is set. Internal to nn.
// Thread-safety: stateless.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/core/tensor.h"

namespace meshtrain::nn::internal {

// The calling thread's rows per block, checked against a call's rows
// (InvalidArgument naming `op` unless whole blocks); 0 when the mode is off.
int64_t deterministic_block(int64_t rows, const char* op);

// db (C) += the tree over blocks of each block's column sums of dy (R, C) f32.
void add_column_sums_tree(const Tensor& dy, const Tensor& db, int64_t block);

// dgamma += the tree of per-block sums of dy * xhat; dbeta (when defined) +=
// that of dy: layer_norm_backward_weight's form.
void layer_norm_weight_tree(const Tensor& dyt, const Tensor& xhat, const Tensor& dgamma, const Tensor& dbeta,
                            int64_t block);

// Whether every id of the 1-d i64/i32 `ids` appears once.
bool distinct_ids(const Tensor& ids);

// dweight[id - begin] += the tree over blocks of each block's sum of the
// rows with that id (a sparse tree: blocks without the id add nothing).
void embedding_backward_tree(const Tensor& ids, const Tensor& dy, const Tensor& dweight, int64_t begin,
                             int64_t block);

// The sum of per-row terms divided by `normalizer`: in row order, then
// divided (block 0); else per block, each divided, in the tree.
double sum_rows(const std::vector<double>& terms, int64_t block, double normalizer);

}  // namespace meshtrain::nn::internal
