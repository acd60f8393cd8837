// The CPU kernels behind nn::functional (OpenBLAS GEMMs, plain loops the
// compiler vectorizes). Not for use outside nn: call nn::functional.
// Thread-safety: stateless; scratch space is per thread.
#pragma once

#include <memory>

#include "meshtrain/nn/functional.h"

namespace meshtrain::nn::internal {

std::unique_ptr<functional::Backend> make_cpu_backend();

}  // namespace meshtrain::nn::internal
