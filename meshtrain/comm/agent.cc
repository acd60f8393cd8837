#include "meshtrain/comm/agent.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>

#include "meshtrain/comm/internal/worker_group.h"
#include "meshtrain/comm/tcp_store.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using internal::WorkerGroup;

constexpr const char* kOp = "meshtrain launch";
// How often an agent looks at the store for the other nodes' news.
constexpr milliseconds kWatchEvery{100};
// Each store call's own deadline (the server is another agent, never a worker).
constexpr milliseconds kStoreTimeout{30'000};
// The variables the agent sets in every worker (and drops from its own
// environment before adding them), and OpenMPI's, which would describe the
// agent's process rather than the workers.
constexpr std::string_view kWorkerVariables[] = {
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "MESHTRAIN_JOB_TOKEN", "MESHTRAIN_AGENT_STORE", "MESHTRAIN_RESTART_COUNT", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_RANK"};

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

// One line on the agent's stderr, in one write.
void say(const std::string& text) {
  const std::string line = fmt::format("meshtrain launch: {}\n", text);
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t n = ::write(2, line.data() + off, line.size() - off);
    if (n > 0) {
      off += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return;
    }
  }
}

// The signals the agent handles arrive as bytes on a pipe (self-pipe), read
// by the one thread that runs the agent; any thread may take the signal.
std::atomic<int> g_signal_write_fd{-1};

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(g_signal_write_fd.load(), &byte, 1);
  errno = saved;
}

class SignalPipe {
 public:
  SignalPipe() {
    if (::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0)
      throw IoError(kOp, fmt::format("pipe: {}", std::strerror(errno)), "the process is out of file descriptors");
    int expected = -1;
    if (!g_signal_write_fd.compare_exchange_strong(expected, fds_[1])) {
      ::close(fds_[0]);
      ::close(fds_[1]);
      throw InvalidArgument(kOp, "run_agent is already running in this process", "run one agent per process");
    }
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    ::sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kHandled); ++i) {
      struct sigaction use = sa;
      if (kHandled[i] == SIGCHLD) use.sa_flags |= SA_NOCLDSTOP;
      if (kHandled[i] == SIGPIPE) use.sa_handler = SIG_IGN;  // a closed stdout must not kill the agent
      ::sigaction(kHandled[i], &use, &old_[i]);
    }
  }
  ~SignalPipe() {
    for (size_t i = 0; i < std::size(kHandled); ++i) ::sigaction(kHandled[i], &old_[i], nullptr);
    g_signal_write_fd.store(-1);
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int fd() const { return fds_[0]; }
  // The signals received since the last call (SIGCHLD included).
  std::vector<int> take() {
    std::vector<int> out;
    unsigned char buf[64];
    for (;;) {
      const ssize_t n = ::read(fds_[0], buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return out;
      out.insert(out.end(), buf, buf + n);
    }
  }

 private:
  static constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE};
  int fds_[2] = {-1, -1};
  struct sigaction old_[std::size(kHandled)] {};
};

// The workers' orphans are reparented to the agent, which reaps them.
class SubreaperScope {
 public:
  SubreaperScope() {
    ::prctl(PR_GET_CHILD_SUBREAPER, &old_);
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  }
  ~SubreaperScope() { ::prctl(PR_SET_CHILD_SUBREAPER, old_); }

 private:
  int old_ = 0;
};

// The agent's environment, without the variables it sets for the workers.
std::vector<std::string> inherited_environment() {
  std::vector<std::string> env;
  for (char** e = ::environ; e && *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (std::find(std::begin(kWorkerVariables), std::end(kWorkerVariables), name) == std::end(kWorkerVariables))
      env.emplace_back(entry);
  }
  return env;
}

struct Outcome {
  enum Kind { success, failed, stopped } kind = success;  // failed: may restart; stopped: the job ends
  int exit_code = 0;
};

// What another node published: a failure of this round, or the end of the job.
struct Remote {
  std::string message;
  bool stop = false;
};

class Agent {
 public:
  explicit Agent(const AgentOptions& o) : o_(o) {}

  int run() {
    std::fflush(stdout);
    std::fflush(stderr);
    if (!connect()) return exit_for_signal();
    agree_on_the_job();
    const int first = o_.node_rank * o_.nproc_per_node, last = first + o_.nproc_per_node - 1;
    say(fmt::format("node {} of {}: {} of {}; store {}:{} ({}); {} restart(s) at most", o_.node_rank, o_.nnodes,
                    first == last ? fmt::format("rank {}", first) : fmt::format("ranks {}-{}", first, last), world(),
                    o_.master_addr, port_, generated_token_ ? "job token generated" : "job token given",
                    o_.max_restarts));
    for (int round = 0;; ++round) {
      Outcome out;
      if (auto early = barrier(round)) {
        out = *early;
      } else {
        out = run_round(round);
      }
      if (out.kind == Outcome::failed && round < o_.max_restarts) {
        say(fmt::format("restarting the group (restart {} of {})", round + 1, o_.max_restarts));
        continue;
      }
      return finish(out.kind == Outcome::success ? 0 : out.exit_code);
    }
  }

  void set_generated_token(bool g) { generated_token_ = g; }

 private:
  int world() const { return o_.nnodes * o_.nproc_per_node; }
  bool multi() const { return o_.nnodes > 1; }
  static std::string round_key(int round, std::string_view what) { return fmt::format("launch/round/{}/{}", round, what); }
  static std::string failed_key(int round) { return fmt::format("launch/failed/{}", round); }
  static constexpr const char* kStopKey = "launch/stop";

  int exit_for_signal() const { return 128 + interrupt_; }

  // Reads the signal pipe: a terminating signal is remembered (the first
  // one) and counted; returns how many came in this call.
  int take_signals() {
    int n = 0;
    for (int sig : signals_.take())
      if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
        if (!interrupt_) interrupt_ = sig;
        ++n;
      }
    return n;
  }

  // Sleeps up to `d` (outside a round), waking for a signal; reaps strays.
  // Returns true when the agent was interrupted.
  bool pause(milliseconds d) {
    pollfd p{signals_.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(d.count())) > 0) take_signals();
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    return interrupt_ != 0;
  }

  // Node 0 starts the store; the others connect, retrying until join_timeout
  // (in short attempts, so that a signal ends the wait). False: interrupted.
  bool connect() {
    TcpStoreOptions so{.host = o_.master_addr,
                       .port = static_cast<uint16_t>(o_.master_port),
                       .is_server = o_.node_rank == 0,
                       .timeout = kStoreTimeout,
                       .connect_timeout = std::chrono::seconds(10),
                       .token = o_.token};
    if (o_.node_rank == 0) {
      store_ = std::make_unique<TcpStore>(so);
      port_ = store_->port();
      return true;
    }
    const auto deadline = Clock::now() + o_.join_timeout;
    for (;;) {
      so.connect_timeout = std::clamp(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()),
                                      milliseconds(1), milliseconds(500));
      try {
        store_ = std::make_unique<TcpStore>(so);
        port_ = store_->port();
        return true;
      } catch (const TimeoutError&) {
        if (Clock::now() >= deadline)
          throw TimeoutError(kOp,
                             fmt::format("node {} found no store at {}:{} within {} s", o_.node_rank, o_.master_addr,
                                         o_.master_port, o_.join_timeout.count() / 1000),
                             "start node 0's launcher (--node-rank 0) with the same --master-addr and --master-port; "
                             "the address must be node 0's, reachable from here");
      }
      if (pause(milliseconds(1))) return false;
    }
  }

  // Every node runs the same job shape, and each node rank is taken once
  // (checked in this order, so a refused launcher claims nothing).
  void agree_on_the_job() {
    const std::string shape =
        fmt::format("nnodes={} nproc_per_node={} max_restarts={}", o_.nnodes, o_.nproc_per_node, o_.max_restarts);
    if (o_.node_rank == 0) {
      store_->set("launch/config", shape);
    } else if (const std::string theirs = store_->get("launch/config", std::chrono::seconds(10)); theirs != shape) {
      throw InvalidArgument(kOp, fmt::format("node 0 runs {}, this node {}", theirs, shape),
                            "give every node's launcher the same --nnodes, --nproc-per-node and --max-restarts");
    }
    if (store_->add(fmt::format("launch/node/{}", o_.node_rank), 1) > 1)
      throw InvalidArgument(kOp, fmt::format("--node-rank {} is taken by another launcher of this job", o_.node_rank),
                            fmt::format("give each node its own --node-rank, 0 to {}", o_.nnodes - 1));
    store_->add("launch/joined", 1);
  }

  // Tells the other nodes that this round failed (`stop`: and the job ends).
  void publish(int round, const std::string& message, bool stop) {
    if (!multi()) return;
    try {
      if (stop) store_->set(kStopKey, message);
      if (!store_->check({failed_key(round)})) store_->set(failed_key(round), message);
    } catch (const Error& e) {
      say(fmt::format("could not tell the other nodes: {}", e.what()));
    }
  }

  // The other nodes' news for this round, if any. Throws the store's errors.
  std::optional<Remote> check_remote(int round) {
    if (store_->check({failed_key(round)}))
      return Remote{store_->get(failed_key(round)), store_->check({kStopKey})};
    if (store_->check({kStopKey})) return Remote{store_->get(kStopKey), true};
    return std::nullopt;
  }

  // Every node's agent arrives before any starts the round's workers. Returns
  // an outcome when the round cannot start (interrupted, a node missing or
  // gone, the job stopped meanwhile).
  std::optional<Outcome> barrier(int round) {
    if (!multi()) return std::nullopt;
    const auto deadline = Clock::now() + o_.join_timeout;
    try {
      store_->set(round_key(round, fmt::format("node/{}", o_.node_rank)), "1");
      if (store_->add(round_key(round, "ready"), 1) == o_.nnodes) store_->set(round_key(round, "go"), "1");
      for (;;) {
        if (store_->check({round_key(round, "go")})) return std::nullopt;
        if (auto r = check_remote(round)) return stopped_by(*r);
        if (pause(kWatchEvery)) return interrupted(round);
        if (Clock::now() >= deadline) {
          std::vector<int> missing;
          for (int n = 0; n < o_.nnodes; ++n)
            if (!store_->check({round_key(round, fmt::format("node/{}", n))})) missing.push_back(n);
          const std::string msg = fmt::format("node(s) {} did not join round {} within {} s", fmt::join(missing, ", "),
                                              round, o_.join_timeout.count() / 1000);
          say(msg + ": start their launchers with the same flags and their --node-rank");
          publish(round, msg, true);
          return Outcome{Outcome::stopped, 1};
        }
      }
    } catch (const Error& e) {
      say(fmt::format("lost the store: {}", e.what()));
      return Outcome{Outcome::stopped, 1};
    }
  }

  Outcome stopped_by(const Remote& r) {
    say(fmt::format("{}: stopping the workers of node {}", r.message, o_.node_rank));
    return Outcome{r.stop ? Outcome::stopped : Outcome::failed, 1};
  }

  Outcome interrupted(int round) {
    say(fmt::format("got {}: stopping the workers", signal_name(interrupt_)));
    publish(round, fmt::format("node {}'s launcher got {}", o_.node_rank, signal_name(interrupt_)), true);
    return Outcome{Outcome::stopped, exit_for_signal()};
  }

  std::vector<std::vector<std::string>> worker_environments(int round) const {
    std::vector<std::vector<std::string>> envs;
    for (int local = 0; local < o_.nproc_per_node; ++local) {
      std::vector<std::string> env = base_env_;
      const std::pair<const char*, std::string> vars[] = {
          {"MASTER_ADDR", o_.master_addr},
          {"MASTER_PORT", std::to_string(port_)},
          {"RANK", std::to_string(o_.node_rank * o_.nproc_per_node + local)},
          {"WORLD_SIZE", std::to_string(world())},
          {"LOCAL_RANK", std::to_string(local)},
          {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node)},
          {"GROUP_RANK", std::to_string(o_.node_rank)},
          {"MESHTRAIN_JOB_TOKEN", o_.token},
          {"MESHTRAIN_AGENT_STORE", "1"},
          {"MESHTRAIN_RESTART_COUNT", std::to_string(round)}};
      for (const auto& [name, value] : vars) env.push_back(fmt::format("{}={}", name, value));
      envs.push_back(std::move(env));
    }
    return envs;
  }

  Outcome run_round(int round) {
    std::vector<int> ranks;
    for (int local = 0; local < o_.nproc_per_node; ++local) ranks.push_back(o_.node_rank * o_.nproc_per_node + local);
    std::unique_ptr<WorkerGroup> group;
    try {
      group = std::make_unique<WorkerGroup>(o_.command, ranks, worker_environments(round),
                                            o_.output == AgentOutput::rank0, signals_.fd(),
                                            [this] { return take_signals() > 0; });
    } catch (const IoError& e) {
      say(fmt::format("{} (hint: {})", e.detail(), e.hint()));
      publish(round, fmt::format("node {}: {}", o_.node_rank, e.detail()), true);
      return Outcome{Outcome::stopped, 1};
    }
    Outcome out;
    int first_signal = SIGTERM;
    auto last_watch = Clock::now();
    for (bool decided = false; !decided;) {
      const auto exits = group->poll(kWatchEvery);
      if (interrupt_) {
        first_signal = interrupt_;  // forwarded as it came
        out = interrupted(round);
        break;
      }
      for (const auto& e : exits) {
        if (e.status == 0) continue;
        const std::string what = fmt::format("rank {} (pid {}) {}", e.rank, e.pid, internal::describe_exit(e.status));
        say(what);
        publish(round, fmt::format("rank {} (pid {}) on node {} {}", e.rank, e.pid, o_.node_rank,
                                   internal::describe_exit(e.status)),
                false);
        out = Outcome{Outcome::failed, 1};
        decided = true;
        break;
      }
      if (decided) break;
      if (group->all_exited()) break;  // every worker exited 0
      if (multi() && Clock::now() - last_watch >= kWatchEvery) {
        last_watch = Clock::now();
        try {
          if (auto r = check_remote(round)) {
            out = stopped_by(*r);
            break;
          }
        } catch (const Error& e) {
          say(fmt::format("lost the store: {}: stopping the workers", e.what()));
          out = Outcome{Outcome::stopped, 1};
          break;
        }
      }
    }
    group->stop(o_.kill_timeout, first_signal);
    group.reset();
    if (interrupt_ && out.kind != Outcome::stopped) out = interrupted(round);  // a signal while stopping
    if (out.kind != Outcome::success || !multi()) return out;
    return wait_for_the_other_nodes(round);
  }

  // This node's workers all exited 0: the round succeeded when every node's
  // did, or failed if another node's failed meanwhile.
  Outcome wait_for_the_other_nodes(int round) {
    try {
      if (store_->add(round_key(round, "done"), 1) == o_.nnodes) store_->set(round_key(round, "all_done"), "1");
      for (;;) {
        if (store_->check({round_key(round, "all_done")})) return Outcome{};
        if (auto r = check_remote(round)) return stopped_by(*r);
        if (pause(kWatchEvery)) return interrupted(round);
      }
    } catch (const Error& e) {
      say(fmt::format("lost the store: {}", e.what()));
      return Outcome{Outcome::stopped, 1};
    }
  }

  // Node 0 keeps the store up until the other nodes that joined have read
  // the outcome (at most kill_timeout + 10 s); they say when they have.
  int finish(int code) {
    if (!multi()) return code;
    try {
      if (o_.node_rank != 0) {
        store_->add("launch/exited", 1);
        return code;
      }
      const auto deadline = Clock::now() + o_.kill_timeout + std::chrono::seconds(10);
      const int64_t others = store_->add("launch/joined", 0) - 1;
      while (store_->add("launch/exited", 0) < others && Clock::now() < deadline)
        if (pause(kWatchEvery)) break;
    } catch (const Error&) {
      // The outcome is known here; a store that went away changes nothing.
    }
    return code;
  }

  const AgentOptions& o_;
  SignalPipe signals_;
  SubreaperScope subreaper_;
  std::unique_ptr<TcpStore> store_;
  uint16_t port_ = 0;
  bool generated_token_ = false;
  int interrupt_ = 0;  // the first SIGINT/SIGTERM/SIGHUP received
  const std::vector<std::string> base_env_ = inherited_environment();
};

}  // namespace

AgentOutput parse_agent_output(std::string_view text) {
  if (text == "all") return AgentOutput::all;
  if (text == "rank0") return AgentOutput::rank0;
  throw InvalidArgument(kOp, fmt::format("--output '{}' is neither all nor rank0", text),
                        "write --output all (every worker's lines) or --output rank0 (global rank 0's only)");
}

void validate(const AgentOptions& o) {
  if (o.nproc_per_node < 1 || o.nproc_per_node > kMaxAgentWorkers)
    throw InvalidArgument(kOp, fmt::format("--nproc-per-node {} is outside [1, {}]", o.nproc_per_node, kMaxAgentWorkers),
                          "give the number of workers per node, e.g. --nproc-per-node 4 (one per device)");
  if (o.nnodes < 1 || o.nnodes > 65536)
    throw InvalidArgument(kOp, fmt::format("--nnodes {} is outside [1, 65536]", o.nnodes),
                          "give the number of machines, e.g. --nnodes 2");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw InvalidArgument(kOp, fmt::format("--node-rank {} is not in [0, --nnodes {})", o.node_rank, o.nnodes),
                          fmt::format("number the nodes 0 to {} (node 0 hosts the store)", o.nnodes - 1));
  if (o.command.empty() || o.command.front().empty())
    throw InvalidArgument(kOp, "no command to run",
                          "write the workers' command after --, e.g. meshtrain launch --nproc-per-node 2 -- "
                          "meshtrain train --engine gloo");
  if (o.master_addr.empty())
    throw InvalidArgument(kOp, "--master-addr is empty", "give node 0's address, e.g. --master-addr 10.0.0.1");
  if (o.master_port < 0 || o.master_port > 65535)
    throw InvalidArgument(kOp, fmt::format("--master-port {} is outside [0, 65535]", o.master_port),
                          "give a free TCP port, e.g. --master-port 29500");
  if (o.master_port == 0 && o.nnodes > 1)
    throw InvalidArgument(kOp, "--master-port 0 with --nnodes > 1",
                          "the other nodes need the port: give every node the same --master-port, e.g. 29500");
  if (o.max_restarts < 0 || o.max_restarts > 1'000'000)
    throw InvalidArgument(kOp, fmt::format("--max-restarts {} is outside [0, 1000000]", o.max_restarts),
                          "give how often the group may restart after a failure, e.g. --max-restarts 3");
  if (o.kill_timeout.count() < 0 || o.kill_timeout > std::chrono::hours(1))
    throw InvalidArgument(kOp, fmt::format("--kill-timeout {} ms is outside [0 s, 3600 s]", o.kill_timeout.count()),
                          "give the seconds between SIGTERM and SIGKILL, e.g. --kill-timeout 5");
  if (o.join_timeout < milliseconds(1) || o.join_timeout > std::chrono::hours(24 * 7))
    throw InvalidArgument(kOp, fmt::format("--join-timeout {} ms is outside [0.001 s, 7 days]", o.join_timeout.count()),
                          "give the seconds to wait for the other nodes, e.g. --join-timeout 300");
  if (o.token.empty() && o.nnodes > 1)
    throw InvalidArgument(kOp, fmt::format("--nnodes {} without a job token", o.nnodes),
                          "export the same secret on every node before launching, e.g. "
                          "export MESHTRAIN_JOB_TOKEN=$(head -c 16 /dev/urandom | xxd -p)");
}

int run_agent(const AgentOptions& options) {
  validate(options);
  AgentOptions o = options;
  const bool generated = o.token.empty();
  if (generated) o.token = random_job_token();
  Agent agent(o);
  agent.set_generated_token(generated);
  return agent.run();
}

std::string random_job_token() {
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  unsigned char bytes[16];
  size_t got = 0;
  while (fd >= 0 && got < sizeof(bytes)) {
    const ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  const int e = errno;
  if (fd >= 0) ::close(fd);
  if (got < sizeof(bytes))
    throw IoError(kOp, fmt::format("cannot read /dev/urandom: {}", std::strerror(e)),
                  "export MESHTRAIN_JOB_TOKEN with a secret of your own");
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

}  // namespace meshtrain::comm
