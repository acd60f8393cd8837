// oneDNN matmul primitives for core's matmul (see internal/onednn_gemm.h).
#include "meshtrain/core/internal/onednn_gemm.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"

#if MESHTRAIN_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>
#elif DNNL_CPU_RUNTIME != DNNL_RUNTIME_SEQ
#error "meshtrain sets oneDNN's thread count per calling thread for the OpenMP or sequential runtime only"
#endif
#endif

namespace meshtrain::internal {

#if MESHTRAIN_HAVE_ONEDNN
namespace {

using dt = dnnl::memory::data_type;

dt to_dnnl(DType t) {
  switch (t) {
    case DType::bf16: return dt::bf16;
    case DType::f16: return dt::f16;
    default: return dt::f32;
  }
}

// Everything a primitive depends on. alpha is a runtime scale (only whether
// it is 1 matters); beta is baked into the sum post-op.
struct Key {
  DType in, out;
  bool trans_a, trans_b, scaled;
  int threads;
  uint32_t beta_bits;
  int64_t m, n, k, lda, ldb, ldc;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(static_cast<uint64_t>(k.in) | static_cast<uint64_t>(k.out) << 8 | uint64_t{k.trans_a} << 16 |
        uint64_t{k.trans_b} << 17 | uint64_t{k.scaled} << 18 | static_cast<uint64_t>(k.threads) << 32);
    for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc}) mix(static_cast<uint64_t>(v));
    mix(k.beta_bits);
    return static_cast<size_t>(h);
  }
};

// A created primitive (or the note that oneDNN has none for the key).
struct Entry {
  bool ok = false;
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c, scratch;
  std::string impl;
};

// cpu_isa() first: it caps oneDNN's ISA (MESHTRAIN_CPU_ISA) before oneDNN
// can have chosen one.
dnnl::engine make_engine() {
  (void)cpu_isa();
  return dnnl::engine(dnnl::engine::kind::cpu, 0);
}

dnnl::engine& cpu_engine() {
  static dnnl::engine e = make_engine();
  return e;
}

// Plain strided descriptors: oneDNN reads the caller's memory as it lies
// (row-major, or column-major for a transposed operand), no reorder.
std::shared_ptr<const Entry> create(const Key& k) {
  auto e = std::make_shared<Entry>();
  using dims = dnnl::memory::dims;
  e->a = dnnl::memory::desc({k.m, k.k}, to_dnnl(k.in), k.trans_a ? dims{1, k.lda} : dims{k.lda, 1});
  e->b = dnnl::memory::desc({k.k, k.n}, to_dnnl(k.in), k.trans_b ? dims{1, k.ldb} : dims{k.ldb, 1});
  e->c = dnnl::memory::desc({k.m, k.n}, to_dnnl(k.out), dims{k.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k.scaled) attr.set_output_scales(0, {DNNL_RUNTIME_F32_VAL});
  if (k.beta_bits != 0) {
    dnnl::post_ops po;
    po.append_sum(std::bit_cast<float>(k.beta_bits));
    attr.set_post_ops(po);
  }
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(e->a, e->b, e->c), attr, cpu_engine());
    e->impl = pd.impl_info_str();
    // A reference (non-JIT) kernel is far slower than the caller's fallback.
    if (e->impl.rfind("ref", 0) == 0) return e;
    e->scratch = pd.scratchpad_desc();
    e->prim = dnnl::matmul(pd);
    e->ok = true;
  } catch (const dnnl::error& err) {
    if (err.status != dnnl_unimplemented)
      throw Error("matmul", fmt::format("oneDNN could not create a {} x {} x {} matmul: {}", k.m, k.n, k.k, err.what()));
  }
  return e;
}

// The process-wide cache: primitives (and their JIT code) are created once.
class Cache {
 public:
  std::shared_ptr<const Entry> get(const Key& k) {
    {
      std::shared_lock lock(mu_);
      auto it = map_.find(k);
      if (it != map_.end()) return it->second;
    }
    // One creation at a time (JIT takes milliseconds, once per shape), outside
    // the map's lock so lookups of other shapes go on: ranks of the threads
    // engine asking for the same new shape then create it once, and every
    // user of a primitive sees its creation happen before (oneDNN's own
    // primitive cache synchronizes where ThreadSanitizer cannot see it).
    std::lock_guard creating(create_mu_);
    {
      std::shared_lock lock(mu_);
      auto it = map_.find(k);
      if (it != map_.end()) return it->second;
    }
    std::shared_ptr<const Entry> e = create(k);
    std::unique_lock lock(mu_);
    if (map_.size() >= kMaxEntries) map_.clear();  // holders keep theirs alive
    return map_.emplace(k, std::move(e)).first->second;
  }
  size_t size() {
    std::shared_lock lock(mu_);
    return map_.size();
  }

 private:
  static constexpr size_t kMaxEntries = 4096;
  std::shared_mutex mu_;
  std::mutex create_mu_;
  std::unordered_map<Key, std::shared_ptr<const Entry>, KeyHash> map_;
};

Cache& cache() {
  static Cache c;
  return c;
}

// Per thread: memory objects bound to each primitive's descriptors (only the
// data handles change per call), the stream, and the scratchpad.
struct Bound {
  std::shared_ptr<const Entry> entry;
  dnnl::memory a, b, c, scratch, scale;
  float alpha = 1.0f;
};

struct ThreadState {
  dnnl::stream stream{cpu_engine()};
  std::unordered_map<Key, Bound, KeyHash> bound;
  std::vector<std::byte> scratch;
  int applied_threads = 0;
};

ThreadState& here() {
  thread_local ThreadState s;
  return s;
}

int apply_threads(ThreadState& s, int threads) {
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
  // OpenMP's thread count is a per-thread setting (an ICV of the calling
  // thread): a rank thread gets its own, not the main thread's.
  if (threads > 0 && s.applied_threads != threads) {
    omp_set_num_threads(threads);
    s.applied_threads = threads;
  }
  return omp_get_max_threads();
#else
  (void)s;
  (void)threads;
  return 1;
#endif
}

Key key_of(const GemmCall& g, int nthreads) {
  return Key{g.in,   g.out,  g.trans_a, g.trans_b, g.alpha != 1.0f, nthreads, std::bit_cast<uint32_t>(g.beta),
             g.m,    g.n,    g.k,       g.lda,     g.ldb,          g.ldc};
}

}  // namespace

bool onednn_built() { return true; }

bool onednn_gemm(const GemmCall& g, int threads) {
  ThreadState& s = here();
  const Key key = key_of(g, apply_threads(s, threads));
  auto it = s.bound.find(key);
  if (it == s.bound.end()) {
    std::shared_ptr<const Entry> e = cache().get(key);
    if (s.bound.size() >= 512) s.bound.clear();
    Bound b;
    b.entry = e;
    if (e->ok) {
      dnnl::engine& eng = cpu_engine();
      b.a = dnnl::memory(e->a, eng, nullptr);
      b.b = dnnl::memory(e->b, eng, nullptr);
      b.c = dnnl::memory(e->c, eng, nullptr);
      b.scale = dnnl::memory({{1}, dt::f32, {1}}, eng, nullptr);
    }
    it = s.bound.emplace(key, std::move(b)).first;
  }
  Bound& b = it->second;
  if (!b.entry->ok) return false;
  b.a.set_data_handle(const_cast<void*>(g.a));
  b.b.set_data_handle(const_cast<void*>(g.b));
  b.c.set_data_handle(g.c);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, b.a}, {DNNL_ARG_WEIGHTS, b.b}, {DNNL_ARG_DST, b.c}};
  if (key.scaled) {
    b.alpha = g.alpha;
    b.scale.set_data_handle(&b.alpha);
    args.emplace(DNNL_ARG_ATTR_OUTPUT_SCALES, b.scale);
  }
  const size_t need = b.entry->scratch.get_size();
  if (need > 0) {
    if (s.scratch.size() < need) s.scratch.resize(need);
    args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(b.entry->scratch, cpu_engine(), s.scratch.data()));
  }
  try {
    b.entry->prim.execute(s.stream, args);
    s.stream.wait();
  } catch (const dnnl::error& err) {
    throw Error("matmul",
                fmt::format("oneDNN failed on a ({}, {}) x ({}, {}) {} product: {}", g.m, g.k, g.k, g.n,
                            dtype_name(g.in), err.what()));
  }
  return true;
}

std::string onednn_description() {
  const dnnl_version_t* v = dnnl_version();
  const char* runtime = DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP ? "OpenMP" : "sequential";
  const char* isa = "unknown";
  (void)cpu_isa();  // the limit first (MESHTRAIN_CPU_ISA)
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx: isa = "avx512_core_amx"; break;
    case dnnl::cpu_isa::avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl::cpu_isa::avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl::cpu_isa::avx512_core: isa = "avx512_core"; break;
    case dnnl::cpu_isa::avx2_vnni: isa = "avx2_vnni"; break;
    case dnnl::cpu_isa::avx2: isa = "avx2"; break;
    case dnnl::cpu_isa::sse41: isa = "sse41"; break;
    default: break;
  }
  return fmt::format("oneDNN {}.{}.{} ({} runtime, CPU ISA {})", v->major, v->minor, v->patch, runtime, isa);
}

std::string onednn_kernel_name(const GemmCall& g, int threads) {
  std::shared_ptr<const Entry> e = cache().get(key_of(g, apply_threads(here(), threads)));
  return e->ok ? e->impl : std::string();
}

int onednn_threads_here(int threads) { return apply_threads(here(), threads); }

size_t onednn_cached_primitives() { return cache().size(); }

#else  // no oneDNN in this build

bool onednn_built() { return false; }
bool onednn_gemm(const GemmCall&, int) { return false; }
std::string onednn_description() { return {}; }
std::string onednn_kernel_name(const GemmCall&, int) { return {}; }
int onednn_threads_here(int) { return 1; }
size_t onednn_cached_primitives() { return 0; }

#endif

}  // namespace meshtrain::internal
