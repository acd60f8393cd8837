// The collectives' data movement on Gloo point-to-point transfers, run by
// the channel's worker thread (see communicator.h for the algorithms and
// why they are direct). Every reduction combines the n contributions in
// rank order 0..n-1 with comm::internal::reduce, so each algorithm gives
// the same bits and bf16/f16 round once.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "meshtrain/comm/gloo/internal/channel.h"
#include "meshtrain/comm/internal/reduce.h"

namespace meshtrain::comm::gloo::internal {
namespace {

// Sends are posted before receives throughout: a send whose receiver's
// "ready" notice is already in moves at once (measured: the 4 KiB direct
// exchange took 150-181 us with receives first, 92-97 us with sends first).
//
// Peers are visited in rotated order: step k = 1..n-1 sends to rank + k and
// receives from rank - k, so at each step every rank writes to a different
// peer instead of all starting with rank 0. It was added against Gloo's
// event-loop spin (channel.h, Directions), which the connection per
// direction removed; alone it measured within the noise (docs/benchmarks.md).

// Phases of a collective's slots (0: fingerprints).
constexpr uint64_t kPhaseData = 1;
constexpr uint64_t kPhaseGather = 2;

std::byte* bytes_of(void* p) { return static_cast<std::byte*>(p); }
const std::byte* bytes_of(const void* p) { return static_cast<const std::byte*>(p); }

// Block p of `count` elements split over n ranks: [off[p], off[p + 1]).
std::vector<size_t> even_split(size_t count, int n) {
  std::vector<size_t> off(static_cast<size_t>(n) + 1);
  for (int p = 0; p <= n; ++p)
    off[static_cast<size_t>(p)] = static_cast<size_t>(
        static_cast<unsigned __int128>(count) * static_cast<unsigned>(p) / static_cast<unsigned>(n));
  return off;
}

// The peer rank + k and the peer rank - k (k = 1..n-1): see the top.
int to_peer(int rank, int k, int n) { return (rank + k) % n; }
int from_peer(int rank, int k, int n) { return (rank - k + n) % n; }

std::vector<size_t> equal_blocks(size_t count, int n) {
  std::vector<size_t> off(static_cast<size_t>(n) + 1);
  for (int p = 0; p <= n; ++p) off[static_cast<size_t>(p)] = count * static_cast<size_t>(p);
  return off;
}

}  // namespace

void Channel::run_collective(Task& t) {
  const Op& op = t.op;
  check_fingerprints(op);
  if (size_ == 1) {
    switch (op.kind) {
      case CollectiveOp::all_reduce:
      case CollectiveOp::all_gather:
      case CollectiveOp::reduce_scatter:
      case CollectiveOp::all_to_all:
        // One rank: the result is the input (avg divides by 1).
        if (op.recv != op.send && op.count > 0) std::memmove(op.recv, op.send, op.bytes());
        break;
      case CollectiveOp::all_to_all_v:
        if (op.send_counts[0] > 0) std::memcpy(op.recv, op.send, op.send_counts[0] * dtype_size(op.dtype));
        break;
      case CollectiveOp::split:
        t.split_table.resize(2);
        break;
      default:
        break;
    }
    return;
  }
  switch (op.kind) {
    case CollectiveOp::all_reduce: return all_reduce(op);
    case CollectiveOp::reduce_scatter:
      if (op.count > 0)
        reduce_scatter_blocks(op, bytes_of(op.send), bytes_of(op.recv), equal_blocks(op.count, size_), kPhaseData);
      return;
    case CollectiveOp::all_gather: {
      if (op.count == 0) return;
      std::byte* mine = bytes_of(op.recv) + static_cast<size_t>(rank_) * op.bytes();
      if (bytes_of(op.send) != mine) std::memcpy(mine, op.send, op.bytes());
      return all_gather_blocks(op, bytes_of(op.recv), equal_blocks(op.count, size_), kPhaseData);
    }
    case CollectiveOp::broadcast: return broadcast(op);
    case CollectiveOp::all_to_all: return all_to_all(op);
    case CollectiveOp::all_to_all_v: return all_to_all_v(op);
    case CollectiveOp::barrier: return barrier(op);
    case CollectiveOp::split: return split_exchange(t);
    default: throw Unsupported(op_name(op.kind), "not a collective", "");
  }
}

void Channel::check_fingerprints(const Op& op) {
  if (!options().check_fingerprints || size_ == 1) return;
  const Fingerprint mine = op.fingerprint();
  using comm::internal::check_from;
  using comm::internal::fingerprint_to;
  using comm::internal::WireFingerprint;
  Transfers x(*this, op, 0);
  // One wire per peer: an all_to_all_v's carries the count that peer gets
  // (comm/internal/fingerprint.h); the others are all the same.
  const size_t n = static_cast<size_t>(size_);
  auto* wires = reinterpret_cast<WireFingerprint*>(x.scratch(n * sizeof(WireFingerprint)));
  for (size_t p = 0; p < n; ++p) wires[p] = WireFingerprint::from(fingerprint_to(op, static_cast<int>(p)));
  auto* theirs = reinterpret_cast<WireFingerprint*>(x.scratch(n * sizeof(WireFingerprint)));
  for (int k = 1; k < size_; ++k) {
    const int p = to_peer(rank_, k, size_);
    x.send(p, &wires[p], sizeof(WireFingerprint));
  }
  for (int k = 1; k < size_; ++k) {
    const int p = from_peer(rank_, k, size_);
    x.recv(p, &theirs[p], sizeof(WireFingerprint));
  }
  x.wait_all();
  comm::internal::FingerprintTable table(static_cast<size_t>(size_));
  bool same = true;
  for (int p = 0; p < size_; ++p) {
    table[static_cast<size_t>(p)] = p == rank_ ? mine : check_from(op, rank_, p, theirs[static_cast<size_t>(p)].to());
    same = same && *table[static_cast<size_t>(p)] == mine;
  }
  if (same) return;
  {
    std::lock_guard lock(mu_);
    mismatch_table_ = table;
  }
  throw comm::internal::mismatch_error(op_name(op.kind), table, rank_);
}

void Channel::all_reduce(const Op& op) {
  if (op.count == 0) return;
  const size_t bytes = op.bytes();
  const int n = size_;
  if (!direct_all_reduce(bytes, n) && op.count >= static_cast<size_t>(n)) {
    const std::vector<size_t> off = even_split(op.count, n);
    const size_t ds = dtype_size(op.dtype);
    reduce_scatter_blocks(op, bytes_of(op.send), bytes_of(op.recv) + off[static_cast<size_t>(rank_)] * ds, off,
                          kPhaseData);
    return all_gather_blocks(op, bytes_of(op.recv), off, kPhaseGather);
  }
  // Direct: every rank sends its whole input to every peer and reduces all
  // n contributions, in chunks of kOverlapBytes above that: the reduction
  // of a chunk overlaps the arrival of the next.
  const size_t ds = dtype_size(op.dtype);
  const size_t chunk = std::max<size_t>(1, kOverlapBytes / ds) * ds;
  const size_t nchunks = (bytes + chunk - 1) / chunk;
  auto len = [&](size_t c) { return std::min(chunk, bytes - c * chunk); };
  Transfers x(*this, op, kPhaseData);
  std::byte* scratch = x.scratch(static_cast<size_t>(n - 1) * bytes);
  auto slot = [&](int p) { return scratch + static_cast<size_t>(p < rank_ ? p : p - 1) * bytes; };
  const std::byte* send = bytes_of(op.send);
  std::vector<size_t> sent, got;  // by chunk, then peer
  for (size_t c = 0; c < nchunks; ++c)
    for (int k = 1; k < n; ++k) sent.push_back(x.send(to_peer(rank_, k, n), send + c * chunk, len(c)));
  for (size_t c = 0; c < nchunks; ++c)
    for (int k = 1; k < n; ++k) {
      const int p = from_peer(rank_, k, n);
      got.push_back(x.recv(p, slot(p) + c * chunk, len(c)));
    }
  const bool in_place = op.recv == op.send;
  std::vector<const void*> ins(static_cast<size_t>(n));
  for (size_t c = 0; c < nchunks; ++c) {
    for (size_t i = c * static_cast<size_t>(n - 1); i < (c + 1) * static_cast<size_t>(n - 1); ++i) {
      x.wait(got[i]);
      if (in_place) x.wait(sent[i]);  // the chunk is about to be overwritten
    }
    for (int p = 0; p < n; ++p)
      ins[static_cast<size_t>(p)] = p == rank_ ? send + c * chunk : slot(p) + c * chunk;
    void* out = bytes_of(op.recv) + c * chunk;
    comm::internal::reduce(&out, 1, ins.data(), n, len(c) / ds, op.dtype, op.reduce, n);
  }
  x.wait_all();
}

void Channel::reduce_scatter_blocks(const Op& op, const std::byte* send, std::byte* out,
                                    const std::vector<size_t>& off, uint64_t phase) {
  const int n = size_;
  const size_t ds = dtype_size(op.dtype);
  const size_t chunk = std::max<size_t>(1, kChunkBytes / ds);
  auto block_len = [&](int p) { return off[static_cast<size_t>(p) + 1] - off[static_cast<size_t>(p)]; };
  Transfers x(*this, op, phase);
  // Every peer's block, in chunks, in order: Gloo matches them with the
  // peer's receives of the same slot in order.
  for (int k = 1; k < n; ++k) {
    const int p = to_peer(rank_, k, n);
    for (size_t e = 0; e < block_len(p); e += chunk)
      x.send(p, send + (off[static_cast<size_t>(p)] + e) * ds, std::min(chunk, block_len(p) - e) * ds);
  }
  const size_t mine = block_len(rank_);
  if (mine == 0) return x.wait_all();
  const size_t nchunks = (mine + chunk - 1) / chunk;
  const size_t chunk_elems = std::min(chunk, mine);
  // Two chunks of every peer's contribution in flight: the reduction of one
  // overlaps the arrival of the next.
  // Peer p's chunk c lands in slot(c, p).
  std::byte* scratch = x.scratch(2 * static_cast<size_t>(n - 1) * chunk_elems * ds);
  auto slot = [&](size_t c, int p) {
    const size_t i = static_cast<size_t>(p < rank_ ? p : p - 1);
    return scratch + ((c % 2) * static_cast<size_t>(n - 1) + i) * chunk_elems * ds;
  };
  std::vector<std::vector<size_t>> posted(nchunks);
  auto post = [&](size_t c) {
    if (c >= nchunks) return;
    const size_t len = std::min(chunk, mine - c * chunk);
    for (int k = 1; k < n; ++k) {
      const int p = from_peer(rank_, k, n);
      posted[c].push_back(x.recv(p, slot(c, p), len * ds));
    }
  };
  post(0);
  post(1);
  std::vector<const void*> ins(static_cast<size_t>(n));
  for (size_t c = 0; c < nchunks; ++c) {
    const size_t first = c * chunk;
    const size_t len = std::min(chunk, mine - first);
    for (size_t i : posted[c]) x.wait(i);
    for (int p = 0; p < n; ++p)
      ins[static_cast<size_t>(p)] =
          p == rank_ ? static_cast<const void*>(send + (off[static_cast<size_t>(rank_)] + first) * ds) : slot(c, p);
    void* dst = out + first * ds;
    comm::internal::reduce(&dst, 1, ins.data(), n, len, op.dtype, op.reduce, n);
    post(c + 2);
  }
  x.wait_all();
}

void Channel::all_gather_blocks(const Op& op, std::byte* buf, const std::vector<size_t>& off, uint64_t phase) {
  const size_t ds = dtype_size(op.dtype);
  const size_t r = static_cast<size_t>(rank_);
  Transfers x(*this, op, phase);
  if (size_ > 2 && (off[r + 1] - off[r]) * ds > kRingAllGatherBytes) {
    // A pipelined ring: step s sends block rank - s to the next rank and
    // receives block rank - s - 1 from the previous one, forwarding each
    // chunk as soon as it arrived.
    const int n = size_, next = (rank_ + 1) % n, prev = (rank_ - 1 + n) % n;
    auto block = [&](int s) { return static_cast<size_t>(((rank_ - s) % n + n) % n); };
    auto chunks = [&](size_t b, auto&& fn) {
      for (size_t e = off[b]; e < off[b + 1]; e += kChunkBytes / ds)
        fn(buf + e * ds, std::min(kChunkBytes / ds, off[b + 1] - e) * ds);
    };
    std::vector<std::vector<size_t>> got(static_cast<size_t>(n - 1));
    for (int s = 0; s < n - 1; ++s)
      chunks(block(s + 1), [&](std::byte* p, size_t len) { got[static_cast<size_t>(s)].push_back(x.recv(prev, p, len)); });
    chunks(block(0), [&](std::byte* p, size_t len) { x.send(next, p, len); });
    for (int s = 1; s < n - 1; ++s) {
      size_t c = 0;
      chunks(block(s), [&](std::byte* p, size_t len) {
        x.wait(got[static_cast<size_t>(s - 1)][c++]);
        x.send(next, p, len);
      });
    }
    return x.wait_all();
  }
  for (int k = 1; k < size_; ++k)
    if (off[r + 1] > off[r]) x.send(to_peer(rank_, k, size_), buf + off[r] * ds, (off[r + 1] - off[r]) * ds);
  for (int k = 1; k < size_; ++k) {
    const int p = from_peer(rank_, k, size_);
    const size_t q = static_cast<size_t>(p);
    if (off[q + 1] > off[q]) x.recv(p, buf + off[q] * ds, (off[q + 1] - off[q]) * ds);
  }
  x.wait_all();
}

void Channel::broadcast(const Op& op) {
  if (op.count == 0) return;
  Transfers x(*this, op, kPhaseData);
  const size_t bytes = op.bytes();
  if (size_ > 2 && bytes > kChunkBytes) {
    // A pipelined chain root, root + 1, ...: each rank forwards a chunk as
    // soon as it arrived, so every rank sends the buffer once (a root that
    // sent it to each peer would send it n - 1 times).
    std::byte* buf = bytes_of(op.recv);
    const int position = (rank_ - op.root + size_) % size_;
    const int prev = (rank_ - 1 + size_) % size_, next = (rank_ + 1) % size_;
    const size_t nchunks = (bytes + kChunkBytes - 1) / kChunkBytes;
    auto len = [&](size_t c) { return std::min(kChunkBytes, bytes - c * kChunkBytes); };
    std::vector<size_t> arrived;
    if (position > 0)
      for (size_t c = 0; c < nchunks; ++c) arrived.push_back(x.recv(prev, buf + c * kChunkBytes, len(c)));
    for (size_t c = 0; c < nchunks; ++c) {
      if (position > 0) x.wait(arrived[c]);
      if (position < size_ - 1) x.send(next, buf + c * kChunkBytes, len(c));
    }
    return x.wait_all();
  }
  if (rank_ == op.root) {
    for (int k = 1; k < size_; ++k) x.send(to_peer(rank_, k, size_), op.recv, bytes);
  } else {
    x.recv(op.root, op.recv, bytes);
  }
  x.wait_all();
}

void Channel::all_to_all(const Op& op) {
  if (op.count == 0) return;
  const size_t block = op.bytes();
  Transfers x(*this, op, kPhaseData);
  for (int k = 1; k < size_; ++k) {
    const int p = to_peer(rank_, k, size_);
    x.send(p, bytes_of(op.send) + static_cast<size_t>(p) * block, block);
  }
  for (int k = 1; k < size_; ++k) {
    const int p = from_peer(rank_, k, size_);
    x.recv(p, bytes_of(op.recv) + static_cast<size_t>(p) * block, block);
  }
  std::memcpy(bytes_of(op.recv) + static_cast<size_t>(rank_) * block,
              bytes_of(op.send) + static_cast<size_t>(rank_) * block, block);
  x.wait_all();
}

void Channel::all_to_all_v(const Op& op) {
  // Blocks packed in rank order; a zero count moves nothing (both sides
  // know it: the fingerprints compared the counts).
  const size_t n = static_cast<size_t>(size_), es = dtype_size(op.dtype);
  std::vector<size_t> send_off(n + 1, 0), recv_off(n + 1, 0);
  for (size_t p = 0; p < n; ++p) {
    send_off[p + 1] = send_off[p] + op.send_counts[p] * es;
    recv_off[p + 1] = recv_off[p] + op.recv_counts[p] * es;
  }
  Transfers x(*this, op, kPhaseData);
  for (int k = 1; k < size_; ++k) {
    const auto p = static_cast<size_t>(to_peer(rank_, k, size_));
    if (send_off[p + 1] > send_off[p])
      x.send(static_cast<int>(p), bytes_of(op.send) + send_off[p], send_off[p + 1] - send_off[p]);
  }
  for (int k = 1; k < size_; ++k) {
    const auto p = static_cast<size_t>(from_peer(rank_, k, size_));
    if (recv_off[p + 1] > recv_off[p])
      x.recv(static_cast<int>(p), bytes_of(op.recv) + recv_off[p], recv_off[p + 1] - recv_off[p]);
  }
  const auto me = static_cast<size_t>(rank_);
  if (send_off[me + 1] > send_off[me])
    std::memcpy(bytes_of(op.recv) + recv_off[me], bytes_of(op.send) + send_off[me], send_off[me + 1] - send_off[me]);
  x.wait_all();
}

void Channel::barrier(const Op& op) {
  if (options().check_fingerprints) return;  // every peer's fingerprint arrived: all entered
  Transfers x(*this, op, kPhaseData);
  std::byte* token = x.scratch(1);
  std::byte* in = x.scratch(static_cast<size_t>(size_));
  *token = std::byte{1};
  for (int k = 1; k < size_; ++k) x.send(to_peer(rank_, k, size_), token, 1);
  for (int k = 1; k < size_; ++k) {
    const int p = from_peer(rank_, k, size_);
    x.recv(p, in + p, 1);
  }
  x.wait_all();
}

void Channel::split_exchange(Task& t) {
  // t.split_table holds this rank's (color, key); it becomes every rank's.
  Transfers x(*this, t.op, kPhaseData);
  auto* table = reinterpret_cast<int32_t*>(x.scratch(2 * static_cast<size_t>(size_) * sizeof(int32_t)));
  std::copy_n(t.split_table.begin(), 2, table + 2 * rank_);
  for (int k = 1; k < size_; ++k) x.send(to_peer(rank_, k, size_), table + 2 * rank_, 2 * sizeof(int32_t));
  for (int k = 1; k < size_; ++k) {
    const int p = from_peer(rank_, k, size_);
    x.recv(p, table + 2 * p, 2 * sizeof(int32_t));
  }
  x.wait_all();
  t.split_table.assign(table, table + 2 * size_);
}

}  // namespace meshtrain::comm::gloo::internal
