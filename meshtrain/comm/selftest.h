// The collective self-test (tests, `meshtrain check` and the demo), engine-agnostic: every rank calls
// run_collective_suite(comm) on its communicator. It checks every collective,
// dtype and reduce op at the given sizes, in place and out of place, against
// closed-form expected values, plus send/recv, split and async overlap.
// Inputs are small integers (1 to size + 10), so sums are exact in every
// accumulator and independent of reduction order; the expected values follow
// the engines' rules (bf16/f16 round once from f32, integers wrap modulo
// 2^bits, products overflow to inf) and are right for any rank count.
// On the first wrong value it throws std::runtime_error naming the rank, the
// operation, dtype, size, element index, the value found and the one expected.
#pragma once

#include <cstddef>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::comm {

struct SuiteOptions {
  std::vector<size_t> sizes = {0, 1, 7, 1000, (1u << 20) + 3};
  // Sizes above this run every dtype with sum only, and the other ops with f32.
  size_t full_matrix_limit = 1 << 16;
};

// Returns the number of checks made (each a whole buffer compared).
size_t run_collective_suite(Communicator& comm, const SuiteOptions& options = {});

namespace internal {
// What the suite feeds and expects, exposed for tests (selftest_test.cc
// checks the expectation against the reduction kernel for many rank counts):
// rank r's input to `op` and the reduction over n ranks, `count` elements of
// dtype t (the pattern repeats every 10 elements).
std::vector<std::byte> suite_input(DType t, ReduceOp op, int rank, size_t count);
std::vector<std::byte> suite_expected(DType t, ReduceOp op, int n, size_t count);
}  // namespace internal

}  // namespace meshtrain::comm
