// The extension module's shared parts (python/src/): numpy arrays as the
// engines take them, the GIL among a threads-engine launch's rank threads,
// and the objects Python holds (a rank's Communicator and DeviceMesh).
// Each bind_* function adds one part's names to the module (module.cc).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/dtype.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/mesh/device_mesh.h"

namespace py = pybind11;

namespace meshtrain::python {

// ---- arrays (arrays.cc) ----

std::string dtype_name(const py::dtype& t);
// The engine dtype of a numpy dtype's (kind, itemsize, byteorder), or none.
std::optional<DType> engine_dtype(char kind, py::ssize_t size, char byteorder);
// The engine dtype of an array (InvalidArgument naming op for another).
DType dtype_of(const py::array& a, const char* op);
std::string shape_of(const py::array& a);
// The array as the engines take it: C-contiguous (and writable when `written`).
void check_layout(const py::array& a, const char* op, const char* what, bool written);
// The numpy dtype of an engine dtype (numpy has no bfloat16).
py::dtype numpy_dtype(DType t, const char* op);
// A tensor over the array's memory (no copy; the array must outlive it).
Tensor tensor_view(const py::array& a, const char* op);
// A numpy array over the tensor's memory (no copy; the array keeps it alive).
py::array numpy_view(const Tensor& t, const char* op);
// A deadline in seconds (InvalidArgument naming op unless > 0).
std::chrono::milliseconds to_ms(double seconds, const char* op);

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
extern std::atomic<bool> g_spin;  // this launch's ranks fit on the cores (set by launch)
extern thread_local bool t_rank;  // this thread runs a rank of launch()
void take_turn();
void give_turn();

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
      throw InvalidArgument(op, "a communicator used after its job ended",
                            "use a rank's communicator inside the function launch() runs, or between init() and "
                            "shutdown()");
    return *c_;
  }
  std::shared_ptr<std::atomic<bool>> alive() const { return alive_; }
  // Whether its job still runs (no shared_ptr copy: all_reduce's fast path asks on every call).
  bool alive_now() const { return alive_->load(); }

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
      throw InvalidArgument(op, "a DeviceMesh used after its job ended",
                            "use a rank's mesh inside the function launch() runs, or between init() and shutdown()");
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

// ---- configs (configs.cc) ----

// A Python value as meshtrain's parsers take text: True -> "true", a list or
// tuple -> "a,b", anything else str().
std::string value_text(py::handle v);

// ---- the module's parts ----
void bind_errors(py::module_& m);    // module.cc
void bind_comm(py::module_& m);      // comm.cc: Work, Communicator, DeviceMesh, launch
// fast_calls.cc: Communicator.all_reduce's common form without pybind11's
// dispatch (the bound method handles every other form); after bind_comm.
void add_fast_calls(py::module_& m);
void bind_sharding(py::module_& m);  // sharding.cc: PartitionSpec, Layout, ShardedTensor
void bind_scaling(py::module_& m);   // scaling.cc: mesh planning, the seeds' configs and strategy rules
void bind_configs(py::module_& m);   // configs.cc: DistributedConfig
void bind_train(py::module_& m);     // train.cc: train, plan, load

}  // namespace meshtrain::python
