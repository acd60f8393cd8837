// Communicator: collectives and point-to-point messages among `size()` ranks
// over flat buffers (pointer, element count, DType), in the style of NCCL and
// Gloo: no templates, one interface, one implementation per engine folder
// (threads/, mpi/, later gloo/ and nccl/).
//
//   void step(meshtrain::comm::Communicator& comm) {
//     std::vector<float> g(n, 1.0f);
//     comm.all_reduce(g.data(), g.data(), n, DType::f32, ReduceOp::avg);
//   }
//
// Contracts shared by every engine:
// - Collective calls are made by every rank of the communicator in the same
//   order. Each carries a fingerprint (sequence number, op, dtype, count, root);
//   engines that check fingerprints (capabilities().checks_fingerprints) raise
//   MismatchError on every rank, naming both sides, when ranks disagree.
// - Every blocking wait has a deadline (timeout(), set per communicator). Past
//   it, TimeoutError names the operation, its sequence number and the ranks that
//   did not arrive (when the engine can know them).
// - After any error the communicator is aborted: later calls throw AbortedError.
// - Buffers are either identical (in place) or do not overlap. Counts are
//   elements, not bytes. Buffers must stay valid until the call (or the Work of
//   an async call) completes.
// - The *_async forms start the operation and return a Work; collectives on
//   one communicator complete in issue order (like a NCCL stream). A send or
//   recv completes on its own, once its data moved (MPI_Isend/MPI_Irecv): a
//   receive never waits for an earlier send to be received, so a pipeline
//   that posts its sends early and receives later cannot deadlock on the
//   order. The blocking form equals `*_async(...).wait()`.
// - Reductions are deterministic for a given engine and rank count.
//   bf16/f16 are accumulated in f32 and rounded once. Integer sums wrap modulo
//   2^bits; integer avg is the sum divided by size(), truncated toward zero.
// Thread-safety: a Communicator is used by one thread at a time (its rank's).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/work.h"
#include "meshtrain/core/dtype.h"

namespace meshtrain::comm {

enum class ReduceOp : uint8_t { sum, avg, max, min, prod };
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max,
                                             ReduceOp::min, ReduceOp::prod};
std::string_view reduce_op_name(ReduceOp op);
ReduceOp parse_reduce_op(std::string_view name);  // reduce_op_name's inverse; throws InvalidArgument

enum class Engine : uint8_t { threads, mpi, gloo, nccl };
std::string_view engine_name(Engine e);
Engine parse_engine(std::string_view name);  // throws InvalidArgument

// What an engine can do, reported up front instead of discovered by exceptions.
struct Capabilities {
  Engine engine = Engine::threads;
  bool async = true;                 // *_async overlap with the caller's compute
  bool send_recv = true;             // point-to-point
  bool split = true;                 // sub-communicators
  bool checks_fingerprints = false;  // every collective's fingerprint is compared
  bool names_missing_ranks = false;  // timeouts can name the ranks that did not arrive
  bool device_memory = false;        // buffers may live on a GPU
  // Work::wait may be called from a thread other than the issuing one, while
  // the issuing thread goes on calling the communicator (a watcher thread
  // can time or complete async operations).
  bool wait_from_any_thread = false;
  // Work::wait(stream) returns before the operation completed, ordering a
  // device stream instead (CUDA engines); false: it blocks like wait().
  bool stream_ordered = false;
};

// The operation names used in fingerprints and errors.
enum class CollectiveOp : uint8_t {
  all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, barrier, split, send, recv, all_to_all_v
};
inline constexpr size_t kNumCollectiveOps = 10;

// What a communicator was asked to move, per operation: calls and bytes as
// passed (count x dtype size of this rank's call: an all_gather's send
// block, a reduce_scatter's received block; all_to_all_v: every element this
// rank sends, its own block included). Benchmarks and tests compare it
// with a strategy's formula (tensor parallelism's all-reduces per layer).
struct TrafficCounter {
  uint64_t calls = 0;
  uint64_t bytes = 0;
};
std::string_view collective_op_name(CollectiveOp op);

// What every rank of a collective must agree on.
struct Fingerprint {
  uint64_t seq = 0;  // per-communicator sequence number, from 1
  CollectiveOp op = CollectiveOp::barrier;
  DType dtype = DType::u8;
  ReduceOp reduce = ReduceOp::sum;  // meaningful for all_reduce/reduce_scatter
  size_t count = 0;  // all_to_all_v: 0 (engines send each peer the count it gets)
  int root = -1;  // broadcast root, else -1

  bool operator==(const Fingerprint&) const = default;
  // "all_reduce #12 (f32 x 1000, sum)"
  std::string to_string() const;
};

using Clock = std::chrono::steady_clock;
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(5);

// One operation as the engines see it. Validated by Communicator before it
// reaches an engine.
struct Op {
  CollectiveOp kind = CollectiveOp::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DType dtype = DType::u8;
  ReduceOp reduce = ReduceOp::sum;
  int root = -1;  // broadcast
  int peer = -1;  // send/recv
  int tag = 0;    // send/recv
  uint64_t seq = 0;  // collective sequence number (0 for send/recv)
  // all_to_all_v (count 0): elements to and from each rank, size() each.
  std::vector<size_t> send_counts = {}, recv_counts = {};

  Fingerprint fingerprint() const { return {seq, kind, dtype, reduce, count, root}; }
  size_t bytes() const { return count * dtype_size(dtype); }
};

// One point-to-point operation of a group (batch_isend_irecv), as in
// torch.distributed.P2POp:
//   std::vector<P2POp> ops = {P2POp::isend(out, n, DType::f32, next),
//                             P2POp::irecv(in, n, DType::f32, prev)};
//   comm.batch_isend_irecv(ops).wait();
struct P2POp {
  CollectiveOp kind = CollectiveOp::send;  // send or recv
  const void* send = nullptr;              // kind == send: the data
  void* recv = nullptr;                    // kind == recv: where it lands
  size_t count = 0;
  DType dtype = DType::u8;
  int peer = -1;
  int tag = 0;

  static P2POp isend(const void* buf, size_t count, DType dtype, int peer, int tag = 0) {
    return {.kind = CollectiveOp::send, .send = buf, .count = count, .dtype = dtype, .peer = peer, .tag = tag};
  }
  static P2POp irecv(void* buf, size_t count, DType dtype, int peer, int tag = 0) {
    return {.kind = CollectiveOp::recv, .recv = buf, .count = count, .dtype = dtype, .peer = peer, .tag = tag};
  }
};

// How the caller will complete an operation: a blocking call may run inline
// and return an empty Work; an async one must return without waiting for peers.
enum class Completion : uint8_t { blocking, async };

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Capabilities capabilities() const = 0;

  // Deadline of every blocking wait of this communicator (default 5 minutes).
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // Number of collectives issued so far; the next one gets seq() + 1.
  uint64_t seq() const { return seq_; }
  // This rank's calls and bytes per operation since creation or the last
  // reset_traffic() (grouped send/recv count each part). Not thread-safe
  // against calls in flight from other threads: read it between steps.
  const TrafficCounter& traffic(CollectiveOp op) const { return traffic_[static_cast<size_t>(op)]; }
  void reset_traffic() { traffic_ = {}; }

  // Element-wise reduction of `count` elements over all ranks; every rank's
  // recv holds the result. In place if send == recv.
  [[nodiscard]] Work all_reduce_async(const void* send, void* recv, size_t count, DType dtype,
                                      ReduceOp op);

  // Every rank contributes `count` elements; recv (size() * count elements)
  // holds rank r's contribution at offset r * count. In place if
  // send == recv + rank() * count.
  [[nodiscard]] Work all_gather_async(const void* send, void* recv, size_t count, DType dtype);

  // send holds size() * count elements; the reduction of block r (offset
  // r * count) over all ranks lands in rank r's recv (count elements). In
  // place if recv == send + rank() * count.
  [[nodiscard]] Work reduce_scatter_async(const void* send, void* recv, size_t count, DType dtype,
                                          ReduceOp op);

  // Copies root's buf (count elements) to every rank's buf.
  [[nodiscard]] Work broadcast_async(void* buf, size_t count, DType dtype, int root);

  // send and recv hold size() * count elements. Block p of rank r's send
  // lands in block r of rank p's recv. Not in place: send and recv must not
  // overlap.
  [[nodiscard]] Work all_to_all_async(const void* send, void* recv, size_t count, DType dtype);

  // Uneven all_to_all (MPI_Alltoallv; torch's all_to_all_single with split
  // sizes): send holds send_counts[p] elements for each rank p and recv
  // receives recv_counts[p] elements from each rank p, both packed in rank
  // order. Rank r's send_counts[p] must equal rank p's recv_counts[r]
  // (all_to_all_counts tells a rank what it will receive); engines that
  // check fingerprints raise MismatchError on a pair that disagrees, naming
  // both ranks. Any count may be 0, a rank may send or receive nothing.
  // The counts are copied: only the buffers must outlive the call's Work.
  // Not in place: send and recv must not overlap.
  [[nodiscard]] Work all_to_all_v_async(const void* send, std::span<const size_t> send_counts, void* recv,
                                        std::span<const size_t> recv_counts, DType dtype);

  // Point-to-point. Messages from one rank to another with the same tag are
  // matched in order; count and dtype must agree on both sides; tag >= 0.
  // Not collectives: they take no sequence number.
  [[nodiscard]] Work send_async(const void* buf, size_t count, DType dtype, int peer, int tag);
  [[nodiscard]] Work recv_async(void* buf, size_t count, DType dtype, int peer, int tag);

  // Grouped point-to-point (torch's batch_isend_irecv): starts every op
  // before waiting for any, so ops that depend on each other across ranks
  // cannot deadlock whatever their order (rank r sends to r+1 and receives
  // from r-1; two ranks each send to and receive from the other). Returns
  // one Work that completes when every op has; its wait() waits for all of
  // them and rethrows the first error (the cause rather than an echo). Each
  // op follows send/recv's rules (matching in order per peer and tag, count
  // and dtype agreeing), except that a peer may be this rank: a send to self
  // is matched by a recv from self in the same or a later group. A recv
  // buffer may not overlap any other buffer of the group. Throws
  // InvalidArgument, before starting anything, for an invalid op. An empty
  // group is complete at once.
  [[nodiscard]] Work batch_isend_irecv(const std::vector<P2POp>& ops);

  // Returns once every rank has entered the barrier.
  [[nodiscard]] Work barrier_async();

  // Collective. Ranks with the same color form a new communicator, ordered by
  // (key, old rank). color < 0: the rank joins no group and gets nullptr.
  // The new communicator inherits timeout(). Pending async work is waited
  // for first.
  std::unique_ptr<Communicator> split(int color, int key);

  // Blocking forms: same contracts, complete on return.
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  void all_gather(const void* send, void* recv, size_t count, DType dtype);
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  void broadcast(void* buf, size_t count, DType dtype, int root);
  void all_to_all(const void* send, void* recv, size_t count, DType dtype);
  void all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                    std::span<const size_t> recv_counts, DType dtype);
  void send(const void* buf, size_t count, DType dtype, int peer, int tag);
  void recv(void* buf, size_t count, DType dtype, int peer, int tag);
  void barrier();

 protected:
  // Engines implement these. `op` is validated and numbered.
  virtual Work start(const Op& op, Completion completion) = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key, uint64_t seq) = 0;
  // Starts the validated send/recv `ops` together. The default starts each
  // with start(op, Completion::async) and joins their Works: right for
  // engines whose async send/recv only post (threads: a mailbox entry; mpi:
  // MPI_Isend/MPI_Irecv through the progress engine), since nothing waits
  // until every op is posted. An engine whose posts can block on a peer
  // (NCCL) overrides it to bracket the posts (ncclGroupStart/End).
  virtual Work start_group(const std::vector<Op>& ops);

 private:
  Work issue(Op op, Completion completion);
  void count_traffic(const Op& op);

  std::chrono::milliseconds timeout_ = kDefaultTimeout;
  uint64_t seq_ = 0;
  std::array<TrafficCounter, kNumCollectiveOps> traffic_{};
};

// Collective: every rank's `mine` (any bytes, any length), in rank order:
// the lengths, then the bytes padded to the longest (two all-gathers).
std::vector<std::string> all_gather_bytes(Communicator& c, std::string_view mine);

// Collective: what each rank will send this one, given what this one sends
// each rank (send_counts, size() entries): the recv_counts of an
// all_to_all_v (one all_to_all of 64-bit counts).
std::vector<size_t> all_to_all_counts(Communicator& c, std::span<const size_t> send_counts);

// Collective: buf (count f32 elements, the same count on every rank)
// becomes the sum of the ranks' bufs in the canonical tree over the ranks
// in rank order (core/reduction_tree.h): the same bits on every engine, and,
// when the ranks hold equal power-of-two nodes of a larger tree, that
// tree's continuation (the deterministic mode, docs/determinism.md). One
// all_to_all of count / size() elements per peer (padded), the tree over
// each received chunk, one all_gather: a ring all-reduce's bytes.
void tree_all_reduce(Communicator& c, float* buf, size_t count);
// Collective: recv (count f32 elements) = the canonical tree over the ranks,
// in rank order, of their send's chunk `rank()` (send: size() chunks of
// count, chunk r for rank r); recv may be this rank's own chunk of send. One
// all_to_all: a ring reduce-scatter's bytes.
void tree_reduce_scatter(Communicator& c, const float* send, float* recv, size_t count);
// Collective: the canonical tree's sum of the ranks' `mine`, in rank order
// (one all_gather).
double tree_all_reduce(Communicator& c, double mine);

}  // namespace meshtrain::comm
