// The tcp benchmark peer's listening socket (native.cc): who may connect.
// Internal.
//
// A rank listens on an ephemeral port and publishes its address with a
// random secret in the job's store, which only authenticated clients read.
// A connecting rank's first bytes are a PeerHello: its rank and the
// listener's secret. accept_peers() reads hellos without blocking, at most
// kMaxPendingPeers connections at once (the oldest is dropped for a new
// one), each for at most kPeerHelloWithin; a connection whose hello is not
// an expected rank's with the right secret is closed and does not count, so
// a stranger on the port can neither take a rank's place nor stall the
// others beyond the deadline.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace meshtrain::comm::gloo::internal {

// An owned file descriptor (closed on destruction).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset();

 private:
  int fd_ = -1;
};

using PeerSecret = std::array<unsigned char, 16>;

struct PeerHello {
  int32_t rank = -1;
  PeerSecret secret{};
};
static_assert(sizeof(PeerHello) == 20, "the hello is sent as bytes: no padding");

inline constexpr size_t kMaxPendingPeers = 64;
inline constexpr std::chrono::milliseconds kPeerHelloWithin{5000};

// A fresh random secret (std::random_device).
PeerSecret random_peer_secret();

// Accepts ranks rank+1 .. size-1 on the listening socket `listener`, each
// showing `secret`; returns the connections by rank (empty Fd for the rest).
// Throws TimeoutError naming the ranks that did not connect within
// `timeout`, EngineError when a socket call fails.
std::vector<Fd> accept_peers(int listener, const PeerSecret& secret, int rank, int size,
                             std::chrono::milliseconds timeout);

}  // namespace meshtrain::comm::gloo::internal
