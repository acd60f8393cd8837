// PartitionSpec, Layout, ShardedTensor and their functions (bind_sharding).
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <optional>

#include "meshtrain/sharding/layout.h"
#include "meshtrain/sharding/partition_spec.h"
#include "meshtrain/sharding/sharded_tensor.h"
#include "meshtrain/sharding/visualize.h"
#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {
namespace {

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
      throw InvalidArgument(op, "a ShardedTensor used after its job ended",
                            "use it inside the function launch() runs, or between init() and shutdown()");
    return tensor;
  }
};

const PyLayout& on_mesh(const PyLayout& l, const char* op) {
  if (!l.mesh)
    throw InvalidArgument(op, "a layout without a DeviceMesh", "build it as Layout(mesh, spec, global_shape)");
  if (!l.alive->load())
    throw InvalidArgument(op, "a Layout used after its job ended",
                          "use it inside the function launch() runs, or between init() and shutdown()");
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

}  // namespace

void bind_sharding(py::module_& m) {
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
      .def_property_readonly("spec", [](const PyLayout& l) { return l.layout.spec(); }, "Its PartitionSpec.")
      .def_property_readonly("global_shape", [](const PyLayout& l) { return l.layout.global_shape(); },
                             "The whole tensor's shape.")
      .def_property_readonly("mesh_shape", [](const PyLayout& l) { return l.layout.mesh_shape(); }, "The mesh's sizes.")
      .def_property_readonly("axis_names", [](const PyLayout& l) { return l.layout.axis_names(); }, "The mesh's axes.")
      .def("local_shape", [](const PyLayout& l, int rank) { return l.layout.local_shape(rank); }, py::arg("rank"),
           "The block `rank` holds.")
      .def(
          "local_box",
          [](const PyLayout& l, int rank) {
            const sharding::Box b = l.layout.local_box(rank);
            return py::make_tuple(b.offsets, b.sizes);
          },
          py::arg("rank"), "(offsets, sizes) of the block `rank` holds, in global coordinates.")
      .def("num_shards", [](const PyLayout& l, int dim) { return l.layout.num_shards(dim); }, py::arg("dim"),
           "Into how many blocks a dimension is split.")
      .def("is_even", [](const PyLayout& l) { return l.layout.is_even(); }, "True when every block has the same shape.")
      .def("__repr__", [](const PyLayout& l) { return l.layout.to_string(); });

  py::class_<PySharded>(m, "ShardedTensor", "This rank's block of a global tensor, and its Layout.")
      .def_property_readonly(
          "local", [](const PySharded& s) { return numpy_view(s.get("ShardedTensor.local").local(), "local"); },
          "This rank's block as a numpy array over the same memory (no copy).")
      .def_property_readonly("layout",
                             [](const PySharded& s) {
                               return PyLayout{s.get("ShardedTensor.layout").layout(), s.mesh, s.alive};
                             },
                             "Its Layout.")
      .def_property_readonly("global_shape",
                             [](const PySharded& s) { return s.get("ShardedTensor.global_shape").global_shape(); },
                             "The whole tensor's shape.")
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

}

}  // namespace meshtrain::python
