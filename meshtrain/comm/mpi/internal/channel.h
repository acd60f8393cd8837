// The MPI engine's progress engine: one Channel per communicator, shared
// with the Works it hands out (which may outlive the communicator).
// Internal: includes mpi.h; never include it from a public header.
//
// How an operation moves through the engine (all under Channel::mu_):
//
//   start()  -> [fingerprints] -> ready -> [data] -> done -> finished
//
// fingerprints: with checks on, collectives first exchange Fingerprints with
//   every peer on the private `check_` communicator; the task becomes ready
//   once all arrived and agree (mismatch: MismatchError).
// ready -> data: the MPI call is posted only when every earlier task has
//   posted its own (a ring only once it is complete), so all ranks post the
//   collectives of `comm_` in issue order, and no rank posts one its peers
//   disagree on. send/recv skip both stages and are posted in start().
// done -> finished: tasks finish in issue order (the Communicator contract);
//   Work::test()/wait() report `finished`.
//
// Progress happens inside start(), Work::test() and Work::wait(): OpenMPI has
// no progress thread. Any failure aborts the channel: every unfinished task
// fails, peers get an abort notice (tag kAbortTag on `check_`), and later
// calls throw AbortedError.

#pragma once

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/mpi/communicator.h"
#include "meshtrain/comm/mpi/internal/fingerprint.h"
#include "meshtrain/comm/mpi/internal/mpi_util.h"
#include "meshtrain/comm/mpi/internal/ring_reduce_scatter.h"

namespace meshtrain::comm::mpi::internal {

enum class Stage : uint8_t { fingerprints, ready, data, done };

// One operation in flight.
struct Task {
  Op op;
  Stage stage = Stage::ready;
  bool finished = false;  // done, and every earlier task too (or failed)
  std::exception_ptr error;

  // Fingerprint exchange: one receive and one send per peer. `mine` is shared
  // so an unfinished send can keep it alive without keeping the whole task.
  std::shared_ptr<WireFingerprint> mine;
  std::vector<WireFingerprint> theirs;
  std::vector<int> peers;
  std::vector<MPI_Request> fp_recv, fp_send;

  // Data: one MPI request, or a ring.
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<std::byte> temp;  // native in-place reduce_scatter lands here first
  std::unique_ptr<internal::RingReduceScatter> ring;
};

// The state of one communicator, shared with its Works (which may outlive it).
class Channel {
 public:
  Channel(MPI_Comm comm, Options options);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Options& options() const { return options_; }
  // Whether reduce_scatter `op` runs on the ring (see ReduceScatterAlgorithm).
  bool use_ring(const Op& op) const {
    switch (options_.reduce_scatter) {
      case ReduceScatterAlgorithm::native: return false;
      case ReduceScatterAlgorithm::ring: return true;
      case ReduceScatterAlgorithm::automatic:
        return op.count > static_cast<size_t>(INT_MAX) || op.bytes() * size_ >= kRingMinBytes;
    }
    return true;
  }
  MPI_Comm comm() const { return comm_; }

  // Queues `op` and posts what it can without waiting for peers. Throws
  // AbortedError if the channel was aborted, Unsupported for counts MPI
  // cannot take.
  std::shared_ptr<Task> start(const Op& op, std::chrono::milliseconds timeout);
  // Waits until `task` finished (at most `timeout` from now); rethrows its error.
  void wait(Task& task, std::chrono::milliseconds timeout);
  bool test(Task& task);
  // Aborts after a failure outside any task (e.g. MPI_Comm_split), then throws it.
  [[noreturn]] void fail_and_throw(std::exception_ptr error);

 private:
  void post_fingerprints(Task& t);
  void post_data(Task& t);
  void progress_locked();
  bool advance(Task& t, bool gate);
  bool poll_fingerprints(Task& t);
  void poll_data(Task& t);
  void finish_data(Task& t);
  std::exception_ptr timeout_error(Task& t, std::chrono::milliseconds timeout);
  // Throws the MismatchError for `t`, given the peers whose fingerprints
  // arrived, and keeps the table for the abort notice.
  [[noreturn]] void throw_mismatch(const Task& t, const std::vector<int>& arrived);
  bool receive_notice();
  void fail(Task* culprit, std::exception_ptr error, bool notify_peers, int origin);
  void abandon(const std::shared_ptr<Task>& t);
  void test_orphans();
  MPI_Op mpi_op(DType dtype, ReduceOp op) const;
  int fingerprint_tag(uint64_t seq) const {
    return 1 + static_cast<int>((seq - 1) % static_cast<uint64_t>(tag_ub_ - 1));
  }

  std::mutex mu_;
  MPI_Comm comm_ = MPI_COMM_NULL;   // data: collectives and user send/recv
  MPI_Comm check_ = MPI_COMM_NULL;  // fingerprints and abort notices
  MPI_Comm ring_ = MPI_COMM_NULL;   // ring reduce-scatter messages
  int rank_ = 0, size_ = 1, tag_ub_ = 32767;
  Options options_;
  MPI_Op ops16_[2][4] = {};  // [bf16, f16][sum, max, min, prod]
  std::deque<std::shared_ptr<Task>> queue_;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<int> abort_ranks_;
  uint64_t mismatch_seq_ = 0;           // set with mismatch_table_ by throw_mismatch
  FingerprintTable mismatch_table_;
  std::vector<Orphan> orphans_;
  std::chrono::milliseconds drain_timeout_ = kDefaultTimeout;
};

}  // namespace meshtrain::comm::mpi::internal
