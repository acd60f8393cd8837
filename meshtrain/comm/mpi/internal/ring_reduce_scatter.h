// A ring reduce-scatter over MPI point-to-point messages, driven by progress()
// calls (no thread of its own). Internal to the MPI engine.
//
// n ranks, block b = elements [b * count, (b + 1) * count) of send. In step
// s = 0 .. n-2, rank r sends its partial sum of block (r - s - 1) mod n to
// rank r + 1 and receives the partial sum of block (r - s - 2) mod n from
// rank r - 1, to which it adds its own contribution. After n - 1 steps rank r
// holds block r reduced in the fixed order r+1, r+2, ..., r (mod n): each rank
// sends and receives (n-1)/n of the buffer once. Messages are chunks of at
// most 1 MiB; up to 4 receives are posted ahead and each chunk is reduced as
// soon as it arrives. bf16/f16 partials travel as f32 after step 0 and are
// rounded once, at the last step (into recv). avg divides at the last step.
//
// Buffers: send (n * count elements) is only read; recv (count elements) is
// written only at the last step, so recv == send + rank * count (in place)
// works. Scratch: min(n - 2, 2) blocks of partials (f32-sized for 16-bit
// types) plus 4 chunks.
// Thread-safety: one thread at a time. Messages use tag 0 of `comm`: run one
// ring at a time per communicator.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/mpi/internal/mpi_util.h"

namespace meshtrain::comm::mpi::internal {

class RingReduceScatter {
 public:
  static constexpr size_t kChunkBytes = size_t{1} << 20;
  static constexpr int kSlots = 4;

  // `op` is a validated reduce_scatter; comm has n ranks and MPI_ERRORS_RETURN.
  RingReduceScatter(MPI_Comm comm, int rank, int size, const Op& op);
  RingReduceScatter(const RingReduceScatter&) = delete;
  RingReduceScatter& operator=(const RingReduceScatter&) = delete;

  // Advances as far as possible without blocking; true once recv holds the
  // result. Throws EngineError on an MPI failure.
  bool progress();

  // For a timeout message: what the ring waits for, and the rank it waits on.
  std::string describe() const;
  int waiting_on() const;

  // After an abort: cancels pending receives; appends the requests MPI still
  // owns (with keep_alive, which must own this object) to `orphans`.
  void abandon(const std::shared_ptr<const void>& keep_alive, std::vector<Orphan>& orphans);

 private:
  void start_step();
  void post_recv(size_t chunk);
  size_t chunk_elems(size_t chunk) const;

  MPI_Comm comm_;
  int rank_, size_;
  Op op_;
  size_t dsize_, wsize_;   // bytes per element: dtype, wide (partials)
  size_t chunk_elems_;     // elements per full chunk
  size_t nchunks_;         // chunks per block
  int step_ = 0;           // 0 .. size_-2
  bool step_started_ = false;
  bool done_ = false;
  size_t next_post_ = 0;    // next chunk to receive into a slot
  size_t next_reduce_ = 0;  // next chunk to reduce (in order)
  std::vector<MPI_Request> sends_;             // this step's sends, one per chunk
  MPI_Request recvs_[kSlots];                  // slot i receives chunk c with c % kSlots == i
  std::vector<std::byte> slots_;               // kSlots * chunk bytes
  std::vector<std::byte> partial_[2];          // partial sums of steps with even/odd s
};

}  // namespace meshtrain::comm::mpi::internal
