// What the launcher's agent (comm/agent.cc) needs of its process: the
// signals it handles, arriving as bytes on a self-pipe that its one thread
// reads; the child-subreaper flag, so the workers' orphans are reaped; a
// heartbeat that beats in the job's store from a thread of its own; and
// one-line messages on stderr. Internal to comm.
#pragma once

#include <signal.h>

#include <chrono>
#include <condition_variable>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm/tcp_store.h"

namespace meshtrain::comm::internal {

// How often the agents beat their heartbeats.
inline constexpr std::chrono::milliseconds kBeatEvery{1000};

// "SIGKILL", or "signal 99".
std::string signal_name(int sig);

// "meshtrain launch: <text>\n" on stderr, in one write.
void say(const std::string& text);

// While alive, SIGINT, SIGTERM, SIGHUP and SIGCHLD arrive as bytes on
// fd() (any thread may take them; SA_RESTART) and SIGPIPE is ignored; the
// handlers that were there before are restored on destruction. One at a
// time per process: a second throws InvalidArgument. Throws IoError when
// no pipe can be made.
class SignalPipe {
 public:
  SignalPipe();
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int fd() const { return fds_[0]; }
  // The signals received since the last call (SIGCHLD included).
  std::vector<int> take();

 private:
  static constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE};
  int fds_[2] = {-1, -1};
  struct sigaction old_[std::size(kHandled)] {};
};

// While alive, the process is a child subreaper: its children's orphans
// are reparented to it (and the agent reaps them).
class SubreaperScope {
 public:
  SubreaperScope();
  ~SubreaperScope();
  SubreaperScope(const SubreaperScope&) = delete;
  SubreaperScope& operator=(const SubreaperScope&) = delete;

 private:
  int old_ = 0;
};

// Adds 1 to `key` every kBeatEvery on a store connection of its own, until
// destroyed; a store that goes away ends it quietly (the agent's own calls
// report that).
class Heartbeat {
 public:
  Heartbeat(TcpStoreOptions options, std::string key);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  void run(const TcpStoreOptions& options, const std::string& key);

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace meshtrain::comm::internal
