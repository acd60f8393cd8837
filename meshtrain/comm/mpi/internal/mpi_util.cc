#include "meshtrain/comm/mpi/internal/mpi_util.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <string>
#include <thread>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::mpi::internal {

void check(int rc, std::string_view call, std::string_view op) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw EngineError(fmt::format("mpi::{}", op),
                    fmt::format("{} failed: {} (MPI error code {})", call,
                                len > 0 ? std::string(text, static_cast<size_t>(len))
                                        : std::string("unknown error"),
                                rc),
                    "MPI reported the failure; check that every rank passes the same count, dtype "
                    "and peer, and the MPI installation (mpirun --version, ompi_info)");
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::bf16: return MPI_UINT16_T;
    case DType::f16: return MPI_UINT16_T;
    case DType::i8: return MPI_INT8_T;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

void Backoff::pause() {
  const auto waited = std::chrono::steady_clock::now() - start_;
  if (waited < kSpinFor) return;  // the caller polls again at once
  if (waited < kYieldFor) {
    sched_yield();
    return;
  }
  std::this_thread::sleep_for(sleep_);
  sleep_ = std::min<std::chrono::nanoseconds>(sleep_ * 2, std::chrono::microseconds(50));
}

}  // namespace meshtrain::comm::mpi::internal
