// The collective self-test (tests, `meshtrain check` and the demo), engine-agnostic: every rank calls
// run_collective_suite(comm) on its communicator. It checks every collective,
// dtype and reduce op at the given sizes, in place and out of place, against
// closed-form expected values (inputs are small integers, so every dtype
// represents every intermediate exactly and the expected result does not
// depend on reduction order), plus send/recv, split and async overlap.
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

}  // namespace meshtrain::comm
