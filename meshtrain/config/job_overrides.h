// What a training command line says about the job on top of the
// configuration file and the launcher's environment (meshtrain train's
// --engine, --devices, --mesh, --mixed-precision and --precision), and
// the one function that reconciles them into a validated DistributedConfig.
// The CLI only collects the flags; tests and the Python bindings call the
// same function.
//
//   config::DistributedConfig dc = config::DistributedConfig::from_toml_file(path)
//                                      .with_env(config::read_launcher_env());
//   dc = config::apply_job_overrides(dc, {.mesh = "data=2,tensor=2", .precision = "bf16"});
//
// Thread-safety: pure function of its arguments.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/config/distributed_config.h"

namespace meshtrain::config {

struct JobOverrides {
  std::string engine{};           // threads | mpi | gloo | nccl; "": see apply_job_overrides
  std::string devices{};          // threads engine: simulated devices
  std::string mesh{};             // replaces the configuration's mesh and parallel sizes
  std::string mixed_precision{};  // no | bf16 | fp16
  std::string precision{};        // fp32 | bf16 | fp16: an alias of mixed_precision
  // Where the configuration's mesh came from, for messages: the TOML file's
  // path, or "" (then "configuration").
  std::string config_source{};
  // Whether the gloo engine is built in (comm::engines().find("gloo")):
  // torchrun's workers default to it, as torch picks gloo for CPU tensors.
  bool gloo_available = false;
  // A resumed run (--resume, or a launcher's restart): when its mesh (the
  // configuration's, or --mesh: a launcher's restart repeats the command
  // line) does not fit the world size (fewer or more devices than it was
  // saved on), the data-parallel axes take the change (mesh::resize_data_axis)
  // and `notes` says so.
  bool resuming = false;
  std::vector<std::string>* notes = nullptr;
};

// dc with the overrides applied, reconciled and validated:
// - without an engine: mpi under mpirun, gloo under torchrun or `meshtrain
//   launch` (when gloo_available), else dc's backend;
// - devices only with the threads engine (world size and ranks per node);
// - a mesh replaces dc's, its parallel sizes included; on the threads engine
//   without devices it also sets the world size (one device per position);
// - only the known axes (mesh::kKnownAxes) of size > 1 (named before
//   validate() would suggest a size setting that leads to the same refusal);
// - the mesh's tensor, pipeline and context axes set those parallel sizes;
// - a resumed run whose mesh does not fit the world size: the data axis
//   resized (InvalidArgument naming --mesh when the other axes do not
//   divide the devices);
// - at most comm::kMaxThreadsRanks simulated devices;
// - mixed_precision and precision, when both are given, agree.
// Errors (InvalidArgument, Unsupported) name the flag (--engine, --devices,
// --mesh, --precision, --mixed-precision) or the configuration file.
DistributedConfig apply_job_overrides(DistributedConfig dc, const JobOverrides& o);

}  // namespace meshtrain::config
