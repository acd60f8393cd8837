// Mesh planning, the seeds' configs and the strategies' rules that
// meshtrain.scaling wraps (bind_scaling).
#include <pybind11/stl.h>

#include "meshtrain/config/sharding_config.h"
#include "meshtrain/mesh/mesh_shape.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/sharding/stage_assignment.h"
#include "meshtrain/sharding/strategy.h"
#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {

void bind_scaling(py::module_& m) {
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
      .def_readonly("shape", &mesh::NamedShape::shape, "The sizes, one per axis.")
      .def_readonly("axis_names", &mesh::NamedShape::axis_names, "The axes' names.")
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
      .def_readonly("shape", &plan::MeshPlan::shape, "The axes of size > 1, in mesh order.")
      .def_readonly("axis_names", &plan::MeshPlan::axis_names, "Their names.")
      .def_readonly("reasons", &plan::MeshPlan::reasons, "Why each axis has its size, one line each.")
      .def_readonly("fits", &plan::MeshPlan::fits, "False when even the least-memory mesh exceeds the devices' memory.")
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
      .def_readwrite("data_parallel_size", &config::ShardingConfig::data_parallel_size,
          "Replicas of the batch (sharded state when fsdp_enabled).")
      .def_readwrite("tensor_parallel_size", &config::ShardingConfig::tensor_parallel_size, "Shards of every layer.")
      .def_readwrite("pipeline_parallel_size", &config::ShardingConfig::pipeline_parallel_size, "Pipeline stages.")
      .def_readwrite("context_parallel_size", &config::ShardingConfig::context_parallel_size, "Shards of the sequence.")
      .def_readwrite("fsdp_enabled", &config::ShardingConfig::fsdp_enabled,
          "The data-parallel devices shard weights, gradients and optimizer state.")
      .def_readwrite("fsdp_min_weight_size", &config::ShardingConfig::fsdp_min_weight_size,
          "Parameters with fewer elements stay replicated.")
      .def_static("from_device_count", &config::ShardingConfig::from_device_count, py::arg("device_count"),
                  "Data x tensor for n devices, every device used (tensor = the largest power of two <= 8 "
                  "dividing n with tensor^2 <= n).")
      .def("get_total_device_count", &config::ShardingConfig::total_device_count,
           "data x tensor x pipeline x context.")
      .def("is_valid", &config::ShardingConfig::is_valid, "True when validate() would not raise.")
      .def("validate", &config::ShardingConfig::validate, "Raises InvalidArgument naming a size < 1 or too large.")
      .def("__repr__", [](const config::ShardingConfig& c) { return "ShardingConfig(" + c.to_string() + ")"; });
  py::class_<config::ParallelismConfig>(m, "ParallelismConfig",
                                        "A mesh and its ShardingConfig (config::ParallelismConfig).")
      .def(py::init([](std::vector<int> shape, std::vector<std::string> names, config::ShardingConfig c) {
             return config::ParallelismConfig{std::move(shape), std::move(names), c};
           }),
           py::arg("mesh_shape"), py::arg("mesh_axis_names"), py::arg("sharding_config"))
      .def_readwrite("mesh_shape", &config::ParallelismConfig::mesh_shape, "The mesh's sizes, in mesh order.")
      .def_readwrite("mesh_axis_names", &config::ParallelismConfig::mesh_axis_names,
          "pipeline, data, fsdp, context, tensor: those of size > 1.")
      .def_readwrite("sharding_config", &config::ParallelismConfig::sharding, "The sizes the mesh was made of.")
      .def_static("from_sharding_config", &config::ParallelismConfig::from_sharding_config, py::arg("config"),
                  "The mesh of a ShardingConfig: axes pipeline, data (fsdp when fsdp_enabled), context, tensor; "
                  "size-1 axes left out.")
      .def("is_valid", &config::ParallelismConfig::is_valid, "True when validate() would not raise.")
      .def("validate", &config::ParallelismConfig::validate,
           "Raises InvalidArgument unless the mesh matches the sizes (its axes, their names and product).");

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
}

}  // namespace meshtrain::python
