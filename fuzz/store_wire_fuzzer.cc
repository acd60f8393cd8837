// libFuzzer target: the TcpStore server's wire protocol (comm/internal/
// tcp_store_wire.h) as a peer on its port meets it (docs/fuzzing.md).
//
// Byte 0, bit 0 picks the server: with the job token "fuzz-token" (a
// connection must say hello with it first) or without one. A fresh server
// takes each input (no state carried between inputs); the rest of the input
// is sent on one connection as it is, and the connection's write side is
// shut. The server must answer only with well-formed frames (a length of
// at most kMaxFrameBytes and a status of ok, timeout or error) and then
// close the connection within 5 s; its thread runs under ASan and UBSan too.
// A job's own client then still works on the same server (set, get).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz/fuzz_input.h"
#include "meshtrain/comm/internal/tcp_store_server.h"
#include "meshtrain/comm/internal/tcp_store_wire.h"
#include "meshtrain/comm/tcp_store.h"

namespace {

namespace internal = meshtrain::comm::internal;
using meshtrain::fuzz::check;
using Clock = std::chrono::steady_clock;
constexpr const char* kToken = "fuzz-token";

int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  check(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // connect_within: libFuzzer's SIGALRM (its -timeout watchdog) may interrupt the connect.
  int err = 0;
  check(internal::connect_within(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a),
                                 Clock::now() + std::chrono::seconds(5), &err) == internal::IoResult::ok);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool with_token = (data[0] & 1) != 0;
  internal::TcpStoreServer server("127.0.0.1", 0, with_token ? kToken : "");
  const int fd = connect_to(server.port());
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  int err = 0;
  // The server may close while the input is still being sent (a refusal).
  (void)internal::send_all(fd, std::string_view(reinterpret_cast<const char*>(data + 1), size - 1), deadline, &err);
  ::shutdown(fd, SHUT_WR);
  for (;;) {
    std::string body;
    const internal::IoResult r = internal::recv_frame(fd, body, deadline, &err);
    check(!(r == internal::IoResult::error && err == EMSGSIZE));  // a frame longer than the protocol allows
    if (r == internal::IoResult::closed || r == internal::IoResult::error) break;  // a reset is a close too
    check(r == internal::IoResult::ok);  // a timeout: the server kept a half-closed connection open
    check(!body.empty() && static_cast<uint8_t>(body[0]) <= static_cast<uint8_t>(internal::StoreStatus::error));
  }
  ::close(fd);
  // The job's own client is not disturbed.
  meshtrain::comm::TcpStore client({.host = "127.0.0.1", .port = server.port(), .timeout = std::chrono::seconds(5),
                                    .connect_timeout = std::chrono::seconds(2), .token = with_token ? kToken : ""});
  client.set("k", "v");
  check(client.get("k") == "v");
  return 0;
}
