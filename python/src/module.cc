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

#include "meshtrain/version.h"
#include "meshtrain/core/cpu_isa.h"
#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {

void bind_errors(py::module_& m) {
  // Errors: the C++ hierarchy, each class also a subclass of the builtin a
  // Python caller would catch (ValueError for a bad argument, TimeoutError
  // for a deadline, ...).
  const auto builtin = [](PyObject* e) { return py::reinterpret_borrow<py::object>(e); };
  py::object base = py::exception<Error>(m, "Error", PyExc_RuntimeError);
  base.attr("__doc__") = "meshtrain's errors: the operation, what was wrong and a hint to fix it.";
  // A class of the module: its bases, and what it is raised for (docs/python.md's table).
  const auto add = [&](const char* name, py::tuple bases, const char* doc) {
    py::object cls = py::reinterpret_steal<py::object>(
        PyErr_NewException(fmt::format("meshtrain._meshtrain.{}", name).c_str(), bases.ptr(), nullptr));
    cls.attr("__doc__") = doc;
    m.attr(name) = cls;
    return cls;
  };
  add("InvalidArgument", py::make_tuple(base, builtin(PyExc_ValueError)),
      "A broken precondition: a bad value, shape, dtype, rank, name or size.");
  add("Unsupported", py::make_tuple(base, builtin(PyExc_NotImplementedError)),
      "A combination meshtrain does not do (the message says which and why).");
  add("OutOfMemory", py::make_tuple(base, builtin(PyExc_MemoryError)), "An allocation over a tracked memory budget.");
  add("IoError", py::make_tuple(base, builtin(PyExc_OSError)),
      "A file that cannot be read or written: checkpoints, datasets, run directories.");
  const py::object comm_error =
      add("CommError", py::make_tuple(base, builtin(PyExc_RuntimeError)),
          "A communication failure; base of TimeoutError, MismatchError, AbortedError, EngineError.");
  add("TimeoutError", py::make_tuple(comm_error, builtin(PyExc_TimeoutError)),
      "A rank did not arrive within the deadline (the message names it).");
  add("MismatchError", py::make_tuple(comm_error),
      "Ranks called different collectives (their fingerprints in the message).");
  add("AbortedError", py::make_tuple(comm_error), "Another rank failed first: this wait was stopped.");
  add("EngineError", py::make_tuple(comm_error), "The engine itself failed (MPI, Gloo).");
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
}

}  // namespace meshtrain::python

PYBIND11_MODULE(_meshtrain, m) {
  using namespace meshtrain::python;
  m.doc() = "meshtrain's C++ core (import meshtrain for the package)";
  m.attr("__version__") = MESHTRAIN_VERSION_STRING;
  bind_errors(m);
  bind_comm(m);
  add_fast_calls(m);
  bind_sharding(m);
  bind_scaling(m);
  bind_configs(m);
  bind_train(m);
  py::list waits;  // what prepare_libraries sets (meshtrain/__init__.py sets the same before loading this module)
  for (const meshtrain::LibraryVariable& v : meshtrain::kIdleWaits)
    waits.append(py::make_tuple(std::string(v.name), std::string(v.value), std::string(v.unless)));
  m.attr("_idle_waits") = py::tuple(waits);
}
