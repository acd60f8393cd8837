// The agent behind `meshtrain launch` (a torchrun-style launcher): on each
// node it starts nproc_per_node worker processes of a command, tells them
// where they sit in the job through the environment, forwards their output
// with a "[rank R] " prefix, stops the whole job (every node) when one worker
// fails, and restarts it up to max_restarts times. (comm/launch.h's launch()
// is something else: it runs an SPMD function inside the calling process.)
//
//   comm::AgentOptions o;                      // meshtrain launch --nnodes 2 --nproc-per-node 4
//   o.nnodes = 2;                              //   --node-rank 0 --master-addr 10.0.0.1
//   o.nproc_per_node = 4;                      //   -- meshtrain train --engine gloo ...
//   o.master_addr = "10.0.0.1";
//   o.token = job_token;                       // MESHTRAIN_JOB_TOKEN (config::read_job_token())
//   o.command = {"meshtrain", "train", "--engine", "gloo"};
//   return comm::run_agent(o);                 // the launcher's exit code
//
// - The store: node 0's agent hosts a TcpStore server on master_addr:
//   master_port (listening on that address only) protected by the job
//   token; the other nodes' agents connect to it (retrying until
//   join_timeout). The workers use the same store as clients
//   (MESHTRAIN_AGENT_STORE=1), so it outlives any worker and every restart.
// - The token: `token`, else with one node a random one (random_job_token());
//   several nodes without a token are refused (every node must export the
//   same MESHTRAIN_JOB_TOKEN). The agent reads no environment variable; it
//   passes its own environment on to the workers, with these set:
//     MASTER_ADDR, MASTER_PORT (the store; the port picked when it was 0),
//     RANK = node_rank * nproc_per_node + LOCAL_RANK, WORLD_SIZE, LOCAL_RANK,
//     LOCAL_WORLD_SIZE, GROUP_RANK (= node_rank), MESHTRAIN_JOB_TOKEN,
//     MESHTRAIN_AGENT_STORE=1, MESHTRAIN_RESTART_COUNT (0, then 1, 2, ...).
//   (OpenMPI's OMPI_COMM_WORLD_* and PMIX_RANK are removed.)
// - Workers: each in its own process group, stdin from /dev/null, killed
//   with the agent (PR_SET_PDEATHSIG). Each output line is printed as
//   "[rank R] line" on the agent's stdout or stderr (as the worker wrote
//   it); output rank0 shows only global rank 0's lines.
// - Failure: a worker that exits non-zero or by a signal stops the job: the
//   agent prints "meshtrain launch: rank R (pid P) exited with status S" (or
//   "... was killed by signal SIGKILL") to stderr, publishes it in the store
//   (launch/failed/<round>), and every agent sends SIGTERM to its workers'
//   groups, then SIGKILL after kill_timeout. A stopped worker (SIGSTOP) is
//   not a failure: its peers' deadlines end the job (they exit non-zero).
// - Restarts: with restarts left, every agent stops its workers, and all
//   meet in the next round before starting them again with
//   MESHTRAIN_RESTART_COUNT = the round; it prints "meshtrain launch:
//   restarting the group (restart r of N)".
// - Elastic membership (nnodes MIN:MAX, torchrun's syntax; docs/elastic.md):
//   each round is a rendezvous that node 0's agent closes: with MAX nodes at
//   once; with MIN or more when every live node of the previous round has
//   joined (in round 0, after last_call); or at join_timeout with MIN or
//   more (fewer: the job stops with an error naming them). Agents beat a
//   heartbeat in the store every second; node 0 takes a node whose beats stop
//   for heartbeat_timeout as gone (a failure of the round). The members get
//   ranks in the order of their node ids (node 0 first), WORLD_SIZE = nodes x
//   nproc_per_node. A node that starts while a round runs waits for the
//   next; below MAX the running nodes stop their workers for it (SIGTERM: a
//   trainer saves a checkpoint and exits), a regroup that is not counted as
//   a restart. A node id (--node-rank) may come back once its old launcher's
//   heartbeat has stopped. Node 0 hosts the store: the job ends with it.
//   The workers of a round after a failure or a regroup also get
//   MESHTRAIN_RESTART_REASON (what happened), MESHTRAIN_RESTART_EVENT_MS
//   (when this node's agent saw it, Unix ms) and MESHTRAIN_RESTART_RENDEZVOUS_MS
//   (from then to their start).
// - Signals: SIGINT, SIGTERM and SIGHUP are forwarded to every worker's
//   group (SIGKILL after kill_timeout, or at once on a second signal); the
//   other nodes stop too, and no restart follows.
// - No orphans: when run_agent returns, every worker's process group has been
//   killed and reaped (the process is made a child subreaper for the
//   duration, so the workers' own orphans are reaped too).
// Exit code: 0 when every worker of every node exited 0; 128 + the signal
// when the agent was interrupted; 1 otherwise.
// Process-wide effects while it runs: handlers for SIGINT, SIGTERM, SIGHUP,
// SIGCHLD, SIGPIPE ignored, the child-subreaper flag (all restored on
// return); it reaps every child of the process. Call it from the main
// thread of a process with no other children. Not reentrant.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::comm {

enum class AgentOutput { all, rank0 };
AgentOutput parse_agent_output(std::string_view text);  // "all" | "rank0"; else InvalidArgument naming --output

// The options mirror `meshtrain launch`'s flags (errors name the flags).
struct AgentOptions {
  std::vector<std::string> command;  // the worker's argv (searched on PATH)
  int nproc_per_node = 1;            // 1 to kMaxAgentWorkers
  int nnodes = 1;                    // the nodes; elastic: the most (MAX)
  int min_nodes = 0;                 // elastic: the fewest (MIN, 1 .. nnodes); 0: a fixed number (nnodes)
  int node_rank = 0;                 // 0 .. nnodes-1; node 0 hosts the store (elastic: the node's id)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;           // 0 (one node only): any free port
  std::string token;                 // the job token; "" : generated (one node) or refused (several)
  AgentOutput output = AgentOutput::all;
  int max_restarts = 0;
  std::chrono::milliseconds kill_timeout = std::chrono::seconds(5);   // SIGTERM .. SIGKILL
  std::chrono::milliseconds join_timeout = std::chrono::seconds(300); // for the other nodes, at every round
  std::chrono::milliseconds last_call = std::chrono::seconds(10);     // elastic round 0: more nodes after MIN
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(15);  // a node without beats is gone

  bool elastic() const { return min_nodes > 0; }
};

// --nnodes: "N" (a fixed number) or "MIN:MAX" (elastic). Sets o.nnodes and
// o.min_nodes; InvalidArgument naming --nnodes otherwise.
void parse_nnodes(std::string_view text, AgentOptions& o);

inline constexpr int kMaxAgentWorkers = 1024;

// Throws InvalidArgument naming the flag and how to fix it.
void validate(const AgentOptions& options);

// Runs the job on this node; returns the launcher's exit code (see above).
// Throws InvalidArgument for bad options, a refused token or a job shape
// that differs from node 0's, IoError when the store cannot listen,
// TimeoutError when node 0's store does not answer within join_timeout. A
// command that cannot be started is reported like a failed worker (exit 1,
// no restart).
int run_agent(const AgentOptions& options);

// 16 bytes of /dev/urandom as 32 hex digits. Throws IoError.
std::string random_job_token();

}  // namespace meshtrain::comm
