// Communicator.all_reduce(array[, op]) through CPython's vectorcall,
// without pybind11's dispatch (internal.h's add_fast_calls).
//
// A small collective from Python is dominated by the binding: pybind11's
// overload dispatch, argument casters and defaults cost about 0.6 us per
// call, and on a threads-engine launch the ranks' calls run one after the
// other under the one GIL. The common form, a C-contiguous writable array
// of an engine dtype, an op given as a string (or none) and async_op False,
// is handled here in a method descriptor that reads the array's header
// directly; every other form (async_op=True, anything to refuse with a
// message) calls
// the pybind11-bound method, which stays the one definition of the
// semantics and errors.
#include <pybind11/numpy.h>

#include <exception>
#include <optional>
#include <string>

#include "meshtrain/comm/communicator.h"
#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {
namespace {

PyObject* g_bound_all_reduce = nullptr;  // the pybind11 method (owned; never released)

// The bound method with the same arguments (self first).
PyObject* call_bound(PyObject* bound, PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  PyObject* stack[8];
  if (nargs + nkw + 1 > 8) {
    PyErr_SetString(PyExc_TypeError, "Communicator.all_reduce: too many arguments");
    return nullptr;
  }
  stack[0] = self;
  for (Py_ssize_t i = 0; i < nargs + nkw; ++i) stack[i + 1] = args[i];
  return PyObject_Vectorcall(bound, stack, static_cast<size_t>(nargs + 1), kwnames);
}

std::optional<comm::ReduceOp> reduce_op(PyObject* name) {
  if (!PyUnicode_Check(name)) return std::nullopt;
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(name, &n);
  if (s == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  try {
    return comm::parse_reduce_op(std::string_view(s, static_cast<size_t>(n)));
  } catch (const std::exception&) {
    return std::nullopt;  // the bound method raises the message
  }
}

// The communicator of a Communicator instance (pybind11's simple layout).
Comm* comm_of(PyObject* self) {
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  return inst->simple_layout && inst->simple_holder_constructed ? static_cast<Comm*>(inst->simple_value_holder[0])
                                                                : nullptr;
}

// The engine's error as the bound method raises it (the module's translators).
PyObject* raise(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (...) {
    auto& local = py::detail::get_local_internals().registered_exception_translators;
    if (py::detail::apply_exception_translators(local)) return nullptr;
    auto& global = py::detail::get_internals().registered_exception_translators;
    if (py::detail::apply_exception_translators(global)) return nullptr;
    PyErr_SetString(PyExc_RuntimeError, "Communicator.all_reduce: unknown error");
    return nullptr;
  }
}

PyObject* fast_all_reduce(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  auto bound = [&] { return call_bound(g_bound_all_reduce, self, args, nargs, kwnames); };
  // (array, op, async_op), positional or by keyword; async_op only False.
  PyObject* given[3] = {nullptr, nullptr, nullptr};
  if (nargs > 3) return bound();
  for (Py_ssize_t i = 0; i < nargs; ++i) given[i] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    const int slot = PyUnicode_CompareWithASCIIString(key, "array") == 0      ? 0
                     : PyUnicode_CompareWithASCIIString(key, "op") == 0       ? 1
                     : PyUnicode_CompareWithASCIIString(key, "async_op") == 0 ? 2
                                                                               : -1;
    if (slot < 0 || given[slot] != nullptr) return bound();
    given[slot] = args[nargs + k];
  }
  if (given[0] == nullptr || (given[2] != nullptr && given[2] != Py_False)) return bound();
  comm::ReduceOp op = comm::ReduceOp::sum;
  if (given[1] != nullptr) {
    const auto r = reduce_op(given[1]);
    if (!r) return bound();
    op = *r;
  }
  PyObject* a = given[0];
  if (!py::detail::npy_api::get().PyArray_Check_(a)) return bound();
  const py::detail::PyArray_Proxy* arr = py::detail::array_proxy(a);
  constexpr int kNeeded = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  if ((arr->flags & kNeeded) != kNeeded) return bound();
  const py::detail::PyArrayDescr_Proxy* d = py::detail::array_descriptor_proxy(arr->descr);
  const std::optional<DType> t = engine_dtype(d->kind, d->elsize, d->byteorder);
  Comm* c = comm_of(self);
  if (!t || c == nullptr || !c->alive_now()) return bound();
  size_t n = 1;
  for (int i = 0; i < arr->nd; ++i) n *= static_cast<size_t>(arr->dimensions[i]);
  comm::Communicator& world = c->get("Communicator.all_reduce");
  std::exception_ptr error;
  {
    GilRelease release;
    try {
      world.all_reduce(arr->data, arr->data, n, *t, op);
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error) return raise(error);
  Py_RETURN_NONE;
}

}  // namespace

void add_fast_calls(py::module_& m) {
  const py::object cls = m.attr("Communicator");
  const py::object bound = cls.attr("all_reduce");
  g_bound_all_reduce = bound.inc_ref().ptr();
  // The signature line CPython's inspect reads, then the bound method's text (after its own signature line).
  const std::string bound_doc = bound.attr("__doc__").cast<std::string>();
  static const std::string doc =
      "all_reduce($self, /, array, op='sum', async_op=False)\n--\n\n" + bound_doc.substr(bound_doc.find('\n') + 1);
  static PyMethodDef def = {"all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_all_reduce)),
                            METH_FASTCALL | METH_KEYWORDS, doc.c_str()};
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  py::object descr = py::reinterpret_steal<py::object>(PyDescr_NewMethod(type, &def));
  if (!descr) throw py::error_already_set();
  cls.attr("all_reduce") = descr;
}

}  // namespace meshtrain::python
