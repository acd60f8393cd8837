// The meshtrain CLI's subcommands. Each add_* function registers its
// subcommands' flags on the app (the flags' help is the --help text) and
// returns, per subcommand, the function that runs it after parsing.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/launch.h"

namespace meshtrain::cli {

struct Command {
  CLI::App* app;
  std::function<int()> run;
};

// Flags shared by the commands that start ranks.
struct EngineFlags {
  std::string engine = "threads";
  int ranks = 2;
  double timeout_s = 300;

  void add(CLI::App* app);
  comm::LaunchOptions launch_options() const;
};

// "meshtrain <command>: key=value ..." on one line, printed at start-up.
void print_config(const std::string& command, const std::vector<std::pair<std::string, std::string>>& kv);

// check, demo, bench collectives
std::vector<Command> add_comm_commands(CLI::App& app);
// mesh, shard
std::vector<Command> add_layout_commands(CLI::App& app);
// train
std::vector<Command> add_train_commands(CLI::App& app);

}  // namespace meshtrain::cli
