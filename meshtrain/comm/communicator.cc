#include "meshtrain/comm/communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/reduction_tree.h"

namespace meshtrain::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::prod: return "prod";
  }
  return "?";
}

ReduceOp parse_reduce_op(std::string_view name) {
  for (ReduceOp op : kAllReduceOps)
    if (reduce_op_name(op) == name) return op;
  throw InvalidArgument("parse_reduce_op", fmt::format("unknown reduce op '{}'", name),
                        "use one of sum, avg, max, min, prod");
}

std::string_view engine_name(Engine e) {
  switch (e) {
    case Engine::threads: return "threads";
    case Engine::mpi: return "mpi";
    case Engine::gloo: return "gloo";
    case Engine::nccl: return "nccl";
  }
  return "?";
}

Engine parse_engine(std::string_view name) {
  for (Engine e : {Engine::threads, Engine::mpi, Engine::gloo, Engine::nccl})
    if (engine_name(e) == name) return e;
  throw InvalidArgument("parse_engine", fmt::format("unknown engine '{}'", name),
                        "use one of threads, mpi, gloo, nccl");
}

std::string_view collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::all_reduce: return "all_reduce";
    case CollectiveOp::all_gather: return "all_gather";
    case CollectiveOp::reduce_scatter: return "reduce_scatter";
    case CollectiveOp::broadcast: return "broadcast";
    case CollectiveOp::all_to_all: return "all_to_all";
    case CollectiveOp::barrier: return "barrier";
    case CollectiveOp::split: return "split";
    case CollectiveOp::send: return "send";
    case CollectiveOp::recv: return "recv";
    case CollectiveOp::all_to_all_v: return "all_to_all_v";
  }
  return "?";
}

std::string Fingerprint::to_string() const {
  std::string s = fmt::format("{} #{}", collective_op_name(op), seq);
  switch (op) {
    case CollectiveOp::all_reduce:
    case CollectiveOp::reduce_scatter:
      return s + fmt::format(" ({} x {}, {})", dtype_name(dtype), count, reduce_op_name(reduce));
    case CollectiveOp::broadcast:
      return s + fmt::format(" ({} x {}, root {})", dtype_name(dtype), count, root);
    case CollectiveOp::all_gather:
    case CollectiveOp::all_to_all:
    case CollectiveOp::send:
    case CollectiveOp::recv:
      return s + fmt::format(" ({} x {})", dtype_name(dtype), count);
    case CollectiveOp::all_to_all_v:
      return s + fmt::format(" ({}, uneven)", dtype_name(dtype));
    case CollectiveOp::barrier:
    case CollectiveOp::split:
      return s;
  }
  return s;
}

namespace {

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return an > 0 && bn > 0 && pa < pb + bn && pb < pa + an;
}

}  // namespace

void Communicator::count_traffic(const Op& op) {
  TrafficCounter& t = traffic_[static_cast<size_t>(op.kind)];
  ++t.calls;
  if (op.kind == CollectiveOp::all_to_all_v) {
    for (size_t c : op.send_counts) t.bytes += c * dtype_size(op.dtype);
  } else {
    t.bytes += op.bytes();
  }
}

Work Communicator::issue(Op op, Completion completion) {
  const std::string name(collective_op_name(op.kind));
  const int n = size();
  const size_t total = op.count * static_cast<size_t>(n) * dtype_size(op.dtype);
  auto require = [&](bool ok, const std::string& what, const std::string& hint) {
    if (!ok) throw InvalidArgument("Communicator::" + name, what, hint);
  };
  switch (op.kind) {
    case CollectiveOp::all_reduce:
      require(op.count == 0 || (op.send && op.recv), "null buffer with count > 0", "pass valid buffers");
      require(op.send == op.recv || !overlaps(op.send, op.bytes(), op.recv, op.bytes()),
              "send and recv overlap without being identical", "use send == recv for in place");
      break;
    case CollectiveOp::all_gather:
    case CollectiveOp::reduce_scatter:
      require(op.count == 0 || (op.send && op.recv), "null buffer with count > 0", "pass valid buffers");
      break;
    case CollectiveOp::broadcast:
      require(op.root >= 0 && op.root < n, fmt::format("root {} outside [0, {})", op.root, n),
              "pass a rank of this communicator");
      require(op.count == 0 || op.recv, "null buffer with count > 0", "pass a valid buffer");
      break;
    case CollectiveOp::all_to_all:
      require(op.count == 0 || (op.send && op.recv), "null buffer with count > 0", "pass valid buffers");
      require(!overlaps(op.send, total, op.recv, total), "send and recv overlap",
              "all_to_all is never in place: use separate buffers");
      break;
    case CollectiveOp::all_to_all_v: {
      require(op.send_counts.size() == static_cast<size_t>(n) && op.recv_counts.size() == static_cast<size_t>(n),
              fmt::format("{} send counts and {} recv counts for {} ranks", op.send_counts.size(),
                          op.recv_counts.size(), n),
              "pass one count per rank of this communicator");
      size_t sent = 0, received = 0;
      for (int p = 0; p < n; ++p) sent += op.send_counts[p], received += op.recv_counts[p];
      require(op.send_counts[rank()] == op.recv_counts[rank()],
              fmt::format("rank {} sends itself {} elements but expects {}", rank(), op.send_counts[rank()],
                          op.recv_counts[rank()]),
              "a rank's send_counts[rank] and recv_counts[rank] are its own block: make them equal");
      require((sent == 0 || op.send) && (received == 0 || op.recv), "null buffer with counts > 0",
              "pass valid buffers");
      require(!overlaps(op.send, sent * dtype_size(op.dtype), op.recv, received * dtype_size(op.dtype)),
              "send and recv overlap", "all_to_all_v is never in place: use separate buffers");
      break;
    }
    case CollectiveOp::send:
    case CollectiveOp::recv:
      require(op.peer >= 0 && op.peer < n && op.peer != rank(),
              fmt::format("peer {} invalid for rank {} of {}", op.peer, rank(), n),
              "pass another rank of this communicator");
      require(op.tag >= 0, fmt::format("tag {} < 0", op.tag), "tags are non-negative");
      require(op.count == 0 || (op.send || op.recv), "null buffer with count > 0", "pass a valid buffer");
      break;
    case CollectiveOp::barrier:
    case CollectiveOp::split:
      break;
  }
  if (op.kind != CollectiveOp::send && op.kind != CollectiveOp::recv) op.seq = ++seq_;
  count_traffic(op);
  return start(op, completion);
}

namespace {

Op all_reduce_op(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  return {.kind = CollectiveOp::all_reduce, .send = send, .recv = recv, .count = count, .dtype = dtype,
          .reduce = op};
}
Op all_gather_op(const void* send, void* recv, size_t count, DType dtype) {
  return {.kind = CollectiveOp::all_gather, .send = send, .recv = recv, .count = count, .dtype = dtype};
}
Op reduce_scatter_op(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  return {.kind = CollectiveOp::reduce_scatter, .send = send, .recv = recv, .count = count, .dtype = dtype,
          .reduce = op};
}
Op broadcast_op(void* buf, size_t count, DType dtype, int root) {
  return {.kind = CollectiveOp::broadcast, .send = buf, .recv = buf, .count = count, .dtype = dtype, .root = root};
}
Op all_to_all_op(const void* send, void* recv, size_t count, DType dtype) {
  return {.kind = CollectiveOp::all_to_all, .send = send, .recv = recv, .count = count, .dtype = dtype};
}
Op all_to_all_v_op(const void* send, std::span<const size_t> send_counts, void* recv,
                   std::span<const size_t> recv_counts, DType dtype) {
  return {.kind = CollectiveOp::all_to_all_v, .send = send, .recv = recv, .dtype = dtype,
          .send_counts = {send_counts.begin(), send_counts.end()},
          .recv_counts = {recv_counts.begin(), recv_counts.end()}};
}
Op send_op(const void* buf, size_t count, DType dtype, int peer, int tag) {
  return {.kind = CollectiveOp::send, .send = buf, .count = count, .dtype = dtype, .peer = peer, .tag = tag};
}
Op recv_op(void* buf, size_t count, DType dtype, int peer, int tag) {
  return {.kind = CollectiveOp::recv, .recv = buf, .count = count, .dtype = dtype, .peer = peer, .tag = tag};
}

}  // namespace

Work Communicator::all_reduce_async(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  return issue(all_reduce_op(send, recv, count, dtype, op), Completion::async);
}
Work Communicator::all_gather_async(const void* send, void* recv, size_t count, DType dtype) {
  return issue(all_gather_op(send, recv, count, dtype), Completion::async);
}
Work Communicator::reduce_scatter_async(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  return issue(reduce_scatter_op(send, recv, count, dtype, op), Completion::async);
}
Work Communicator::broadcast_async(void* buf, size_t count, DType dtype, int root) {
  return issue(broadcast_op(buf, count, dtype, root), Completion::async);
}
Work Communicator::all_to_all_async(const void* send, void* recv, size_t count, DType dtype) {
  return issue(all_to_all_op(send, recv, count, dtype), Completion::async);
}
Work Communicator::all_to_all_v_async(const void* send, std::span<const size_t> send_counts, void* recv,
                                      std::span<const size_t> recv_counts, DType dtype) {
  return issue(all_to_all_v_op(send, send_counts, recv, recv_counts, dtype), Completion::async);
}
Work Communicator::send_async(const void* buf, size_t count, DType dtype, int peer, int tag) {
  return issue(send_op(buf, count, dtype, peer, tag), Completion::async);
}
Work Communicator::recv_async(void* buf, size_t count, DType dtype, int peer, int tag) {
  return issue(recv_op(buf, count, dtype, peer, tag), Completion::async);
}
Work Communicator::barrier_async() { return issue({.kind = CollectiveOp::barrier}, Completion::async); }

void Communicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  issue(all_reduce_op(send, recv, count, dtype, op), Completion::blocking).wait();
}
void Communicator::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  issue(all_gather_op(send, recv, count, dtype), Completion::blocking).wait();
}
void Communicator::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  issue(reduce_scatter_op(send, recv, count, dtype, op), Completion::blocking).wait();
}
void Communicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  issue(broadcast_op(buf, count, dtype, root), Completion::blocking).wait();
}
void Communicator::all_to_all(const void* send, void* recv, size_t count, DType dtype) {
  issue(all_to_all_op(send, recv, count, dtype), Completion::blocking).wait();
}
void Communicator::all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                                std::span<const size_t> recv_counts, DType dtype) {
  issue(all_to_all_v_op(send, send_counts, recv, recv_counts, dtype), Completion::blocking).wait();
}
void Communicator::send(const void* buf, size_t count, DType dtype, int peer, int tag) {
  issue(send_op(buf, count, dtype, peer, tag), Completion::blocking).wait();
}
void Communicator::recv(void* buf, size_t count, DType dtype, int peer, int tag) {
  issue(recv_op(buf, count, dtype, peer, tag), Completion::blocking).wait();
}
void Communicator::barrier() { issue({.kind = CollectiveOp::barrier}, Completion::blocking).wait(); }

namespace {

// The Work of a group: every part's Work, and the error of a part that could
// not even start (the others were started regardless, so that the peers'
// matching ops do not wait for nothing).
class GroupWork final : public internal::WorkState {
 public:
  GroupWork(std::vector<Work> parts, std::exception_ptr start_error)
      : parts_(std::move(parts)), error_(std::move(start_error)) {}
  void wait() override {
    // Every part is waited for, even after an error: when wait() returns,
    // no op of the group uses its buffers any more (or its engine has
    // failed them). The parts' deadlines run from when they were started,
    // so a group that times out does so within one timeout.
    bool echo = false;  // error_ is an AbortedError: a consequence of another failure
    for (Work& w : parts_) {
      try {
        w.wait();
      } catch (const AbortedError&) {
        if (!error_) error_ = std::current_exception(), echo = true;
      } catch (...) {
        if (!error_ || echo) error_ = std::current_exception(), echo = false;
      }
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool test() override {
    for (Work& w : parts_)
      if (!w.is_completed()) return false;
    return true;
  }

 private:
  std::vector<Work> parts_;
  std::exception_ptr error_;
};

}  // namespace

Work Communicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  const int n = size();
  std::vector<Op> group;
  group.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& p = ops[i];
    auto require = [&](bool ok, const std::string& what, const std::string& hint) {
      if (!ok) throw InvalidArgument("Communicator::batch_isend_irecv", fmt::format("op {}: {}", i, what), hint);
    };
    require(p.kind == CollectiveOp::send || p.kind == CollectiveOp::recv,
            fmt::format("kind {} is not send or recv", collective_op_name(p.kind)), "use P2POp::isend or P2POp::irecv");
    require(p.peer >= 0 && p.peer < n, fmt::format("peer {} outside [0, {})", p.peer, n),
            "pass a rank of this communicator");
    require(p.tag >= 0, fmt::format("tag {} < 0", p.tag), "tags are non-negative");
    const bool is_send = p.kind == CollectiveOp::send;
    require(p.count == 0 || (is_send ? p.send != nullptr : p.recv != nullptr), "null buffer with count > 0",
            "pass a valid buffer");
    group.push_back({.kind = p.kind, .send = is_send ? p.send : nullptr, .recv = is_send ? nullptr : p.recv,
                     .count = p.count, .dtype = p.dtype, .peer = p.peer, .tag = p.tag});
  }
  // A recv that overlaps another op's buffer would race with it.
  for (size_t i = 0; i < group.size(); ++i) {
    if (group[i].kind != CollectiveOp::recv) continue;
    for (size_t j = 0; j < group.size(); ++j) {
      if (j == i) continue;
      const void* other = group[j].kind == CollectiveOp::recv ? group[j].recv : group[j].send;
      if (overlaps(group[i].recv, group[i].bytes(), other, group[j].bytes()))
        throw InvalidArgument("Communicator::batch_isend_irecv",
                              fmt::format("op {} (recv) overlaps op {} ({})", i, j, collective_op_name(group[j].kind)),
                              "give every recv of a group its own buffer");
    }
  }
  if (group.empty()) return Work{};
  for (const Op& op : group) count_traffic(op);
  return start_group(group);
}

Work Communicator::start_group(const std::vector<Op>& ops) {
  std::vector<Work> parts;
  parts.reserve(ops.size());
  std::exception_ptr error;
  for (const Op& op : ops) {
    try {
      parts.push_back(start(op, Completion::async));
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  return Work(std::make_unique<GroupWork>(std::move(parts), std::move(error)));
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  return do_split(color, key, ++seq_);
}

std::vector<std::string> all_gather_bytes(Communicator& c, std::string_view mine) {
  const auto n = static_cast<size_t>(c.size());
  int64_t len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(n);
  c.all_gather(&len, lens.data(), 1, DType::i64);
  const auto most = static_cast<size_t>(std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end())));
  std::string padded(mine);
  padded.resize(most);
  std::string all(most * n, '\0');
  c.all_gather(padded.data(), all.data(), most, DType::u8);
  std::vector<std::string> out;
  for (size_t r = 0; r < n; ++r) out.push_back(all.substr(r * most, static_cast<size_t>(lens[r])));
  return out;
}

std::vector<size_t> all_to_all_counts(Communicator& c, std::span<const size_t> send_counts) {
  const auto n = static_cast<size_t>(c.size());
  if (send_counts.size() != n)
    throw InvalidArgument("all_to_all_counts", fmt::format("{} counts for {} ranks", send_counts.size(), n),
                          "pass one count per rank of this communicator");
  std::vector<uint64_t> out(send_counts.begin(), send_counts.end()), in(n);
  c.all_to_all(out.data(), in.data(), 1, DType::i64);
  return {in.begin(), in.end()};
}

void tree_reduce_scatter(Communicator& c, const float* send, float* recv, size_t count) {
  const auto n = static_cast<size_t>(c.size());
  if (count == 0) return;
  if (n == 1) {
    std::copy(send, send + count, recv);
    return;
  }
  // received[i] = rank i's chunk for this rank (uninitialized: all_to_all writes all of it).
  const std::unique_ptr<float[]> received(new float[count * n]);
  c.all_to_all(send, received.get(), count, DType::f32);
  std::vector<float*> parts(n);
  for (size_t i = 0; i < n; ++i) parts[i] = received.get() + i * count;
  tree_sum(parts, static_cast<int64_t>(count));
  std::copy(received.get(), received.get() + count, recv);
}

void tree_all_reduce(Communicator& c, float* buf, size_t count) {
  const auto n = static_cast<size_t>(c.size());
  if (n == 1 || count == 0) return;
  const size_t chunk = (count + n - 1) / n;
  std::vector<float> mine(chunk);
  if (chunk * n == count) {  // no padding: straight from and into buf
    tree_reduce_scatter(c, buf, mine.data(), chunk);
    c.all_gather(mine.data(), buf, chunk, DType::f32);
    return;
  }
  std::vector<float> padded(chunk * n, 0.0f);
  std::copy(buf, buf + count, padded.begin());
  tree_reduce_scatter(c, padded.data(), mine.data(), chunk);
  c.all_gather(mine.data(), padded.data(), chunk, DType::f32);
  std::copy(padded.begin(), padded.begin() + static_cast<std::ptrdiff_t>(count), buf);
}

double tree_all_reduce(Communicator& c, double mine) {
  std::vector<double> all(static_cast<size_t>(c.size()));
  c.all_gather(&mine, all.data(), 1, DType::f64);
  return tree_sum(all);
}

}  // namespace meshtrain::comm
