// Work, Communicator, DeviceMesh and launch (internal.h's bind_comm).
#include <fmt/format.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "meshtrain/comm/launch.h"
#include "meshtrain/config/distributed_config.h"
#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {
namespace {

void check_same(const py::array& a, const py::array& b, const char* op, const char* what) {
  if (!a.dtype().equal(b.dtype()) || a.size() != b.size())
    throw InvalidArgument(op,
                          fmt::format("{} {} of {} for input {} of {}", what, shape_of(b),
                                      dtype_name(b.dtype()), shape_of(a), dtype_name(a.dtype())),
                          "pass an output of the input's dtype and the documented size");
}

// An asynchronous operation: keeps its arrays alive until waited for.
class PyWork {
 public:
  PyWork(comm::Work w, std::vector<py::object> keep, py::object result)
      : work_(std::move(w)), keep_(std::move(keep)), result_(std::move(result)) {}
  // Waits (GIL released), rethrows the engine's error; returns the result
  // array of an all_gather/reduce_scatter/all_to_all(_v), else None.
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
  py::array o = out ? *out : py::array(a.dtype(), shape);
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
  py::array o = out ? *out : py::array(a.dtype(), per_rank_shape(a, c.size(), name));
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
  py::array o = out ? *out : py::array(a.dtype(), shape);
  check_layout(o, name, "out", true);
  check_same(a, o, name, "out");
  const void* in = a.data();
  void* res = o.mutable_data();
  const size_t n = count_of(a) / static_cast<size_t>(c.size());
  return run(async_op, [&] { return std::vector<py::object>{a, o}; }, o, [&] { c.all_to_all(in, res, n, t); },
             [&] { return c.all_to_all_async(in, res, n, t); });
}

// Uneven all_to_all along the first axis (torch's all_to_all_single with
// split sizes): send_counts[p] rows of `array` (in order) go to rank p; the
// result holds recv_counts[r] rows from each rank r, in rank order
// (recv_counts None: exchanged first, one all_to_all of the counts).
py::object all_to_all_v(const Comm& self, py::array a, const std::vector<int64_t>& send_counts,
                        std::optional<std::vector<int64_t>> recv_counts, std::optional<py::array> out,
                        bool async_op) {
  const char* name = "Communicator.all_to_all_v";
  comm::Communicator& c = self.get(name);
  check_layout(a, name, "array", false);
  const DType t = dtype_of(a, name);
  if (a.ndim() < 1)
    throw InvalidArgument(name, fmt::format("array of shape {}", shape_of(a)), "pass an array of rows (ndim >= 1)");
  const auto n = static_cast<size_t>(c.size());
  const auto rows_in = [&](const std::vector<int64_t>& counts, const char* what) {
    if (counts.size() != n)
      throw InvalidArgument(name, fmt::format("{} {} counts for {} ranks", counts.size(), what, n),
                            "pass one row count per rank");
    int64_t sum = 0;
    for (int64_t v : counts) {
      if (v < 0) throw InvalidArgument(name, fmt::format("{} count {}", what, v), "row counts are >= 0");
      sum += v;
    }
    return sum;
  };
  if (rows_in(send_counts, "send") != a.shape(0))
    throw InvalidArgument(name,
                          fmt::format("send counts add up to {} rows, array has {}", rows_in(send_counts, "send"),
                                      a.shape(0)),
                          "send_counts must split the array's first axis");
  size_t row = 1;
  for (py::ssize_t d = 1; d < a.ndim(); ++d) row *= static_cast<size_t>(a.shape(d));
  std::vector<size_t> send(n), recv(n);
  for (size_t p = 0; p < n; ++p) send[p] = static_cast<size_t>(send_counts[p]) * row;
  std::vector<int64_t> got;
  if (recv_counts) {
    got = *recv_counts;
  } else {
    std::vector<size_t> rows(send_counts.begin(), send_counts.end());
    GilRelease release;
    for (size_t v : comm::all_to_all_counts(c, rows)) got.push_back(static_cast<int64_t>(v));
  }
  std::vector<py::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  shape[0] = rows_in(got, "recv");
  for (size_t p = 0; p < n; ++p) recv[p] = static_cast<size_t>(got[p]) * row;
  py::array o = out ? *out : py::array(a.dtype(), shape);
  check_layout(o, name, "out", true);
  if (!o.dtype().equal(a.dtype()) || o.ndim() != a.ndim() ||
      !std::equal(shape.begin(), shape.end(), o.shape()))
    throw InvalidArgument(name, fmt::format("out {} of {} for a result of {} rows of the array's", shape_of(o),
                                            dtype_name(o.dtype()), shape[0]),
                          "pass an out of the array's dtype with sum(recv_counts) rows");
  const void* in = a.data();
  void* res = o.mutable_data();
  return run(async_op, [&] { return std::vector<py::object>{a, o}; }, o,
             [&] { c.all_to_all_v(in, send, res, recv, t); },
             [&] { return c.all_to_all_v_async(in, send, res, recv, t); });
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

// The world of the launch() rank this thread runs (init() there returns it).
thread_local comm::Communicator* t_launch_world = nullptr;
thread_local std::shared_ptr<std::atomic<bool>> t_launch_alive;

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
        struct WorldGuard {  // init() on this thread returns this rank's world until fn returns
          WorldGuard(comm::Communicator* w, std::shared_ptr<std::atomic<bool>> a) {
            t_launch_world = w;
            t_launch_alive = std::move(a);
          }
          ~WorldGuard() {
            t_launch_world = nullptr;
            t_launch_alive.reset();
          }
        } world_guard(&world, alive);
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

// ---- init ----
//
// init() joins the job this process belongs to and returns its world
// communicator, which stays usable until shutdown(). The engines hand out a
// world only inside comm::launch's callback, so a runner thread calls
// launch() and parks in the callback; shutdown() releases it and joins. MPI
// is initialized there with MPI_THREAD_MULTIPLE, so the Python thread may
// call it.
struct InitState {
  std::mutex mu;
  std::condition_variable cv;
  std::thread runner;
  comm::Communicator* world = nullptr;  // while the runner is parked
  bool release = false;                 // shutdown() asked the runner to return
  bool done = false;                    // the runner's launch() returned
  std::exception_ptr error;             // what launch() threw
  std::shared_ptr<std::atomic<bool>> alive;
  std::string engine;
};

InitState& init_state() {
  static auto* s = new InitState;  // never destroyed: shutdown() runs from atexit
  return *s;
}

bool is_initialized() {
  if (t_launch_world) return true;
  InitState& s = init_state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.world != nullptr;
}

void shutdown() {
  InitState& s = init_state();
  if (!s.runner.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.release = true;
  }
  s.cv.notify_all();
  if (s.alive) s.alive->store(false);
  {
    py::gil_scoped_release release;
    s.runner.join();
  }
  std::exception_ptr error = std::exchange(s.error, nullptr);
  s.world = nullptr;
  s.engine.clear();
  if (error) std::rethrow_exception(error);
}

Comm init(std::optional<std::string> engine_name, double timeout) {
  const char* op = "meshtrain.init";
  if (t_launch_world) return Comm(t_launch_world, t_launch_alive);  // a rank of launch(): its world
  InitState& s = init_state();
  const std::string engine = engine_name ? *engine_name : engine_from_environment();
  if (s.runner.joinable()) {
    if (engine != s.engine)
      throw InvalidArgument(op, fmt::format("this process already joined a {} job", s.engine),
                            fmt::format("call meshtrain.shutdown() before joining a {} job", engine));
    return Comm(s.world, s.alive);
  }
  const comm::LaunchOptions options{.engine = engine, .ranks = engine == "threads" ? 1 : 0,
                                    .timeout = to_ms(timeout, op), .bind_to_cores = false};
  s.alive = std::make_shared<std::atomic<bool>>(true);
  s.release = s.done = false;
  s.error = nullptr;
  s.world = nullptr;
  s.engine = engine;
  s.runner = std::thread([&s, options] {
    try {
      comm::launch(options, [&s](comm::Communicator& world) {
        std::unique_lock<std::mutex> lock(s.mu);
        s.world = &world;
        s.cv.notify_all();
        s.cv.wait(lock, [&s] { return s.release; });
      });
    } catch (...) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.done = true;
    }
    s.cv.notify_all();
  });
  {
    py::gil_scoped_release release;  // joining may wait for the other processes (rendezvous)
    std::unique_lock<std::mutex> lock(s.mu);
    s.cv.wait(lock, [&s] { return s.world != nullptr || s.done; });
  }
  if (!s.world) {  // the engine failed to start: its error, and nothing left running
    {
      py::gil_scoped_release release;
      s.runner.join();
    }
    s.engine.clear();
    std::rethrow_exception(std::exchange(s.error, nullptr));
  }
  return Comm(s.world, s.alive);
}

}  // namespace

void bind_comm(py::module_& m) {
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
      .def("all_to_all_v", &all_to_all_v, py::arg("array"), py::arg("send_counts"),
           py::arg("recv_counts") = py::none(), py::arg("out") = py::none(), py::arg("async_op") = false,
           "Uneven all_to_all along the first axis (torch's all_to_all_single with split sizes): "
           "send_counts[p] rows of `array` go to rank p; returns the rows received, recv_counts[r] from each "
           "rank r in rank order (recv_counts None: exchanged first). Any count may be 0; rank r's "
           "send_counts[p] must equal rank p's recv_counts[r] (MismatchError otherwise).")
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
      .def_property_readonly("shape", [](const Mesh& m) { return m.get("DeviceMesh.shape").shape(); },
                             "The sizes, one per axis.")
      .def_property_readonly("axis_names", [](const Mesh& m) { return m.get("DeviceMesh.axis_names").axis_names(); },
                             "The axes' names.")
      .def_property_readonly("ndim", [](const Mesh& m) { return m.get("DeviceMesh.ndim").ndim(); },
                             "The number of axes.")
      .def_property_readonly("size", [](const Mesh& m) { return m.get("DeviceMesh.size").size(); },
                             "The number of ranks (the product of the shape).")
      .def_property_readonly("rank", [](const Mesh& m) { return m.get("DeviceMesh.rank").rank(); },
                             "This rank's world rank.")
      .def_property_readonly("coords", [](const Mesh& m) { return m.get("DeviceMesh.coords").coords(); },
                             "This rank's coordinates (row-major: the last axis fastest).")
      .def("coords_of", [](const Mesh& m, int rank) { return m.get("DeviceMesh.coords_of").coords_of(rank); },
           py::arg("rank"), "The coordinates of a world rank.")
      .def("rank_of", [](const Mesh& m, std::vector<int> c) { return m.get("DeviceMesh.rank_of").rank_of(c); },
           py::arg("coords"), "The world rank at coordinates.")
      .def("axis_size", [](const Mesh& m, const std::string& a) { return m.get("DeviceMesh.axis_size").axis_size(a); },
           py::arg("axis"), "The size of an axis.")
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

  m.def("launch", &launch, py::arg("fn"), py::arg("engine") = py::none(), py::arg("ranks") = py::none(),
        py::arg("timeout") = static_cast<double>(comm::kDefaultTimeout.count()) / 1000,
        py::arg("bind_to_cores") = false,
        "Runs fn(world) on every rank of an engine and returns the ranks' results in rank order (None for ranks "
        "of other processes). engine None: the job's (mpi under mpirun, gloo under `meshtrain launch` or "
        "torchrun, else threads). threads: `ranks` threads of this process (default 1); mpi, gloo: this "
        "process's rank of the job (ranks None or 0: the job's size). A rank that raises ends the job: the "
        "others' waits fail at once, and launch raises RankError naming the rank, from its exception.");
  m.def("init", &init, py::arg("engine") = py::none(),
        py::arg("timeout") = static_cast<double>(comm::kDefaultTimeout.count()) / 1000,
        "Joins the job this process belongs to (torch.distributed.init_process_group) and returns its world "
        "Communicator, usable until shutdown(). engine None: the job's (mpi under mpirun, gloo under `meshtrain "
        "launch` or torchrun, else threads, a world of this one rank). Inside a function launch() runs it returns "
        "that rank's world. Calling it again returns the same world; shutdown() runs at exit.");
  m.def("shutdown", &shutdown,
        "Leaves the job init() joined (torch.distributed.destroy_process_group): every rank calls it; the "
        "world and its meshes and split communicators raise afterwards. Nothing to do when not joined.");
  m.def("is_initialized", &is_initialized,
        "True between init() and shutdown() (and inside a function launch() runs).");
  m.def("engine_from_environment", &engine_from_environment,
        "The engine launch() uses when none is given: mpi under mpirun, gloo under `meshtrain launch` or "
        "torchrun, else threads.");
}

}  // namespace meshtrain::python
