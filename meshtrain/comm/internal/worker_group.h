// The worker processes of one node for `meshtrain launch` (comm/agent.h):
// started, watched, their output forwarded line by line, stopped, reaped.
//
// - Each worker runs in its own process group (its pid), with stdin from
//   /dev/null, stdout and stderr on pipes, the signals the agent handles back
//   at their defaults, and PR_SET_PDEATHSIG = SIGKILL (a launcher killed
//   with -9 takes its workers along).
// - Output: every whole line a worker writes is forwarded as one write()
//   of "[rank R] line\n" to the agent's stdout or stderr (the same stream
//   the worker used), so lines of different workers never mix; a partial
//   line is forwarded when the worker closes the stream, or at 64 KiB.
//   With rank0_only, only global rank 0's lines are forwarded (the others
//   are read and dropped, so no worker blocks on a full pipe).
// - poll() reaps with waitpid(-1): the agent's process is a child subreaper
//   (agent.cc), so the workers' own orphans are reaped too; call it from a
//   process that has no other children.
// - stop() sends SIGTERM (and SIGCONT, so a stopped worker takes it) to every
//   group, waits up to the grace period while forwarding output, then sends
//   SIGKILL; it returns when every worker is reaped and every group is empty.
//   The destructor does the same with no grace, so no process of a group
//   outlives the WorkerGroup (a process that left its group with setsid or
//   setpgid is out of reach).
// Internal to comm; single-threaded: one thread calls every method.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace meshtrain::comm::internal {

struct WorkerExit {
  int rank = 0;      // global rank
  pid_t pid = 0;
  int status = 0;    // as waitpid reports it
};

// "exited with status 3", "was killed by signal SIGKILL".
std::string describe_exit(int status);

class WorkerGroup {
 public:
  // Starts one worker per entry of `ranks` (global ranks; env[i] is worker
  // i's whole environment, "NAME=value"). Whenever `wake_fd` (the agent's
  // signal pipe) is readable, `on_wake` is called; it must drain the fd, and
  // returns true to cut stop()'s grace period short. Throws IoError when a
  // worker cannot be started (the command not found, not executable...),
  // after killing the ones already started.
  WorkerGroup(const std::vector<std::string>& command, const std::vector<int>& ranks,
              const std::vector<std::vector<std::string>>& env, bool rank0_only, int wake_fd,
              std::function<bool()> on_wake);
  ~WorkerGroup();  // SIGKILL to every group, reaps them
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Waits up to `timeout` for output, an exit or wake_fd (then calls
  // on_wake); forwards output, reaps, and returns the workers that exited
  // since the last call.
  std::vector<WorkerExit> poll(std::chrono::milliseconds timeout);
  bool all_exited() const;
  // Sends `sig` to every worker's group that may still have processes.
  void signal_all(int sig);
  // SIGTERM + SIGCONT, up to `grace` for the groups to empty, then SIGKILL;
  // returns when all are gone and their output forwarded. `first` is the
  // signal sent first (SIGTERM, or the SIGINT the agent got). on_wake
  // returning true skips the rest of the grace period.
  void stop(std::chrono::milliseconds grace, int first);

 private:
  struct Stream {
    int fd = -1;       // read end; -1 once closed
    int to = 1;        // the agent's fd the lines go to
    std::string partial;
  };
  struct Worker {
    int rank = 0;
    pid_t pid = -1;    // also its process group
    bool exited = false;
    bool group_empty = false;
    int status = 0;
    Stream out, err;
  };

  void start(Worker& w, const std::vector<std::string>& command, const std::vector<std::string>& env);
  void read_stream(Worker& w, Stream& s);
  void emit(const Worker& w, const Stream& s, std::string_view line);
  std::vector<WorkerExit> reap();
  bool groups_empty();
  void drain(std::chrono::milliseconds timeout);
  bool wait_ready(std::chrono::milliseconds timeout);  // true: on_wake asked to hurry
  void kill_and_reap();

  std::vector<Worker> workers_;
  bool rank0_only_;
  int wake_fd_;
  std::function<bool()> on_wake_;
};

}  // namespace meshtrain::comm::internal
