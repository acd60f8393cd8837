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
// done -> finished: collectives finish in issue order, a send or recv when
//   done (the Communicator contract);
//   Work::test()/wait() report `finished`.
//
// Progress happens inside start(), Work::test() and Work::wait(), and on the
// runtime's progress thread (internal/runtime.h), which calls poll(). Any
// failure aborts the channel: every unfinished task fails, peers get an
// abort notice (tag kAbortTag on `check_`), Options::on_error runs, and
// later calls throw AbortedError.
//
// Timeouts: past the deadline, wait() first asks the peer processes where
// they are (Runtime::probe, at most probe_grace(timeout)), then fails the
// oldest unfinished task with an error that names the ranks that did not
// arrive or do not answer.

#pragma once

#include <mpi.h>

#include <algorithm>
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
#include "meshtrain/comm/internal/fingerprint.h"
#include "meshtrain/comm/mpi/internal/mpi_util.h"
#include "meshtrain/comm/mpi/internal/ring_reduce_scatter.h"
#include "meshtrain/comm/mpi/internal/runtime.h"

namespace meshtrain::comm::mpi::internal {

using comm::internal::decode_notice;
using comm::internal::encode_notice;
using comm::internal::canonical;
using comm::internal::check_from;
using comm::internal::FingerprintTable;
using comm::internal::fingerprint_to;
using comm::internal::format_ranks;
using comm::internal::mismatch_error;
using comm::internal::Notice;
using comm::internal::WireFingerprint;

enum class Stage : uint8_t { fingerprints, ready, data, done };

// "mpi::all_reduce": the operation named in errors.
inline std::string op_name(const Op& op) { return "mpi::" + std::string(collective_op_name(op.kind)); }
inline bool is_p2p(CollectiveOp k) { return k == CollectiveOp::send || k == CollectiveOp::recv; }

// How long a timed-out wait waits for its peers' answers: a quarter of the
// timeout, within [20 ms, 1 s], so the error comes within 1.25x the deadline.
using comm::internal::probe_grace;
using comm::internal::ProbeFindings;
using comm::internal::read_probe;

// all_reduce on 2 ranks of at most kDirectTwoRankBytes, or of at most
// kSmallAllReduceBytes per rank on up to kSmallAllReduceRanks ranks, is a
// direct exchange: every rank sends its input to every peer (MPI_Isend on a
// private communicator, posted by start() at once, so it overlaps the
// fingerprint exchange) and reduces the n inputs itself, in rank order.
// One message latency instead of the rounds of MPI's non-blocking
// collective schedule (each of which needs a progress call: an async
// all_reduce of 1.6 MB took 7x its blocking time), the same bytes as a ring
// on 2 ranks, and bit-identical to the threads engine (16-bit types rounded
// once). Costs a receive buffer of (n-1) inputs, kept for reuse.
inline constexpr size_t kSmallAllReduceBytes = size_t{64} << 10;
inline constexpr int kSmallAllReduceRanks = 8;
// Beyond this, each rank reducing the whole buffer costs more than MPI's
// reduce-scatter + all-gather (16 MiB: 13 ms vs 7 ms, docs/benchmarks.md).
inline constexpr size_t kDirectTwoRankBytes = size_t{8} << 20;

// The id of the communicator split(color) makes from channel `parent` at
// collective `seq`: the same on every member, distinct from its siblings'.
uint64_t split_id(uint64_t parent, uint64_t seq, int color);

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

  // Data: one MPI request, a direct-exchange all_reduce, or a ring.
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<MPI_Request> direct;   // receives (one per peer), then sends
  std::unique_ptr<std::byte[]> inputs;  // peer (rank + 1 + i) % n's input at i * op.bytes()
  size_t inputs_capacity = 0;
  std::vector<std::byte> temp;  // native in-place reduce_scatter lands here first
  std::vector<int> v_counts;    // all_to_all_v: send counts, send offsets, recv counts, recv offsets
  std::unique_ptr<internal::RingReduceScatter> ring;
};

// The state of one communicator, shared with its Works (which may outlive it).
class Channel {
 public:
  // Takes ownership of comm. `id` names the channel in liveness probes: the
  // same on every member (see Runtime::next_world_id and split_id).
  Channel(MPI_Comm comm, Options options, uint64_t id);
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
  // Whether all_reduce `op` is a direct exchange (see kSmallAllReduceBytes).
  bool use_direct(const Op& op) const {
    return op.kind == CollectiveOp::all_reduce && op.count > 0 && op.count <= static_cast<size_t>(INT_MAX) &&
           ((size_ == 2 && op.bytes() <= kDirectTwoRankBytes) ||
            (size_ > 2 && size_ <= kSmallAllReduceRanks && op.bytes() <= kSmallAllReduceBytes));
  }
  uint64_t id() const { return id_; }
  // Whether timeouts can ask the peers where they are (a progress thread runs).
  bool probes_peers() const {
    const Runtime* rt = Runtime::get();
    return rt && rt->has_thread();
  }

  // For the progress thread: advances what it can if no other thread holds
  // the channel; returns whether operations are in flight that nobody is
  // waiting for (a waiting thread progresses them itself).
  bool poll();
  // What this process answers to a peer's probe.
  ChannelStatus status();

  // Queues `op` and posts what it can without waiting for peers; `async`:
  // the caller will not wait at once, so the progress thread takes over.
  // Throws AbortedError if the channel was aborted, Unsupported for counts
  // MPI cannot take.
  std::shared_ptr<Task> start(const Op& op, std::chrono::milliseconds timeout, bool async);
  // Waits until `task` finished (at most `timeout` from now); rethrows its error.
  void wait(Task& task, std::chrono::milliseconds timeout);
  bool test(Task& task);
  // Aborts after a failure outside any task (e.g. MPI_Comm_split), then throws it.
  [[noreturn]] void fail_and_throw(std::exception_ptr error);

 private:
  void post_fingerprints(Task& t);
  void post_data(Task& t);
  void post_direct(Task& t);
  void finish_direct(Task& t);
  void progress_locked();
  bool advance(Task& t, bool gate);
  bool poll_fingerprints(Task& t);
  void poll_data(Task& t);
  void finish_data(Task& t);
  std::vector<PeerStatus> probe_peers(std::chrono::milliseconds timeout);
  std::exception_ptr timeout_error(Task& t, std::chrono::milliseconds timeout,
                                   const std::vector<PeerStatus>& peers);
  // Throws the MismatchError for `t`, given the peers whose fingerprints
  // arrived, and keeps the table for the abort notice.
  [[noreturn]] void throw_mismatch(const Task& t, const std::vector<int>& arrived);
  bool receive_notice();
  void fail(Task* culprit, std::exception_ptr error, bool notify_peers, int origin);
  // Hands the error to Options::on_error (if set).
  void report(const std::exception_ptr& error);
  void abandon(const std::shared_ptr<Task>& t);
  void test_orphans();
  MPI_Op mpi_op(DType dtype, ReduceOp op) const;
  // Tags of collective `seq` (fingerprints, direct-exchange all_reduce inputs),
  // offset by the channel id: OpenMPI reuses a freed communicator's context
  // id, and a message of an aborted collective that arrives after its
  // communicator was freed is delivered to the next one with that id; the
  // offset keeps it from matching that communicator's receives.
  int fingerprint_tag(uint64_t seq) const {
    const uint64_t span = static_cast<uint64_t>(tag_ub_ - 1);
    return 1 + static_cast<int>((seq - 1 + id_ * 0x9E3779B97F4A7C15ULL % span) % span);
  }

  std::mutex mu_;
  MPI_Comm comm_ = MPI_COMM_NULL;   // data: collectives and user send/recv
  MPI_Comm check_ = MPI_COMM_NULL;  // fingerprints and abort notices
  MPI_Comm ring_ = MPI_COMM_NULL;   // ring reduce-scatter messages
  MPI_Comm direct_ = MPI_COMM_NULL;  // direct-exchange all_reduce inputs
  // Receive buffers of finished direct-exchange all_reduces, for reuse:
  // (capacity in bytes, buffer).
  std::vector<std::pair<size_t, std::unique_ptr<std::byte[]>>> direct_pool_;
  int rank_ = 0, size_ = 1, tag_ub_ = 32767;
  uint64_t id_ = 0;
  std::vector<int> world_ranks_;  // MPI_COMM_WORLD rank of each member
  Options options_;
  // Reported to probing peers.
  uint64_t issued_ = 0, finished_ = 0;  // last collective seq started / finished
  uint8_t last_op_ = 0;
  int waiting_ = 0;                     // threads inside wait()
  Clock::time_point next_notice_check_{};
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
