#include "meshtrain/comm/internal/worker_group.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::internal {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A line longer than this is forwarded in pieces (each with its prefix).
constexpr size_t kMaxLine = 64 * 1024;
// How long SIGKILLed groups may take to empty (a process in uninterruptible
// sleep dies when its I/O ends), and how long output is drained afterwards
// (a process that left its group may still hold a pipe).
constexpr milliseconds kKillWait{10'000};
constexpr milliseconds kDrainWait{500};

// Writes all of `data` to fd; output that cannot be written (the agent's
// stdout closed) is dropped rather than stopping the agent.
void write_all(int fd, std::string_view data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n > 0) {
      off += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 1000) <= 0) return;
    } else {
      return;
    }
  }
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

milliseconds left_until(Clock::time_point deadline) {
  return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

}  // namespace

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::sigabbrev_np(sig);
    return fmt::format("was killed by signal {}{}", name ? fmt::format("SIG{}", name) : std::to_string(sig),
                       WCOREDUMP(status) ? " (core dumped)" : "");
  }
  return fmt::format("ended with wait status {:#x}", status);
}

WorkerGroup::WorkerGroup(const std::vector<std::string>& command, const std::vector<int>& ranks,
                         const std::vector<std::vector<std::string>>& env, bool rank0_only, int wake_fd,
                         std::function<bool()> on_wake)
    : rank0_only_(rank0_only), wake_fd_(wake_fd), on_wake_(std::move(on_wake)) {
  if (command.empty() || env.size() != ranks.size())
    throw InvalidArgument("WorkerGroup", "no command, or not one environment per worker", "see agent.cc");
  workers_.resize(ranks.size());
  try {
    for (size_t i = 0; i < ranks.size(); ++i) {
      workers_[i].rank = ranks[i];
      start(workers_[i], command, env[i]);
    }
  } catch (...) {
    // The destructor does not run for a constructor that throws: kill and
    // reap the workers already started here.
    kill_and_reap();
    throw;
  }
}

WorkerGroup::~WorkerGroup() { kill_and_reap(); }

void WorkerGroup::kill_and_reap() {
  signal_all(SIGKILL);
  const auto deadline = Clock::now() + kKillWait;
  while (!(all_exited() && groups_empty()) && Clock::now() < deadline) {
    wait_ready(milliseconds(20));
    reap();
  }
  for (auto& w : workers_) close_fd(w.out.fd), close_fd(w.err.fd);
}

void WorkerGroup::start(Worker& w, const std::vector<std::string>& command, const std::vector<std::string>& env) {
  // Everything the child needs is prepared here: between fork and exec it
  // calls only async-signal-safe functions (the agent has other threads).
  std::vector<char*> argv, envp;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int out[2] = {-1, -1}, err[2] = {-1, -1}, exec_err[2] = {-1, -1};
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0 || ::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 ||
      ::pipe2(exec_err, O_CLOEXEC) != 0) {
    const int e = errno;
    for (int fd : {devnull, out[0], out[1], err[0], err[1], exec_err[0], exec_err[1]})
      if (fd >= 0) ::close(fd);
    throw IoError("meshtrain launch", fmt::format("cannot create the pipes of rank {}: {}", w.rank, std::strerror(e)),
                  "the process is out of file descriptors (ulimit -n)");
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    // Killed with the agent (even by SIGKILL); if the agent already died,
    // go now.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
    sigset_t none;
    ::sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(devnull, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    ::execvpe(argv[0], argv.data(), envp.data());
    const int e = errno;
    [[maybe_unused]] const ssize_t n = ::write(exec_err[1], &e, sizeof(e));
    ::_exit(127);
  }
  const int fork_errno = errno;
  for (int fd : {devnull, out[1], err[1], exec_err[1]}) ::close(fd);
  if (pid < 0) {
    for (int fd : {out[0], err[0], exec_err[0]}) ::close(fd);
    throw IoError("meshtrain launch", fmt::format("cannot start rank {}: fork: {}", w.rank, std::strerror(fork_errno)),
                  "the machine is out of processes or memory");
  }
  ::setpgid(pid, pid);  // also here, so no signal to the group can come before the child's own call
  w.pid = pid;
  w.out = {out[0], 1, {}};
  w.err = {err[0], 2, {}};
  for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  // The exec-error pipe closes on a successful exec, or carries errno.
  int exec_errno = 0;
  ssize_t got;
  do {
    got = ::read(exec_err[0], &exec_errno, sizeof(exec_errno));
  } while (got < 0 && errno == EINTR);
  ::close(exec_err[0]);
  if (got == static_cast<ssize_t>(sizeof(exec_errno)))
    throw IoError("meshtrain launch",
                  fmt::format("cannot run '{}' (rank {}): {}", command.front(), w.rank, std::strerror(exec_errno)),
                  "the command after -- must be a program on PATH or a path to an executable");
}

void WorkerGroup::emit(const Worker& w, const Stream& s, std::string_view line) {
  if (rank0_only_ && w.rank != 0) return;
  std::string text = fmt::format("[rank {}] ", w.rank);
  text.append(line);
  text.push_back('\n');
  write_all(s.to, text);  // one write: lines of different workers never mix
}

void WorkerGroup::read_stream(Worker& w, Stream& s) {
  char buf[64 * 1024];
  for (;;) {
    const ssize_t n = ::read(s.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // end of file (every writer closed it) or an error
      if (!s.partial.empty()) emit(w, s, s.partial);
      s.partial.clear();
      close_fd(s.fd);
      return;
    }
    s.partial.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(w, s, std::string_view(s.partial).substr(start, nl - start));
    s.partial.erase(0, start);
    while (s.partial.size() >= kMaxLine) {
      emit(w, s, std::string_view(s.partial).substr(0, kMaxLine));
      s.partial.erase(0, kMaxLine);
    }
  }
}

bool WorkerGroup::wait_ready(milliseconds timeout) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> streams;
  fds.push_back({wake_fd_, POLLIN, 0});
  for (auto& w : workers_)
    for (Stream* s : {&w.out, &w.err})
      if (s->fd >= 0) {
        fds.push_back({s->fd, POLLIN, 0});
        streams.emplace_back(&w, s);
      }
  const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(timeout.count(), 60'000)));
  if (rc <= 0) return false;  // timeout, or EINTR (a signal: its byte is in wake_fd)
  for (size_t i = 1; i < fds.size(); ++i)
    if (fds[i].revents) read_stream(*streams[i - 1].first, *streams[i - 1].second);
  return fds[0].revents != 0 && on_wake_();
}

std::vector<WorkerExit> WorkerGroup::reap() {
  std::vector<WorkerExit> exits;
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid <= 0) break;  // none exited now, or no children left
    for (auto& w : workers_)
      if (w.pid == pid && !w.exited) {
        w.exited = true;
        w.status = status;
        exits.push_back({w.rank, pid, status});
      }
    // Other pids: the workers' orphans, reparented to the agent (a child
    // subreaper); reaping them is all there is to do.
  }
  return exits;
}

std::vector<WorkerExit> WorkerGroup::poll(milliseconds timeout) {
  wait_ready(timeout);
  return reap();
}

bool WorkerGroup::all_exited() const {
  return std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.pid < 0 || w.exited; });
}

bool WorkerGroup::groups_empty() {
  bool all = true;
  for (auto& w : workers_) {
    if (w.pid < 0 || w.group_empty) continue;
    // A group lives while a member does (zombies included, and the leader
    // until it is reaped); its id is not reused meanwhile.
    if (::kill(-w.pid, 0) != 0 && errno == ESRCH) {
      w.group_empty = true;
    } else {
      all = false;
    }
  }
  return all;
}

void WorkerGroup::signal_all(int sig) {
  for (auto& w : workers_)
    if (w.pid > 0 && !w.group_empty && ::kill(-w.pid, sig) != 0 && errno == ESRCH) w.group_empty = true;
}

void WorkerGroup::stop(milliseconds grace, int first) {
  signal_all(first);
  signal_all(SIGCONT);  // a stopped worker takes its signal now
  auto settled = [&] { return all_exited() && groups_empty(); };
  const auto deadline = Clock::now() + grace;
  while (!settled() && Clock::now() < deadline) {
    const bool hurry = wait_ready(std::min(left_until(deadline), milliseconds(50)));
    reap();
    if (hurry) break;
  }
  if (!settled()) {
    signal_all(SIGKILL);
    const auto kill_deadline = Clock::now() + kKillWait;
    while (!settled() && Clock::now() < kill_deadline) {
      wait_ready(milliseconds(20));
      reap();
    }
  }
  drain(kDrainWait);
}

void WorkerGroup::drain(milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto open = [&] {
    return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.out.fd >= 0 || w.err.fd >= 0; });
  };
  while (open() && Clock::now() < deadline) wait_ready(std::min(left_until(deadline), milliseconds(50)));
  for (auto& w : workers_)
    for (Stream* s : {&w.out, &w.err})
      if (s->fd >= 0) {
        if (!s->partial.empty()) emit(w, *s, s->partial);
        s->partial.clear();
        close_fd(s->fd);
      }
}

}  // namespace meshtrain::comm::internal
