#include "meshtrain/nn/parallel/context_parallel.h"

#include <fmt/format.h>

#include <cmath>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/functional.h"

namespace meshtrain::nn {

namespace F = functional;

namespace {

// Point-to-point tags of the ring (the context communicator is the ring's own).
constexpr int kKvTag = 0x4350;
constexpr int kDkvTag = kKvTag + 1;

// How query chunk qa attends key chunk kb (global chunk indexes).
enum class Pair : uint8_t { skip, diagonal, full };
Pair pair_kind(bool causal, int64_t qa, int64_t kb) {
  if (!causal || kb < qa) return Pair::full;
  return kb == qa ? Pair::diagonal : Pair::skip;
}

struct Dims {
  int64_t p, b, h, c, d;
  int64_t n() const { return b * h; }     // attention rows per chunk (batch x heads)
  int64_t numel() const { return p * b * h * c * d; }
};

Dims check_operands(const char* op, const ContextParallelGroup& g, std::initializer_list<std::pair<const char*, const Tensor*>> ts) {
  const Tensor& first = *ts.begin()->second;
  for (auto [what, t] : ts)
    if (!t->defined() || t->dtype() != DType::f32 || !t->is_contiguous() || t->dim() != 5 || t->shape() != first.shape())
      throw InvalidArgument(op,
                            fmt::format("{} is {} (expected the shape of {}: {})", what,
                                        t->defined() ? fmt::format("{} {}", dtype_name(t->dtype()), shape_to_string(t->shape()))
                                                     : std::string("undefined"),
                                        ts.begin()->first, shape_to_string(first.shape())),
                            "pass contiguous f32 (chunks, batch, heads, chunk length, head_dim) tensors");
  const Dims d{first.size(0), first.size(1), first.size(2), first.size(3), first.size(4)};
  if (d.p != g.local_chunks())
    throw InvalidArgument(op, fmt::format("{} chunks per rank, the group holds {}", d.p, g.local_chunks()),
                          "shard the sequence with the same group (shard_sequence)");
  return d;
}

// Chunk p of a (P, B, H, c, D) tensor as (B H, c, D); of (P, B, H, c) as (B H, c).
Tensor rows_of(const Tensor& t, int64_t p, const Dims& d) { return t.select(0, p).view({d.n(), d.c, d.d}); }
Tensor lse_of(const Tensor& t, int64_t p, const Dims& d) { return t.select(0, p).view({d.n(), d.c}); }

// Starts sending `out` to the next rank and receiving the previous rank's into `in`.
comm::Work shift(comm::Communicator& c, const Tensor& out, const Tensor& in, int tag) {
  const int n = c.size(), r = c.rank();
  const size_t count = static_cast<size_t>(out.numel());
  return c.batch_isend_irecv({comm::P2POp::isend(out.data_ptr(), count, DType::f32, (r + 1) % n, tag),
                              comm::P2POp::irecv(in.data_ptr(), count, DType::f32, (r + n - 1) % n, tag)});
}

void wait(comm::Work& w) {
  const F::ProfileScope scope("cp ring send/recv wait");
  w.wait();
}

// ---- ring ----

Tensor ring_forward(const ContextParallelGroup& g, const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                    double scale, ContextAttentionSaved& saved, const Dims& d) {
  const int n = g.size(), r = g.rank();
  Tensor out = Tensor::zeros(q.shape(), DType::f32);
  Tensor lse = Tensor::full({d.p, d.b, d.h, d.c}, -INFINITY, DType::f32);
  Tensor kv = Tensor::empty({2, d.p, d.b, d.h, d.c, d.d}, DType::f32);  // the block in hand: its k, v
  kv.select(0, 0).copy_from(k);
  kv.select(0, 1).copy_from(v);
  Tensor next = n > 1 ? Tensor::empty(kv.shape(), DType::f32) : Tensor();
  Tensor part = Tensor::empty({d.n(), d.c, d.d}, DType::f32), part_lse = Tensor::empty({d.n(), d.c}, DType::f32);
  const std::vector<int64_t> mine = g.chunk_ids(r);
  for (int s = 0; s < n; ++s) {
    const std::vector<int64_t> theirs = g.chunk_ids((r - s + n) % n);
    comm::Work w;
    if (s + 1 < n) w = shift(*g.comm, kv, next, kKvTag);  // the next block arrives while this one is used
    for (int64_t a = 0; a < d.p; ++a)
      for (int64_t b = 0; b < d.p; ++b) {
        const Pair kind = pair_kind(causal, mine[static_cast<size_t>(a)], theirs[static_cast<size_t>(b)]);
        if (kind == Pair::skip) continue;
        F::attention_forward(rows_of(q, a, d), rows_of(kv.select(0, 0), b, d), rows_of(kv.select(0, 1), b, d),
                             kind == Pair::diagonal, scale, part, part_lse);
        F::attention_merge(rows_of(out, a, d), lse_of(lse, a, d), part, part_lse);
      }
    if (s + 1 < n) {
      wait(w);
      std::swap(kv, next);
    }
  }
  saved = {q, k, v, out, lse};
  return out;
}

void ring_backward(const ContextParallelGroup& g, const Tensor& dout, bool causal, double scale,
                   const ContextAttentionSaved& sv, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                   const Dims& d) {
  const int n = g.size(), r = g.rank();
  dq.fill(0.0);
  Tensor kv = Tensor::empty({2, d.p, d.b, d.h, d.c, d.d}, DType::f32);
  kv.select(0, 0).copy_from(sv.k);
  kv.select(0, 1).copy_from(sv.v);
  // The dK/dV accumulators of the block in hand travel with it.
  Tensor dkv = Tensor::zeros(kv.shape(), DType::f32);
  Tensor next = n > 1 ? Tensor::empty(kv.shape(), DType::f32) : Tensor();
  Tensor dnext = n > 1 ? Tensor::empty(kv.shape(), DType::f32) : Tensor();
  const std::vector<int64_t> mine = g.chunk_ids(r);
  for (int s = 0; s < n; ++s) {
    const std::vector<int64_t> theirs = g.chunk_ids((r - s + n) % n);
    comm::Work w;
    if (s + 1 < n) w = shift(*g.comm, kv, next, kKvTag);
    for (int64_t a = 0; a < d.p; ++a)
      for (int64_t b = 0; b < d.p; ++b) {
        const Pair kind = pair_kind(causal, mine[static_cast<size_t>(a)], theirs[static_cast<size_t>(b)]);
        if (kind == Pair::skip) continue;
        F::attention_backward(rows_of(sv.q, a, d), rows_of(kv.select(0, 0), b, d), rows_of(kv.select(0, 1), b, d),
                              rows_of(sv.out, a, d), lse_of(sv.lse, a, d), rows_of(dout, a, d),
                              kind == Pair::diagonal, scale, rows_of(dq, a, d), rows_of(dkv.select(0, 0), b, d),
                              rows_of(dkv.select(0, 1), b, d), /*accumulate=*/true);
      }
    if (s + 1 < n) {
      comm::Work dw = shift(*g.comm, dkv, dnext, kDkvTag);
      wait(dw);
      wait(w);
      std::swap(kv, next);
      std::swap(dkv, dnext);
    }
  }
  if (n > 1) {  // the accumulators now hold block r+1's sums: hand each to its owner
    comm::Work dw = shift(*g.comm, dkv, dnext, kDkvTag);
    wait(dw);
    std::swap(dkv, dnext);
  }
  dk.copy_from(dkv.select(0, 0));
  dv.copy_from(dkv.select(0, 1));
}

// ---- all_to_all (Ulysses) ----

// (P, B, H, c, D) of this rank's chunks -> (B, H / n, T, D): its heads' share
// of the whole sequence.
Tensor to_heads(const ContextParallelGroup& g, const Tensor& x, const Dims& d) {
  const int n = g.size();
  const int64_t h = d.h / n, t = d.c * g.chunks();
  Tensor send = Tensor::empty({n, d.p, d.b, h, d.c, d.d}, DType::f32), recv = Tensor::empty(send.shape(), DType::f32);
  for (int j = 0; j < n; ++j) send.select(0, j).copy_from(x.narrow(2, j * h, h));
  {
    const F::ProfileScope scope("cp all_to_all");
    g.comm->all_to_all(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(send.numel() / n), DType::f32);
  }
  Tensor full = Tensor::empty({d.b, h, t, d.d}, DType::f32);
  for (int i = 0; i < n; ++i) {
    const std::vector<int64_t> ids = g.chunk_ids(i);
    for (int64_t p = 0; p < d.p; ++p)
      full.narrow(2, ids[static_cast<size_t>(p)] * d.c, d.c).copy_from(recv.select(0, i).select(0, p));
  }
  return full;
}

// The inverse: (B, H / n, T, D) -> this rank's chunks of every head in `x`.
void to_chunks(const ContextParallelGroup& g, const Tensor& full, const Tensor& x, const Dims& d) {
  const int n = g.size();
  const int64_t h = d.h / n;
  Tensor send = Tensor::empty({n, d.p, d.b, h, d.c, d.d}, DType::f32), recv = Tensor::empty(send.shape(), DType::f32);
  for (int i = 0; i < n; ++i) {
    const std::vector<int64_t> ids = g.chunk_ids(i);
    for (int64_t p = 0; p < d.p; ++p)
      send.select(0, i).select(0, p).copy_from(full.narrow(2, ids[static_cast<size_t>(p)] * d.c, d.c));
  }
  {
    const F::ProfileScope scope("cp all_to_all");
    g.comm->all_to_all(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(send.numel() / n), DType::f32);
  }
  for (int j = 0; j < n; ++j) x.narrow(2, j * h, h).copy_from(recv.select(0, j));
}

void check_heads(const char* op, const ContextParallelGroup& g, const Dims& d) {
  if (d.h % g.size() != 0)
    throw InvalidArgument(op,
                          fmt::format("{} heads on this rank do not split over the {} ranks of the context axis "
                                      "(all_to_all gives each rank whole heads)",
                                      d.h, g.size()),
                          "use --cp-comm ring, or a head count (per tensor-parallel rank) divisible by the context axis");
}

}  // namespace


std::vector<int64_t> ContextParallelGroup::chunk_ids(int r) const {
  if (!load_balance) return {r};
  return {r, 2 * int64_t{size()} - 1 - r};
}

void ContextParallelGroup::check_length(int64_t t, std::string_view what) const {
  check_context_length(t, size(), load_balance, what);
}

void check_context_length(int64_t t, int ranks, bool load_balance, std::string_view what) {
  const int64_t chunks = load_balance ? 2 * int64_t{ranks} : ranks;
  if (t % chunks == 0) return;
  throw InvalidArgument(std::string(what),
                        fmt::format("sequence length {} is not divisible by {} ({} chunks over the context axis of {} "
                                    "ranks{})",
                                    t, chunks, chunks, ranks, load_balance ? ", two per rank: zig-zag" : ""),
                        fmt::format("use a length divisible by {}", chunks));
}

Tensor shard_sequence(const Tensor& x, const ContextParallelGroup& g, int dim) {
  if (!x.defined() || dim < 0 || dim >= x.dim())
    throw InvalidArgument("shard_sequence", fmt::format("dim {} of a {}-d tensor", dim, x.defined() ? x.dim() : 0),
                          "pass a tensor holding the whole sequence along dim");
  if (!g.active()) return x.contiguous();
  g.check_length(x.size(dim), "shard_sequence");
  const int64_t c = x.size(dim) / g.chunks();
  std::vector<int64_t> shape = x.shape();
  shape[static_cast<size_t>(dim)] = c * g.local_chunks();
  Tensor out = Tensor::empty(shape, x.dtype());
  const std::vector<int64_t> ids = g.chunk_ids(g.rank());
  for (size_t p = 0; p < ids.size(); ++p)
    out.narrow(dim, static_cast<int64_t>(p) * c, c).copy_from(x.narrow(dim, ids[p] * c, c));
  return out;
}

Tensor unshard_sequence(const Tensor& local, const ContextParallelGroup& g, int dim) {
  if (!g.active()) return local.contiguous();
  const Tensor mine = local.contiguous();
  const int n = g.size();
  const int64_t c = local.size(dim) / g.local_chunks();
  std::vector<int64_t> gshape = mine.shape();
  gshape.insert(gshape.begin(), n);
  Tensor all = Tensor::empty(gshape, mine.dtype());
  g.comm->all_gather(mine.data_ptr(), all.data_ptr(), static_cast<size_t>(mine.numel()), mine.dtype());
  std::vector<int64_t> shape = mine.shape();
  shape[static_cast<size_t>(dim)] = c * g.chunks();
  Tensor out = Tensor::empty(shape, mine.dtype());
  for (int i = 0; i < n; ++i) {
    const std::vector<int64_t> ids = g.chunk_ids(i);
    for (size_t p = 0; p < ids.size(); ++p)
      out.narrow(dim, ids[p] * c, c).copy_from(all.select(0, i).narrow(dim, static_cast<int64_t>(p) * c, c));
  }
  return out;
}

std::vector<int64_t> sequence_positions(const ContextParallelGroup& g, int64_t t) {
  std::vector<int64_t> pos;
  if (!g.active()) {
    for (int64_t i = 0; i < t; ++i) pos.push_back(i);
    return pos;
  }
  g.check_length(t, "sequence_positions");
  const int64_t c = t / g.chunks();
  for (int64_t id : g.chunk_ids(g.rank()))
    for (int64_t i = 0; i < c; ++i) pos.push_back(id * c + i);
  return pos;
}

Tensor context_attention_forward(const ContextParallelGroup& g, const Tensor& q, const Tensor& k, const Tensor& v,
                                 bool causal, double scale, ContextAttentionSaved& saved) {
  const char* op = "context_attention_forward";
  const Dims d = check_operands(op, g, {{"q", &q}, {"k", &k}, {"v", &v}});
  if (g.kind == ContextComm::ring || !g.active()) return ring_forward(g, q, k, v, causal, scale, saved, d);
  check_heads(op, g, d);
  const Tensor qf = to_heads(g, q, d), kf = to_heads(g, k, d), vf = to_heads(g, v, d);
  const int64_t rows = qf.size(0) * qf.size(1), t = qf.size(2);
  Tensor of = Tensor::empty(qf.shape(), DType::f32), lf = Tensor::empty({rows, t}, DType::f32);
  F::attention_forward(qf.view({rows, t, d.d}), kf.view({rows, t, d.d}), vf.view({rows, t, d.d}), causal, scale,
                       of.view({rows, t, d.d}), lf);
  Tensor out = Tensor::empty(q.shape(), DType::f32);
  to_chunks(g, of, out, d);
  saved = {qf, kf, vf, of, lf};
  return out;
}

void context_attention_backward(const ContextParallelGroup& g, const Tensor& dout, bool causal, double scale,
                                const ContextAttentionSaved& saved, const Tensor& dq, const Tensor& dk,
                                const Tensor& dv) {
  const char* op = "context_attention_backward";
  const Dims d = check_operands(op, g, {{"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  if (!saved.q.defined())
    throw InvalidArgument(op, "nothing saved", "call context_attention_forward first, with the same group");
  if (g.kind == ContextComm::ring || !g.active()) {
    ring_backward(g, dout, causal, scale, saved, dq, dk, dv, d);
    return;
  }
  const Tensor gf = to_heads(g, dout, d);
  const int64_t rows = gf.size(0) * gf.size(1), t = gf.size(2);
  Tensor dqf = Tensor::empty(gf.shape(), DType::f32), dkf = Tensor::empty(gf.shape(), DType::f32),
         dvf = Tensor::empty(gf.shape(), DType::f32);
  auto v3 = [&](const Tensor& x) { return x.view({rows, t, d.d}); };
  F::attention_backward(v3(saved.q), v3(saved.k), v3(saved.v), v3(saved.out), saved.lse, v3(gf), causal, scale,
                        v3(dqf), v3(dkf), v3(dvf));
  to_chunks(g, dqf, dq, d);
  to_chunks(g, dkf, dk, d);
  to_chunks(g, dvf, dv, d);
}

}  // namespace meshtrain::nn
