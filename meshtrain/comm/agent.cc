#include "meshtrain/comm/agent.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "meshtrain/comm/internal/agent_process.h"
#include "meshtrain/comm/internal/worker_group.h"
#include "meshtrain/comm/tcp_store.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"

namespace meshtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using internal::Heartbeat;
using internal::kBeatEvery;
using internal::say;
using internal::signal_name;
using internal::SignalPipe;
using internal::SubreaperScope;
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
    "MESHTRAIN_JOB_TOKEN", "MESHTRAIN_AGENT_STORE", "MESHTRAIN_RESTART_COUNT", "MESHTRAIN_RESTART_REASON",
    "MESHTRAIN_RESTART_EVENT_MS", "MESHTRAIN_RESTART_RENDEZVOUS_MS", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_RANK"};

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

// How a round ended. failed: may restart (counted); regroup: the membership
// changes (not counted); stopped: the job ends.
struct Outcome {
  enum Kind { success, failed, stopped, regroup } kind = success;
  int exit_code = 0;
  std::string why;  // failed, regroup: what happened (MESHTRAIN_RESTART_REASON)
  int64_t at_ms = 0;  // when this node's agent saw it (Unix ms)
};

// What another node published: a failure of this round, or the end of the job.
struct Remote {
  std::string message;
  bool stop = false;
};

// A closed round: its members and the failed rounds before it.
struct Round {
  int number = 0;
  std::vector<int> nodes;  // node ids in rank order (ascending: node 0 first)
  int failures = 0;
  int index_of(int node) const {
    const auto it = std::find(nodes.begin(), nodes.end(), node);
    return it == nodes.end() ? -1 : static_cast<int>(it - nodes.begin());
  }
};

int64_t unix_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string node_list(const std::vector<int>& nodes) {
  return fmt::format("{} {}", nodes.size() == 1 ? "node" : "nodes", fmt::join(nodes, ", "));
}

class Agent {
 public:
  explicit Agent(const AgentOptions& o) : o_(o) {}

  int run() {
    std::fflush(stdout);
    std::fflush(stderr);
    if (!connect()) return exit_for_signal();
    agree_on_the_job();
    const std::string token = generated_token_ ? "job token generated" : "job token given";
    if (o_.elastic()) {
      say(fmt::format("node {} (elastic: {} to {} nodes of {} workers); store {}:{} ({}); {} restart(s) at most",
                      o_.node_rank, o_.min_nodes, o_.nnodes, o_.nproc_per_node, o_.master_addr, port_, token,
                      o_.max_restarts));
    } else {
      const int first = o_.node_rank * o_.nproc_per_node, last = first + o_.nproc_per_node - 1;
      say(fmt::format("node {} of {}: {} of {}; store {}:{} ({}); {} restart(s) at most", o_.node_rank, o_.nnodes,
                      first == last ? fmt::format("rank {}", first) : fmt::format("ranks {}-{}", first, last),
                      o_.nnodes * o_.nproc_per_node, o_.master_addr, port_, token, o_.max_restarts));
    }
    Outcome before;  // what ended the previous round (failed, regroup)
    for (int round = first_round();; ++round) {
      Round members;
      Outcome out;
      if (auto early = rendezvous(round, members)) {
        out = *early;
      } else if (members.index_of(o_.node_rank) < 0) {
        // Below MAX the running nodes regroup for this one; at MAX it waits
        // for the next round (a failure) or the end of the job.
        say(fmt::format("round {} runs with {} ({} at most): node {} waits for the next round", round,
                        node_list(members.nodes), o_.nnodes, o_.node_rank));
        continue;
      } else {
        out = run_round(members, before);
      }
      if (out.kind == Outcome::failed && members.failures < o_.max_restarts && !members.nodes.empty()) {
        say(fmt::format("restarting the group (restart {} of {})", members.failures + 1, o_.max_restarts));
      } else if (out.kind == Outcome::regroup) {
        say(fmt::format("regrouping: {} (not counted as a restart)", out.why));
      } else {
        return finish(out.kind == Outcome::success ? 0 : out.exit_code, members);
      }
      before = out;
    }
  }

  void set_generated_token(bool g) { generated_token_ = g; }

 private:
  bool multi() const { return o_.nnodes > 1; }
  bool host() const { return o_.node_rank == 0; }
  static std::string round_key(int round, std::string_view what) {
    return fmt::format("launch/round/{}/{}", round, what);
  }
  static std::string failed_key(int round) { return fmt::format("launch/failed/{}", round); }
  static std::string heartbeat_key(int node) { return fmt::format("launch/heartbeat/{}", node); }
  static constexpr const char* kStopKey = "launch/stop";
  static constexpr const char* kFinishedKey = "launch/finished";
  static constexpr const char* kCurrentKey = "launch/current";  // the last round that closed

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

  // Node 0: whether `node` beat within heartbeat_timeout (as node 0 saw its counter change).
  bool alive(int node) {
    if (node == o_.node_rank) return true;
    const int64_t beats = store_->add(heartbeat_key(node), 0);
    auto [it, fresh] = beats_.try_emplace(node, Beats{beats, Clock::now()});
    if (!fresh && it->second.count != beats) it->second = Beats{beats, Clock::now()};
    return Clock::now() - it->second.changed < o_.heartbeat_timeout;
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
                       .is_server = host(),
                       .timeout = kStoreTimeout,
                       .connect_timeout = std::chrono::seconds(10),
                       .token = o_.token};
    if (host()) {
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

  // Every node runs the same job shape, and each node rank is held by one
  // live launcher: one whose heartbeat still moves keeps it (checked in this
  // order, so a refused launcher claims nothing).
  void agree_on_the_job() {
    const std::string nodes =
        o_.elastic() ? fmt::format("{}:{}", o_.min_nodes, o_.nnodes) : std::to_string(o_.nnodes);
    const std::string shape =
        fmt::format("nnodes={} nproc_per_node={} max_restarts={}", nodes, o_.nproc_per_node, o_.max_restarts);
    if (host()) {
      store_->set("launch/config", shape);
    } else if (const std::string theirs = store_->get("launch/config", std::chrono::seconds(10)); theirs != shape) {
      throw InvalidArgument(kOp, fmt::format("node 0 runs {}, this node {}", theirs, shape),
                            "give every node's launcher the same --nnodes, --nproc-per-node and --max-restarts");
    }
    const std::string key = heartbeat_key(o_.node_rank);
    if (!host() && store_->check({key})) {
      const int64_t seen = store_->add(key, 0);
      std::this_thread::sleep_for(kBeatEvery * 5 / 2);
      if (store_->add(key, 0) != seen)
        throw InvalidArgument(kOp,
                              fmt::format("--node-rank {} is taken by a running launcher of this job", o_.node_rank),
                              fmt::format("give each node its own --node-rank, 0 to {}", o_.nnodes - 1));
    }
    if (multi()) store_->add(key, 1);
    // The other nodes beat from a thread of their own, so that a long stop
    // of the workers (a checkpoint's save) does not look like a dead node.
    if (multi() && !host()) {
      TcpStoreOptions so{.host = o_.master_addr,
                         .port = port_,
                         .is_server = false,
                         .timeout = kStoreTimeout,
                         .connect_timeout = std::chrono::seconds(10),
                         .token = o_.token};
      heartbeat_ = std::make_unique<Heartbeat>(std::move(so), key);
    }
  }

  // The round to join: 0, or after the last one that closed (a node that
  // starts while the job runs).
  int first_round() {
    if (host() || !store_->check({kCurrentKey})) return 0;
    return static_cast<int>(std::stol(store_->get(kCurrentKey))) + 1;
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

  // Joins round `round` and waits until node 0 closes it (`out`: its
  // members, which may not include this node). Returns an outcome when the
  // round cannot start (interrupted, too few nodes, the job stopped).
  std::optional<Outcome> rendezvous(int round, Round& out) {
    out = Round{.number = round, .nodes = {}, .failures = 0};
    if (!multi()) {
      out.nodes = {0};
      out.failures = failures_;
      return std::nullopt;
    }
    try {
      const int64_t slot = store_->add(round_key(round, "count"), 1);
      store_->set(round_key(round, fmt::format("joiner/{}", slot)), std::to_string(o_.node_rank));
      if (host()) {
        opened_ = Clock::now();
        joined_.clear();
        joiners_read_ = 0;
        store_->set(round_key(round, "open"), "1");
      }
      for (;;) {
        if (host())
          if (auto stop = try_close(round)) return stop;
        if (store_->check({round_key(round, "closed")})) {
          parse_round(store_->get(round_key(round, "closed")), out);
          return std::nullopt;
        }
        if (store_->check({kStopKey})) return stopped_by(Remote{store_->get(kStopKey), true});
        if (!host() && store_->check({kFinishedKey})) {
          const std::string code = store_->get(kFinishedKey);
          say(fmt::format("the job finished (exit code {}) before node {} could join", code, o_.node_rank));
          return Outcome{code == "0" ? Outcome::success : Outcome::stopped, code == "0" ? 0 : 1, ""};
        }
        if (pause(kWatchEvery)) return interrupted(round);
      }
    } catch (const Error& e) {
      say(fmt::format("lost the store: {}", e.what()));
      return Outcome{Outcome::stopped, 1, ""};
    }
  }

  // Node 0: closes the round when its rule says so (see agent.h), or stops
  // the job at the deadline with too few nodes.
  std::optional<Outcome> try_close(int round) {
    for (const int64_t n = store_->add(round_key(round, "count"), 0); joiners_read_ < n;) {
      const std::string key = round_key(round, fmt::format("joiner/{}", joiners_read_ + 1));
      if (!store_->check({key})) break;  // its set() is on the way
      const int node = static_cast<int>(std::stol(store_->get(key)));
      if (std::find(joined_.begin(), joined_.end(), node) == joined_.end()) joined_.push_back(node);
      ++joiners_read_;
    }
    const int have = static_cast<int>(joined_.size());
    bool missing_live = false;  // a node of the previous round that still beats but has not joined
    for (int node : previous_)
      if (std::find(joined_.begin(), joined_.end(), node) == joined_.end() && alive(node)) missing_live = true;
    const bool late = Clock::now() >= opened_ + o_.join_timeout;
    bool close = have >= o_.nnodes;
    if (o_.elastic() && have >= o_.min_nodes)
      close = close || late || (!missing_live && (!previous_.empty() || Clock::now() >= opened_ + o_.last_call));
    if (close) {
      // Beyond MAX: the previous round's nodes first, then in the order they joined.
      std::vector<int> chosen = {o_.node_rank};  // node 0 is in every round
      for (int node : joined_)
        if (node != o_.node_rank && std::find(previous_.begin(), previous_.end(), node) != previous_.end())
          chosen.push_back(node);
      for (int node : joined_)
        if (std::find(chosen.begin(), chosen.end(), node) == chosen.end()) chosen.push_back(node);
      chosen.resize(std::min<size_t>(chosen.size(), static_cast<size_t>(o_.nnodes)));
      std::sort(chosen.begin(), chosen.end());
      store_->set(round_key(round, "closed"), fmt::format("{};{}", failures_, fmt::join(chosen, ",")));
      store_->set(kCurrentKey, std::to_string(round));
      previous_ = chosen;
      return std::nullopt;
    }
    if (!late) return std::nullopt;
    std::vector<int> missing;
    for (int n = 0; n < o_.nnodes; ++n)
      if (std::find(joined_.begin(), joined_.end(), n) == joined_.end()) missing.push_back(n);
    std::string msg =
        o_.elastic()
            ? fmt::format("only {} joined round {} within {} s; the job needs at least {} (--nnodes {}:{})",
                          node_list(joined_), round, o_.join_timeout.count() / 1000, o_.min_nodes, o_.min_nodes,
                          o_.nnodes)
            : fmt::format("node(s) {} did not join round {} within {} s", fmt::join(missing, ", "), round,
                          o_.join_timeout.count() / 1000);
    say(msg + (o_.elastic() ? ": start more launchers, or lower MIN"
                            : ": start their launchers with the same flags and their --node-rank"));
    publish(round, msg, true);
    return Outcome{Outcome::stopped, 1, ""};
  }

  // "failures;node,node,..." as try_close writes it.
  static void parse_round(const std::string& text, Round& out) {
    const size_t semi = text.find(';');
    out.failures = static_cast<int>(std::stol(text.substr(0, semi)));
    std::string_view rest = std::string_view(text).substr(semi + 1);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      out.nodes.push_back(static_cast<int>(std::stol(std::string(rest.substr(0, comma)))));
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
  }

  Outcome stopped_by(const Remote& r) {
    say(fmt::format("{}: stopping the workers of node {}", r.message, o_.node_rank));
    return Outcome{r.stop ? Outcome::stopped : Outcome::failed, 1, r.message};
  }

  Outcome interrupted(int round) {
    say(fmt::format("got {}: stopping the workers", signal_name(interrupt_)));
    publish(round, fmt::format("node {}'s launcher got {}", o_.node_rank, signal_name(interrupt_)), true);
    return Outcome{Outcome::stopped, exit_for_signal(), ""};
  }

  // Elastic, below MAX: the nodes outside round m waiting for the next one
  // (empty: none). The members themselves join it after a failure.
  std::vector<int> waiting(const Round& m) {
    if (!o_.elastic() || m.nodes.size() >= static_cast<size_t>(o_.nnodes)) return {};
    const int64_t n = store_->add(round_key(m.number + 1, "count"), 0);
    std::vector<int> nodes;
    for (int64_t i = 1; i <= n; ++i)
      if (const std::string key = round_key(m.number + 1, fmt::format("joiner/{}", i)); store_->check({key}))
        if (const int node = static_cast<int>(std::stol(store_->get(key))); m.index_of(node) < 0)
          nodes.push_back(node);
    return nodes;
  }

  std::vector<std::vector<std::string>> worker_environments(const Round& m, const Outcome& before) const {
    const int index = m.index_of(o_.node_rank);
    std::vector<std::vector<std::string>> envs;
    for (int local = 0; local < o_.nproc_per_node; ++local) {
      std::vector<std::string> env = base_env_;
      const std::pair<const char*, std::string> vars[] = {
          {"MASTER_ADDR", o_.master_addr},
          {"MASTER_PORT", std::to_string(port_)},
          {"RANK", std::to_string(index * o_.nproc_per_node + local)},
          {"WORLD_SIZE", std::to_string(static_cast<int>(m.nodes.size()) * o_.nproc_per_node)},
          {"LOCAL_RANK", std::to_string(local)},
          {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node)},
          {"GROUP_RANK", std::to_string(index)},
          {"MESHTRAIN_JOB_TOKEN", o_.token},
          {"MESHTRAIN_AGENT_STORE", "1"},
          {"MESHTRAIN_RESTART_COUNT", std::to_string(m.number)}};
      for (const auto& [name, value] : vars) env.push_back(fmt::format("{}={}", name, value));
      if (!before.why.empty()) {
        env.push_back(fmt::format("MESHTRAIN_RESTART_REASON={}", before.why));
        env.push_back(fmt::format("MESHTRAIN_RESTART_EVENT_MS={}", before.at_ms));
        env.push_back(fmt::format("MESHTRAIN_RESTART_RENDEZVOUS_MS={}", unix_ms() - before.at_ms));
      }
      envs.push_back(std::move(env));
    }
    return envs;
  }

  Outcome run_round(const Round& m, const Outcome& before) {
    const int round = m.number, index = m.index_of(o_.node_rank);
    if (o_.elastic())
      say(fmt::format("round {}: {} -> ranks {}-{} of {} on this node", round, node_list(m.nodes),
                      index * o_.nproc_per_node, (index + 1) * o_.nproc_per_node - 1,
                      static_cast<int>(m.nodes.size()) * o_.nproc_per_node));
    std::vector<int> ranks;
    for (int local = 0; local < o_.nproc_per_node; ++local) ranks.push_back(index * o_.nproc_per_node + local);
    std::unique_ptr<WorkerGroup> group;
    try {
      group = std::make_unique<WorkerGroup>(o_.command, ranks, worker_environments(m, before),
                                            o_.output == AgentOutput::rank0, signals_.fd(),
                                            [this] { return take_signals() > 0; });
    } catch (const IoError& e) {
      say(fmt::format("{} (hint: {})", e.detail(), e.hint()));
      publish(round, fmt::format("node {}: {}", o_.node_rank, e.detail()), true);
      return Outcome{Outcome::stopped, 1, ""};
    }
    Outcome out;
    int first_signal = SIGTERM;
    auto last_watch = Clock::now(), last_liveness = Clock::now();
    // A worker's exit while nodes wait to join is the regroup (the trainer
    // stops for it), not a failure.
    auto regroup_for = [&](const std::vector<int>& nodes) {
      return Outcome{Outcome::regroup, 0, fmt::format("{} joined", node_list(nodes))};
    };
    for (bool decided = false; !decided;) {
      const auto exits = group->poll(kWatchEvery);
      if (interrupt_) {
        first_signal = interrupt_;  // forwarded as it came
        out = interrupted(round);
        break;
      }
      try {
        for (const auto& e : exits) {
          if (e.status == 0) continue;
          if (auto r = multi() ? check_remote(round) : std::nullopt) {  // the cause is elsewhere
            out = stopped_by(*r);
          } else if (const std::vector<int> w = waiting(m); !w.empty()) {
            out = regroup_for(w);
          } else {
            const std::string what = internal::describe_exit(e.status);
            say(fmt::format("rank {} (pid {}) {}", e.rank, e.pid, what));
            const std::string why = fmt::format("rank {} (pid {}) on node {} {}", e.rank, e.pid, o_.node_rank, what);
            publish(round, why, false);
            out = Outcome{Outcome::failed, 1, why};
          }
          decided = true;
          break;
        }
        if (decided || group->all_exited()) break;  // every worker exited 0
        if (multi() && Clock::now() - last_watch >= kWatchEvery) {
          last_watch = Clock::now();
          if (auto r = check_remote(round)) {
            out = stopped_by(*r);
            break;
          }
          if (const std::vector<int> w = waiting(m); !w.empty()) {
            out = regroup_for(w);
            say(fmt::format("{} waiting to join: stopping the workers of node {} to regroup", node_list(w),
                            o_.node_rank));
            break;
          }
          // Heartbeats move once a second: node 0 reads them as often (a store call per node).
          if (host() && Clock::now() - last_liveness >= kBeatEvery) {
            last_liveness = Clock::now();
            for (int node : m.nodes)
              if (!alive(node)) {
                out.why = fmt::format("node {} sent no heartbeat for {} s", node,
                                      std::chrono::duration<double>(o_.heartbeat_timeout).count());
                say(out.why + ": stopping the workers");
                publish(round, out.why, false);
                out.kind = Outcome::failed;
                out.exit_code = 1;
                decided = true;
                break;
              }
          }
        }
      } catch (const Error& e) {
        say(fmt::format("lost the store: {}: stopping the workers", e.what()));
        out = Outcome{Outcome::stopped, 1, ""};
        break;
      }
    }
    out.at_ms = unix_ms();
    group->stop(o_.kill_timeout, first_signal);
    group.reset();
    if (interrupt_ && out.kind != Outcome::stopped) out = interrupted(round);  // a signal while stopping
    if (out.kind == Outcome::failed) failures_ = m.failures + 1;
    if (out.kind != Outcome::success || !multi()) return out;
    return wait_for_the_other_nodes(m);
  }

  // This node's workers all exited 0: the round succeeded when every node's
  // did, or failed if another node's failed meanwhile.
  Outcome wait_for_the_other_nodes(const Round& m) {
    const int round = m.number;
    try {
      if (store_->add(round_key(round, "done"), 1) == static_cast<int64_t>(m.nodes.size()))
        store_->set(round_key(round, "all_done"), "1");
      for (;;) {
        if (store_->check({round_key(round, "all_done")})) return Outcome{};
        if (auto r = check_remote(round)) {
          failures_ = m.failures + (r->stop ? 0 : 1);
          Outcome out = stopped_by(*r);
          out.at_ms = unix_ms();
          return out;
        }
        if (pause(kWatchEvery)) return interrupted(round);
      }
    } catch (const Error& e) {
      say(fmt::format("lost the store: {}", e.what()));
      return Outcome{Outcome::stopped, 1, ""};
    }
  }

  // Node 0 keeps the store up until the other nodes of the last round have
  // read the outcome (at most kill_timeout + 10 s); they say when they have.
  // Nodes waiting to join learn that the job finished.
  int finish(int code, const Round& last) {
    if (!multi()) return code;
    try {
      if (!host()) {
        if (last.index_of(o_.node_rank) >= 0) store_->add("launch/exited", 1);
        return code;
      }
      store_->set(kFinishedKey, std::to_string(code));
      const auto deadline = Clock::now() + o_.kill_timeout + std::chrono::seconds(10);
      const int64_t others = static_cast<int64_t>(last.nodes.size()) - 1;
      while (store_->add("launch/exited", 0) < others && Clock::now() < deadline)
        if (pause(kWatchEvery)) break;
    } catch (const Error&) {
      // The outcome is known here; a store that went away changes nothing.
    }
    return code;
  }

  struct Beats {
    int64_t count = 0;
    Clock::time_point changed{};
  };

  const AgentOptions& o_;
  SignalPipe signals_;
  SubreaperScope subreaper_;
  std::unique_ptr<TcpStore> store_;
  uint16_t port_ = 0;
  bool generated_token_ = false;
  int interrupt_ = 0;  // the first SIGINT/SIGTERM/SIGHUP received
  int failures_ = 0;   // failed rounds so far (node 0 writes it into each round it closes)
  std::unique_ptr<Heartbeat> heartbeat_;
  // Node 0's view: the open round's joiners, the last round's members, heartbeats.
  Clock::time_point opened_{};
  std::vector<int> joined_;
  int64_t joiners_read_ = 0;
  std::vector<int> previous_;
  std::map<int, Beats> beats_;
  const std::vector<std::string> base_env_ = inherited_environment();
};

}  // namespace

AgentOutput parse_agent_output(std::string_view text) {
  if (text == "all") return AgentOutput::all;
  if (text == "rank0") return AgentOutput::rank0;
  throw InvalidArgument(kOp, fmt::format("--output '{}' is neither all nor rank0", text),
                        "write --output all (every worker's lines) or --output rank0 (global rank 0's only)");
}

void parse_nnodes(std::string_view text, AgentOptions& o) {
  const size_t colon = text.find(':');
  try {
    if (colon == std::string_view::npos) {
      o.nnodes = static_cast<int>(parse_int_in_range(text, "--nnodes", 1, 65536, kOp));
      o.min_nodes = 0;
      return;
    }
    o.min_nodes = static_cast<int>(parse_int_in_range(text.substr(0, colon), "--nnodes MIN", 1, 65536, kOp));
    o.nnodes = static_cast<int>(parse_int_in_range(text.substr(colon + 1), "--nnodes MAX", 1, 65536, kOp));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(kOp, e.detail(),
                          "give the number of machines (--nnodes 2) or, elastic, the fewest and the most "
                          "(--nnodes 1:4)");
  }
  if (o.min_nodes > o.nnodes)
    throw InvalidArgument(kOp, fmt::format("--nnodes {}: MIN {} is above MAX {}", text, o.min_nodes, o.nnodes),
                          "write the fewest nodes first, e.g. --nnodes 1:4");
}

void validate(const AgentOptions& o) {
  if (o.nproc_per_node < 1 || o.nproc_per_node > kMaxAgentWorkers)
    throw InvalidArgument(kOp, fmt::format("--nproc-per-node {} is outside [1, {}]", o.nproc_per_node, kMaxAgentWorkers),
                          "give the number of workers per node, e.g. --nproc-per-node 4 (one per device)");
  if (o.nnodes < 1 || o.nnodes > 65536)
    throw InvalidArgument(kOp, fmt::format("--nnodes {} is outside [1, 65536]", o.nnodes),
                          "give the number of machines, e.g. --nnodes 2");
  if (o.elastic() && o.min_nodes > o.nnodes)
    throw InvalidArgument(kOp, fmt::format("--nnodes {}:{}: MIN is above MAX", o.min_nodes, o.nnodes),
                          "write the fewest nodes first, e.g. --nnodes 1:4");
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
  if (o.last_call.count() < 0 || o.last_call > std::chrono::hours(1))
    throw InvalidArgument(kOp, fmt::format("--last-call {} ms is outside [0 s, 3600 s]", o.last_call.count()),
                          "give the seconds an elastic job's first round waits for more nodes, e.g. --last-call 10");
  if (o.heartbeat_timeout < std::chrono::seconds(2) || o.heartbeat_timeout > std::chrono::hours(1))
    throw InvalidArgument(kOp,
                          fmt::format("--heartbeat-timeout {} ms is outside [2 s, 3600 s]",
                                      o.heartbeat_timeout.count()),
                          "give the seconds without a heartbeat after which a node counts as gone, e.g. "
                          "--heartbeat-timeout 15 (agents beat every second)");
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
