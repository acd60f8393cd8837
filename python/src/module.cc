// meshtrain._meshtrain: the C++ core as Python sees it (pybind11). The
// package meshtrain (python/meshtrain/__init__.py) re-exports it with the
// seeds' names; docs/python.md is the user's guide.
//
// Arrays cross as numpy arrays through the buffer protocol, never copied:
// a collective reads and writes the caller's array (it must be C-contiguous,
// writable where written, of a dtype the engines move), else ValueError
// names what it expected. Every wait releases the GIL, so the ranks of a
// threads-engine launch (threads of this process) run their collectives
// together. Errors are the C++ ones, mapped onto Python classes of the same
// names (meshtrain.Error and its subclasses, also subclasses of the matching
// builtins) with the same messages.
#include <fmt/format.h>
#include <pybind11/eval.h>
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/config/sharding_config.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/sharding/stage_assignment.h"
#include "meshtrain/sharding/strategy.h"
#include "meshtrain/sharding/layout.h"
#include "meshtrain/sharding/partition_spec.h"
#include "meshtrain/sharding/sharded_tensor.h"
#include "meshtrain/sharding/visualize.h"
#include "meshtrain/config/job_overrides.h"
#include "meshtrain/plan/time_model.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/model_parameters.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/core/dtype.h"
#include "meshtrain/core/error.h"
#include "meshtrain/version.h"

namespace py = pybind11;

namespace meshtrain::python {
namespace {

// ---- arrays ----

// numpy's name of a dtype ("float32").
std::string dtype_name(const py::dtype& t) { return t.attr("name").cast<std::string>(); }

// The engine dtype of a numpy array's dtype (numpy has no bfloat16): by
// kind and size, native byte order (a per-call lookup without Python calls).
DType dtype_of(const py::array& a, const char* op) {
  const py::dtype t = a.dtype();
  const char kind = t.kind();
  const py::ssize_t size = t.itemsize();
  const char order = t.byteorder();
  const bool native = order == '=' || order == '|' || order == (std::endian::native == std::endian::little ? '<' : '>');
  if (native) {
    if (kind == 'f' && size == 4) return DType::f32;
    if (kind == 'f' && size == 8) return DType::f64;
    if (kind == 'f' && size == 2) return DType::f16;
    if (kind == 'i' && size == 1) return DType::i8;
    if (kind == 'i' && size == 4) return DType::i32;
    if (kind == 'i' && size == 8) return DType::i64;
    if (kind == 'u' && size == 1) return DType::u8;
  }
  throw InvalidArgument(op, fmt::format("an array of dtype {}", dtype_name(t)),
                        "pass float32, float64, float16, int8, int32, int64 or uint8 (native byte order)");
}

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// The array as the engines take it: C-contiguous (and writable when `written`).
void check_layout(const py::array& a, const char* op, const char* what, bool written) {
  if (!(a.flags() & py::array::c_style))
    throw InvalidArgument(op, fmt::format("{} {} is not C-contiguous", what, shape_of(a)),
                          "pass numpy.ascontiguousarray(x) (a collective never copies)");
  if (written && !a.writeable())
    throw InvalidArgument(op, fmt::format("{} {} is read-only", what, shape_of(a)),
                          "pass a writable array (the collective writes the result into it)");
}

// A new C-contiguous array of `shape` and a's dtype.
py::array empty_like_shape(const py::array& a, const std::vector<py::ssize_t>& shape) {
  return py::array(a.dtype(), shape);
}

void check_same(const py::array& a, const py::array& b, const char* op, const char* what) {
  if (!a.dtype().equal(b.dtype()) || a.size() != b.size())
    throw InvalidArgument(op,
                          fmt::format("{} {} of {} for input {} of {}", what, shape_of(b),
                                      dtype_name(b.dtype()), shape_of(a), dtype_name(a.dtype())),
                          "pass an output of the input's dtype and the documented size");
}

// ---- the GIL among the ranks of a threads-engine launch ----
//
// Every collective hands the GIL from one rank thread to another: the rank
// that arrives first releases it to wait, the other takes it to arrive.
// CPython's GIL wakes a thread waiting for it through a condition variable,
// which costs tens of microseconds when that thread's core is idle (18 us
// per 4 KiB all_reduce here). So rank threads first take a turn, spinning
// (bounded) rather than sleeping, and ask for the GIL only once they hold
// it: the GIL is then free and taken at once. The turn is released right
// after the GIL. A rank that spins past kTurnSpin (another rank computes
// with the GIL released inside numpy, or sleeps) asks for the GIL as
// before; with more ranks than cores nobody spins.
constexpr std::chrono::microseconds kTurnSpin{200};
std::atomic<bool> g_turn{false};      // a rank thread holds the GIL (or is taking it) by its turn
std::atomic<bool> g_spin{false};      // this launch's ranks fit on the cores
thread_local bool t_rank = false;     // this thread runs a rank of launch()
thread_local bool t_turn = false;     // this thread holds the turn

void take_turn() {
  if (!t_rank || !g_spin.load(std::memory_order_relaxed)) return;
  const auto until = std::chrono::steady_clock::now() + kTurnSpin;
  for (int i = 0;; ++i) {
    if (!g_turn.load(std::memory_order_relaxed) && !g_turn.exchange(true, std::memory_order_acquire)) {
      t_turn = true;
      return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return;
  }
}

void give_turn() {
  if (!t_turn) return;
  t_turn = false;
  g_turn.store(false, std::memory_order_release);
}

// py::gil_scoped_release for a wait: the GIL, then the turn; back in the
// other order.
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) { give_turn(); }
  ~GilRelease() {
    take_turn();
    PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

// ---- communicators ----

// A rank's communicator as Python holds it. The world communicator of a
// launch belongs to the launch; `alive` turns false when it ends, and any
// use after that raises instead of touching freed memory. Split
// communicators are owned (and share their world's flag).
class Comm {
 public:
  Comm(comm::Communicator* c, std::shared_ptr<std::atomic<bool>> alive, std::shared_ptr<void> owner)
      : owner_(std::move(owner)), c_(c), alive_(std::move(alive)) {}
  Comm(comm::Communicator* c, std::shared_ptr<std::atomic<bool>> alive) : c_(c), alive_(std::move(alive)) {}
  Comm(std::unique_ptr<comm::Communicator> owned, std::shared_ptr<std::atomic<bool>> alive)
      : owned_(std::move(owned)), c_(owned_.get()), alive_(std::move(alive)) {}

  comm::Communicator& get(const char* op) const {
    if (!alive_->load())
      throw InvalidArgument(op, "a communicator used after its launch ended",
                            "use a rank's communicator only inside the function launch() runs");
    return *c_;
  }
  std::shared_ptr<std::atomic<bool>> alive() const { return alive_; }

 private:
  std::shared_ptr<void> owner_;  // what owns *c_ when not this (a DeviceMesh)
  std::unique_ptr<comm::Communicator> owned_;
  comm::Communicator* c_;
  std::shared_ptr<std::atomic<bool>> alive_;
};

// A rank's DeviceMesh (meshtrain::mesh::DeviceMesh) over a launch's
// communicator; its communicators keep it alive.
class Mesh {
 public:
  Mesh(const Comm& world, std::vector<int> shape, std::vector<std::string> names)
      : alive_(world.alive()) {
    comm::Communicator& w = world.get("DeviceMesh");
    GilRelease release;  // collective: the other ranks need the GIL to arrive
    mesh_ = std::make_shared<mesh::DeviceMesh>(w, std::move(shape), std::move(names));
  }
  const mesh::DeviceMesh& get(const char* op) const {
    if (!alive_->load())
      throw InvalidArgument(op, "a DeviceMesh used after its launch ended",
                            "use a rank's mesh only inside the function launch() runs");
    return *mesh_;
  }
  Comm comm(const std::vector<std::string>& axes) {
    get("DeviceMesh.comm");
    comm::Communicator* c = nullptr;
    {
      GilRelease release;  // a first multi-axis request splits the world (collective)
      c = axes.size() == 1 ? &mesh_->comm(std::string_view(axes[0])) : &mesh_->comm(axes);
    }
    return Comm(c, alive_, mesh_);
  }

  std::shared_ptr<mesh::DeviceMesh> shared() const { return mesh_; }
  std::shared_ptr<std::atomic<bool>> alive() const { return alive_; }

 private:
  std::shared_ptr<std::atomic<bool>> alive_;
  std::shared_ptr<mesh::DeviceMesh> mesh_;
};

// ---- sharding ----

// The numpy dtype of an engine dtype (numpy has no bfloat16).
py::dtype numpy_dtype(DType t, const char* op) {
  switch (t) {
    case DType::f32: return py::dtype::of<float>();
    case DType::f64: return py::dtype::of<double>();
    case DType::f16: return py::dtype("float16");
    case DType::i8: return py::dtype::of<int8_t>();
    case DType::i32: return py::dtype::of<int32_t>();
    case DType::i64: return py::dtype::of<int64_t>();
    case DType::u8: return py::dtype::of<uint8_t>();
    case DType::bf16: break;
  }
  throw InvalidArgument(op, fmt::format("a {} tensor", dtype_name(t)), "numpy has no bfloat16: convert it first");
}

// A tensor over the array's memory (no copy; the array must outlive it).
Tensor tensor_view(const py::array& a, const char* op) {
  check_layout(a, op, "array", false);
  std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
  return Tensor::from_blob(const_cast<void*>(a.data()), std::move(shape), dtype_of(a, op));
}

// A numpy array over the tensor's memory (no copy; the array keeps it alive).
py::array numpy_view(const Tensor& t, const char* op) {
  const Tensor c = t.contiguous();
  auto* keep = new Tensor(c);
  py::capsule owner(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  std::vector<py::ssize_t> shape(c.shape().begin(), c.shape().end());
  return py::array(numpy_dtype(c.dtype(), op), shape, c.data_ptr(), owner);
}

// A Layout as Python holds it: over a DeviceMesh (kept alive) or pure.
struct PyLayout {
  sharding::Layout layout;
  std::shared_ptr<mesh::DeviceMesh> mesh;  // null for a pure layout
  std::shared_ptr<std::atomic<bool>> alive;
};

// A ShardedTensor with what keeps its mesh alive.
struct PySharded {
  sharding::ShardedTensor tensor;
  std::shared_ptr<mesh::DeviceMesh> mesh;
  std::shared_ptr<std::atomic<bool>> alive;
  const sharding::ShardedTensor& get(const char* op) const {
    if (!alive->load())
      throw InvalidArgument(op, "a ShardedTensor used after its launch ended",
                            "use it only inside the function launch() runs");
    return tensor;
  }
};

const PyLayout& on_mesh(const PyLayout& l, const char* op) {
  if (!l.mesh)
    throw InvalidArgument(op, "a layout without a DeviceMesh", "build it as Layout(mesh, spec, global_shape)");
  if (!l.alive->load())
    throw InvalidArgument(op, "a Layout used after its launch ended", "use it only inside the function launch() runs");
  return l;
}

// PartitionSpec("data", None, ("fsdp", "tensor")): one entry per dimension.
sharding::PartitionSpec spec_of(const py::args& entries) {
  std::vector<std::vector<std::string>> dims;
  for (const py::handle e : entries) {
    if (e.is_none()) dims.emplace_back();
    else if (py::isinstance<py::str>(e)) dims.push_back({e.cast<std::string>()});
    else if (py::isinstance<py::tuple>(e) || py::isinstance<py::list>(e))
      dims.push_back(e.cast<std::vector<std::string>>());
    else
      throw InvalidArgument("PartitionSpec", fmt::format("entry {}", std::string(py::repr(e))),
                            "pass None, an axis name, or a tuple of axis names per dimension");
  }
  return sharding::PartitionSpec(std::move(dims));
}

// JAX's repr: PartitionSpec('data', None, ('fsdp', 'tensor')).
std::string spec_repr(const sharding::PartitionSpec& s) {
  std::string out = "PartitionSpec(";
  for (int d = 0; d < s.ndim(); ++d) {
    const std::vector<std::string>& axes = s.axes(d);
    std::string entry = axes.empty() ? "None" : axes.size() == 1 ? "'" + axes[0] + "'" : "(";
    if (axes.size() > 1) {
      for (size_t i = 0; i < axes.size(); ++i) entry += (i ? ", '" : "'") + axes[i] + "'";
      entry += ")";
    }
    out += (d ? ", " : "") + entry;
  }
  return out + ")";
}

// An asynchronous operation: keeps its arrays alive until waited for.
class PyWork {
 public:
  PyWork(comm::Work w, std::vector<py::object> keep, py::object result)
      : work_(std::move(w)), keep_(std::move(keep)), result_(std::move(result)) {}
  // Waits (GIL released), rethrows the engine's error; returns the result
  // array of an all_gather/reduce_scatter/all_to_all, else None.
  py::object wait() {
    {
      GilRelease release;
      work_.wait();
    }
    keep_.clear();
    return result_;
  }
  bool is_completed() { return work_.is_completed(); }

 private:
  comm::Work work_;
  std::vector<py::object> keep_;
  py::object result_;
};

// Runs an operation: blocking (the engine's blocking form, inline on this
// thread, the GIL released) or, with async_op, started and returned as a
// PyWork (the engine's asynchronous form, completed by wait()) that keeps
// the arrays `keep` names alive.
template <typename Blocking, typename Async, typename Keep>
py::object run(bool async_op, Keep keep, py::object result, Blocking blocking, Async start) {
  if (async_op) return py::cast(PyWork(start(), keep(), std::move(result)));
  {
    GilRelease release;
    blocking();
  }
  return result;
}

size_t count_of(const py::array& a) { return static_cast<size_t>(a.size()); }

py::object all_reduce(const Comm& self, py::array a, const std::string& op, bool async_op) {
  const char* name = "Communicator.all_reduce";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", true);
  const DType t = dtype_of(a, name);
  const comm::ReduceOp r = comm::parse_reduce_op(op);
  const void* in = a.data();
  void* out = a.mutable_data();
  const size_t n = count_of(a);
  return run(async_op, [&] { return std::vector<py::object>{a}; }, py::none(), [&] { c.all_reduce(in, out, n, t, r); },
             [&] { return c.all_reduce_async(in, out, n, t, r); });
}

py::object broadcast(const Comm& self, py::array a, int root, bool async_op) {
  const char* name = "Communicator.broadcast";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", true);
  void* buf = a.mutable_data();
  const size_t n = count_of(a);
  const DType t = dtype_of(a, name);
  return run(async_op, [&] { return std::vector<py::object>{a}; }, py::none(), [&] { c.broadcast(buf, n, t, root); },
             [&] { return c.broadcast_async(buf, n, t, root); });
}

// (size, *a.shape): every rank's array, rank r at [r].
py::object all_gather(const Comm& self, py::array a, std::optional<py::array> out, bool async_op) {
  const char* name = "Communicator.all_gather";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", false);
  const DType t = dtype_of(a, name);
  std::vector<py::ssize_t> shape{c.size()};
  for (py::ssize_t i = 0; i < a.ndim(); ++i) shape.push_back(a.shape(i));
  py::array o = out ? *out : empty_like_shape(a, shape);
  check_layout(o, name, "out", true);
  if (!o.dtype().equal(a.dtype()) || o.size() != a.size() * c.size())
    throw InvalidArgument(name,
                          fmt::format("out {} of {} for {} ranks' arrays {} of {}", shape_of(o),
                                      dtype_name(o.dtype()), c.size(), shape_of(a),
                                      dtype_name(a.dtype())),
                          "pass out with size() x the array's elements, of its dtype, or none");
  const void* in = a.data();
  void* res = o.mutable_data();
  const size_t n = count_of(a);
  return run(async_op, [&] { return std::vector<py::object>{a, o}; }, o, [&] { c.all_gather(in, res, n, t); },
             [&] { return c.all_gather_async(in, res, n, t); });
}

// The input's leading dimension is the ranks: a[r] reduced over the ranks
// lands on rank r (shape a.shape[1:]).
std::vector<py::ssize_t> per_rank_shape(const py::array& a, int ranks, const char* name) {
  if (a.ndim() < 1 || a.shape(0) != ranks)
    throw InvalidArgument(name, fmt::format("an array {} for {} ranks", shape_of(a), ranks),
                          fmt::format("pass an array whose first dimension is the {} ranks", ranks));
  return std::vector<py::ssize_t>(a.shape() + 1, a.shape() + a.ndim());
}

py::object reduce_scatter(const Comm& self, py::array a, const std::string& op, std::optional<py::array> out,
                          bool async_op) {
  const char* name = "Communicator.reduce_scatter";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", false);
  const DType t = dtype_of(a, name);
  const comm::ReduceOp r = comm::parse_reduce_op(op);
  py::array o = out ? *out : empty_like_shape(a, per_rank_shape(a, c.size(), name));
  if (out) (void)per_rank_shape(a, c.size(), name);
  check_layout(o, name, "out", true);
  if (!o.dtype().equal(a.dtype()) || o.size() * c.size() != a.size())
    check_same(a, o, name, "out");
  const void* in = a.data();
  void* res = o.mutable_data();
  const size_t n = count_of(o);
  return run(async_op, [&] { return std::vector<py::object>{a, o}; }, o, [&] { c.reduce_scatter(in, res, n, t, r); },
             [&] { return c.reduce_scatter_async(in, res, n, t, r); });
}

// a[p] goes to rank p; the result's [r] came from rank r.
py::object all_to_all(const Comm& self, py::array a, std::optional<py::array> out, bool async_op) {
  const char* name = "Communicator.all_to_all";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", false);
  const DType t = dtype_of(a, name);
  (void)per_rank_shape(a, c.size(), name);
  std::vector<py::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  py::array o = out ? *out : empty_like_shape(a, shape);
  check_layout(o, name, "out", true);
  check_same(a, o, name, "out");
  const void* in = a.data();
  void* res = o.mutable_data();
  const size_t n = count_of(a) / static_cast<size_t>(c.size());
  return run(async_op, [&] { return std::vector<py::object>{a, o}; }, o, [&] { c.all_to_all(in, res, n, t); },
             [&] { return c.all_to_all_async(in, res, n, t); });
}

py::object send(const Comm& self, py::array a, int dst, int tag, bool async_op) {
  const char* name = "Communicator.send";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", false);
  const void* buf = a.data();
  const size_t n = count_of(a);
  const DType t = dtype_of(a, name);
  return run(async_op, [&] { return std::vector<py::object>{a}; }, py::none(), [&] { c.send(buf, n, t, dst, tag); },
             [&] { return c.send_async(buf, n, t, dst, tag); });
}

py::object recv(const Comm& self, py::array a, int src, int tag, bool async_op) {
  const char* name = "Communicator.recv";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", true);
  void* buf = a.mutable_data();
  const size_t n = count_of(a);
  const DType t = dtype_of(a, name);
  return run(async_op, [&] { return std::vector<py::object>{a}; }, py::none(), [&] { c.recv(buf, n, t, src, tag); },
             [&] { return c.recv_async(buf, n, t, src, tag); });
}

py::object barrier(const Comm& self, bool async_op) {
  comm::Communicator& c = self.get("Communicator.barrier");
  return run(async_op, [] { return std::vector<py::object>{}; }, py::none(),
             [&] { c.barrier(); }, [&] { return c.barrier_async(); });
}

std::optional<Comm> split(const Comm& self, int color, int key) {
  comm::Communicator& c = self.get("Communicator.split");
  std::unique_ptr<comm::Communicator> sub;
  {
    GilRelease release;
    sub = c.split(color, key);
  }
  if (!sub) return std::nullopt;
  return Comm(std::move(sub), self.alive());
}

std::chrono::milliseconds to_ms(double seconds, const char* op) {
  if (!(seconds > 0) || !std::isfinite(seconds))
    throw InvalidArgument(op, fmt::format("timeout {} s", seconds), "pass a deadline in seconds > 0");
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
}

// ---- launch ----

// What launch() raises when a rank's function raised: the rank, and the
// exception itself (raised `from` it).
struct RankFailure {
  int rank = -1;
  std::string message;
  py::object exception;
};

// The engine of the job this process belongs to: mpi under mpirun, gloo
// under `meshtrain launch` or torchrun, else threads (the launcher's
// environment, read by config::read_launcher_env as the CLI reads it).
std::string engine_from_environment() {
  switch (config::DistributedConfig{}.with_env(config::read_launcher_env()).launcher) {
    case config::Launcher::mpirun: return "mpi";
    case config::Launcher::torchrun: return "gloo";
    case config::Launcher::none: break;
  }
  return "threads";
}

py::list launch(py::function fn, std::optional<std::string> engine_name, std::optional<int> ranks_given,
                double timeout, bool bind_to_cores) {
  const char* op = "meshtrain.launch";
  const std::string engine = engine_name ? *engine_name : engine_from_environment();
  // threads: 1 rank unless told; a launcher's engine: the job's ranks (0: take them).
  const int ranks = ranks_given ? *ranks_given : engine == "threads" ? 1 : 0;
  comm::LaunchOptions options{.engine = engine, .ranks = ranks, .timeout = to_ms(timeout, op),
                              .bind_to_cores = bind_to_cores};
  const auto alive = std::make_shared<std::atomic<bool>>(true);
  std::vector<py::object> results;  // by rank (of this process's ranks: the others' stay None)
  std::mutex results_mu;
  std::mutex mu;
  std::optional<RankFailure> first;  // the first rank whose function raised (its cause, not an echo)
  bool first_is_echo = false;
  std::exception_ptr error;
  const bool threads = engine == "threads";
  g_spin.store(threads && ranks >= 2 && static_cast<unsigned>(ranks) <= std::thread::hardware_concurrency());
  {
    py::gil_scoped_release release;
    try {
      comm::launch(options, [&](comm::Communicator& world) {
        t_rank = true;
        struct TurnGuard {
          TurnGuard() { take_turn(); }
          ~TurnGuard() { give_turn(); }  // after the GIL (destroyed after `gil`)
        } turn;
        py::gil_scoped_acquire gil;
        try {
          py::object r = fn(Comm(&world, alive));
          std::lock_guard<std::mutex> lock(results_mu);
          if (results.size() < static_cast<size_t>(world.size())) results.resize(static_cast<size_t>(world.size()));
          results.at(static_cast<size_t>(world.rank())) = std::move(r);
        } catch (py::error_already_set& e) {
          const std::string message = fmt::format("rank {} raised {}", world.rank(), e.what());
          // An AbortedError echoes another rank's failure: the cause is the
          // first failure that is not one (launch() rethrows it likewise).
          const bool echo = e.matches(py::module_::import("meshtrain._meshtrain").attr("AbortedError"));
          {
            std::lock_guard<std::mutex> lock(mu);
            if (!first || (first_is_echo && !echo)) {
              first = RankFailure{world.rank(), message, e.value()};
              first_is_echo = echo;
            }
          }
          throw CommError(op, message, "the other ranks were stopped; see the rank's exception above");
        }
      });
    } catch (...) {
      error = std::current_exception();
    }
  }
  alive->store(false);
  if (first) {
    // The rank's own exception, raised from a RankError that names it.
    py::object cls = py::module_::import("meshtrain._meshtrain").attr("RankError");
    py::object err = cls(first->message, first->rank);
    err.attr("__cause__") = first->exception;
    PyErr_SetObject(cls.ptr(), err.ptr());
    throw py::error_already_set();
  }
  if (error) std::rethrow_exception(error);
  py::list out;
  for (py::object& r : results) out.append(r ? r : py::none());
  results.clear();  // with the GIL held
  return out;
}

}  // namespace
}  // namespace meshtrain::python

PYBIND11_MODULE(_meshtrain, m) {
  using namespace meshtrain;
  using namespace meshtrain::python;
  m.doc() = "meshtrain's C++ core (import meshtrain for the package)";
  m.attr("__version__") = MESHTRAIN_VERSION_STRING;

  // Errors: the C++ hierarchy, each class also a subclass of the builtin a
  // Python caller would catch (ValueError for a bad argument, TimeoutError
  // for a deadline, ...).
  py::object base = py::exception<Error>(m, "Error", PyExc_RuntimeError);
  const auto sub = [&](const char* name, py::object builtin) {
    py::object cls = py::reinterpret_steal<py::object>(
        PyErr_NewException(fmt::format("meshtrain._meshtrain.{}", name).c_str(),
                           py::make_tuple(base, builtin).ptr(), nullptr));
    m.attr(name) = cls;
    return cls;
  };
  py::object invalid = sub("InvalidArgument", py::reinterpret_borrow<py::object>(PyExc_ValueError));
  py::object unsupported = sub("Unsupported", py::reinterpret_borrow<py::object>(PyExc_NotImplementedError));
  py::object oom = sub("OutOfMemory", py::reinterpret_borrow<py::object>(PyExc_MemoryError));
  py::object io = sub("IoError", py::reinterpret_borrow<py::object>(PyExc_OSError));
  py::object comm_error = sub("CommError", py::reinterpret_borrow<py::object>(PyExc_RuntimeError));
  py::object timeout = py::reinterpret_steal<py::object>(PyErr_NewException(
      "meshtrain._meshtrain.TimeoutError", py::make_tuple(comm_error, py::reinterpret_borrow<py::object>(
                                                                          PyExc_TimeoutError))
                                                .ptr(),
      nullptr));
  m.attr("TimeoutError") = timeout;
  py::object mismatch = py::reinterpret_steal<py::object>(
      PyErr_NewException("meshtrain._meshtrain.MismatchError", py::make_tuple(comm_error).ptr(), nullptr));
  m.attr("MismatchError") = mismatch;
  py::object aborted = py::reinterpret_steal<py::object>(
      PyErr_NewException("meshtrain._meshtrain.AbortedError", py::make_tuple(comm_error).ptr(), nullptr));
  m.attr("AbortedError") = aborted;
  py::object engine_error = py::reinterpret_steal<py::object>(
      PyErr_NewException("meshtrain._meshtrain.EngineError", py::make_tuple(comm_error).ptr(), nullptr));
  m.attr("EngineError") = engine_error;
  py::exec(R"(
class RankError(CommError):
    """A rank's function raised: `rank` names it; the exception is its __cause__."""
    def __init__(self, message, rank):
        super().__init__(message)
        self.rank = rank
)", m.attr("__dict__"));
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    py::module_ mod = py::module_::import("meshtrain._meshtrain");
    const auto raise = [&](const char* cls, const std::exception& e) {
      PyErr_SetString(mod.attr(cls).ptr(), e.what());
    };
    try {
      std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      raise("TimeoutError", e);
    } catch (const MismatchError& e) {
      raise("MismatchError", e);
    } catch (const AbortedError& e) {
      raise("AbortedError", e);
    } catch (const EngineError& e) {
      raise("EngineError", e);
    } catch (const CommError& e) {
      raise("CommError", e);
    } catch (const InvalidArgument& e) {
      raise("InvalidArgument", e);
    } catch (const Unsupported& e) {
      raise("Unsupported", e);
    } catch (const OutOfMemory& e) {
      raise("OutOfMemory", e);
    } catch (const IoError& e) {
      raise("IoError", e);
    } catch (const Error& e) {
      raise("Error", e);
    }
  });

  py::class_<PyWork>(m, "Work", "An asynchronous operation (async_op=True): wait() completes it.")
      .def("wait", &PyWork::wait,
           "Waits for the operation (the GIL released) and returns its result array (all_gather, "
           "reduce_scatter, all_to_all) or None; raises the engine's error (TimeoutError naming the rank "
           "that did not arrive, MismatchError, ...).")
      .def("is_completed", &PyWork::is_completed, "True once the operation has finished (never blocks).");

  py::class_<Comm>(m, "Communicator",
                   "One rank's view of a group of ranks (meshtrain::comm::Communicator). Collectives take numpy "
                   "arrays and never copy them: every rank calls them in the same order with the same shapes.")
      .def_property_readonly("rank", [](const Comm& c) { return c.get("Communicator.rank").rank(); },
                             "This rank's index in the group, 0 <= rank < size.")
      .def_property_readonly("size", [](const Comm& c) { return c.get("Communicator.size").size(); },
                             "The number of ranks in the group.")
      .def_property(
          "timeout",
          [](const Comm& c) { return static_cast<double>(c.get("Communicator.timeout").timeout().count()) / 1000; },
          [](const Comm& c, double s) { c.get("Communicator.timeout").set_timeout(to_ms(s, "Communicator.timeout")); },
          "Every wait's deadline in seconds: a rank that does not arrive in time makes the others raise "
          "TimeoutError naming it.")
      .def("all_reduce", &all_reduce, py::arg("array"), py::arg("op") = "sum", py::arg("async_op") = false,
           "Reduces `array` element-wise over the ranks, in place (op: sum, avg, max, min, prod). Returns None, "
           "or a Work with async_op=True.")
      .def("broadcast", &broadcast, py::arg("array"), py::arg("root") = 0, py::arg("async_op") = false,
           "Copies root's `array` into every rank's `array`, in place.")
      .def("all_gather", &all_gather, py::arg("array"), py::arg("out") = py::none(), py::arg("async_op") = false,
           "Returns (size, *array.shape): rank r's array at [r] (written into `out` when given).")
      .def("reduce_scatter", &reduce_scatter, py::arg("array"), py::arg("op") = "sum", py::arg("out") = py::none(),
           py::arg("async_op") = false,
           "`array` is (size, ...): returns array[rank] reduced over the ranks, of shape array.shape[1:].")
      .def("all_to_all", &all_to_all, py::arg("array"), py::arg("out") = py::none(), py::arg("async_op") = false,
           "`array` is (size, ...): array[p] goes to rank p; returns the same shape, [r] from rank r.")
      .def("send", &send, py::arg("array"), py::arg("dst"), py::arg("tag") = 0, py::arg("async_op") = false,
           "Sends `array` to rank dst (matched in order with dst's recv of the same tag).")
      .def("recv", &recv, py::arg("array"), py::arg("src"), py::arg("tag") = 0, py::arg("async_op") = false,
           "Receives into `array` from rank src (same size and dtype as the send).")
      .def("barrier", &barrier, py::arg("async_op") = false, "Returns once every rank has entered the barrier.")
      .def("split", &split, py::arg("color"), py::arg("key") = 0,
           "Collective: ranks of the same color form a new Communicator, ordered by (key, rank); color < 0 "
           "returns None.");

  py::class_<Mesh>(m, "DeviceMesh",
                   "Devices as a mesh with named axes (meshtrain::mesh::DeviceMesh): DeviceMesh(world, shape, "
                   "axis_names) is collective over the launch's world communicator (every rank passes the same "
                   "shape and names); comm(axis) is the communicator of the ranks that differ only along it.")
      .def(py::init<const Comm&, std::vector<int>, std::vector<std::string>>(), py::arg("world"), py::arg("shape"),
           py::arg("axis_names"))
      .def_property_readonly("shape", [](const Mesh& m) { return m.get("DeviceMesh.shape").shape(); })
      .def_property_readonly("axis_names", [](const Mesh& m) { return m.get("DeviceMesh.axis_names").axis_names(); })
      .def_property_readonly("ndim", [](const Mesh& m) { return m.get("DeviceMesh.ndim").ndim(); })
      .def_property_readonly("size", [](const Mesh& m) { return m.get("DeviceMesh.size").size(); },
                             "The number of ranks (the product of the shape).")
      .def_property_readonly("rank", [](const Mesh& m) { return m.get("DeviceMesh.rank").rank(); },
                             "This rank's world rank.")
      .def_property_readonly("coords", [](const Mesh& m) { return m.get("DeviceMesh.coords").coords(); },
                             "This rank's coordinates (row-major: the last axis fastest).")
      .def("coords_of", [](const Mesh& m, int rank) { return m.get("DeviceMesh.coords_of").coords_of(rank); },
           py::arg("rank"))
      .def("rank_of", [](const Mesh& m, std::vector<int> c) { return m.get("DeviceMesh.rank_of").rank_of(c); },
           py::arg("coords"))
      .def("axis_size", [](const Mesh& m, const std::string& a) { return m.get("DeviceMesh.axis_size").axis_size(a); },
           py::arg("axis"))
      .def("axis_rank", [](const Mesh& m, const std::string& a) { return m.get("DeviceMesh.axis_rank").axis_rank(a); },
           py::arg("axis"), "This rank's coordinate along the axis.")
      .def("comm", [](Mesh& m, const std::string& axis) { return m.comm({axis}); }, py::arg("axis"),
           "The Communicator along one axis (no communication).")
      .def("comm", [](Mesh& m, const std::vector<std::string>& axes) { return m.comm(axes); }, py::arg("axes"),
           "The Communicator spanning several axes, ranked row-major over them in the order given (the first "
           "request for a list is collective over the world).")
      .def("group_ranks",
           [](const Mesh& m, const std::vector<std::string>& axes) {
             return m.get("DeviceMesh.group_ranks").group_ranks(axes);
           },
           py::arg("axes"), "World ranks of this rank's group along the axes.")
      .def("all_groups",
           [](const Mesh& m, const std::vector<std::string>& axes) {
             return m.get("DeviceMesh.all_groups").all_groups(axes);
           },
           py::arg("axes"), "Every group along the axes.")
      .def("__str__", [](const Mesh& m) { return m.get("DeviceMesh.__str__").to_string(); },
           "The text picture of the mesh (render_mesh).");
  m.def("render_mesh", &mesh::render_mesh, py::arg("shape"), py::arg("axis_names"),
        "A text picture of a mesh: its grid of world ranks and every axis's groups (no communicator needed).");

  py::class_<sharding::PartitionSpec>(m, "PartitionSpec",
                                      "How a tensor's dimensions map onto mesh axes (JAX's PartitionSpec): one "
                                      "entry per dimension, None (not split), an axis name, or a tuple of axis "
                                      "names (split row-major over them).")
      .def(py::init([](const py::args& entries) { return spec_of(entries); }))
      .def_static("parse", &sharding::PartitionSpec::parse, py::arg("text"),
                  "\"data,None\", \"(data,fsdp),tensor\": the --spec syntax.")
      .def_property_readonly("dims", &sharding::PartitionSpec::dims, "Each dimension's axes (empty: not split).")
      .def("__len__", &sharding::PartitionSpec::ndim)
      .def("__eq__", [](const sharding::PartitionSpec& a, const sharding::PartitionSpec& b) { return a == b; })
      .def("__repr__", &spec_repr)
      .def("__str__", &sharding::PartitionSpec::to_string);

  py::class_<PyLayout>(m, "Layout",
                       "Which block of a global tensor every rank holds (uneven blocks allowed): "
                       "Layout(mesh, spec, global_shape) over a DeviceMesh, or Layout.pure(mesh_shape, axis_names, "
                       "spec, global_shape) without one.")
      .def(py::init([](const Mesh& mesh, const sharding::PartitionSpec& spec, std::vector<int64_t> shape,
                       bool strict) {
             mesh.get("Layout");
             std::shared_ptr<mesh::DeviceMesh> dm = mesh.shared();
             return PyLayout{sharding::Layout(*dm, spec, std::move(shape), {.partial = {}, .strict = strict}), dm,
                             mesh.alive()};
           }),
           py::arg("mesh"), py::arg("spec"), py::arg("global_shape"), py::arg("strict") = false)
      .def_static(
          "pure",
          [](std::vector<int> mesh_shape, std::vector<std::string> names, const sharding::PartitionSpec& spec,
             std::vector<int64_t> shape, bool strict) {
            return PyLayout{sharding::Layout(std::move(mesh_shape), std::move(names), spec, std::move(shape),
                                             {.partial = {}, .strict = strict}),
                            nullptr, std::make_shared<std::atomic<bool>>(true)};
          },
          py::arg("mesh_shape"), py::arg("axis_names"), py::arg("spec"), py::arg("global_shape"),
          py::arg("strict") = false, "A layout over a mesh shape alone (every query, no ShardedTensor).")
      .def_property_readonly("spec", [](const PyLayout& l) { return l.layout.spec(); })
      .def_property_readonly("global_shape", [](const PyLayout& l) { return l.layout.global_shape(); })
      .def_property_readonly("mesh_shape", [](const PyLayout& l) { return l.layout.mesh_shape(); })
      .def_property_readonly("axis_names", [](const PyLayout& l) { return l.layout.axis_names(); })
      .def("local_shape", [](const PyLayout& l, int rank) { return l.layout.local_shape(rank); }, py::arg("rank"),
           "The block `rank` holds.")
      .def(
          "local_box",
          [](const PyLayout& l, int rank) {
            const sharding::Box b = l.layout.local_box(rank);
            return py::make_tuple(b.offsets, b.sizes);
          },
          py::arg("rank"), "(offsets, sizes) of the block `rank` holds, in global coordinates.")
      .def("num_shards", [](const PyLayout& l, int dim) { return l.layout.num_shards(dim); }, py::arg("dim"))
      .def("is_even", [](const PyLayout& l) { return l.layout.is_even(); })
      .def("__repr__", [](const PyLayout& l) { return l.layout.to_string(); });

  py::class_<PySharded>(m, "ShardedTensor", "This rank's block of a global tensor, and its Layout.")
      .def_property_readonly(
          "local", [](const PySharded& s) { return numpy_view(s.get("ShardedTensor.local").local(), "local"); },
          "This rank's block as a numpy array over the same memory (no copy).")
      .def_property_readonly("layout",
                             [](const PySharded& s) {
                               return PyLayout{s.get("ShardedTensor.layout").layout(), s.mesh, s.alive};
                             })
      .def_property_readonly("global_shape",
                             [](const PySharded& s) { return s.get("ShardedTensor.global_shape").global_shape(); })
      .def("__repr__", [](const PySharded& s) { return s.get("ShardedTensor.__repr__").to_string(); });

  m.def(
      "distribute",
      [](py::object global, const PyLayout& layout, int src_rank) {
        const char* op = "meshtrain.distribute";
        const PyLayout& l = on_mesh(layout, op);
        const bool mine = l.mesh->rank() == src_rank;
        py::array a = mine ? py::array(global) : py::array();
        Tensor t = mine ? tensor_view(a, op) : Tensor();
        sharding::ShardedTensor out;
        {
          GilRelease release;  // collective
          out = sharding::distribute(t, l.layout, src_rank);
        }
        return PySharded{std::move(out), l.mesh, l.alive};
      },
      py::arg("array"), py::arg("layout"), py::arg("src_rank") = 0,
      "Collective: rank src_rank's global array split by the layout; every rank gets its block (the others' "
      "array is ignored, e.g. None).");
  m.def(
      "distribute_replicated",
      [](const py::array& global, const PyLayout& layout) {
        const char* op = "meshtrain.distribute_replicated";
        const PyLayout& l = on_mesh(layout, op);
        return PySharded{sharding::distribute_replicated(tensor_view(global, op), l.layout), l.mesh, l.alive};
      },
      py::arg("array"), py::arg("layout"),
      "Every rank holds the same global array and takes its block (no communication).");
  m.def(
      "gather",
      [](const PySharded& s, std::optional<int> dst_rank) -> py::object {
        const sharding::ShardedTensor& t = s.get("meshtrain.gather");
        Tensor out;
        {
          GilRelease release;  // collective
          out = sharding::gather(t, dst_rank ? *dst_rank : sharding::kAllRanks);
        }
        if (!out.defined()) return py::none();
        return numpy_view(out, "meshtrain.gather");
      },
      py::arg("tensor"), py::arg("dst_rank") = py::none(),
      "Collective: the global array on every rank (dst_rank None) or on dst_rank alone (None elsewhere).");
  m.def(
      "redistribute",
      [](const PySharded& s, const sharding::PartitionSpec& spec) {
        const sharding::ShardedTensor& t = s.get("meshtrain.redistribute");
        sharding::ShardedTensor out;
        {
          GilRelease release;  // collective
          out = sharding::redistribute(t, spec);
        }
        return PySharded{std::move(out), s.mesh, s.alive};
      },
      py::arg("tensor"), py::arg("spec"), "Collective: the same global tensor split by another PartitionSpec.");
  m.def(
      "visualize_sharding",
      [](const PyLayout& l, int width, int height, bool svg) {
        const sharding::VisualizeOptions o{.width = width, .height = height};
        return svg ? sharding::visualize_sharding_svg(l.layout, o) : sharding::visualize_sharding(l.layout, o);
      },
      py::arg("layout"), py::arg("width") = 48, py::arg("height") = 8, py::arg("svg") = false,
      "A picture of which ranks hold which block of a 1-D or 2-D tensor: text, or an SVG document.");

  m.def(
      "load",
      [](const std::string& run_dir, std::optional<int64_t> step) {
        train::RunModel r;
        {
          py::gil_scoped_release release;
          r = train::read_run_model(run_dir, step, "meshtrain.load");
        }
        py::dict out;
        for (const auto& [name, tensor] : r.tensors) out[py::str(name)] = numpy_view(tensor, "meshtrain.load");
        return out;
      },
      py::arg("run_dir"), py::arg("step") = py::none(),
      "A training run's model as {name: numpy array} in meshtrain's names and layout: from its newest checkpoint "
      "(or step's), else its model.safetensors; an interrupted run's staging directory first.");

  // ---- mesh planning and the seeds' configs (meshtrain.scaling wraps them) ----
  py::class_<mesh::NamedShape>(m, "NamedShape",
                               "A mesh's shape and axis names without devices (what --mesh spells): what "
                               "DeviceMesh(world, shape, axis_names) builds on a launch's ranks.")
      .def(py::init([](std::vector<int> shape, std::vector<std::string> names) {
             mesh::validate_mesh(shape, names);
             return mesh::NamedShape{std::move(shape), std::move(names)};
           }),
           py::arg("shape"), py::arg("axis_names"))
      .def_static("parse", &mesh::parse_mesh_spec, py::arg("spec"), "\"data=2,tensor=2\": the --mesh syntax.")
      .def_readonly("shape", &mesh::NamedShape::shape)
      .def_readonly("axis_names", &mesh::NamedShape::axis_names)
      .def_property_readonly("size", [](const mesh::NamedShape& s) { return mesh::num_ranks(s.shape); },
                             "The number of devices (the product of the shape).")
      .def("size_of", &mesh::NamedShape::size_of, py::arg("axis"), "An axis's size (1 when absent).")
      .def("to_spec", &mesh::NamedShape::to_spec, "\"data=4,tensor=2\"")
      .def("__eq__", [](const mesh::NamedShape& a, const mesh::NamedShape& b) { return a == b; })
      .def("__repr__", [](const mesh::NamedShape& s) { return "NamedShape(" + s.to_spec() + ")"; })
      .def("__str__", [](const mesh::NamedShape& s) { return mesh::render_mesh(s.shape, s.axis_names); });
  m.def("get_optimal_mesh_shape", &mesh::get_optimal_mesh_shape, py::arg("n"), py::arg("dims") = 2,
        "The most balanced shape of `dims` axes whose product is exactly n (every device used).");
  m.def("validate_mesh_config", py::overload_cast<const std::vector<int>&, int>(&mesh::validate_mesh_config),
        py::arg("shape"), py::arg("n_devices"),
        "Raises InvalidArgument unless the shape uses exactly n_devices (no device left idle).");
  py::class_<plan::MeshPlan>(m, "MeshPlan", "A transformer's mesh for a device count, with the reasons.")
      .def_readonly("shape", &plan::MeshPlan::shape)
      .def_readonly("axis_names", &plan::MeshPlan::axis_names)
      .def_readonly("reasons", &plan::MeshPlan::reasons)
      .def_readonly("fits", &plan::MeshPlan::fits)
      .def("to_spec", &plan::MeshPlan::to_spec)
      .def("__repr__", [](const plan::MeshPlan& p) { return "MeshPlan(" + p.to_spec() + ")"; });
  m.def("optimize_for_transformer", &plan::optimize_for_transformer, py::arg("n_devices"), py::arg("model_size"),
        py::arg("sequence_length"), py::arg("device_memory") = "80GB", py::arg("devices_per_node") = 8,
        "The named mesh to train a transformer of model_size (\"7B\", \"350M\") on n devices "
        "(docs/mesh-planning.md).");

  py::class_<config::ShardingConfig>(m, "ShardingConfig",
                                     "Parallelism sizes (config::ShardingConfig): data, tensor, pipeline, context; "
                                     "fsdp_enabled shards the data-parallel devices' state.")
      .def(py::init([](int data, int tensor, int pipeline, int context, bool fsdp, int64_t min_weight) {
             config::ShardingConfig c{.data_parallel_size = data, .tensor_parallel_size = tensor,
                                      .pipeline_parallel_size = pipeline, .context_parallel_size = context,
                                      .fsdp_enabled = fsdp, .fsdp_min_weight_size = min_weight};
             c.validate();
             return c;
           }),
           py::arg("data_parallel_size") = 1, py::arg("tensor_parallel_size") = 1,
           py::arg("pipeline_parallel_size") = 1, py::arg("context_parallel_size") = 1,
           py::arg("fsdp_enabled") = false, py::arg("fsdp_min_weight_size") = 1024)
      .def_readwrite("data_parallel_size", &config::ShardingConfig::data_parallel_size)
      .def_readwrite("tensor_parallel_size", &config::ShardingConfig::tensor_parallel_size)
      .def_readwrite("pipeline_parallel_size", &config::ShardingConfig::pipeline_parallel_size)
      .def_readwrite("context_parallel_size", &config::ShardingConfig::context_parallel_size)
      .def_readwrite("fsdp_enabled", &config::ShardingConfig::fsdp_enabled)
      .def_readwrite("fsdp_min_weight_size", &config::ShardingConfig::fsdp_min_weight_size)
      .def_static("from_device_count", &config::ShardingConfig::from_device_count, py::arg("device_count"),
                  "Data x tensor for n devices, every device used (tensor = the largest power of two <= 8 "
                  "dividing n with tensor^2 <= n).")
      .def("get_total_device_count", &config::ShardingConfig::total_device_count,
           "data x tensor x pipeline x context.")
      .def("is_valid", &config::ShardingConfig::is_valid)
      .def("validate", &config::ShardingConfig::validate)
      .def("__repr__", [](const config::ShardingConfig& c) { return "ShardingConfig(" + c.to_string() + ")"; });
  py::class_<config::ParallelismConfig>(m, "ParallelismConfig",
                                        "A mesh and its ShardingConfig (config::ParallelismConfig).")
      .def(py::init([](std::vector<int> shape, std::vector<std::string> names, config::ShardingConfig c) {
             return config::ParallelismConfig{std::move(shape), std::move(names), c};
           }),
           py::arg("mesh_shape"), py::arg("mesh_axis_names"), py::arg("sharding_config"))
      .def_readwrite("mesh_shape", &config::ParallelismConfig::mesh_shape)
      .def_readwrite("mesh_axis_names", &config::ParallelismConfig::mesh_axis_names)
      .def_readwrite("sharding_config", &config::ParallelismConfig::sharding)
      .def_static("from_sharding_config", &config::ParallelismConfig::from_sharding_config, py::arg("config"),
                  "The mesh of a ShardingConfig: axes pipeline, data (fsdp when fsdp_enabled), context, tensor; "
                  "size-1 axes left out.")
      .def("is_valid", &config::ParallelismConfig::is_valid)
      .def("validate", &config::ParallelismConfig::validate);

  // The strategies' rules the seeds' strategy classes answer with.
  m.def("_batch_spec",
        [](const std::string& axis, int ndim, int batch_dim) {
          return sharding::DataParallelStrategy(axis).batch_spec(ndim, batch_dim);
        },
        py::arg("axis"), py::arg("ndim"), py::arg("batch_dim"));
  m.def("_tensor_specs",
        [](const std::string& axis) {
          const sharding::TensorParallelStrategy tp(axis);
          py::dict out;
          out["column_weight"] = tp.column_weight_spec();
          out["row_weight"] = tp.row_weight_spec();
          out["column_bias"] = tp.column_bias_spec();
          out["attention_qkv"] = tp.attention_qkv_spec();
          out["attention_output"] = tp.attention_output_spec();
          return out;
        },
        py::arg("axis"));
  m.def("_assign_layers_to_stages",
        [](const std::string& axis, int stages, int layers) {
          return sharding::PipelineParallelStrategy(axis, stages).assign_layers_to_stages(layers);
        },
        py::arg("axis"), py::arg("num_stages"), py::arg("num_layers"));
  m.def("_fsdp_large_enough", &sharding::FSDPStrategy::large_enough, py::arg("numel"), py::arg("min_weight_size"));

  py::class_<train::TrainResult>(m, "TrainResult", "What meshtrain.train returns (train::TrainResult).")
      .def_readonly("steps", &train::TrainResult::steps)
      .def_readonly("seconds", &train::TrainResult::seconds, "Wall time of the training loop.")
      .def_readonly("samples_per_second", &train::TrainResult::samples_per_second)
      .def_readonly("step_losses", &train::TrainResult::step_losses, "Every step's global loss.")
      .def_readonly("final_train_loss", &train::TrainResult::final_train_loss)
      .def_readonly("test_loss", &train::TrainResult::test_loss)
      .def_readonly("test_accuracy", &train::TrainResult::test_accuracy)
      .def_property_readonly("test_metrics",
                             [](const train::TrainResult& r) {
                               py::dict d;
                               for (const auto& [k, v] : r.test_metrics) d[py::str(k)] = v;
                               return d;
                             },
                             "The final evaluation's metrics by name.")
      .def_readonly("test_summary", &train::TrainResult::test_summary, "The recipe's final line.")
      .def_readonly("run_dir", &train::TrainResult::run_dir)
      .def_readonly("artifacts", &train::TrainResult::artifacts)
      .def_readonly("parallelism", &train::TrainResult::parallelism)
      .def("__repr__", [](const train::TrainResult& r) {
        return fmt::format("TrainResult({} steps, {}, run_dir '{}')", r.steps, r.test_summary, r.run_dir);
      });
  m.def(
      "train",
      [](std::optional<std::string> config_file, const py::kwargs& overrides) {
        const char* op = "meshtrain.train";
        train::TrainConfig tc = config_file ? train::TrainConfig::from_toml_file(*config_file) : train::TrainConfig{};
        config::JobOverrides job{.config_source = config_file.value_or("")};
        job.gloo_available = comm::engines().find("gloo") != nullptr;
        std::string timeout = "300";
        for (const auto& [k, v] : overrides) {
          const std::string key = k.cast<std::string>();
          // Python values as the TOML and the flags spell them.
          std::string text;
          if (py::isinstance<py::bool_>(v)) text = v.cast<bool>() ? "true" : "false";
          else if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
            for (const py::handle item : v) text += (text.empty() ? "" : ",") + py::str(item).cast<std::string>();
          } else text = py::str(v).cast<std::string>();
          if (key == "engine") job.engine = text;
          else if (key == "devices") job.devices = text;
          else if (key == "mesh") job.mesh = text;
          else if (key == "mixed_precision") job.mixed_precision = text;
          else if (key == "precision") job.precision = text;
          else if (key == "timeout") timeout = text;
          else tc.set(key, text, fmt::format("{}({}=...)", op, key));
        }
        tc.validate();
        config::DistributedConfig dc = config_file ? config::DistributedConfig::from_toml_file(*config_file)
                                                   : config::DistributedConfig{};
        dc = config::apply_job_overrides(dc.with_env(config::read_launcher_env()), job);
        const double seconds = std::stod(timeout);
        const train::ResolvedTraining resolved = train::resolve_training(tc, dc);
        const comm::LaunchOptions launch{.engine = dc.backend,
                                         .ranks = dc.backend == comm::Engine::threads ? dc.world_size : 0,
                                         .timeout = to_ms(seconds, op)};
        train::TrainResult r;
        {
          py::gil_scoped_release release;  // the trainer's ranks run no Python
          r = train::run_training(resolved, dc, launch);
        }
        return r;
      },
      py::arg("config") = py::none(),
      "Runs the trainer as `meshtrain train` does: `config` a TOML file (its [train] and [distributed] "
      "sections), keyword overrides its keys (the TOML names: model, max_steps, batch_size, run_dir, ...) and "
      "engine, devices, mesh, precision, timeout as the flags. Returns a TrainResult (per-step losses, the final "
      "evaluation, the run directory). The GIL is released while it trains.");

  m.def(
      "plan",
      [](std::optional<std::string> hardware, const py::kwargs& kwargs) {
        const char* op = "meshtrain.plan";
        train::PlanRequest r;
        for (const auto& [k, v] : kwargs) {
          const std::string key = k.cast<std::string>();
          if (key == "size") r.size = v.cast<std::string>();
          else if (key == "layers") r.layers = v.cast<int64_t>();
          else if (key == "heads") r.heads = v.cast<int64_t>();
          else if (key == "width") r.width = v.cast<int64_t>();
          else if (key == "vocab") r.vocab = v.cast<int64_t>();
          else if (key == "seq") r.seq = v.cast<int64_t>();
          else if (key == "batch") r.batch = v.cast<int64_t>();
          else if (key == "mesh") r.mesh = v.cast<std::string>();
          else if (key == "fsdp") r.fsdp = v.cast<std::string>();
          else if (key == "precision") r.precision = v.cast<std::string>();
          else if (key == "micro_batches") r.micro_batches = v.cast<int>();
          else if (key == "pipeline_schedule") r.schedule = v.cast<std::string>();
          else if (key == "virtual_stages") r.virtual_stages = v.cast<int>();
          else if (key == "sequence_parallel") r.sequence_parallel = v.cast<bool>();
          else if (key == "recompute") r.recompute = v.cast<bool>();
          else if (key == "cp_comm") r.cp_comm = v.cast<std::string>();
          else if (key == "fsdp_min_weight_size") r.min_weight_size = v.cast<int64_t>();
          else
            throw InvalidArgument(op, fmt::format("unknown keyword '{}'", key),
                                  "use size, layers, heads, width, vocab, seq, batch, mesh, fsdp, precision, "
                                  "micro_batches, pipeline_schedule, virtual_stages, sequence_parallel, recompute, "
                                  "cp_comm, fsdp_min_weight_size, hardware");
        }
        const train::PlannedRun p = train::resolve_plan_request(r);
        plan::MemoryPrediction m;
        std::optional<plan::TimePrediction> t;
        {
          py::gil_scoped_release release;
          m = plan::predict_memory(p.shape, p.layout);
          if (hardware) t = plan::predict_time(p.shape, p.layout, plan::hardware_preset(*hardware));
        }
        const auto memory_row = [](const plan::DeviceMemory& d) {
          py::dict row;
          row["stage"] = d.stage;
          row["tensor_rank"] = d.tensor_rank;
          row["parameters"] = d.parameters;
          row["gradients"] = d.gradients;
          row["optimizer"] = d.optimizer;
          row["working"] = d.working;
          row["activations"] = d.activations;
          row["comm_buffers"] = d.comm_buffers;
          row["total"] = d.total();
          row["elements"] = d.elements;
          row["in_flight"] = d.in_flight;
          row["peak_at"] = d.peak_at;
          return row;
        };
        py::dict out;
        out["model"] = py::dict(py::arg("vocab") = p.shape.vocab, py::arg("seq") = p.shape.seq,
                                py::arg("layers") = p.shape.layers, py::arg("heads") = p.shape.heads,
                                py::arg("width") = p.shape.width);
        out["mesh"] = r.mesh;
        out["fsdp"] = p.fsdp;
        py::list devices;
        for (const plan::DeviceMemory& d : m.devices) devices.append(memory_row(d));
        out["memory"] = devices;
        out["largest"] = memory_row(m.worst());
        if (t) {
          py::list times;
          for (const plan::DeviceTime& d : t->devices) {
            py::dict row;
            row["stage"] = d.stage;
            row["tensor_rank"] = d.tensor_rank;
            row["gemm"] = d.gemm;
            row["attention"] = d.attention;
            row["elementwise"] = d.elementwise;
            row["optimizer"] = d.optimizer;
            row["comm"] = d.comm;
            row["comm_exposed"] = d.comm_exposed;
            row["bubble"] = d.bubble;
            row["step"] = d.step;
            py::dict groups;
            for (const auto& [g, s] : d.comm_by_group) groups[py::str(g)] = s;
            row["comm_by_group"] = groups;
            times.append(row);
          }
          out["time"] = py::dict(py::arg("step") = t->step, py::arg("model_flops") = t->model_flops,
                                 py::arg("devices") = times);
        }
        return out;
      },
      py::arg("hardware") = py::none(),
      "The planner's prediction for a GPT under a layout, as `meshtrain plan` prints it: keywords as its flags "
      "(size, layers, heads, width, vocab, seq, batch, mesh, fsdp, precision, micro_batches, pipeline_schedule, "
      "virtual_stages, sequence_parallel, recompute, cp_comm, fsdp_min_weight_size); hardware (\"A100\", "
      "\"H100\") adds the step time. Returns {model, mesh, fsdp, memory: [per stage and tensor rank, bytes], "
      "largest, time}.");

  m.def("launch", &launch, py::arg("fn"), py::arg("engine") = py::none(), py::arg("ranks") = py::none(),
        py::arg("timeout") = static_cast<double>(comm::kDefaultTimeout.count()) / 1000,
        py::arg("bind_to_cores") = false,
        "Runs fn(world) on every rank of an engine and returns the ranks' results in rank order (None for ranks "
        "of other processes). engine None: the job's (mpi under mpirun, gloo under `meshtrain launch` or "
        "torchrun, else threads). threads: `ranks` threads of this process (default 1); mpi, gloo: this "
        "process's rank of the job (ranks None or 0: the job's size). A rank that raises ends the job: the "
        "others' waits fail at once, and launch raises RankError naming the rank, from its exception.");
  m.def("engine_from_environment", &engine_from_environment,
        "The engine launch() uses when none is given: mpi under mpirun, gloo under `meshtrain launch` or "
        "torchrun, else threads.");
}
