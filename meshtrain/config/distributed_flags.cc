#include "meshtrain/config/distributed_flags.h"

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace meshtrain::config {

struct DistributedFlags::State {
  std::vector<std::string> values;  // one per field; CLI11 writes into them
  std::vector<CLI::Option*> options;
};

DistributedFlags::DistributedFlags(CLI::App* app) : state_(std::make_unique<State>()) {
  const auto fields = distributed_config_fields();
  state_->values.resize(fields.size());  // sized once: CLI11 keeps pointers into it
  const DistributedConfig defaults;
  for (size_t i = 0; i < fields.size(); ++i) {
    const ConfigField& f = fields[i];
    const std::string flag(f.flag), help(f.help);
    CLI::Option* o = nullptr;
    if (f.type == "bool") {
      o = app->add_flag(flag, state_->values[i], help);
    } else {
      o = app->add_option(flag, state_->values[i], help);
      const std::string d = f.format(defaults);
      if (!d.empty()) o->default_str(d);
      o->type_name(f.type == "int" ? "INT" : f.type == "mesh" ? "AXIS=N,..." : "TEXT");
    }
    o->group("Distributed");
    state_->options.push_back(o);
  }
}

DistributedFlags::DistributedFlags(DistributedFlags&&) noexcept = default;
DistributedFlags& DistributedFlags::operator=(DistributedFlags&&) noexcept = default;
DistributedFlags::~DistributedFlags() = default;

DistributedConfig DistributedFlags::config(const DistributedConfig& base) const {
  DistributedConfig c = base;
  const auto fields = distributed_config_fields();
  bool gave_world_or_nodes = false, gave_per_node = false;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (state_->options[i]->count() == 0) continue;
    fields[i].parse(c, state_->values[i], fields[i].flag);
    gave_world_or_nodes = gave_world_or_nodes || fields[i].key == "world_size" || fields[i].key == "num_nodes";
    gave_per_node = gave_per_node || fields[i].key == "num_processes_per_node";
  }
  derive_processes_per_node(c, gave_world_or_nodes, gave_per_node);
  return c;
}

}  // namespace meshtrain::config
