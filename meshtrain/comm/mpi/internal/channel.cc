#include "meshtrain/comm/mpi/internal/channel.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "meshtrain/comm/internal/reduce.h"
#include "meshtrain/comm/mpi/internal/reduce.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::mpi::internal {

namespace {

constexpr int kAbortTag = 0;  // on check_: abort notices; fingerprints use tags >= 1
constexpr std::chrono::milliseconds kNoticeCheckInterval{1};
constexpr size_t kSmallPieceBytes = 4000;        // payload of one eager message
constexpr size_t kSmallPiecesUpTo = size_t{16} << 10;

template <DType D, ReduceOp R>
void op16(void* in, void* inout, int* len, MPI_Datatype*) {
  internal::reduce_16bit(D, R, in, inout, static_cast<size_t>(*len));
}

std::vector<int> ranks_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const CommError& ex) {
    return ex.ranks();
  } catch (...) {
    return {};
  }
}

}  // namespace

uint64_t split_id(uint64_t parent, uint64_t seq, int color) {
  // splitmix64 over the three values: equal inputs give equal ids everywhere.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  return mix(mix(mix(parent) ^ seq) ^ static_cast<uint64_t>(static_cast<uint32_t>(color)));
}

Channel::Channel(MPI_Comm comm, Options options, uint64_t id)
    : comm_(comm), id_(id), options_(std::move(options)) {
  const char* what = "create";
  try {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", what);
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank", what);
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size", what);
    check(MPI_Comm_dup(comm_, &check_), "MPI_Comm_dup", what);
    check(MPI_Comm_dup(comm_, &ring_), "MPI_Comm_dup", what);
    check(MPI_Comm_dup(comm_, &direct_), "MPI_Comm_dup", what);
    void* attr = nullptr;
    int flag = 0;
    check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &attr, &flag), "MPI_Comm_get_attr", what);
    if (flag && attr) tag_ub_ = *static_cast<int*>(attr);
    MPI_User_function* fns[2][4] = {
        {op16<DType::bf16, ReduceOp::sum>, op16<DType::bf16, ReduceOp::max>,
         op16<DType::bf16, ReduceOp::min>, op16<DType::bf16, ReduceOp::prod>},
        {op16<DType::f16, ReduceOp::sum>, op16<DType::f16, ReduceOp::max>,
         op16<DType::f16, ReduceOp::min>, op16<DType::f16, ReduceOp::prod>}};
    for (int t = 0; t < 2; ++t)
      for (int o = 0; o < 4; ++o)
        check(MPI_Op_create(fns[t][o], /*commute=*/1, &ops16_[t][o]), "MPI_Op_create", what);
    MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    check(MPI_Comm_group(comm_, &group), "MPI_Comm_group", what);
    check(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group", what);
    std::vector<int> local(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) local[static_cast<size_t>(r)] = r;
    world_ranks_.resize(local.size());
    const int rc = MPI_Group_translate_ranks(group, size_, local.data(), world, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    check(rc, "MPI_Group_translate_ranks", what);
  } catch (...) {
    for (auto& row : ops16_)
      for (MPI_Op& op : row)
        if (op != MPI_OP_NULL && op != MPI_Op{}) MPI_Op_free(&op);
    if (direct_ != MPI_COMM_NULL) MPI_Comm_free(&direct_);
    if (ring_ != MPI_COMM_NULL) MPI_Comm_free(&ring_);
    if (check_ != MPI_COMM_NULL) MPI_Comm_free(&check_);
    MPI_Comm_free(&comm_);
    throw;
  }
  if (Runtime* rt = Runtime::get()) rt->attach(this);
}

Channel::~Channel() {
  if (Runtime* rt = Runtime::get()) rt->detach(this);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // MPI already released everything; nothing is safe to call
  for (auto& t : queue_) abandon(t);
  queue_.clear();
  // Requests MPI cannot cancel (collectives a late peer may still join, sends
  // in flight): those on the caller's buffers get the last timeout to finish,
  // the engine's own small sends (fingerprints, abort notices: they complete
  // only once the peer's MPI takes them) a short grace. What is left stays
  // with MPI, its buffers deliberately leaked: freeing them would let MPI
  // write into freed memory.
  const auto start = Clock::now();
  const auto grace = std::min<std::chrono::milliseconds>(drain_timeout_, std::chrono::milliseconds(50));
  Backoff backoff;
  for (;;) {
    test_orphans();
    const bool user = std::any_of(orphans_.begin(), orphans_.end(),
                                  [](const Orphan& o) { return o.user_buffers; });
    const auto waited = Clock::now() - start;
    if (orphans_.empty() || waited >= drain_timeout_ || (!user && waited >= grace)) break;
    backoff.pause();
  }
  if (!orphans_.empty()) {
    for (Orphan& o : orphans_)
      if (!o.user_buffers) MPI_Request_free(&o.request);  // sends: MPI finishes them on its own
    auto leaked = std::make_unique<std::vector<Orphan>>(std::move(orphans_));
    (void)leaked.release();
  }
  // Return codes ignored: a destructor cannot report them, and MPI_Comm_free
  // and MPI_Op_free only mark the objects for release once pending work ends.
  for (auto& row : ops16_)
    for (MPI_Op& op : row) MPI_Op_free(&op);
  MPI_Comm_free(&direct_);
  MPI_Comm_free(&ring_);
  MPI_Comm_free(&check_);
  MPI_Comm_free(&comm_);
}

MPI_Op Channel::mpi_op(DType dtype, ReduceOp op) const {
  if (dtype == DType::bf16 || dtype == DType::f16) {
    const int t = dtype == DType::bf16 ? 0 : 1;
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: return ops16_[t][0];
      case ReduceOp::max: return ops16_[t][1];
      case ReduceOp::min: return ops16_[t][2];
      case ReduceOp::prod: return ops16_[t][3];
    }
  }
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::prod: return MPI_PROD;
  }
  return MPI_SUM;
}

std::shared_ptr<Task> Channel::start(const Op& op, std::chrono::milliseconds timeout, bool async) {
  std::lock_guard lock(mu_);
  drain_timeout_ = timeout;
  if (aborted_)
    throw AbortedError(op_name(op), "the communicator was aborted earlier: " + abort_reason_,
                       "an earlier error (on this rank or the one named) ended this communicator; "
                       "create a new one to continue",
                       abort_ranks_);
  const bool ring = op.kind == CollectiveOp::reduce_scatter && use_ring(op);
  if (op.count > static_cast<size_t>(INT_MAX) && !ring)
    throw Unsupported(op_name(op),
                      fmt::format("count {} exceeds the largest MPI count ({})", op.count, INT_MAX),
                      "split the buffer into calls of at most 2^31-1 elements");
  if (is_p2p(op.kind) && op.tag > tag_ub_)
    throw Unsupported(op_name(op), fmt::format("tag {} exceeds MPI_TAG_UB ({})", op.tag, tag_ub_),
                      fmt::format("use tags in [0, {}]", tag_ub_));

  auto task = std::make_shared<Task>();
  task->op = op;
  queue_.push_back(task);
  if (!is_p2p(op.kind)) {
    issued_ = op.seq;
    last_op_ = static_cast<uint8_t>(op.kind);
  }
  try {
    if (is_p2p(op.kind)) {
      post_data(*task);  // not collective: nothing to order or compare
    } else if (use_direct(op)) {
      post_direct(*task);  // its own tags on its own communicator: no order to keep
      if (options_.check_fingerprints) {
        task->stage = Stage::fingerprints;
        post_fingerprints(*task);
      }
    } else if (options_.check_fingerprints && size_ > 1) {
      task->stage = Stage::fingerprints;
      post_fingerprints(*task);
    }
  } catch (...) {
    fail(task.get(), std::current_exception(), /*notify_peers=*/true, rank_);
    return task;
  }
  progress_locked();
  if (async && !task->finished)
    if (Runtime* rt = Runtime::get()) rt->wake();
  return task;
}

void Channel::post_fingerprints(Task& t) {
  const std::string_view name = collective_op_name(t.op.kind);
  const int tag = fingerprint_tag(t.op.seq);
  const size_t peers = static_cast<size_t>(size_ - 1);
  // mine[0] is this rank's fingerprint; an all_to_all_v sends peer i its own
  // (mine[1 + i], carrying the count it gets).
  const bool per_peer = t.op.kind == CollectiveOp::all_to_all_v;
  auto wires = std::make_shared<std::vector<WireFingerprint>>(per_peer ? 1 + peers : 1);
  (*wires)[0] = WireFingerprint::from(t.op.fingerprint());
  t.mine = std::shared_ptr<WireFingerprint>(wires, wires->data());
  t.theirs.resize(peers);
  t.peers.resize(peers);
  t.fp_recv.assign(peers, MPI_REQUEST_NULL);
  t.fp_send.assign(peers, MPI_REQUEST_NULL);
  for (size_t i = 0; i < peers; ++i) {
    const int p = (rank_ + 1 + static_cast<int>(i)) % size_;
    t.peers[i] = p;
    if (per_peer) (*wires)[1 + i] = WireFingerprint::from(fingerprint_to(t.op, p));
    check(MPI_Irecv(&t.theirs[i], sizeof(WireFingerprint), MPI_BYTE, p, tag, check_, &t.fp_recv[i]),
          "MPI_Irecv", name);
  }
  for (size_t i = 0; i < peers; ++i)
    check(MPI_Isend(t.mine.get() + (per_peer ? 1 + i : 0), sizeof(WireFingerprint), MPI_BYTE, t.peers[i], tag,
                    check_, &t.fp_send[i]),
          "MPI_Isend", name);
}

void Channel::post_data(Task& t) {
  const Op& op = t.op;
  const std::string_view name = collective_op_name(op.kind);
  const MPI_Datatype type = mpi_type(op.dtype);
  const int count = static_cast<int>(std::min<size_t>(op.count, INT_MAX));
  const size_t block_bytes = op.bytes();
  t.stage = Stage::data;
  if (!t.direct.empty()) return;  // posted by start()
  switch (op.kind) {
    case CollectiveOp::all_reduce:
      if (op.count == 0) break;
      check(MPI_Iallreduce(op.send == op.recv ? MPI_IN_PLACE : op.send, op.recv, count, type,
                           mpi_op(op.dtype, op.reduce), comm_, &t.request),
            "MPI_Iallreduce", name);
      return;
    case CollectiveOp::all_gather: {
      if (op.count == 0) break;
      const bool in_place = op.send == static_cast<const std::byte*>(op.recv) +
                                           static_cast<size_t>(rank_) * block_bytes;
      check(MPI_Iallgather(in_place ? MPI_IN_PLACE : op.send, count, type, op.recv, count, type,
                           comm_, &t.request),
            "MPI_Iallgather", name);
      return;
    }
    case CollectiveOp::reduce_scatter: {
      if (op.count == 0) break;
      if (use_ring(op)) {
        t.ring = std::make_unique<internal::RingReduceScatter>(ring_, rank_, size_, op);
        return;
      }
      // MPI_IN_PLACE means "the whole input is in recv", not our layout
      // (recv == send + rank * count): reduce into a temporary instead.
      const bool in_place = op.recv == static_cast<const std::byte*>(op.send) +
                                           static_cast<size_t>(rank_) * block_bytes;
      void* out = op.recv;
      if (in_place) {
        t.temp.resize(block_bytes);
        out = t.temp.data();
      }
      check(MPI_Ireduce_scatter_block(op.send, out, count, type, mpi_op(op.dtype, op.reduce),
                                      comm_, &t.request),
            "MPI_Ireduce_scatter_block", name);
      return;
    }
    case CollectiveOp::broadcast:
      if (op.count == 0) break;
      check(MPI_Ibcast(op.recv, count, type, op.root, comm_, &t.request), "MPI_Ibcast", name);
      return;
    case CollectiveOp::all_to_all:
      if (op.count == 0) break;
      check(MPI_Ialltoall(op.send, count, type, op.recv, count, type, comm_, &t.request),
            "MPI_Ialltoall", name);
      return;
    case CollectiveOp::all_to_all_v: {
      // Counts and displacements (MPI's are int): send's, then recv's.
      const size_t n = static_cast<size_t>(size_);
      t.v_counts.resize(4 * n);
      size_t sent = 0, received = 0;
      for (size_t p = 0; p < n; ++p) {
        for (size_t v : {op.send_counts[p], sent, op.recv_counts[p], received})
          if (v > static_cast<size_t>(INT_MAX))
            throw Unsupported(std::string(name),
                              fmt::format("a count or offset ({}) exceeds the largest MPI count ({})", v, INT_MAX),
                              "split the exchange into calls of at most 2^31-1 elements");
        t.v_counts[p] = static_cast<int>(op.send_counts[p]);
        t.v_counts[n + p] = static_cast<int>(sent);
        t.v_counts[2 * n + p] = static_cast<int>(op.recv_counts[p]);
        t.v_counts[3 * n + p] = static_cast<int>(received);
        sent += op.send_counts[p], received += op.recv_counts[p];
      }
      check(MPI_Ialltoallv(op.send, &t.v_counts[0], &t.v_counts[n], type, op.recv, &t.v_counts[2 * n],
                           &t.v_counts[3 * n], type, comm_, &t.request),
            "MPI_Ialltoallv", name);
      return;
    }
    case CollectiveOp::barrier:
    case CollectiveOp::split:
      // With checks, every peer's fingerprint has arrived: everyone entered.
      if (options_.check_fingerprints) break;
      check(MPI_Ibarrier(comm_, &t.request), "MPI_Ibarrier", name);
      return;
    case CollectiveOp::send:
      check(MPI_Isend(op.send, count, type, op.peer, op.tag, comm_, &t.request), "MPI_Isend", name);
      return;
    case CollectiveOp::recv:
      check(MPI_Irecv(op.recv, count, type, op.peer, op.tag, comm_, &t.request), "MPI_Irecv", name);
      return;
  }
  t.stage = Stage::done;  // nothing to move
}

void Channel::post_direct(Task& t) {
  const Op& op = t.op;
  const size_t bytes = op.bytes(), peers = static_cast<size_t>(size_ - 1);
  const int tag = fingerprint_tag(op.seq);
  const MPI_Datatype type = mpi_type(op.dtype);
  const size_t need = std::max(peers * bytes, peers * kSmallAllReduceBytes);
  auto fits = std::find_if(direct_pool_.begin(), direct_pool_.end(), [&](const auto& b) { return b.first >= need; });
  if (fits != direct_pool_.end()) {
    t.inputs_capacity = fits->first;
    t.inputs = std::move(fits->second);
    direct_pool_.erase(fits);
  } else {
    t.inputs_capacity = need;
    t.inputs = std::make_unique<std::byte[]>(need);
  }
  // Up to kSmallPiecesUpTo, pieces that fit OpenMPI's shared-memory eager
  // limit (4 KiB with its header) go through its FIFOs at once; a larger
  // message waits for a rendezvous and a process_vm_readv system call,
  // which costs more than it saves below about 16 KiB (docs/benchmarks.md).
  const size_t piece = bytes <= kSmallPiecesUpTo ? kSmallPieceBytes / dtype_size(op.dtype) : op.count,
               pieces = (op.count + piece - 1) / piece;
  const size_t es = dtype_size(op.dtype);
  t.direct.assign(2 * peers * pieces, MPI_REQUEST_NULL);
  MPI_Request* recvs = t.direct.data();
  MPI_Request* sends = t.direct.data() + peers * pieces;
  for (size_t i = 0; i < peers; ++i) {
    const int p = (rank_ + 1 + static_cast<int>(i)) % size_;
    for (size_t k = 0; k < pieces; ++k) {
      const size_t first = k * piece, n = std::min(piece, op.count - first);
      check(MPI_Irecv(t.inputs.get() + i * bytes + first * es, static_cast<int>(n), type, p, tag, direct_,
                      &recvs[i * pieces + k]),
            "MPI_Irecv", "all_reduce");
    }
  }
  for (size_t i = 0; i < peers; ++i) {
    const int p = (rank_ + 1 + static_cast<int>(i)) % size_;
    for (size_t k = 0; k < pieces; ++k) {
      const size_t first = k * piece, n = std::min(piece, op.count - first);
      check(MPI_Isend(static_cast<const std::byte*>(op.send) + first * es, static_cast<int>(n), type, p, tag,
                      direct_, &sends[i * pieces + k]),
            "MPI_Isend", "all_reduce");
    }
  }
}

void Channel::finish_direct(Task& t) {
  const Op& op = t.op;
  const size_t bytes = op.bytes();
  // In rank order, so every rank computes the same bits (and the threads
  // engine's): in[0] op in[1] op ... op in[n-1].
  const void* ins[kSmallAllReduceRanks];
  for (int p = 0; p < size_; ++p) {
    const size_t i = static_cast<size_t>((p - rank_ - 1 + size_) % size_);
    ins[p] = p == rank_ ? op.send : t.inputs.get() + i * bytes;
  }
  void* outs[1] = {op.recv};  // may alias op.send element for element (in place)
  comm::internal::reduce(outs, 1, ins, size_, op.count, op.dtype, op.reduce, size_);
  t.direct.clear();
  // Keep the largest few for the next exchanges (a bucket all-reduce reuses
  // its size every step).
  direct_pool_.emplace_back(t.inputs_capacity, std::move(t.inputs));
  if (direct_pool_.size() > 4) {
    std::sort(direct_pool_.begin(), direct_pool_.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    direct_pool_.resize(4);
  }
}

void Channel::progress_locked() {
  if (aborted_) return;
  if (!orphans_.empty()) test_orphans();
  // A peer's abort notice ends every wait here within 1 ms; looking for it
  // at every poll would double the latency of small collectives.
  if (size_ > 1) {
    const auto now = Clock::now();
    if (now >= next_notice_check_) {
      next_notice_check_ = now + kNoticeCheckInterval;
      if (receive_notice()) return;
    }
  }
  bool gate = true;
  for (size_t i = 0; i < queue_.size(); ++i) {
    const std::shared_ptr<Task> t = queue_[i];  // fail() empties queue_
    try {
      gate = advance(*t, gate);
    } catch (...) {
      fail(t.get(), std::current_exception(), /*notify_peers=*/true, rank_);
      return;
    }
    if (aborted_) return;
  }
  // A send or recv finishes as soon as its data moved, wherever it stands
  // in the queue (MPI_Isend / MPI_Irecv semantics, like the threads
  // engine's rendezvous): a pipeline's receive must not wait for an earlier
  // send whose receiver is still busy. Collectives finish in issue order.
  for (const std::shared_ptr<Task>& t : queue_)
    if (is_p2p(t->op.kind) && t->stage == Stage::done) t->finished = true;
  while (!queue_.empty() && queue_.front()->stage == Stage::done) {
    Task& t = *queue_.front();
    // Our fingerprint sends usually completed long ago; if not, they must
    // finish before the task's buffers go.
    for (MPI_Request& r : t.fp_send)
      if (r != MPI_REQUEST_NULL) orphans_.push_back({r, t.mine, /*user_buffers=*/false});
    t.fp_send.clear();
    t.finished = true;
    if (!is_p2p(t.op.kind)) finished_ = t.op.seq;
    queue_.pop_front();
  }
}

// Returns whether later tasks may post their data.
bool Channel::advance(Task& t, bool gate) {
  if (t.stage == Stage::fingerprints && poll_fingerprints(t)) t.stage = Stage::ready;
  if (t.stage == Stage::ready && gate) {
    // Never post data for a collective a peer has given up on: it would be
    // a collective nobody else joins. MPI_Iprobe looks before it
    // progresses, so a notice that came in with the fingerprints (a peer
    // that gave up on this very collective just before we arrived) is
    // visible only now. (A direct-exchange all_reduce's data is point-to-point,
    // posted by start().)
    if (t.direct.empty() && size_ > 1 && receive_notice()) return false;
    post_data(t);
  }
  if (t.stage == Stage::data) poll_data(t);
  return gate && (t.stage == Stage::done || (t.stage == Stage::data && !t.ring));
}

bool Channel::poll_fingerprints(Task& t) {
  const std::string_view name = collective_op_name(t.op.kind);
  int flag = 0;
  check(MPI_Testall(static_cast<int>(t.fp_recv.size()), t.fp_recv.data(), &flag,
                    MPI_STATUSES_IGNORE),
        "MPI_Testall", name);
  if (!flag) return false;
  for (size_t i = 0; i < t.theirs.size(); ++i)
    if (check_from(t.op, rank_, t.peers[i], t.theirs[i].to()) != t.mine->to()) throw_mismatch(t, t.peers);
  int sent = 0;  // completes the sends if they are done; finishing checks again
  check(MPI_Testall(static_cast<int>(t.fp_send.size()), t.fp_send.data(), &sent,
                    MPI_STATUSES_IGNORE),
        "MPI_Testall", name);
  if (sent) t.fp_send.clear();
  return true;
}

void Channel::throw_mismatch(const Task& t, const std::vector<int>& arrived) {
  FingerprintTable table(static_cast<size_t>(size_));
  table[static_cast<size_t>(rank_)] = t.mine->to();
  for (int p : arrived) {
    const size_t i = static_cast<size_t>((p - rank_ - 1 + size_) % size_);  // index in t.peers
    table[static_cast<size_t>(p)] = canonical(t.theirs[i].to());
  }
  mismatch_seq_ = t.op.seq;
  mismatch_table_ = table;
  throw mismatch_error(op_name(t.op), table, rank_);
}

void Channel::poll_data(Task& t) {
  if (!t.direct.empty()) {
    int flag = 0;
    check(MPI_Testall(static_cast<int>(t.direct.size()), t.direct.data(), &flag, MPI_STATUSES_IGNORE),
          "MPI_Testall", "all_reduce");
    if (!flag) return;
    finish_direct(t);
    t.stage = Stage::done;
    return;
  }
  if (t.ring) {
    if (t.ring->progress()) t.stage = Stage::done;
    return;
  }
  if (t.request != MPI_REQUEST_NULL) {
    int flag = 0;
    check(MPI_Test(&t.request, &flag, MPI_STATUS_IGNORE), "MPI_Test",
          collective_op_name(t.op.kind));
    if (!flag) return;
  }
  finish_data(t);
  t.stage = Stage::done;
}

void Channel::finish_data(Task& t) {
  const Op& op = t.op;
  if (op.kind == CollectiveOp::reduce_scatter && !t.temp.empty()) {
    std::memcpy(op.recv, t.temp.data(), t.temp.size());
    t.temp = {};
  }
  if ((op.kind == CollectiveOp::all_reduce || op.kind == CollectiveOp::reduce_scatter) &&
      op.reduce == ReduceOp::avg && op.count > 0)
    internal::divide(op.dtype, op.recv, op.count, size_);
}

bool Channel::test(Task& task) {
  std::lock_guard lock(mu_);
  progress_locked();
  return task.finished;
}

bool Channel::poll() {
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return true;  // another thread is progressing it
  progress_locked();
  return !queue_.empty() && waiting_ == 0;
}

ChannelStatus Channel::status() {
  std::lock_guard lock(mu_);
  return {.issued = issued_, .finished = finished_, .last_op = last_op_, .waiting = waiting_ > 0,
          .aborted = aborted_};
}

void Channel::wait(Task& task, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  Backoff backoff;
  std::unique_lock lock(mu_);
  drain_timeout_ = timeout;
  ++waiting_;
  for (;;) {
    progress_locked();
    if (task.finished) break;
    if (Clock::now() >= deadline) {
      // Ask the peers where they are before blaming anyone; the channel
      // stays unlocked meanwhile, so the progress thread can answer theirs.
      lock.unlock();
      const std::vector<PeerStatus> peers = probe_peers(timeout);
      lock.lock();
      progress_locked();
      if (task.finished) break;  // it completed during the probe
      // The oldest unfinished task is the one holding everything up.
      Task& front = *queue_.front();
      fail(&front, timeout_error(front, timeout, peers), /*notify_peers=*/true, rank_);
      break;
    }
    lock.unlock();
    backoff.pause();
    lock.lock();
  }
  --waiting_;
  if (task.error) std::rethrow_exception(task.error);
}


bool Channel::receive_notice() {
  int flag = 0;
  MPI_Status status;
  check(MPI_Iprobe(MPI_ANY_SOURCE, kAbortTag, check_, &flag, &status), "MPI_Iprobe", "abort");
  if (!flag) return false;
  int len = 0;
  check(MPI_Get_count(&status, MPI_BYTE, &len), "MPI_Get_count", "abort");
  std::string bytes(static_cast<size_t>(std::max(len, 0)), '\0');
  check(MPI_Recv(bytes.data(), len, MPI_BYTE, status.MPI_SOURCE, kAbortTag, check_,
                 MPI_STATUS_IGNORE),
        "MPI_Recv", "abort");
  const int origin = status.MPI_SOURCE;
  const internal::Notice notice = internal::decode_notice(bytes);
  // A notice for an earlier communicator whose context id MPI reused.
  if (notice.channel != id_) return false;
  // A mismatch at a collective this rank has issued is this rank's mismatch
  // too: raise the same MismatchError the peer raised (the contract says
  // every rank gets one), rebuilt from the peer's table.
  if (notice.mismatch.size() == static_cast<size_t>(size_)) {
    for (auto& t : queue_) {
      if (is_p2p(t->op.kind) || t->op.seq != notice.seq) continue;
      FingerprintTable table = notice.mismatch;
      table[static_cast<size_t>(rank_)] = t->op.fingerprint();
      fail(t.get(), std::make_exception_ptr(mismatch_error(op_name(t->op), table, rank_)),
           /*notify_peers=*/false, origin);
      return true;
    }
  }
  Task* front = queue_.empty() ? nullptr : queue_.front().get();
  const std::string op = front ? op_name(front->op) : "mpi::communicator";
  fail(front,
       std::make_exception_ptr(AbortedError(
           op, fmt::format("rank {} aborted the communicator: {}", origin, notice.reason),
           fmt::format("rank {} failed first; its error above is the cause", origin), {origin})),
       /*notify_peers=*/false, origin);
  return true;
}

void Channel::fail(Task* culprit, std::exception_ptr error, bool notify_peers, int origin) {
  aborted_ = true;
  Runtime::note_failure(drain_timeout_);
  abort_reason_ = comm::internal::reason_of(error);
  abort_ranks_ = ranks_of(error);
  if (abort_ranks_.empty() && origin != rank_) abort_ranks_ = {origin};
  // The caller may be iterating queue_: work on a moved-out copy.
  std::deque<std::shared_ptr<Task>> tasks;
  tasks.swap(queue_);
  for (auto& t : tasks) {
    if (t.get() == culprit) {
      t->error = error;
    } else {
      t->error = std::make_exception_ptr(
          AbortedError(op_name(t->op), "the communicator was aborted: " + abort_reason_,
                       "an earlier error ended this communicator; create a new one to continue",
                       abort_ranks_));
    }
    abandon(t);
    t->finished = true;
  }
  if (!notify_peers) {
    report(error);
    return;
  }
  // Tell every peer, so its pending and later calls fail now instead of at
  // its own deadline. Errors are ignored: we are already failing.
  internal::Notice notice;
  notice.channel = id_;
  notice.reason = abort_reason_;
  try {
    std::rethrow_exception(error);
  } catch (const MismatchError&) {
    notice.seq = mismatch_seq_;
    notice.mismatch = mismatch_table_;
  } catch (...) {
    if (culprit && !is_p2p(culprit->op.kind)) notice.seq = culprit->op.seq;
  }
  auto text = std::make_shared<const std::string>(internal::encode_notice(notice));
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    MPI_Request r = MPI_REQUEST_NULL;
    if (MPI_Isend(text->data(), static_cast<int>(text->size()), MPI_BYTE, p, kAbortTag, check_,
                  &r) == MPI_SUCCESS)
      orphans_.push_back({r, text, /*user_buffers=*/false});
  }
  report(error);
}

void Channel::report(const std::exception_ptr& error) {
  if (!options_.on_error) return;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    options_.on_error(e, world_ranks_[static_cast<size_t>(rank_)]);
  } catch (...) {
  }
}

void Channel::fail_and_throw(std::exception_ptr error) {
  {
    std::lock_guard lock(mu_);
    fail(nullptr, error, /*notify_peers=*/true, rank_);
  }
  std::rethrow_exception(error);
}

void Channel::abandon(const std::shared_ptr<Task>& t) {
  // Receives can be cancelled; sends and collectives cannot (MPI forbids
  // cancelling a non-blocking collective) and stay with MPI as orphans that
  // keep the task's buffers alive. Return codes are ignored: we are failing.
  auto cancel = [&](MPI_Request& r) {
    if (r == MPI_REQUEST_NULL) return;
    MPI_Cancel(&r);
    int flag = 0;
    MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    if (!flag) orphans_.push_back({r, t});
    r = MPI_REQUEST_NULL;
  };
  for (MPI_Request& r : t->fp_recv) cancel(r);
  for (MPI_Request& r : t->fp_send)
    if (r != MPI_REQUEST_NULL) orphans_.push_back({r, t->mine, /*user_buffers=*/false});
  t->fp_send.clear();
  if (t->ring) t->ring->abandon(t, orphans_);
  // A direct-exchange all_reduce: its receives are cancelled, its sends (from the
  // caller's buffer) stay with MPI.
  const size_t peers = t->direct.size() / 2;
  for (size_t i = 0; i < t->direct.size(); ++i) {
    if (i < peers) {
      cancel(t->direct[i]);
    } else if (t->direct[i] != MPI_REQUEST_NULL) {
      orphans_.push_back({t->direct[i], t});
      t->direct[i] = MPI_REQUEST_NULL;
    }
  }
  if (t->request != MPI_REQUEST_NULL) {
    if (t->op.kind == CollectiveOp::recv) {
      cancel(t->request);
    } else {
      orphans_.push_back({t->request, t});
      t->request = MPI_REQUEST_NULL;
    }
  }
}

void Channel::test_orphans() {
  std::erase_if(orphans_, [](Orphan& o) {
    int flag = 0;
    // An error completes the request as well; nobody is left to report it to.
    if (MPI_Test(&o.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) return true;
    return flag != 0;
  });
}

}  // namespace meshtrain::comm::mpi::internal
