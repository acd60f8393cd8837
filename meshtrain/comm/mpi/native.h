// OpenMPI's own blocking collectives, called directly: the peer that
// `meshtrain bench collectives --engine mpi` measures beside the engine in
// the same run. No deadline, no fingerprints, no progress thread involvement:
// exactly what a program calling MPI itself gets.
//
//   meshtrain::comm::mpi::NativeCollectives native;   // collective: dups MPI_COMM_WORLD
//   native.run(CollectiveOp::all_reduce, send, recv, count, DType::f32);
//
// Layouts as in comm/communicator.h (all_reduce sums; reduce_scatter is
// MPI_Reduce_scatter_block, sum; broadcast from rank 0). Blocks until done,
// and may hang if a peer never calls: for benchmarks only.
// Thread-safety: one thread at a time.
#pragma once

#include <cstddef>
#include <memory>

#include "meshtrain/comm/communicator.h"

namespace meshtrain::comm::mpi {

class NativeCollectives {
 public:
  NativeCollectives();  // initializes MPI if needed; collective over MPI_COMM_WORLD
  ~NativeCollectives();
  NativeCollectives(const NativeCollectives&) = delete;
  NativeCollectives& operator=(const NativeCollectives&) = delete;

  int rank() const;
  int size() const;
  // Throws Unsupported for send/recv/barrier/split and counts above INT_MAX.
  void run(CollectiveOp op, const void* send, void* recv, size_t count, DType dtype);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshtrain::comm::mpi
