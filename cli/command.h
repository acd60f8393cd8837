// The meshtrain CLI's subcommands. Each add_* function registers its
// subcommands' flags on the app (the flags' help is the --help text) and
// returns, per subcommand, the function that runs it after parsing.
#pragma once

#include <CLI/CLI.hpp>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
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
  std::string timeout = "300";  // seconds; parsed by parse_timeout

  // --ranks accepts 1..max_ranks (threads engine).
  void add(CLI::App* app, int max_ranks = comm::kMaxThreadsRanks);
  // Throws InvalidArgument naming --timeout when it is not a finite number
  // of seconds in [0.001, 604800].
  comm::LaunchOptions launch_options() const;
};

// --timeout's text as a deadline: a finite number of seconds in
// [kMinTimeout, kMaxTimeout] (1 ms to 7 days); else InvalidArgument naming
// `flag` and the range (nan, -1, 0 and 1e10 used to become deadlines of
// INT64_MIN ms and blame a healthy rank).
std::chrono::milliseconds parse_timeout(std::string_view text, std::string_view flag = "--timeout");
inline constexpr std::string_view kTimeoutHelp = "deadline of every wait, seconds (0.001 to 604800)";

// CLI11's check that a flag takes one of `names` (the vocabulary's lists,
// layout/vocabulary.h), so --help and the refusal list the same names the
// parsers take.
template <size_t N>
CLI::IsMember one_of(const std::array<std::string_view, N>& names) {
  return CLI::IsMember(std::vector<std::string>(names.begin(), names.end()));
}

// "meshtrain <command>: key=value ..." on one line, printed at start-up.
void print_config(const std::string& command, const std::vector<std::pair<std::string, std::string>>& kv);

// A comma list of integers, each in [lo, hi] ("512,512,256"); else
// InvalidArgument naming `flag`, the text, the range and `example`.
std::vector<int64_t> parse_int_list(std::string_view text, std::string_view flag, int64_t lo, int64_t hi,
                                    std::string_view example);

// check, demo, bench collectives
std::vector<Command> add_comm_commands(CLI::App& app);
// mesh, shard
std::vector<Command> add_layout_commands(CLI::App& app);
// train
std::vector<Command> add_train_commands(CLI::App& app);
// tokenize
std::vector<Command> add_data_commands(CLI::App& app);
// launch
std::vector<Command> add_launch_commands(CLI::App& app);
// devices
std::vector<Command> add_device_commands(CLI::App& app);
// plan
std::vector<Command> add_plan_commands(CLI::App& app);

}  // namespace meshtrain::cli
