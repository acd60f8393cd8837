// meshtrain.train, plan and load (bind_train).
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <optional>

#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/config/job_overrides.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/plan/time_model.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/model_parameters.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/train/device_memory.h"
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
      [](std::optional<std::string> config_file, const py::kwargs& kwargs) {
        const char* op = "meshtrain.train";
        // resume=RUN without a config: the run's own config.toml, as `meshtrain train --resume` does.
        if (!config_file && kwargs.contains("resume") && !kwargs["resume"].is_none())
          config_file = train::resume_config(value_text(kwargs["resume"]));
        train::TrainConfig tc = config_file ? train::TrainConfig::from_toml_file(*config_file) : train::TrainConfig{};
        config::DistributedConfig dc = config_file ? config::DistributedConfig::from_toml_file(*config_file)
                                                   : config::DistributedConfig{};
        config::JobOverrides job{.config_source = config_file.value_or("")};
        job.gloo_available = comm::engines().find("gloo") != nullptr;
        std::string timeout = "300";
        std::optional<int> secondary_group_size;
        // Every key once, as text, with where it came from: a keyword, or an
        // options object's train_options() (FSDP2Config, ZeroPlusPlusConfig, ...).
        struct Given {
          std::string text, from;
        };
        std::vector<std::pair<std::string, Given>> keys;
        auto add = [&](const std::string& key, py::handle v, const std::string& from) {
          const std::string text = value_text(v);
          for (const auto& [k, g] : keys)
            if (k == key && g.text != text)
              throw InvalidArgument(op, fmt::format("{} is {} by {} but {} by {}", key, g.text, g.from, text, from),
                                    "give each key once");
          keys.emplace_back(key, Given{text, from});
        };
        for (const auto& [k, v] : kwargs) {
          const std::string key = k.cast<std::string>();
          if (key == "distributed") {
            if (!py::isinstance<config::DistributedConfig>(v))
              throw InvalidArgument(op, "distributed= takes a meshtrain.distributed.DistributedConfig",
                                    "pass distributed=DistributedConfig(world_size=4, ...)");
            dc = v.cast<config::DistributedConfig>();  // replaces the file's [distributed]
          } else if (py::hasattr(v, "train_options")) {
            const std::string from =
                fmt::format("{}={}", key, py::str(py::type::of(v).attr("__name__")).cast<std::string>());
            for (const auto& [k2, v2] : v.attr("train_options")().cast<py::dict>())
              add(k2.cast<std::string>(), v2, from);
          } else {
            add(key, v, key);
          }
        }
        const auto dc_keys = config::distributed_config_keys();
        std::vector<std::pair<std::string, std::string>> dc_values;
        for (const auto& [key, g] : keys) {
          const std::string source = fmt::format("{}({}=...)", op, key);
          if (key == "engine") job.engine = g.text;
          else if (key == "devices") job.devices = g.text;
          else if (key == "mesh") job.mesh = g.text;
          else if (key == "mixed_precision") job.mixed_precision = g.text;
          else if (key == "precision") job.precision = g.text;
          else if (key == "timeout") timeout = g.text;
          else if (key == "zeropp_secondary_group_size")
            secondary_group_size = static_cast<int>(parse_int_in_range(g.text, source, 1, INT32_MAX, op));
          else if (std::find(dc_keys.begin(), dc_keys.end(), key) != dc_keys.end()) dc_values.emplace_back(key, g.text);
          else tc.set(key, g.text, source);
        }
        tc.continue_in_resumed_directory(kwargs.contains("run_dir"), "meshtrain.train(run_dir=...)");
        tc.validate();
        // A resumed run on another number of devices is re-planned as `meshtrain train` does (docs/elastic.md).
        std::vector<std::string> notes;
        const mesh::NamedShape saved =
            !tc.resume.empty() && !dc.mesh_shape.empty() ? dc.mesh() : mesh::NamedShape{};  // its last part's
        job.resuming = !tc.resume.empty();
        job.notes = &notes;
        dc = config::apply_job_overrides(dc.with_values(dc_values, op).with_env(config::read_launcher_env()), job);
        if (!saved.shape.empty() && !kwargs.contains("micro_batches"))
          train::keep_micro_batch_size(tc, saved, dc.mesh(), &notes);
        // A size given as a key that the mesh (or the engine) then changed is a contradiction, not an override.
        for (const auto& [key, text] : dc_values)
          for (const config::ConfigField& f : config::distributed_config_fields())
            if (f.key == key && f.format(dc.with_values({{key, text}}, op)) != f.format(dc))
              throw InvalidArgument(op,
                                    fmt::format("{}={} but the job's mesh {} makes it {}", key, text,
                                                dc.mesh().to_spec(), f.format(dc)),
                                    "give it once: in the mesh, or as the key without a mesh");
        if (secondary_group_size) {
          const mesh::NamedShape m = dc.mesh();
          const int node_local = m.size_of(mesh::kFsdp);
          if (*secondary_group_size != node_local)
            throw InvalidArgument(op,
                                  fmt::format("ZeroPlusPlusConfig's secondary_group_size {} is not the mesh {}'s "
                                              "ranks per node ({}, its fsdp axis)",
                                              *secondary_group_size, m.to_spec(), node_local),
                                  "leave secondary_group_size None (the mesh's node x fsdp split decides), or use "
                                  "a mesh node=K,fsdp=L with L = secondary_group_size");
        }
        const double seconds = std::stod(timeout);
        const train::ResolvedTraining resolved =
            train::fit_device_memory(train::resolve_training(tc, dc), dc, !tc.resume.empty(), &notes);
        if (dc.rank == 0)
          for (const std::string& note : notes) fmt::print("# {}\n", note);
        const comm::LaunchOptions launch{.engine = dc.backend,
                                         .ranks = dc.backend == comm::Engine::threads ? dc.world_size : 0,
                                         .timeout = to_ms(seconds, op)};
        // Ctrl-C stops every rank after the same step (with a checkpoint when checkpoint_every is set), then
        // raises KeyboardInterrupt here. Python runs its own SIGINT handler only between bytecodes of the main
        // thread, which waits in C++ meanwhile: so the trainer's handler stands in for it while training (on
        // the main thread only, where Python would have handled the signal).
        const py::module_ threading = py::module_::import("threading");
        const bool main_thread = threading.attr("current_thread")().is(threading.attr("main_thread")());
        train::StopRequest stop;
        train::TrainResult r;
        try {
          py::gil_scoped_release release;  // the trainer's ranks run no Python
          std::optional<train::StopOnSignals> on_signals;
          if (main_thread) on_signals.emplace(stop, std::initializer_list<int>{SIGINT});
          r = train::run_training(resolved, dc, launch, &stop);
        } catch (const train::TrainingInterrupted& e) {
          PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
          throw py::error_already_set();
        }
        return r;
      },
      py::arg("config") = py::none(),
      "Runs the trainer as `meshtrain train` does: `config` a TOML file (its [train] and [distributed] "
      "sections); keywords override its keys: the [train] keys (model, max_steps, batch_size, run_dir, fsdp, "
      "zeropp, cp_comm, ...), the [distributed] keys (world_size, tensor_parallel_size, context_parallel_size, "
      "...), engine, devices, mesh, precision and timeout as the flags; distributed=DistributedConfig(...) "
      "replaces the file's [distributed]; an options object (FSDP2Config, ZeroPlusPlusConfig, "
      "ContextParallelConfig from meshtrain.distributed) given under any keyword adds its train_options(). A key "
      "given twice with different values is an error. Returns a TrainResult (per-step losses, the final "
      "evaluation, the run directory). The GIL is released while it trains. Ctrl-C stops every rank after the "
      "same step (saving a checkpoint when checkpoint_every is set; the run directory is not committed) and "
      "raises KeyboardInterrupt saying so; a second Ctrl-C ends the process at once.");

  m.def(
      "_check_train_options",
      [](const py::dict& options, const std::string& source) {
        try {
          train::TrainConfig tc;
          std::vector<std::pair<std::string, std::string>> dc_values;
          const auto dc_keys = config::distributed_config_keys();
          for (const auto& [k, v] : options) {
            const std::string key = k.cast<std::string>(), text = value_text(v);
            if (key == "mixed_precision" || key == "precision") (void)layout::parse_precision(text, key);
            else if (key == "zeropp_secondary_group_size") (void)parse_int_in_range(text, key, 1, INT32_MAX, source);
            else if (std::find(dc_keys.begin(), dc_keys.end(), key) != dc_keys.end()) dc_values.emplace_back(key, text);
            else tc.set(key, text, key);
          }
          tc.validate();
          (void)config::DistributedConfig{}.with_values(dc_values, "");
        } catch (const InvalidArgument& e) {
          throw InvalidArgument(source, fmt::format("{}: {}", e.op(), e.detail()), e.hint());
        }
      },
      py::arg("options"), py::arg("source"),
      "Checks meshtrain.train keys by the parsers meshtrain.train uses (the options classes call it).");

  m.def(
      "plan",
      [](std::optional<std::string> hardware, const py::kwargs& kwargs) {
        const char* op = "meshtrain.plan";
        train::PlanRequest r;
        train::TrainConfig blocks;  // the GPT's blocks, by train's keys and parsers
        for (const auto& [k, v] : kwargs) {
          const std::string key = k.cast<std::string>();
          if (std::find(std::begin(train::kGptBlockKeys), std::end(train::kGptBlockKeys), key) !=
              std::end(train::kGptBlockKeys))
            blocks.set(key, value_text(v), key);
          else if (key == "size") r.size = v.cast<std::string>();
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
          else if (key == "expert_imbalance") r.expert_imbalance = v.cast<double>();
          else
            throw InvalidArgument(op, fmt::format("unknown keyword '{}'", key),
                                  "use size, layers, heads, width, vocab, seq, batch, mesh, fsdp, precision, "
                                  "micro_batches, pipeline_schedule, virtual_stages, sequence_parallel, recompute, "
                                  "cp_comm, fsdp_min_weight_size, expert_imbalance, hardware, arch, kv_heads, "
                                  "ffn_hidden, tie_embeddings, experts, top_k, expert_hidden, shared_experts, "
                                  "first_dense");
        }
        r.set_blocks(blocks);
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
                                py::arg("width") = p.shape.width,
                                py::arg("arch") = std::string(layout::decoder_arch_name(p.shape.arch)),
                                py::arg("kv_heads") = p.shape.key_value_heads(),
                                py::arg("mlp_hidden") = p.shape.mlp_hidden(), py::arg("experts") = p.shape.moe.experts,
                                py::arg("top_k") = p.shape.moe.top_k);
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
