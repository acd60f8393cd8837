#include "meshtrain/comm/mpi/internal/ring_reduce_scatter.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "meshtrain/comm/mpi/internal/reduce.h"

namespace meshtrain::comm::mpi::internal {
namespace {

constexpr int kTag = 0;
constexpr std::string_view kOpName = "reduce_scatter";

}  // namespace

RingReduceScatter::RingReduceScatter(MPI_Comm comm, int rank, int size, const Op& op)
    : comm_(comm),
      rank_(rank),
      size_(size),
      op_(op),
      dsize_(dtype_size(op.dtype)),
      wsize_(wide_size(op.dtype)),
      chunk_elems_(std::max<size_t>(1, kChunkBytes / wsize_)),
      nchunks_((op.count + chunk_elems_ - 1) / chunk_elems_) {
  std::fill(std::begin(recvs_), std::end(recvs_), MPI_REQUEST_NULL);
  if (op_.count == 0) {
    done_ = true;
    return;
  }
  if (size_ == 1) {
    // One rank: the reduction of one contribution is itself (avg divides by 1).
    if (op_.recv != op_.send) std::memcpy(op_.recv, op_.send, op_.count * dsize_);
    done_ = true;
    return;
  }
  slots_.resize(static_cast<size_t>(kSlots) * chunk_elems_ * wsize_);
  for (int i = 0; i < std::min(size_ - 2, 2); ++i) partial_[i].resize(op_.count * wsize_);
}

size_t RingReduceScatter::chunk_elems(size_t chunk) const {
  return std::min(chunk_elems_, op_.count - chunk * chunk_elems_);
}

void RingReduceScatter::post_recv(size_t chunk) {
  const int prev = (rank_ + size_ - 1) % size_;
  const size_t bytes = chunk_elems(chunk) * (step_ == 0 ? dsize_ : wsize_);
  std::byte* slot = slots_.data() + (chunk % kSlots) * chunk_elems_ * wsize_;
  check(MPI_Irecv(slot, static_cast<int>(bytes), MPI_BYTE, prev, kTag, comm_,
                  &recvs_[chunk % kSlots]),
        "MPI_Irecv", kOpName);
}

void RingReduceScatter::start_step() {
  const int next = (rank_ + 1) % size_;
  const size_t send_block = static_cast<size_t>((rank_ - step_ - 1 + 2 * size_) % size_);
  sends_.assign(nchunks_, MPI_REQUEST_NULL);
  for (size_t c = 0; c < nchunks_; ++c) {
    const std::byte* src;
    size_t bytes;
    if (step_ == 0) {  // our own contribution, in the dtype's encoding
      src = static_cast<const std::byte*>(op_.send) + (send_block * op_.count + c * chunk_elems_) * dsize_;
      bytes = chunk_elems(c) * dsize_;
    } else {  // the partial sum we completed in the previous step
      src = partial_[(step_ - 1) % 2].data() + c * chunk_elems_ * wsize_;
      bytes = chunk_elems(c) * wsize_;
    }
    check(MPI_Isend(src, static_cast<int>(bytes), MPI_BYTE, next, kTag, comm_, &sends_[c]),
          "MPI_Isend", kOpName);
  }
  next_post_ = 0;
  next_reduce_ = 0;
  while (next_post_ < nchunks_ && next_post_ < static_cast<size_t>(kSlots)) post_recv(next_post_++);
  step_started_ = true;
}

bool RingReduceScatter::progress() {
  while (!done_) {
    if (!step_started_) start_step();
    bool advanced = false;
    const bool last = step_ == size_ - 2;
    const size_t own_block = static_cast<size_t>((rank_ - step_ - 2 + 2 * size_) % size_);
    while (next_reduce_ < nchunks_) {
      const size_t c = next_reduce_;
      int flag = 0;
      check(MPI_Test(&recvs_[c % kSlots], &flag, MPI_STATUS_IGNORE), "MPI_Test", kOpName);
      if (!flag) break;
      const std::byte* in = slots_.data() + (c % kSlots) * chunk_elems_ * wsize_;
      const std::byte* own =
          static_cast<const std::byte*>(op_.send) + (own_block * op_.count + c * chunk_elems_) * dsize_;
      void* out = last ? static_cast<void*>(static_cast<std::byte*>(op_.recv) + c * chunk_elems_ * dsize_)
                       : static_cast<void*>(partial_[step_ % 2].data() + c * chunk_elems_ * wsize_);
      combine(op_.dtype, op_.reduce, in, /*a_wide=*/step_ > 0, own, out, /*out_wide=*/!last,
              chunk_elems(c), last ? size_ : 0);
      ++next_reduce_;
      advanced = true;
      if (next_post_ < nchunks_) post_recv(next_post_++);
    }
    if (next_reduce_ < nchunks_) return false;
    int flag = 0;
    check(MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &flag, MPI_STATUSES_IGNORE),
          "MPI_Testall", kOpName);
    if (!flag) {
      if (!advanced) return false;
      continue;
    }
    // Every chunk of this step was reduced and sent: the next step may
    // overwrite the partial buffer these sends read from.
    step_started_ = false;
    if (++step_ == size_ - 1) done_ = true;
  }
  return true;
}

std::string RingReduceScatter::describe() const {
  if (next_reduce_ < nchunks_)
    return fmt::format("ring step {} of {}: chunk {} of {} from rank {} has not arrived", step_ + 1,
                       size_ - 1, next_reduce_ + 1, nchunks_, waiting_on());
  return fmt::format("ring step {} of {}: rank {} has not taken the chunks sent to it", step_ + 1,
                     size_ - 1, waiting_on());
}

int RingReduceScatter::waiting_on() const {
  if (next_reduce_ < nchunks_) return (rank_ + size_ - 1) % size_;
  return (rank_ + 1) % size_;
}

void RingReduceScatter::abandon(const std::shared_ptr<const void>& keep_alive,
                                std::vector<Orphan>& orphans) {
  // Return codes are ignored here: the communicator is already failing with
  // the error that caused this, and a failed cancel leaves the request to the
  // orphan list, which only tests it.
  for (MPI_Request& r : recvs_) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    int flag = 0;
    MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    if (!flag) orphans.push_back({r, keep_alive});
    r = MPI_REQUEST_NULL;
  }
  for (MPI_Request& r : sends_) {
    if (r != MPI_REQUEST_NULL) orphans.push_back({r, keep_alive});
    r = MPI_REQUEST_NULL;
  }
  done_ = true;
}

}  // namespace meshtrain::comm::mpi::internal
