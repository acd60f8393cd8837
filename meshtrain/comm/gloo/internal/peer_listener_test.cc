// The tcp peer's listener takes only the ranks that show its secret:
// strangers that connect and stay silent, send garbage, or claim a rank
// with the wrong secret are closed, and neither take a rank's place nor
// stall the ranks that follow.
#include "meshtrain/comm/gloo/internal/peer_listener.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo::internal {
namespace {

using std::chrono::milliseconds;

struct Listener {
  Fd fd{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  sockaddr_in addr{};
  Listener() {
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(::listen(fd.get(), SOMAXCONN), 0);
    EXPECT_EQ(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  }
  Fd connect() const {
    Fd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    EXPECT_EQ(::connect(c.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
    return c;
  }
};

void send_bytes(const Fd& c, const void* p, size_t n) {
  ASSERT_EQ(::send(c.get(), p, n, MSG_NOSIGNAL), static_cast<ssize_t>(n));
}

// A rank's connection: the hello, then one byte that says who sent it.
Fd rank_connection(const Listener& l, int rank, const PeerSecret& secret) {
  Fd c = l.connect();
  const PeerHello hello{.rank = rank, .secret = secret};
  send_bytes(c, &hello, sizeof(hello));
  const auto mark = static_cast<unsigned char>(100 + rank);
  send_bytes(c, &mark, 1);
  return c;
}

unsigned char mark_on(const Fd& fd) {
  unsigned char b = 0;
  for (int tries = 0; tries < 1000; ++tries) {  // the accepted socket does not block
    if (::recv(fd.get(), &b, 1, 0) == 1) return b;
    ::usleep(1000);
  }
  return 0;
}

TEST(PeerListener, StrangersAreClosedAndTheRanksThatShowTheSecretAreTaken) {
  Listener l;
  const PeerSecret secret = random_peer_secret();
  PeerSecret wrong = secret;
  wrong[7] ^= 1;
  std::vector<Fd> strangers;
  for (int i = 0; i < 3; ++i) strangers.push_back(l.connect());  // silent
  strangers.push_back(l.connect());
  const char garbage[20] = "GET / HTTP/1.1\r\n\r\n";
  send_bytes(strangers.back(), garbage, sizeof(garbage));
  strangers.push_back(rank_connection(l, 1, wrong));  // claims rank 1 first, wrong secret
  strangers.push_back(rank_connection(l, 9, secret));  // the secret, but no such rank
  strangers.push_back(rank_connection(l, 0, secret));  // a lower rank connects, not accepts
  strangers.push_back(l.connect());
  send_bytes(strangers.back(), garbage, 7);  // half a hello, then silence
  std::vector<Fd> ranks;
  for (int r : {3, 1, 2}) ranks.push_back(rank_connection(l, r, secret));

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Fd> fds = accept_peers(l.fd.get(), secret, 0, 4, milliseconds(20000));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(2000)) << "strangers must not stall the ranks";
  ASSERT_EQ(fds.size(), 4u);
  EXPECT_LT(fds[0].get(), 0);
  for (int r = 1; r < 4; ++r) {
    ASSERT_GE(fds[static_cast<size_t>(r)].get(), 0) << "rank " << r;
    EXPECT_EQ(mark_on(fds[static_cast<size_t>(r)]), 100 + r) << "rank " << r << "'s place went to a stranger";
  }
}

TEST(PeerListener, AFloodOfSilentConnectionsDoesNotKeepARankOut) {
  Listener l;
  const PeerSecret secret = random_peer_secret();
  std::vector<Fd> strangers;
  for (size_t i = 0; i < 3 * kMaxPendingPeers; ++i) strangers.push_back(l.connect());
  Fd rank1 = rank_connection(l, 1, secret);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Fd> fds = accept_peers(l.fd.get(), secret, 0, 2, milliseconds(20000));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(3000));
  EXPECT_EQ(mark_on(fds[1]), 101);
}

TEST(PeerListener, ARankThatNeverConnectsIsNamedAtTheDeadline) {
  Listener l;
  const PeerSecret secret = random_peer_secret();
  Fd rank1 = rank_connection(l, 1, secret);
  Fd stranger = l.connect();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    accept_peers(l.fd.get(), secret, 0, 3, milliseconds(300));
    FAIL() << "expected a TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("waited 300 ms"), std::string::npos) << e.what();
    EXPECT_EQ(e.ranks(), std::vector<int>{2});
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(2000));
}

}  // namespace
}  // namespace meshtrain::comm::gloo::internal
