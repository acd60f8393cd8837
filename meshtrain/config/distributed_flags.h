// CLI flags for DistributedConfig, one per row of distributed_config_fields():
// --distributed, --world-size, --rank, --local-rank, --num-nodes,
// --num-processes-per-node, --master-addr, --master-port, --backend,
// --tensor-parallel-size, --pipeline-parallel-size, --context-parallel-size,
// --mesh data=2,tensor=2, --mixed-precision.
//
//   CLI::App app{"train"};
//   meshtrain::config::DistributedFlags flags(&app);   // registers the flags
//   app.parse(argc, argv);
//   auto c = flags.config(DistributedConfig::from_toml_file(path).with_env(env));
//   c.validate();
//
// Only flags given on the command line override `base`; values are parsed by
// the same code as TOML keys and environment variables, so errors read alike
// ("--world-size: 'x' is not an integer"). Flags are registered in the option
// group "Distributed".
// Thread-safety: like CLI::App, use from one thread.
#pragma once

#include <memory>

#include "meshtrain/config/distributed_config.h"

namespace CLI {
class App;
}  // namespace CLI

namespace meshtrain::config {

class DistributedFlags {
 public:
  // Registers the flags on `app`, which must outlive this object's use.
  // Throws CLI::OptionAlreadyAdded if `app` already has one of the flags.
  explicit DistributedFlags(CLI::App* app);
  DistributedFlags(DistributedFlags&&) noexcept;
  DistributedFlags& operator=(DistributedFlags&&) noexcept;
  ~DistributedFlags();

  // After app->parse(): `base` with every flag that was given applied (and
  // num_processes_per_node derived as for TOML); not validated. Throws
  // InvalidArgument naming the flag when a value does not parse.
  DistributedConfig config(const DistributedConfig& base = {}) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The same as DistributedFlags(app), for symmetry with the free-function style.
inline DistributedFlags add_distributed_flags(CLI::App* app) { return DistributedFlags(app); }

}  // namespace meshtrain::config
