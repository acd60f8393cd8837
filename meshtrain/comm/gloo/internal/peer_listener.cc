// Who may connect to the tcp benchmark peer (peer_listener.h).
#include "meshtrain/comm/gloo/internal/peer_listener.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>
#include <string_view>

#include "meshtrain/comm/internal/tcp_store_wire.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo::internal {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kOp = "gloo::native";

[[noreturn]] void throw_errno(const char* what) {
  throw EngineError(kOp, fmt::format("tcp peer: {}: {}", what, std::strerror(errno)),
                    "check that the ranks can reach each other on the address Gloo uses");
}

std::string_view bytes(const PeerSecret& s) { return {reinterpret_cast<const char*>(s.data()), s.size()}; }

struct Pending {
  Fd fd;
  PeerHello hello;
  size_t got = 0;
  Clock::time_point until;
};

}  // namespace

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

PeerSecret random_peer_secret() {
  PeerSecret s{};
  std::random_device random;
  for (auto& b : s) b = static_cast<unsigned char>(random());
  return s;
}

std::vector<Fd> accept_peers(int listener, const PeerSecret& secret, int rank, int size,
                             std::chrono::milliseconds timeout) {
  std::vector<Fd> fds(static_cast<size_t>(size));
  if (::fcntl(listener, F_SETFL, ::fcntl(listener, F_GETFL) | O_NONBLOCK) != 0) throw_errno("O_NONBLOCK");
  std::vector<Pending> pending;
  const auto deadline = Clock::now() + timeout;
  int missing = size - 1 - rank;
  while (missing > 0) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int> late;
      for (int k = rank + 1; k < size; ++k)
        if (fds[static_cast<size_t>(k)].get() < 0) late.push_back(k);
      throw TimeoutError(kOp,
                         fmt::format("tcp peer: rank {} waited {} ms for its peers to connect", rank, timeout.count()),
                         "every rank must create the peers", late);
    }
    std::erase_if(pending, [&](const Pending& c) { return c.until <= now; });
    std::vector<pollfd> pfds{{.fd = listener, .events = POLLIN, .revents = 0}};
    auto wake = deadline;
    for (const Pending& c : pending) {
      pfds.push_back({.fd = c.fd.get(), .events = POLLIN, .revents = 0});
      wake = std::min(wake, c.until);
    }
    const int64_t wait = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1;
    if (::poll(pfds.data(), pfds.size(), static_cast<int>(std::clamp<int64_t>(wait, 0, INT_MAX))) < 0 &&
        errno != EINTR)
      throw_errno("poll");
    for (size_t i = pending.size(); i-- > 0;) {  // back to front: erasing keeps the earlier indices
      if (!(pfds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Pending& c = pending[i];
      const ssize_t k =
          ::recv(c.fd.get(), reinterpret_cast<std::byte*>(&c.hello) + c.got, sizeof(PeerHello) - c.got, 0);
      if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (k > 0) c.got += static_cast<size_t>(k);
      if (k > 0 && c.got < sizeof(PeerHello)) continue;
      const int from = c.hello.rank;
      if (k > 0 && from > rank && from < size && fds[static_cast<size_t>(from)].get() < 0 &&
          comm::internal::tokens_equal(bytes(c.hello.secret), bytes(secret))) {
        fds[static_cast<size_t>(from)] = std::move(c.fd);
        --missing;
      }
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));  // taken, or a stranger: closed
    }
    if (pfds[0].revents & POLLIN) {
      for (;;) {
        Fd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (fd.get() < 0 && (errno == EMFILE || errno == ENFILE) && !pending.empty()) {
          pending.erase(pending.begin());  // out of descriptors: the oldest stranger makes room
          continue;
        }
        if (fd.get() < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
          throw_errno("accept");
        if (fd.get() < 0) break;
        if (pending.size() >= kMaxPendingPeers) pending.erase(pending.begin());
        pending.push_back({.fd = std::move(fd), .hello = {}, .got = 0,
                           .until = std::min(deadline, Clock::now() + kPeerHelloWithin)});
      }
    }
  }
  return fds;
}

}  // namespace meshtrain::comm::gloo::internal
