// Multi-rank checks of the MPI engine; run under mpirun (any rank count):
//
//   mpirun --oversubscribe -np 4 build/release/meshtrain/comm/mpi/mpi_communicator_test
//
// Every collective, dtype and reduce op at sizes 0, 1, 7, 1000 and 2^20+3, in
// place and out of place, against closed-form results (small integers, so
// every dtype represents them exactly and results are compared bit for bit);
// ring vs native reduce-scatter; async issue order; send/recv; split; and the
// faults: mismatched collectives, a rank that arrives past the deadline (with
// and without fingerprint checks), a recv nobody sends to.
// Prints each failure with its rank; exits non-zero on any rank's failure.
// `mpi_communicator_test faults` runs only the fault tests (for repeating them).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/comm/mpi/communicator.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/half.h"

namespace {

using meshtrain::AbortedError;
using meshtrain::CommError;
using meshtrain::DType;
using meshtrain::dtype_name;
using meshtrain::dtype_size;
using meshtrain::MismatchError;
using meshtrain::TimeoutError;
using meshtrain::comm::Communicator;
using meshtrain::comm::ReduceOp;
using meshtrain::comm::Work;
namespace mpi = meshtrain::comm::mpi;
using Clock = std::chrono::steady_clock;
using Bytes = std::vector<std::byte>;

constexpr size_t kSizes[] = {0, 1, 7, 1000, (size_t{1} << 20) + 3};

int g_rank = 0;
int g_checks = 0;
int g_failures = 0;

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  if (++g_failures <= 30) std::fprintf(stderr, "[rank %d] FAILED: %s\n", g_rank, what.c_str());
}

bool is_unsigned(DType t) { return t == DType::u8; }

// Writes v (a value every dtype here represents exactly, or the result of
// the documented rounding) into element i.
void put(DType t, void* p, size_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(p)[i] = v; return;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = meshtrain::float_to_bf16(static_cast<float>(v)); return;
    case DType::f16: static_cast<uint16_t*>(p)[i] = meshtrain::float_to_f16(static_cast<float>(v)); return;
    case DType::i8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(static_cast<int64_t>(v)); return;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(static_cast<int64_t>(v)); return;
    case DType::i64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); return;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(static_cast<int64_t>(v)); return;
  }
}

double get(DType t, const void* p, size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return meshtrain::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return meshtrain::f16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::i8: return static_cast<const int8_t*>(p)[i];
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

// Input of rank r at global element j: small integers, period 18 in j.
// prod gets {-1, 1, 2} (unsigned: {1, 2}) so products stay small.
constexpr size_t kPeriod = 18;
int64_t value(DType t, ReduceOp op, int r, size_t j, int salt = 0) {
  const size_t rr = static_cast<size_t>(r) + static_cast<size_t>(salt) * 5;
  if (op == ReduceOp::prod) {
    if (is_unsigned(t)) return 1 + static_cast<int64_t>((j + rr) % 2);
    static constexpr int64_t kVals[] = {-1, 1, 2};
    return kVals[(j * 5 + rr * 3) % 3];
  }
  const int64_t v = static_cast<int64_t>((j * 7 + rr * 13) % 9);
  return is_unsigned(t) ? v : v - 4;
}

// Fills count elements whose global indices start at `first` by tiling one
// period of fn(j).
void fill(DType t, void* dst, size_t first, size_t count, const std::function<double(size_t)>& fn) {
  if (count == 0) return;
  const size_t es = dtype_size(t);
  Bytes period(kPeriod * es);
  for (size_t k = 0; k < kPeriod; ++k) put(t, period.data(), k, fn(first + k));
  auto* out = static_cast<std::byte*>(dst);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(kPeriod, count - done);
    std::memcpy(out + done * es, period.data(), n * es);
    done += n;
  }
}

// The documented result of reducing value(t, op, 0..n-1, j), as put() stores it.
double expected_reduce(DType t, ReduceOp op, int n, size_t j) {
  int64_t acc = value(t, op, 0, j);
  for (int r = 1; r < n; ++r) {
    const int64_t v = value(t, op, r, j);
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += v; break;
      case ReduceOp::prod: acc *= v; break;
      case ReduceOp::max: acc = std::max(acc, v); break;
      case ReduceOp::min: acc = std::min(acc, v); break;
    }
  }
  if (op != ReduceOp::avg) return static_cast<double>(acc);  // put() wraps integers
  switch (t) {
    case DType::f64: return static_cast<double>(acc) / n;
    case DType::f32:
    case DType::bf16:
    case DType::f16: return static_cast<float>(acc) / static_cast<float>(n);
    case DType::i8: return static_cast<int8_t>(acc) / n;  // wrapped sum, truncated
    case DType::u8: return static_cast<uint8_t>(acc) / n;
    case DType::i32:
    case DType::i64: return static_cast<double>(acc / n);
  }
  return 0;
}

// Compares element-wise bytes; reports the first difference.
void expect_equal(DType t, const void* got, const void* want, size_t count, const std::string& what) {
  const size_t es = dtype_size(t);
  if (count == 0 || std::memcmp(got, want, count * es) == 0) return expect(true, what);
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(static_cast<const std::byte*>(got) + i * es,
                    static_cast<const std::byte*>(want) + i * es, es) != 0) {
      return expect(false, fmt::format("{}: element {} is {} but should be {}", what, i,
                                       get(t, got, i), get(t, want, i)));
    }
  }
}

void test_all_reduce(Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (DType t : meshtrain::kAllDTypes)
    for (ReduceOp op : meshtrain::comm::kAllReduceOps)
      for (size_t count : kSizes)
        for (bool in_place : {false, true}) {
          const size_t es = dtype_size(t);
          Bytes send(count * es), recv(count * es), want(count * es);
          fill(t, send.data(), 0, count, [&](size_t j) { return double(value(t, op, r, j)); });
          fill(t, want.data(), 0, count, [&](size_t j) { return expected_reduce(t, op, n, j); });
          const std::string what = fmt::format("all_reduce {} {} x {} {}", dtype_name(t),
                                               meshtrain::comm::reduce_op_name(op), count,
                                               in_place ? "in place" : "out of place");
          if (in_place) {
            c.all_reduce(send.data(), send.data(), count, t, op);
            expect_equal(t, send.data(), want.data(), count, what);
          } else {
            const Bytes before = send;
            c.all_reduce(send.data(), recv.data(), count, t, op);
            expect_equal(t, recv.data(), want.data(), count, what);
            expect(send == before, what + ": send buffer unchanged");
          }
        }
}

void test_reduce_scatter(Communicator& c, const char* algo) {
  const int n = c.size(), r = c.rank();
  const size_t un = static_cast<size_t>(n), ur = static_cast<size_t>(r);
  for (DType t : meshtrain::kAllDTypes)
    for (ReduceOp op : meshtrain::comm::kAllReduceOps)
      for (size_t count : kSizes)
        for (bool in_place : {false, true}) {
          const size_t es = dtype_size(t);
          Bytes send(un * count * es), recv(count * es), want(count * es);
          fill(t, send.data(), 0, un * count, [&](size_t j) { return double(value(t, op, r, j)); });
          fill(t, want.data(), ur * count, count, [&](size_t j) { return expected_reduce(t, op, n, j); });
          const std::string what = fmt::format("reduce_scatter({}) {} {} x {} {}", algo, dtype_name(t),
                                               meshtrain::comm::reduce_op_name(op), count,
                                               in_place ? "in place" : "out of place");
          if (in_place) {
            std::byte* mine = send.data() + ur * count * es;
            c.reduce_scatter(send.data(), mine, count, t, op);
            expect_equal(t, mine, want.data(), count, what);
          } else {
            const Bytes before = send;
            c.reduce_scatter(send.data(), recv.data(), count, t, op);
            expect_equal(t, recv.data(), want.data(), count, what);
            expect(send == before, what + ": send buffer unchanged");
          }
        }
}

void test_data_movement(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const size_t un = static_cast<size_t>(n), ur = static_cast<size_t>(r);
  for (DType t : meshtrain::kAllDTypes)
    for (size_t count : kSizes) {
      const size_t es = dtype_size(t);
      const std::string suffix = fmt::format("{} x {}", dtype_name(t), count);
      // all_gather, out of place and in place.
      {
        Bytes send(count * es), recv(un * count * es), want(un * count * es);
        fill(t, send.data(), 0, count, [&](size_t j) { return double(value(t, ReduceOp::sum, r, j)); });
        for (int p = 0; p < n; ++p)
          fill(t, want.data() + size_t(p) * count * es, 0, count,
               [&](size_t j) { return double(value(t, ReduceOp::sum, p, j)); });
        c.all_gather(send.data(), recv.data(), count, t);
        expect_equal(t, recv.data(), want.data(), un * count, "all_gather " + suffix);
        Bytes inplace(un * count * es);
        if (count > 0) std::memcpy(inplace.data() + ur * count * es, send.data(), count * es);
        c.all_gather(inplace.data() + ur * count * es, inplace.data(), count, t);
        expect_equal(t, inplace.data(), want.data(), un * count, "all_gather in place " + suffix);
      }
      // broadcast from every root.
      for (int root = 0; root < n; ++root) {
        Bytes buf(count * es), want(count * es);
        fill(t, buf.data(), 0, count,
             [&](size_t j) { return double(value(t, ReduceOp::sum, r, j, /*salt=*/1)); });
        fill(t, want.data(), 0, count,
             [&](size_t j) { return double(value(t, ReduceOp::sum, root, j, /*salt=*/1)); });
        c.broadcast(buf.data(), count, t, root);
        expect_equal(t, buf.data(), want.data(), count, fmt::format("broadcast root {} {}", root, suffix));
      }
      // all_to_all: block p of rank r's send lands in block r of rank p's recv.
      {
        Bytes send(un * count * es), recv(un * count * es), want(un * count * es);
        for (int p = 0; p < n; ++p) {
          fill(t, send.data() + size_t(p) * count * es, 0, count,
               [&](size_t j) { return double(value(t, ReduceOp::sum, r * n + p, j)); });
          fill(t, want.data() + size_t(p) * count * es, 0, count,
               [&](size_t j) { return double(value(t, ReduceOp::sum, p * n + r, j)); });
        }
        c.all_to_all(send.data(), recv.data(), count, t);
        expect_equal(t, recv.data(), want.data(), un * count, "all_to_all " + suffix);
      }
      // send/recv around the ring: two messages on one tag arrive in order.
      if (n > 1) {
        const int next = (r + 1) % n, prev = (r + n - 1) % n;
        Bytes a(count * es), b(count * es), got_a(count * es), got_b(count * es), want_a(count * es),
            want_b(count * es);
        fill(t, a.data(), 0, count, [&](size_t j) { return double(value(t, ReduceOp::sum, r, j, 2)); });
        fill(t, b.data(), 0, count, [&](size_t j) { return double(value(t, ReduceOp::sum, r, j, 3)); });
        fill(t, want_a.data(), 0, count, [&](size_t j) { return double(value(t, ReduceOp::sum, prev, j, 2)); });
        fill(t, want_b.data(), 0, count, [&](size_t j) { return double(value(t, ReduceOp::sum, prev, j, 3)); });
        Work ra = c.recv_async(got_a.data(), count, t, prev, 7);
        Work rb = c.recv_async(got_b.data(), count, t, prev, 7);
        Work sa = c.send_async(a.data(), count, t, next, 7);
        Work sb = c.send_async(b.data(), count, t, next, 7);
        sb.wait();
        sa.wait();
        rb.wait();
        ra.wait();
        expect_equal(t, got_a.data(), want_a.data(), count, "send/recv first " + suffix);
        expect_equal(t, got_b.data(), want_b.data(), count, "send/recv second " + suffix);
      }
    }
  c.barrier();
}

// Closed-form checks that need specific values.
void test_special_values(Communicator& c) {
  const int n = c.size(), r = c.rank();
  // Integer sums wrap modulo 2^bits; avg divides the wrapped sum, toward zero.
  {
    int8_t v[2] = {100, 100};
    c.all_reduce(v, v, 1, DType::i8, ReduceOp::sum);
    c.all_reduce(v + 1, v + 1, 1, DType::i8, ReduceOp::avg);
    const auto wrapped = static_cast<int8_t>(100 * n);
    expect(v[0] == wrapped, fmt::format("i8 sum wraps: {} vs {}", v[0], wrapped));
    expect(v[1] == static_cast<int8_t>(wrapped / n), fmt::format("i8 avg of wrapped sum: {}", v[1]));
  }
  {
    int32_t v = r == 0 ? -(2 * n - 1) : 0;  // avg = -(2n-1)/n = -1.x -> -1
    c.all_reduce(&v, &v, 1, DType::i32, ReduceOp::avg);
    expect(v == -1, fmt::format("i32 avg truncates toward zero: {}", v));
  }
  // Counts MPI cannot take are refused up front, and the communicator lives on.
  {
    uint8_t dummy[1] = {};
    try {
      c.all_reduce(dummy, dummy, size_t{1} << 31, DType::u8, ReduceOp::sum);  // never touched
      expect(false, "count 2^31: no Unsupported");
    } catch (const meshtrain::Unsupported& e) {
      expect(e.detail().find("2147483647") != std::string::npos, std::string("count 2^31: ") + e.what());
    }
    int32_t v = 1;
    c.all_reduce(&v, &v, 1, DType::i32, ReduceOp::sum);
    expect(v == n, "usable after Unsupported");
  }
  // bf16: the ring keeps partial sums in f32 and rounds once.
  if (n >= 2) {
    auto ring = mpi::create_world({.reduce_scatter = mpi::ReduceScatterAlgorithm::ring});
    const size_t un = static_cast<size_t>(n);
    std::vector<uint16_t> send(un), recv(1);
    for (size_t b = 0; b < un; ++b) send[b] = meshtrain::float_to_bf16(r == 0 ? 256.0f : 1.0f);
    ring->reduce_scatter(send.data(), recv.data(), 1, DType::bf16, ReduceOp::sum);
    const uint16_t want = meshtrain::float_to_bf16(256.0f + float(n - 1));
    expect(recv[0] == want, fmt::format("bf16 ring rounds once: {} vs {}", meshtrain::bf16_to_float(recv[0]),
                       meshtrain::bf16_to_float(want)));
  }
}

uint32_t hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Ring and native reduce-scatter agree on random floats (within rounding) and
// the ring is bit-identical across runs.
void test_ring_vs_native(Communicator& ring, Communicator& native) {
  const int n = ring.size(), r = ring.rank();
  const size_t un = static_cast<size_t>(n);
  for (size_t count : {size_t{1000}, (size_t{1} << 20) + 3}) {
    std::vector<float> send(un * count), a(count), b(count), a2(count);
    for (size_t j = 0; j < send.size(); ++j)
      send[j] = float(hash(uint32_t(j * 131 + size_t(r) * 7919))) / 4294967296.0f - 0.5f;
    ring.reduce_scatter(send.data(), a.data(), count, DType::f32, ReduceOp::sum);
    ring.reduce_scatter(send.data(), a2.data(), count, DType::f32, ReduceOp::sum);
    native.reduce_scatter(send.data(), b.data(), count, DType::f32, ReduceOp::sum);
    expect(a == a2, fmt::format("ring reduce_scatter deterministic (count {})", count));
    double worst = 0;
    for (size_t j = 0; j < count; ++j) worst = std::max(worst, double(std::fabs(a[j] - b[j])));
    expect(worst <= 1e-5 * n, fmt::format("ring vs native f32 random (count {}): max diff {}", count, worst));
  }
}

void test_async_order(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const size_t count = 4099, un = static_cast<size_t>(n);
  std::vector<int32_t> a(count, r), b(count, 2 * r), rs(un * count, 1), rs_out(count), ag(un * count);
  int32_t one = r;
  Work wa = c.all_reduce_async(a.data(), a.data(), count, DType::i32, ReduceOp::sum);
  Work wrs = c.reduce_scatter_async(rs.data(), rs_out.data(), count, DType::i32, ReduceOp::sum);
  Work wb = c.all_reduce_async(b.data(), b.data(), count, DType::i32, ReduceOp::max);
  Work wg = c.all_gather_async(&one, ag.data(), 1, DType::i32);
  Work wbar = c.barrier_async();
  wbar.wait();  // completes in issue order: everything before it is done too
  expect(wa.is_completed() && wrs.is_completed() && wb.is_completed() && wg.is_completed(),
         "async: earlier works complete before a later one");
  wg.wait();
  wb.wait();
  wrs.wait();
  wa.wait();
  const int32_t sum = n * (n - 1) / 2;
  expect(a[0] == sum && a[count - 1] == sum, "async all_reduce sum");
  expect(b[0] == 2 * (n - 1) && b[count - 1] == 2 * (n - 1), "async all_reduce max");
  expect(rs_out[0] == n && rs_out[count - 1] == n, "async reduce_scatter");
  for (int p = 0; p < n; ++p) expect(ag[size_t(p)] == p, "async all_gather");
  expect(c.seq() >= 5, "sequence numbers advance");
}

// Grouped send/recv (batch_isend_irecv): a ring each way, a pairwise swap
// posted in opposite orders, and every rank with every rank (itself included).
void test_p2p_group(Communicator& c) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  auto value = [](int rank, size_t i) { return int64_t{rank} * 1'000'003 + static_cast<int64_t>(i); };
  for (size_t count : {size_t{1}, size_t{100'000}}) {
    std::vector<int64_t> out(count), in(count, -1), back(count, -1);
    for (size_t i = 0; i < count; ++i) out[i] = value(r, i);
    Work w = c.batch_isend_irecv({meshtrain::comm::P2POp::isend(out.data(), count, DType::i64, next),
                                  meshtrain::comm::P2POp::irecv(in.data(), count, DType::i64, prev)});
    w.wait();
    bool ok = w.is_completed();
    for (size_t i = 0; i < count; ++i) ok = ok && in[i] == value(prev, i);
    expect(ok, fmt::format("group ring from rank {} (count {})", prev, count));
    c.batch_isend_irecv({meshtrain::comm::P2POp::irecv(back.data(), count, DType::i64, next, 3),
                         meshtrain::comm::P2POp::isend(out.data(), count, DType::i64, prev, 3)})
        .wait();
    ok = true;
    for (size_t i = 0; i < count; ++i) ok = ok && back[i] == value(next, i);
    expect(ok, fmt::format("group reverse ring from rank {} (count {})", next, count));
  }
  if (n >= 2 && r < 2) {  // ranks 0 and 1 swap; rank 1 lists the recv first
    const int peer = 1 - r;
    std::vector<float> out(5000, float(r + 1)), in(5000, 0);
    std::vector<meshtrain::comm::P2POp> ops = {meshtrain::comm::P2POp::isend(out.data(), out.size(), DType::f32, peer),
                                               meshtrain::comm::P2POp::irecv(in.data(), in.size(), DType::f32, peer)};
    if (r == 1) std::swap(ops[0], ops[1]);
    c.batch_isend_irecv(ops).wait();
    expect(in == std::vector<float>(5000, float(peer + 1)), "group swap in opposite orders");
  }
  std::vector<int64_t> out(static_cast<size_t>(n)), in(static_cast<size_t>(n), -1);
  std::vector<meshtrain::comm::P2POp> ops;
  for (int p = 0; p < n; ++p) {
    out[size_t(p)] = value(r, size_t(p));
    ops.push_back(meshtrain::comm::P2POp::irecv(&in[size_t(p)], 1, DType::i64, p, 9));
  }
  for (int p = n - 1; p >= 0; --p) ops.push_back(meshtrain::comm::P2POp::isend(&out[size_t(p)], 1, DType::i64, p, 9));
  c.batch_isend_irecv(ops).wait();
  bool ok = true;
  for (int p = 0; p < n; ++p) ok = ok && in[size_t(p)] == value(p, size_t(r));
  expect(ok, "group with every rank, self included");
}

// A receive completes without waiting for an earlier send (too big for
// MPI's eager path) that its receiver posts only after this receive: rank 0
// sends A then waits to receive B; rank 1 sends B, then a barrier that rank 0
// reaches only after its receive, and only then receives A. With issue-order
// completion of point-to-point operations this deadlocks (a pipeline's
// interleaved schedule did).
void test_p2p_out_of_order(Communicator& c) {
  if (c.size() < 2 || c.rank() > 1) {
    c.barrier();
    return;
  }
  std::vector<float> a(1 << 18, 1.0f), b(1 << 18, 2.0f), got(1 << 18, 0.0f);
  if (c.rank() == 0) {
    Work send_a = c.send_async(a.data(), a.size(), DType::f32, 1, 11);
    c.recv(got.data(), got.size(), DType::f32, 1, 12);
    expect(got == b, "p2p: the receive completed before the earlier send");
    c.barrier();
    send_a.wait();
  } else {
    c.send(b.data(), b.size(), DType::f32, 0, 12);
    c.barrier();
    c.recv(got.data(), got.size(), DType::f32, 0, 11);
    expect(got == a, "p2p: the earlier send arrives afterwards");
  }
}

void test_split(Communicator& c) {
  const int n = c.size(), r = c.rank();
  // Two colors; key reverses the order inside each group.
  auto sub = c.split(r % 2, n - r);
  std::vector<int> members;
  for (int p = 0; p < n; ++p)
    if (p % 2 == r % 2) members.push_back(p);
  const int sub_n = int(members.size());
  int expected_rank = 0;
  for (int p : members)
    if (p > r) ++expected_rank;
  expect(sub != nullptr, "split returns a communicator");
  if (!sub) return;
  expect(sub->size() == sub_n, fmt::format("split size {} vs {}", sub->size(), sub_n));
  expect(sub->rank() == expected_rank, fmt::format("split rank {} vs {}", sub->rank(), expected_rank));
  expect(sub->timeout() == c.timeout(), "split inherits the timeout");
  int64_t v = r, want = 0;
  for (int p : members) want += p;
  sub->all_reduce(&v, &v, 1, DType::i64, ReduceOp::sum);
  expect(v == want, fmt::format("all_reduce on split: {} vs {}", v, want));
  std::vector<float> rs(size_t(sub_n) * 3, 1.0f), out(3);
  sub->reduce_scatter(rs.data(), out.data(), 3, DType::f32, ReduceOp::sum);
  expect(out[2] == float(sub_n), "reduce_scatter on split");
  // color < 0: rank 0 joins nothing.
  auto sub2 = c.split(r == 0 ? -1 : 0, 0);
  expect((r == 0) == (sub2 == nullptr), "split with negative color gives nullptr");
  if (sub2) {
    expect(sub2->size() == n - 1 && sub2->rank() == r - 1, "split without rank 0");
    sub2->barrier();
  }
  c.barrier();
}

void test_capabilities(Communicator& checked, Communicator& unchecked) {
  auto a = checked.capabilities(), b = unchecked.capabilities();
  expect(a.engine == meshtrain::comm::Engine::mpi && a.async && a.send_recv && a.split &&
             a.checks_fingerprints && a.names_missing_ranks && !a.device_memory && a.wait_from_any_thread,
         "capabilities with checks");
  // Without checks the liveness probes still name missing ranks.
  expect(!b.checks_fingerprints && b.names_missing_ranks, "capabilities without checks");
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void test_mismatch(Communicator& world) {
  const int n = world.size(), r = world.rank();
  auto c = mpi::create_world();
  c->set_timeout(std::chrono::seconds(10));
  std::vector<float> buf(1000, 1.0f);
  const auto t0 = Clock::now();
  try {
    if (r == 0) {
      c->all_reduce(buf.data(), buf.data(), 1000, DType::f32, ReduceOp::sum);
    } else {
      c->broadcast(buf.data(), 1000, DType::f32, 0);
    }
    expect(false, "mismatch: no error");
  } catch (const MismatchError& e) {
    const std::string want = fmt::format(
        "rank 0 called all_reduce #1 (f32 x 1000, sum) but {} called broadcast #1 (f32 x 1000, root 0)",
        n == 2 ? "rank 1" : n == 3 ? "ranks 1, 2" : fmt::format("ranks 1-{}", n - 1));
    expect(e.detail() == want, "mismatch detail: " + e.detail());
    expect(seconds_since(t0) < 5, "mismatch is reported at once");
    expect(r == 0 ? e.ranks().size() == size_t(n - 1) : e.ranks() == std::vector<int>{0},
           "mismatch names the other side");
  } catch (const std::exception& e) {
    expect(false, std::string("mismatch: wrong error: ") + e.what());
  }
  try {
    c->barrier();
    expect(false, "after a mismatch: no AbortedError");
  } catch (const AbortedError&) {
    expect(true, "after a mismatch: AbortedError");
  } catch (const std::exception& e) {
    expect(false, std::string("after a mismatch: wrong error: ") + e.what());
  }
  // Counts differ.
  auto d = mpi::create_world();
  d->set_timeout(std::chrono::seconds(10));
  try {
    d->all_reduce(buf.data(), buf.data(), r == 0 ? 999 : 1000, DType::f32, ReduceOp::sum);
    expect(false, "count mismatch: no error");
  } catch (const MismatchError& e) {
    expect(e.detail().find("f32 x 999") != std::string::npos, "count mismatch detail: " + e.detail());
  } catch (const std::exception& e) {
    expect(false, std::string("count mismatch: wrong error: ") + e.what());
  }
  // all_to_all_v: rank 0 expects 3 elements from rank 1, which sends 2. Rank
  // 0 names the pair; the others fail too (its notice), none hangs.
  auto v = mpi::create_world();
  v->set_timeout(std::chrono::seconds(10));
  std::vector<size_t> send(static_cast<size_t>(n), 2), recv(static_cast<size_t>(n), 2);
  if (r == 0) recv[1] = 3;
  std::vector<float> out(2 * static_cast<size_t>(n), 1.0f), in(2 * static_cast<size_t>(n) + 1);
  try {
    v->all_to_all_v(out.data(), send, in.data(), recv, DType::f32);
    expect(false, "all_to_all_v count mismatch: no error");
  } catch (const MismatchError& e) {
    expect(r != 0 || e.detail().find("rank 1 sends 2 elements to rank 0, which expects 3") != std::string::npos,
           "all_to_all_v count mismatch detail: " + e.detail());
  } catch (const AbortedError& e) {
    expect(r != 0, std::string("all_to_all_v count mismatch: rank 0 aborted: ") + e.what());
  } catch (const std::exception& e) {
    expect(false, std::string("all_to_all_v count mismatch: wrong error: ") + e.what());
  }
  world.barrier();
}

// One rank arrives 1.5 s late to a collective with a 1 s deadline.
void test_timeout(Communicator& world, bool checks) {
  const int n = world.size(), r = world.rank();
  const int late = n - 1;
  const std::string what = checks ? "timeout (checked)" : "timeout (unchecked)";
  {
    // buf outlives c: MPI cannot cancel a posted collective, so after a
    // timeout its buffers must stay valid until the communicator is gone.
    std::vector<float> buf(1000, 1.0f);
    auto c = mpi::create_world({.check_fingerprints = checks});
    c->set_timeout(std::chrono::seconds(1));
    if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    const auto t0 = Clock::now();
    try {
      c->all_reduce(buf.data(), buf.data(), 1000, DType::f32, ReduceOp::sum);
      expect(false, what + ": no error");
    } catch (const TimeoutError& e) {
      const double s = seconds_since(t0);
      expect(r != late, what + ": the late rank got a timeout: " + std::string(e.what()));
      expect(s >= 0.9 && s < 2.0, fmt::format("{}: raised after {:.2f} s", what, s));
      // With checks the missing fingerprint names the late rank; without,
      // its answer to the liveness probe does ("alive but has issued no
      // collective here yet").
      expect(e.ranks() == std::vector<int>{late}, what + ": names the late rank: " + e.what());
      expect(e.detail().find(fmt::format("all_reduce #1 (f32 x 1000, sum)")) != std::string::npos &&
                 e.detail().find(fmt::format("ranks that did not arrive: [{}]", late)) != std::string::npos,
             what + ": detail " + e.detail());
      if (!checks)
        expect(e.detail().find(fmt::format("rank {} is alive but has issued no collective", late)) !=
                   std::string::npos,
               what + ": says the late rank is alive: " + e.detail());
    } catch (const AbortedError& e) {
      // The late rank learns of the abort; so may an on-time rank whose own
      // deadline had not passed when the first rank's abort notice arrived
      // (oversubscribed ranks start waiting at different times). Either way
      // the error comes within 2x the deadline and names where it started.
      const double s = seconds_since(t0);
      expect(s < 2.0, fmt::format("{}: AbortedError after {:.2f} s", what, s));
      expect(e.ranks().size() == 1 && e.ranks()[0] != late, what + ": abort names its origin: " + e.what());
      if (r != late && checks)
        expect(std::string(e.what()).find(fmt::format("ranks that did not arrive: [{}]", late)) != std::string::npos,
               what + ": an on-time rank's abort names the late rank: " + e.what());
    } catch (const std::exception& e) {
      expect(false, what + ": wrong error: " + e.what());
    }
    try {
      c->barrier();
      expect(false, what + ": barrier after the error");
    } catch (const AbortedError&) {
      expect(true, what + ": later calls abort");
    } catch (const std::exception& e) {
      expect(false, what + ": later call, wrong error: " + e.what());
    }
  }  // destroying c waits (bounded) for what MPI could not cancel
  world.barrier();
}

void test_recv_timeout(Communicator& world) {
  const int r = world.rank();
  {
    auto c = mpi::create_world();
    c->set_timeout(std::chrono::milliseconds(300));
    if (r == 0) {
      int v = 0;
      try {
        c->recv(&v, 1, DType::i32, 1, 99);
        expect(false, "recv timeout: no error");
      } catch (const TimeoutError& e) {
        expect(e.ranks() == std::vector<int>{1}, std::string("recv timeout names the sender: ") + e.what());
      }
    }
  }
  world.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  const bool faults_only = argc > 1 && std::string(argv[1]) == "faults";
  auto world = mpi::create_world();
  auto native = mpi::create_world({.reduce_scatter = mpi::ReduceScatterAlgorithm::native});
  auto unchecked = mpi::create_world({.check_fingerprints = false});
  g_rank = world->rank();
  const int n = world->size();
  const auto t0 = Clock::now();
  auto run = [&](const char* name, const std::function<void()>& fn) {
    const auto t = Clock::now();
    try {
      fn();
    } catch (const std::exception& e) {
      expect(false, fmt::format("{} threw: {}", name, e.what()));
    }
    if (g_rank == 0) std::printf("  %-28s %.2f s\n", name, seconds_since(t));
  };
  if (g_rank == 0) std::printf("mpi_communicator_test: %d ranks\n", n);
  run("capabilities", [&] { test_capabilities(*world, *unchecked); });
  if (!faults_only) {
    run("all_reduce", [&] { test_all_reduce(*world); });
    run("all_reduce unchecked", [&] { test_all_reduce(*unchecked); });
    run("reduce_scatter ring", [&] { test_reduce_scatter(*world, "ring"); });
    run("reduce_scatter native", [&] { test_reduce_scatter(*native, "native"); });
    run("gather/bcast/a2a/p2p", [&] { test_data_movement(*world); });
    run("gather/bcast/a2a/p2p uncheck", [&] { test_data_movement(*unchecked); });
    run("special values ring", [&] { test_special_values(*world); });
    run("ring vs native", [&] { test_ring_vs_native(*world, *native); });
    run("async order", [&] { test_async_order(*world); });
    run("async order unchecked", [&] { test_async_order(*unchecked); });
    run("p2p group", [&] { test_p2p_group(*world); });
    run("p2p out of issue order", [&] { test_p2p_out_of_order(*world); });
    run("p2p group unchecked", [&] { test_p2p_group(*unchecked); });
    run("split", [&] { test_split(*world); });
    run("split unchecked", [&] { test_split(*unchecked); });
  }
  if (n > 1) {
    run("mismatch", [&] { test_mismatch(*world); });
    run("timeout checked", [&] { test_timeout(*world, true); });
    run("timeout unchecked", [&] { test_timeout(*world, false); });
    run("recv timeout", [&] { test_recv_timeout(*world); });
  }
  int32_t failures = g_failures, checks = g_checks;
  world->all_reduce(&failures, &failures, 1, DType::i32, ReduceOp::sum);
  world->all_reduce(&checks, &checks, 1, DType::i32, ReduceOp::sum);
  if (g_rank == 0)
    std::printf("%s: %d checks on %d ranks, %d failed (%.1f s)\n", failures ? "FAIL" : "PASS", checks, n,
                failures, seconds_since(t0));
  return failures ? 1 : 0;
}
