// Small helpers shared by the MPI engine's sources. Internal: this header
// includes mpi.h and must never be included from a public header.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <string_view>

#include "meshtrain/core/dtype.h"

namespace meshtrain::comm::mpi::internal {

// Throws EngineError("mpi::<op>", "<call> failed: <MPI error string>") unless
// rc is MPI_SUCCESS. The engine's communicators use MPI_ERRORS_RETURN, so
// every MPI failure arrives here instead of killing the process.
void check(int rc, std::string_view call, std::string_view op);

// The MPI type that carries one element: bf16 and f16 travel as MPI_UINT16_T.
MPI_Datatype mpi_type(DType dtype);

// A request MPI still owns (it cannot be cancelled, or has not finished
// cancelling) and what keeps its buffers alive until it completes.
// `user_buffers`: it reads or writes the caller's buffers (not just the
// engine's own small messages), so it is worth waiting for.
struct Orphan {
  MPI_Request request = MPI_REQUEST_NULL;
  std::shared_ptr<const void> keep_alive;
  bool user_buffers = true;
};

// Polls politely: returns at once for the first 10 us of a wait (a small
// collective's reply comes within a few microseconds, and one system call
// costs as much), then sched_yield() up to 2 ms (a rendezvous transfer
// needs several progress calls on both sides; yielding gives the core to any
// runnable thread, and sleeping would add the timer slack to each step),
// then sleeps that double from 1 us up to 50 us, so a rank that waits long
// leaves the core to the ranks it waits for.
class Backoff {
 public:
  void pause();

 private:
  static constexpr std::chrono::microseconds kSpinFor{10};
  static constexpr std::chrono::microseconds kYieldFor{2000};
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::nanoseconds sleep_{1000};
};

}  // namespace meshtrain::comm::mpi::internal
