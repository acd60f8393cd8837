// meshtrain.distributed.DistributedConfig (bind_configs): config::DistributedConfig
// with the seeds' keyword constructor, validated on construction; and the text
// a Python value is given as to meshtrain's parsers (value_text).
#include <fmt/format.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <utility>

#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/config/job_overrides.h"
#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {

std::string value_text(py::handle v) {
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>() ? "true" : "false";
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    std::string text;
    for (const py::handle item : v) {
      if (!text.empty()) text += ',';
      text += py::str(item).cast<std::string>();
    }
    return text;
  }
  return py::str(v).cast<std::string>();
}

namespace {

constexpr const char* kOp = "DistributedConfig";

const config::ConfigField* field_of(std::string_view key) {
  for (const config::ConfigField& f : config::distributed_config_fields())
    if (f.key == key) return &f;
  return nullptr;
}

// The Python type a key takes, checked before its text is parsed, so that
// world_size="4" or enabled=1 is an error naming the key rather than parsed.
void check_type(const std::string& key, py::handle v) {
  auto wrong = [&](const char* wanted, const std::string& example) {
    throw InvalidArgument(kOp,
                          fmt::format("{} must be {}, got {} {}", key, wanted,
                                      py::str(py::type::of(v).attr("__name__")).cast<std::string>(),
                                      py::repr(v).cast<std::string>()),
                          fmt::format("write e.g. {}", example));
  };
  const bool is_int = py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v);
  if (key == "mesh_shape" || key == "mesh_axis_names") {
    const bool names = key == "mesh_axis_names";
    const char* wanted = names ? "a sequence of str" : "a sequence of int";
    const std::string example = names ? "mesh_axis_names=(\"data\", \"tensor\")" : "mesh_shape=(2, 2)";
    if (!py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v)) wrong(wanted, example);
    for (const py::handle item : v) {
      const bool ok = names ? py::isinstance<py::str>(item)
                            : py::isinstance<py::int_>(item) && !py::isinstance<py::bool_>(item);
      if (!ok) wrong(wanted, example);
    }
    return;
  }
  const config::ConfigField* f = field_of(key);
  if (!f) return;  // with_values names the unknown key
  if (f->type == "bool" && !py::isinstance<py::bool_>(v)) wrong("a bool", key + "=True");
  if (f->type == "int" && !is_int) wrong("an int", key + "=4");
  if (f->type != "bool" && f->type != "int" && !py::isinstance<py::str>(v))
    wrong("a str", fmt::format("{}=\"{}\"", key, f->format(config::DistributedConfig{})));
}

config::DistributedConfig validated(config::DistributedConfig c) {
  c.validate();
  return c;
}

config::DistributedConfig with_kwargs(const config::DistributedConfig& base, const py::kwargs& kw) {
  std::vector<std::pair<std::string, std::string>> values;
  for (const auto& [k, v] : kw) {
    const std::string key = k.cast<std::string>();
    if (v.is_none() && (key == "mesh_shape" || key == "mesh_axis_names")) {
      values.emplace_back(key, "");  // None: not given
      continue;
    }
    check_type(key, v);
    values.emplace_back(key, value_text(v));
  }
  return validated(base.with_values(values, ""));
}

py::object mesh_tuple_or_none(const config::DistributedConfig& c, bool names) {
  if (c.mesh_shape.empty() && c.mesh_axis_names.empty()) return py::none();
  return names ? py::object(py::tuple(py::cast(c.mesh_axis_names))) : py::object(py::tuple(py::cast(c.mesh_shape)));
}

// A field's value as Python holds it (bool, int, str).
py::object field_value(const config::DistributedConfig& c, const config::ConfigField& f) {
  const std::string text = f.format(c);
  if (f.type == "bool") return py::bool_(text == "true");
  if (f.type == "int") return py::int_(std::stoll(text));
  return py::str(text);
}

}  // namespace

void bind_configs(py::module_& m) {
  py::class_<config::DistributedConfig> dc(
      m, "DistributedConfig",
      "Where this process sits in the job, the engine, the parallel sizes and mesh, mixed precision "
      "(config::DistributedConfig; docs/configs.md). Built from keywords (the seeds' names and defaults), "
      "validated on construction; read-only (replace() returns a changed copy).\n\n"
      "Differences from the seeds (docs/python.md): the default backend is 'threads' (the seeds' nccl needs "
      "GPUs), the mesh axes are meshtrain's (tensor, not model), the mesh is checked against the ranks "
      "(devices) and the parallel sizes, a pipeline-only config keeps its pipeline axis, and "
      "find_unused_parameters, gradient_as_bucket_view and broadcast_buffers (PyTorch DDP switches) and the "
      "required name are not taken.");
  dc.def(py::init([](const py::kwargs& kw) { return with_kwargs(config::DistributedConfig{}, kw); }),
         "DistributedConfig(**keys): the defaults overlaid with the keys given, then validated (InvalidArgument "
         "naming the first broken rule and what to change).");
  for (const config::ConfigField& f : config::distributed_config_fields()) {
    if (f.type == "mesh") continue;  // the property mesh is the NamedShape
    const std::string help = fmt::format("{} ({}; flag {}).", f.help, f.type, f.flag);
    dc.def_property_readonly(
        std::string(f.key).c_str(), [&f](const config::DistributedConfig& c) { return field_value(c, f); },
        help.c_str());
  }
  dc.def_property_readonly(
        "mesh_shape", [](const config::DistributedConfig& c) { return mesh_tuple_or_none(c, false); },
        "The mesh's sizes as given, or None (then derived: see mesh).")
      .def_property_readonly(
          "mesh_axis_names", [](const config::DistributedConfig& c) { return mesh_tuple_or_none(c, true); },
          "The mesh's axis names as given, or None.")
      .def_property_readonly(
          "launcher", [](const config::DistributedConfig& c) { return std::string(config::launcher_name(c.launcher)); },
          "Which launcher started this process: 'none', 'torchrun' (meshtrain launch) or 'mpirun' "
          "(from_environment()).")
      .def_static(
          "from_dict", [](const py::dict& d) { return with_kwargs(config::DistributedConfig{}, py::kwargs(d)); },
          py::arg("values"), "DistributedConfig(**values): unknown keys are errors (the seeds' strict from_dict).")
      .def_static(
          "from_toml",
          [](const std::string& text) { return validated(config::DistributedConfig::from_toml(text)); },
          py::arg("text"), "From TOML text ([distributed] or top-level keys), validated.")
      .def_static(
          "from_toml_file",
          [](const std::string& path) { return validated(config::DistributedConfig::from_toml_file(path)); },
          py::arg("path"), "From a TOML file (meshtrain train --config's), validated.")
      .def_static(
          "from_environment",
          [](const py::kwargs& kw) {
            config::DistributedConfig c = config::DistributedConfig{}.with_env(config::read_launcher_env());
            // The engine as meshtrain train picks it: mpi under mpirun, gloo under torchrun.
            if (!kw.contains("backend")) {
              config::JobOverrides job;
              job.gloo_available = comm::engines().find("gloo") != nullptr;
              c = config::apply_job_overrides(c, job);
            }
            return with_kwargs(c, kw);
          },
          "The job this process belongs to, from the launcher's variables (torchrun's, as meshtrain launch "
          "sets them, or mpirun's; the engine then gloo or mpi, as meshtrain train picks it), overlaid with the "
          "keys given; validated.")
      .def(
          "replace", [](const config::DistributedConfig& c, const py::kwargs& kw) { return with_kwargs(c, kw); },
          "A copy with the keys given changed, validated (dataclasses.replace).")
      .def("validate", &config::DistributedConfig::validate,
           "Raises InvalidArgument at the first broken rule, saying what to change.")
      .def("is_valid", &config::DistributedConfig::is_valid, "True when validate() would not raise.")
      .def("get_data_parallel_size", &config::DistributedConfig::data_parallel_size,
           "world_size / (tensor x pipeline x context): the data (and fsdp) ranks.")
      .def("is_main_process", &config::DistributedConfig::is_main_process, "rank == 0.")
      .def("is_local_main_process", &config::DistributedConfig::is_local_main_process, "local_rank == 0.")
      .def_property_readonly("mesh", &config::DistributedConfig::mesh,
                             "The mesh to build (a NamedShape): the one given, or (pipeline, data, context, tensor) "
                             "from the sizes, size-1 axes left out.")
      .def(
          "get_mesh_config",
          [](const config::DistributedConfig& c) {
            const mesh::NamedShape s = c.mesh();
            py::dict d;
            d["mesh_shape"] = py::tuple(py::cast(s.shape));
            d["axis_names"] = py::tuple(py::cast(s.axis_names));
            return d;
          },
          "{'mesh_shape': ..., 'axis_names': ...} of mesh: always a mesh (the seeds returned None without a "
          "shape, and lost the pipeline axis when tensor_parallel_size was 1).")
      .def("parallelism_config", &config::DistributedConfig::parallelism_config,
           "The mesh with its ShardingConfig (fsdp_enabled when the mesh has an fsdp axis > 1).")
      .def(
          "to_dict",
          [](const config::DistributedConfig& c) {
            py::dict d;
            for (const config::ConfigField& f : config::distributed_config_fields())
              if (f.type != "mesh") d[py::str(std::string(f.key))] = field_value(c, f);
            d["mesh_shape"] = mesh_tuple_or_none(c, false);
            d["mesh_axis_names"] = mesh_tuple_or_none(c, true);
            return d;
          },
          "Every key's value; DistributedConfig.from_dict(c.to_dict()) == c.")
      .def("to_toml", &config::DistributedConfig::to_toml,
           "The [distributed] table meshtrain train --config reads (the start-up dump).")
      .def(py::self == py::self)  // NOLINT(misc-redundant-expression)
      .def("__repr__", [](const config::DistributedConfig& c) {
        std::string out = "DistributedConfig(";
        for (const config::ConfigField& f : config::distributed_config_fields()) {
          if (f.type == "mesh") continue;
          out += fmt::format("{}={}, ", f.key, py::repr(field_value(c, f)).cast<std::string>());
        }
        out += fmt::format("mesh_shape={}, mesh_axis_names={})",
                           py::repr(mesh_tuple_or_none(c, false)).cast<std::string>(),
                           py::repr(mesh_tuple_or_none(c, true)).cast<std::string>());
        return out;
      });
}

}  // namespace meshtrain::python
