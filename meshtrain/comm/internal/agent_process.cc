#include "meshtrain/comm/internal/agent_process.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::internal {
namespace {

constexpr const char* kOp = "meshtrain launch";

// The write end of the running SignalPipe (-1: none).
std::atomic<int> g_signal_write_fd{-1};

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(g_signal_write_fd.load(), &byte, 1);
  errno = saved;
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

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

SignalPipe::SignalPipe() {
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

SignalPipe::~SignalPipe() {
  for (size_t i = 0; i < std::size(kHandled); ++i) ::sigaction(kHandled[i], &old_[i], nullptr);
  g_signal_write_fd.store(-1);
  ::close(fds_[0]);
  ::close(fds_[1]);
}

std::vector<int> SignalPipe::take() {
  std::vector<int> out;
  unsigned char buf[64];
  for (;;) {
    const ssize_t n = ::read(fds_[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.insert(out.end(), buf, buf + n);
  }
}

SubreaperScope::SubreaperScope() {
  ::prctl(PR_GET_CHILD_SUBREAPER, &old_);
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
}

SubreaperScope::~SubreaperScope() { ::prctl(PR_SET_CHILD_SUBREAPER, old_); }

Heartbeat::Heartbeat(TcpStoreOptions options, std::string key)
    : thread_([this, o = std::move(options), k = std::move(key)] { run(o, k); }) {}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Heartbeat::run(const TcpStoreOptions& options, const std::string& key) {
  try {
    TcpStore store(options);
    for (std::unique_lock l(mu_); !cv_.wait_for(l, kBeatEvery, [this] { return stop_; });) {
      l.unlock();
      store.add(key, 1);
      l.lock();
    }
  } catch (const Error&) {
  }
}

}  // namespace meshtrain::comm::internal
