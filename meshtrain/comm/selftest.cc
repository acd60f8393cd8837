#include "meshtrain/comm/selftest.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "meshtrain/core/half.h"

namespace meshtrain::comm {
namespace {

// Inputs repeat with period kPeriod in the element index.
constexpr size_t kPeriod = 10;  // a multiple of both input patterns (5 and 2)

// Rank r's input at element i (before conversion to the dtype).
int64_t input_value(ReduceOp op, int r, size_t i) {
  if (op == ReduceOp::prod) return 1 + static_cast<int64_t>((i + r) % 2);  // 1 or 2
  return static_cast<int64_t>(i % kPeriod) + r + 1;                      // 1..12
}

// Stores an exact small integer (or, for float avg, a float) as dtype bytes,
// with the engine's rules: integers wrap modulo 2^bits.
void store(DType t, double v, std::byte* out) {
  auto put = [&](auto x) { std::memcpy(out, &x, sizeof(x)); };
  switch (t) {
    case DType::f32: return put(static_cast<float>(v));
    case DType::f64: return put(v);
    case DType::bf16: return put(float_to_bf16(static_cast<float>(v)));
    case DType::f16: return put(float_to_f16(static_cast<float>(v)));
    case DType::i8: return put(static_cast<int8_t>(static_cast<int64_t>(v)));
    case DType::i32: return put(static_cast<int32_t>(static_cast<int64_t>(v)));
    case DType::i64: return put(static_cast<int64_t>(v));
    case DType::u8: return put(static_cast<uint8_t>(static_cast<int64_t>(v)));
  }
}

double load(DType t, const std::byte* p) {
  auto get = [&](auto x) {
    std::memcpy(&x, p, sizeof(x));
    return x;
  };
  switch (t) {
    case DType::f32: return get(float{});
    case DType::f64: return get(double{});
    case DType::bf16: return bf16_to_float(get(uint16_t{}));
    case DType::f16: return f16_to_float(get(uint16_t{}));
    case DType::i8: return get(int8_t{});
    case DType::i32: return get(int32_t{});
    case DType::i64: return static_cast<double>(get(int64_t{}));
    case DType::u8: return get(uint8_t{});
  }
  return 0;
}

// Wraps an integer to the dtype's range (as the engine's integer sums do).
int64_t wrap(DType t, int64_t v) {
  switch (t) {
    case DType::i8: return static_cast<int8_t>(v);
    case DType::u8: return static_cast<uint8_t>(v);
    case DType::i32: return static_cast<int32_t>(v);
    default: return v;
  }
}

// v as the dtype holds it: with many ranks the inputs (up to n + 10) exceed
// the integers bf16 (256) and f16 (2048) hold exactly, and round.
double as_stored(DType t, int64_t v) {
  std::byte b[8];
  store(t, static_cast<double>(v), b);
  return load(t, b);
}

// Stores an integer already wrapped to an integer dtype.
void store_int(DType t, int64_t v, std::byte* out) {
  auto put = [&](auto x) { std::memcpy(out, &x, sizeof(x)); };
  switch (t) {
    case DType::i8: return put(static_cast<int8_t>(v));
    case DType::u8: return put(static_cast<uint8_t>(v));
    case DType::i32: return put(static_cast<int32_t>(v));
    default: return put(v);
  }
}

// Expected reduction over ranks 0..n-1 at element i, as dtype bytes, for any
// n. Floating dtypes: the exact value of the stored inputs in double (sums
// stay far below 2^24, so the engines' f32 accumulator is exact too; products
// are powers of two, exact up to 2^1023), rounded once to the dtype as the
// engines do (bf16/f16 accumulate in f32, so an overflow is inf in both).
// Integer dtypes: sums and products modulo 2^64 (unsigned, defined), which
// wrap to the dtype exactly as the engines' modulo-2^bits arithmetic does.
void expected_reduction(DType t, ReduceOp op, int n, size_t i, std::byte* out) {
  if (is_floating(t)) {
    double acc = as_stored(t, input_value(op, 0, i));
    for (int r = 1; r < n; ++r) {
      const double x = as_stored(t, input_value(op, r, i));
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc += x; break;
        case ReduceOp::prod: acc *= x; break;
        case ReduceOp::max: acc = std::max(acc, x); break;
        case ReduceOp::min: acc = std::min(acc, x); break;
      }
    }
    if (op == ReduceOp::avg) {
      // The engines divide the sum in the accumulator type (f32 for f32, bf16, f16).
      if (t == DType::f64) return store(t, acc / n, out);
      return store(t, static_cast<double>(static_cast<float>(acc) / static_cast<float>(n)), out);
    }
    if (t != DType::f64) acc = static_cast<double>(static_cast<float>(acc));  // f32 accumulator
    return store(t, acc, out);
  }
  // The inputs (up to n + 10) were stored wrapped to the dtype, so max/min
  // compare the wrapped values.
  uint64_t acc = static_cast<uint64_t>(wrap(t, input_value(op, 0, i)));
  int64_t best = wrap(t, input_value(op, 0, i));
  for (int r = 1; r < n; ++r) {
    const int64_t x = wrap(t, input_value(op, r, i));
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += static_cast<uint64_t>(x); break;
      case ReduceOp::prod: acc *= static_cast<uint64_t>(x); break;
      case ReduceOp::max: best = std::max(best, x); break;
      case ReduceOp::min: best = std::min(best, x); break;
    }
  }
  if (op == ReduceOp::max || op == ReduceOp::min) return store_int(t, best, out);
  const int64_t wrapped = wrap(t, static_cast<int64_t>(acc));
  // avg truncates toward zero after wrapping to the dtype.
  store_int(t, op == ReduceOp::avg ? wrapped / n : wrapped, out);
}

// A buffer of `count` elements whose element i equals table[i % kPeriod].
std::vector<std::byte> periodic(DType t, size_t count, const std::vector<std::byte>& table) {
  const size_t es = dtype_size(t);
  std::vector<std::byte> b(count * es);
  for (size_t i = 0; i < count; ++i) std::memcpy(&b[i * es], &table[(i % kPeriod) * es], es);
  return b;
}

class Checker {
 public:
  explicit Checker(Communicator& c) : comm_(c) {}

  // Compares got with want; throws describing the first differing element.
  void expect(const std::string& what, DType t, const std::byte* got, const std::byte* want, size_t count) {
    ++checks_;
    const size_t es = dtype_size(t);
    if (count == 0 || std::memcmp(got, want, count * es) == 0) return;
    for (size_t i = 0; i < count; ++i) {
      if (std::memcmp(got + i * es, want + i * es, es) != 0)
        throw std::runtime_error(fmt::format("rank {} of {}: {} ({}): element {} is {}, expected {}", comm_.rank(),
                                             comm_.size(), what, dtype_name(t), i, load(t, got + i * es),
                                             load(t, want + i * es)));
    }
  }
  size_t checks() const { return checks_; }

 private:
  Communicator& comm_;
  size_t checks_ = 0;
};

std::vector<std::byte> input_table(DType t, ReduceOp op, int r) {
  const size_t es = dtype_size(t);
  std::vector<std::byte> tab(kPeriod * es);
  for (size_t i = 0; i < kPeriod; ++i) store(t, static_cast<double>(input_value(op, r, i)), &tab[i * es]);
  return tab;
}

std::vector<std::byte> expected_table(DType t, ReduceOp op, int n, size_t offset) {
  const size_t es = dtype_size(t);
  std::vector<std::byte> tab(kPeriod * es);
  for (size_t i = 0; i < kPeriod; ++i) expected_reduction(t, op, n, offset + i, &tab[i * es]);
  return tab;
}

void check_all_reduce(Communicator& c, Checker& ck, DType t, ReduceOp op, size_t count) {
  const int n = c.size(), r = c.rank();
  const auto want = periodic(t, count, expected_table(t, op, n, 0));
  const std::string what = fmt::format("all_reduce {} x {}", reduce_op_name(op), count);
  auto in = periodic(t, count, input_table(t, op, r));
  std::vector<std::byte> out(in.size(), std::byte{0xAB});
  c.all_reduce(in.data(), out.data(), count, t, op);
  ck.expect(what + " out of place", t, out.data(), want.data(), count);
  ck.expect(what + " (input untouched)", t, in.data(), periodic(t, count, input_table(t, op, r)).data(), count);
  c.all_reduce(in.data(), in.data(), count, t, op);
  ck.expect(what + " in place", t, in.data(), want.data(), count);
}

void check_reduce_scatter(Communicator& c, Checker& ck, DType t, ReduceOp op, size_t count) {
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(t);
  // Block b of the input is the periodic pattern shifted by b * count, so every
  // block's expected values differ.
  const auto in_full = periodic(t, count * n, input_table(t, op, r));
  const size_t offset = (static_cast<size_t>(r) * count) % kPeriod;
  const auto want = periodic(t, count, expected_table(t, op, n, offset));
  const std::string what = fmt::format("reduce_scatter {} x {}", reduce_op_name(op), count);
  std::vector<std::byte> out(count * es, std::byte{0xAB});
  c.reduce_scatter(in_full.data(), out.data(), count, t, op);
  ck.expect(what + " out of place", t, out.data(), want.data(), count);
  auto inplace = in_full;
  c.reduce_scatter(inplace.data(), inplace.data() + r * count * es, count, t, op);
  ck.expect(what + " in place", t, inplace.data() + r * count * es, want.data(), count);
}

// Rank r's contribution to all_gather/broadcast/all_to_all: element i of block
// b is r * 1000 + b * 10 + i % kPeriod (wrapped for narrow integer dtypes).
std::vector<std::byte> tagged(DType t, int r, int blocks, size_t count) {
  const size_t es = dtype_size(t);
  std::vector<std::byte> b(blocks * count * es);
  for (int blk = 0; blk < blocks; ++blk) {
    std::vector<std::byte> tab(kPeriod * es);
    for (size_t i = 0; i < kPeriod; ++i) {
      int64_t v = r * 16 + blk * 3 + static_cast<int64_t>(i);  // <= 127 + ... small enough for bf16/f16
      store(t, static_cast<double>(wrap(t, v)), &tab[i * es]);
    }
    auto blkbytes = periodic(t, count, tab);
    if (!blkbytes.empty()) std::memcpy(&b[blk * count * es], blkbytes.data(), blkbytes.size());
  }
  return b;
}

void check_data_movement(Communicator& c, Checker& ck, DType t, size_t count) {
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(t), bytes = count * es;
  // all_gather
  {
    auto mine = tagged(t, r, 1, count);
    std::vector<std::byte> want(n * bytes), out(n * bytes, std::byte{0xAB});
    for (int p = 0; p < n; ++p) {
      auto theirs = tagged(t, p, 1, count);
      if (bytes) std::memcpy(&want[p * bytes], theirs.data(), bytes);
    }
    c.all_gather(mine.data(), out.data(), count, t);
    ck.expect(fmt::format("all_gather x {} out of place", count), t, out.data(), want.data(), n * count);
    std::vector<std::byte> inplace(n * bytes, std::byte{0xCD});
    if (bytes) std::memcpy(&inplace[r * bytes], mine.data(), bytes);
    c.all_gather(inplace.data() + r * bytes, inplace.data(), count, t);
    ck.expect(fmt::format("all_gather x {} in place", count), t, inplace.data(), want.data(), n * count);
  }
  // broadcast from every root
  for (int root = 0; root < n; ++root) {
    auto buf = r == root ? tagged(t, root, 1, count) : std::vector<std::byte>(bytes, std::byte{0xAB});
    c.broadcast(buf.data(), count, t, root);
    ck.expect(fmt::format("broadcast x {} root {}", count, root), t, buf.data(), tagged(t, root, 1, count).data(),
              count);
  }
  // all_to_all: block p of rank r's send lands in block r of rank p's recv.
  {
    auto send = tagged(t, r, n, count);
    std::vector<std::byte> recv(n * bytes, std::byte{0xAB}), want(n * bytes);
    for (int p = 0; p < n; ++p) {
      auto theirs = tagged(t, p, n, count);
      if (bytes) std::memcpy(&want[p * bytes], &theirs[r * bytes], bytes);
    }
    c.all_to_all(send.data(), recv.data(), count, t);
    ck.expect(fmt::format("all_to_all x {}", count), t, recv.data(), want.data(), n * count);
  }
  // all_to_all_v, two patterns of counts: (r + 2p) % 3 blocks of `count`
  // from rank r to rank p (zeros among them), and everyone to rank 0 only
  // (count + r elements; the other ranks receive nothing). Element i of the
  // block from r to p is tagged(r, block p)'s element i.
  for (int pattern = 0; pattern < 2; ++pattern) {
    auto sends = [&](int from, int to) -> size_t {
      if (pattern == 0) return static_cast<size_t>((from + 2 * to) % 3) * count;
      return to == 0 ? count + static_cast<size_t>(from) : 0;
    };
    const size_t most = 2 * count + static_cast<size_t>(n);
    std::vector<size_t> send_counts(n), want_counts(n);
    std::vector<std::byte> send, want;
    auto mine = tagged(t, r, n, most);
    for (int p = 0; p < n; ++p) {
      send_counts[p] = sends(r, p);
      want_counts[p] = sends(p, r);
      send.insert(send.end(), mine.begin() + p * most * es, mine.begin() + (p * most + send_counts[p]) * es);
      auto theirs = tagged(t, p, n, most);
      want.insert(want.end(), theirs.begin() + r * most * es, theirs.begin() + (r * most + want_counts[p]) * es);
    }
    const std::vector<size_t> recv_counts = all_to_all_counts(c, send_counts);
    if (recv_counts != want_counts)
      throw std::runtime_error(fmt::format("rank {}: all_to_all_counts gave [{}], expected [{}]", r,
                                           fmt::join(recv_counts, ", "), fmt::join(want_counts, ", ")));
    std::vector<std::byte> recv(want.size(), std::byte{0xAB});
    c.all_to_all_v(send.data(), send_counts, recv.data(), recv_counts, t);
    ck.expect(fmt::format("all_to_all_v pattern {} x {}", pattern, count), t, recv.data(), want.data(),
              want.size() / es);
  }
}

// Ring exchange with two tags in flight, posted before either is waited for.
void check_send_recv(Communicator& c, Checker& ck, size_t count) {
  const int n = c.size(), r = c.rank();
  if (n == 1) return;
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto a = tagged(DType::f32, r, 1, count), b = tagged(DType::f32, r + 1, 1, count);
  std::vector<std::byte> ra(a.size(), std::byte{0}), rb(b.size(), std::byte{0});
  auto w1 = c.recv_async(rb.data(), count, DType::f32, prev, 7);
  auto w2 = c.recv_async(ra.data(), count, DType::f32, prev, 3);
  auto w3 = c.send_async(a.data(), count, DType::f32, next, 3);
  auto w4 = c.send_async(b.data(), count, DType::f32, next, 7);
  w1.wait();
  w2.wait();
  w3.wait();
  w4.wait();
  ck.expect(fmt::format("send/recv tag 3 x {}", count), DType::f32, ra.data(), tagged(DType::f32, prev, 1, count).data(), count);
  ck.expect(fmt::format("send/recv tag 7 x {}", count), DType::f32, rb.data(), tagged(DType::f32, prev + 1, 1, count).data(), count);
}

// Split into even and odd ranks, ordered by descending rank (key = -rank).
void check_split(Communicator& c, Checker& ck) {
  const int n = c.size(), r = c.rank();
  auto sub = c.split(r % 2, -r);
  const int members = (n - r % 2 + 1) / 2;
  std::vector<int> want_order;
  for (int p = n - 1; p >= 0; --p)
    if (p % 2 == r % 2) want_order.push_back(p);
  if (!sub || sub->size() != members || want_order[sub->rank()] != r)
    throw std::runtime_error(fmt::format("rank {}: split(color {}, key {}) gave size {} rank {}", r, r % 2, -r,
                                         sub ? sub->size() : -1, sub ? sub->rank() : -1));
  int32_t mine = r;
  std::vector<int32_t> gathered(members, -1);  // one per member: any rank count
  sub->all_gather(&mine, gathered.data(), 1, DType::i32);
  std::vector<int32_t> want(want_order.begin(), want_order.end());
  ck.expect("split then all_gather of world ranks", DType::i32, reinterpret_cast<std::byte*>(gathered.data()),
            reinterpret_cast<std::byte*>(want.data()), want.size());
  auto none = c.split(-1, 0);
  if (none) throw std::runtime_error("split with color -1 returned a communicator");
}

// Several async all_reduces in flight at once complete in order and correctly.
void check_async(Communicator& c, Checker& ck) {
  const int n = c.size();
  constexpr size_t kCount = 100'000;
  std::vector<std::vector<float>> bufs(4);
  std::vector<Work> works;
  for (int k = 0; k < 4; ++k) {
    bufs[k].assign(kCount, static_cast<float>(k + c.rank()));
    works.push_back(c.all_reduce_async(bufs[k].data(), bufs[k].data(), kCount, DType::f32, ReduceOp::sum));
  }
  c.barrier();  // a blocking call after async ones keeps issue order
  for (int k = 0; k < 4; ++k) {
    works[k].wait();
    std::vector<float> want(kCount, static_cast<float>(k * n + n * (n - 1) / 2));
    ck.expect(fmt::format("async all_reduce #{}", k), DType::f32, reinterpret_cast<std::byte*>(bufs[k].data()),
              reinterpret_cast<std::byte*>(want.data()), kCount);
  }
}

}  // namespace

namespace internal {
std::vector<std::byte> suite_input(DType t, ReduceOp op, int rank, size_t count) {
  return periodic(t, count, input_table(t, op, rank));
}
std::vector<std::byte> suite_expected(DType t, ReduceOp op, int n, size_t count) {
  return periodic(t, count, expected_table(t, op, n, 0));
}
}  // namespace internal

size_t run_collective_suite(Communicator& c, const SuiteOptions& options) {
  Checker ck(c);
  for (size_t size : options.sizes) {
    const bool full = size <= options.full_matrix_limit;
    for (DType t : kAllDTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!full && op != ReduceOp::sum && t != DType::f32) continue;
        check_all_reduce(c, ck, t, op, size);
        check_reduce_scatter(c, ck, t, op, (size + c.size() - 1) / c.size());
      }
      if (full || t == DType::f32 || t == DType::bf16)
        check_data_movement(c, ck, t, (size + c.size() - 1) / c.size());
    }
    check_send_recv(c, ck, size);
  }
  check_split(c, ck);
  check_async(c, ck);
  c.barrier();
  return ck.checks();
}

}  // namespace meshtrain::comm
