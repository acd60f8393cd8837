// meshtrain.train, plan and load (bind_train).
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <optional>

#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/config/job_overrides.h"
#include "meshtrain/plan/time_model.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/model_parameters.h"
#include "meshtrain/train/trainer.h"
#include "python/src/internal.h"

namespace py = pybind11;

namespace meshtrain::python {

void bind_train(py::module_& m) {
  py::class_<train::TrainResult>(m, "TrainResult", "What meshtrain.train returns (train::TrainResult).")
      .def_readonly("steps", &train::TrainResult::steps, "Optimizer steps run.")
      .def_readonly("seconds", &train::TrainResult::seconds, "Wall time of the training loop.")
      .def_readonly("samples_per_second", &train::TrainResult::samples_per_second, "Training samples per second.")
      .def_readonly("step_losses", &train::TrainResult::step_losses, "Every step's global loss.")
      .def_readonly("final_train_loss", &train::TrainResult::final_train_loss, "Mean loss of the last logged window.")
      .def_readonly("test_loss", &train::TrainResult::test_loss, "The final evaluation's loss.")
      .def_readonly("test_accuracy", &train::TrainResult::test_accuracy,
          "The final evaluation's accuracy (classifiers).")
      .def_property_readonly("test_metrics",
                             [](const train::TrainResult& r) {
                               py::dict d;
                               for (const auto& [k, v] : r.test_metrics) d[py::str(k)] = v;
                               return d;
                             },
                             "The final evaluation's metrics by name.")
      .def_readonly("test_summary", &train::TrainResult::test_summary, "The recipe's final line.")
      .def_readonly("run_dir", &train::TrainResult::run_dir, "The run directory.")
      .def_readonly("artifacts", &train::TrainResult::artifacts, "The recipe's own files in run_dir.")
      .def_readonly("parallelism", &train::TrainResult::parallelism, "The strategy as the trainer describes it.")
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
            for (const py::handle item : v) {
              if (!text.empty()) text += ',';
              text += py::str(item).cast<std::string>();
            }
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
}

}  // namespace meshtrain::python
