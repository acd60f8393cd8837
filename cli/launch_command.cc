// meshtrain launch: start the worker processes of a job on this node, like
// torchrun (comm/agent.h does the work; docs/launch.md).
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "meshtrain/comm/agent.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::cli {
namespace {

struct LaunchFlags {
  comm::AgentOptions agent;
  std::string output = "all";
  std::string kill_timeout = "5";
  std::string join_timeout = "300";
  std::string nnodes = "1";
  std::string last_call = "10";
  std::string heartbeat_timeout = "15";
};

std::chrono::milliseconds seconds_flag(const std::string& text, std::string_view flag, double lo, double hi,
                                       std::string_view example) {
  try {
    return std::chrono::milliseconds(
        std::llround(parse_double_in_range(text, flag, NumberRange{.min = lo, .max = hi}, "meshtrain launch") * 1000));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(e.op(), e.detail(), fmt::format("give {} in seconds, e.g. {} {}", flag, flag, example));
  }
}

int run_launch(LaunchFlags f) {
  comm::AgentOptions& o = f.agent;
  o.output = comm::parse_agent_output(f.output);
  o.kill_timeout = seconds_flag(f.kill_timeout, "--kill-timeout", 0, 3600, "5");
  o.join_timeout = seconds_flag(f.join_timeout, "--join-timeout", 0.001, 604800, "300");
  o.last_call = seconds_flag(f.last_call, "--last-call", 0, 3600, "10");
  o.heartbeat_timeout = seconds_flag(f.heartbeat_timeout, "--heartbeat-timeout", 2, 3600, "15");
  comm::parse_nnodes(f.nnodes, o);
  o.token = config::read_job_token();
  return comm::run_agent(o);
}

constexpr const char* kDescription =
    "start the worker processes of a job on this node, like torchrun: each gets RANK, WORLD_SIZE, LOCAL_RANK, "
    "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, MESHTRAIN_JOB_TOKEN, MESHTRAIN_AGENT_STORE=1 and "
    "MESHTRAIN_RESTART_COUNT; their output lines are prefixed \"[rank R] \"; one failing worker stops the job on "
    "every node (see docs/launch.md)";

constexpr const char* kExamples = R"(
Examples:
  # 4 workers on this machine (a random job token is made up):
  meshtrain launch --nproc-per-node 4 -- meshtrain train --engine gloo

  # 2 machines x 2 workers; the same secret on both, node 0 at 10.0.0.1:
  export MESHTRAIN_JOB_TOKEN=$(head -c 16 /dev/urandom | xxd -p)     # copy it to the other node
  meshtrain launch --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 10.0.0.1 -- meshtrain train --engine gloo
  meshtrain launch --nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr 10.0.0.1 -- meshtrain train --engine gloo

  # Elastic: 1 to 2 machines; a machine's loss or return re-plans the mesh (docs/elastic.md):
  meshtrain launch --nnodes 1:2 --nproc-per-node 2 --node-rank 0 --master-addr 10.0.0.1 --max-restarts 3 -- \
      meshtrain train --engine gloo --run-dir run --checkpoint-every 50
)";

}  // namespace

std::vector<Command> add_launch_commands(CLI::App& app) {
  auto f = std::make_shared<LaunchFlags>();
  auto* cmd = app.add_subcommand("launch", kDescription);
  cmd->footer(kExamples);
  // Ranges are checked by comm::validate, whose errors say how to fix them.
  cmd->add_option("--nproc-per-node", f->agent.nproc_per_node, "worker processes on this node (one per device)")
      ->capture_default_str();
  cmd->add_option("--nnodes", f->nnodes,
                  "machines in the job (each runs one meshtrain launch); MIN:MAX: elastic, the job goes on with "
                  "MIN to MAX machines as they fail or join (docs/elastic.md)")
      ->capture_default_str();
  cmd->add_option("--node-rank", f->agent.node_rank,
                  "this machine's number, 0 to nnodes-1 (MAX-1); node 0 hosts the store (elastic: the ranks follow "
                  "the numbers of the machines in each round)")
      ->capture_default_str();
  cmd->add_option("--master-addr", f->agent.master_addr,
                  "node 0's address: its store listens there only (0.0.0.0: every interface)")
      ->capture_default_str();
  cmd->add_option("--master-port", f->agent.master_port, "the store's TCP port (0, one node only: any free port)")
      ->capture_default_str();
  cmd->add_option("--max-restarts", f->agent.max_restarts,
                  "restart every node's workers up to N times after a failure (MESHTRAIN_RESTART_COUNT counts them)")
      ->capture_default_str();
  cmd->add_option("--output", f->output, "whose lines to show: all | rank0 (global rank 0's only)")
      ->capture_default_str();
  cmd->add_option("--kill-timeout", f->kill_timeout, "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  cmd->add_option("--join-timeout", f->join_timeout, "seconds to wait for the other nodes (at start and each restart)")
      ->capture_default_str();
  cmd->add_option("--last-call", f->last_call,
                  "elastic: seconds the first round waits for more machines once MIN have joined")
      ->capture_default_str();
  cmd->add_option("--heartbeat-timeout", f->heartbeat_timeout,
                  "elastic or not: seconds without a machine's heartbeat (one a second) after which it counts as gone")
      ->capture_default_str();
  cmd->add_option("command", f->agent.command, "the workers' command and its arguments, after --");
  return {{cmd, [f] { return run_launch(*f); }}};
}

}  // namespace meshtrain::cli
