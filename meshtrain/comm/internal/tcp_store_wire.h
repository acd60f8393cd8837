// TcpStore's wire format and socket helpers, shared by the client
// (comm/tcp_store.cc) and the server (internal/tcp_store_server.cc).
//
// Frame: u32 length (of what follows, at most kMaxFrameBytes), then
//   request: u8 opcode, payload     answer: u8 status, payload
// Payloads (all integers little-endian, strings = u32 length + bytes):
//   set    key, value                    -> ok
//   get    key, u64 timeout_ms           -> ok value | timeout [key]
//   add    key, i64 delta                -> ok i64
//   check  u32 n, n keys                 -> ok u8
//   wait   u32 n, n keys, u64 timeout_ms -> ok | timeout u32 m, m missing keys
//   delete key                           -> ok u8 existed
//   hello  token                         -> ok (the connection may go on)
//   any                                  -> error message (the request was refused)
// The job token: a server with a token (TcpStoreOptions::token) takes a
// connection only after a first message `hello` with the same token
// (compared in constant time); anything else first, or another token, is
// answered with the error kRefusedToken and the connection is closed. A
// server without a token answers every hello ok, whatever its token, and
// takes other requests without one. Clients with a token send hello right
// after every connect.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/store.h"

namespace meshtrain::comm::internal {

enum class StoreOp : uint8_t { set = 1, get = 2, add = 3, check = 4, wait = 5, delete_key = 6, hello = 7 };
enum class StoreStatus : uint8_t { ok = 0, timeout = 1, error = 2 };
std::string_view store_op_name(uint8_t op);  // "set", ..., or "unknown"

// The longest job token (hello's payload).
inline constexpr size_t kMaxTokenBytes = 1024;
// The error a server answers to a connection without its token.
inline constexpr std::string_view kRefusedToken = "refused: wrong or missing job token";
// a == b in time that depends only on the lengths, not on where they differ.
bool tokens_equal(std::string_view a, std::string_view b);

// The largest frame either side accepts: the largest value plus its key and
// framing. A longer length prefix means a broken or foreign peer.
inline constexpr size_t kMaxFrameBytes = kMaxStoreValueBytes + kMaxStoreKeyBytes + 64;

// Builds a frame; finish() writes the length prefix.
class FrameWriter {
 public:
  FrameWriter() : buf_(4, '\0') {}
  FrameWriter& u8(uint8_t v);
  FrameWriter& u32(uint32_t v);
  FrameWriter& u64(uint64_t v);
  FrameWriter& str(std::string_view s);
  // The frame with its length prefix. Throws InvalidArgument (op `op`) past kMaxFrameBytes.
  std::string finish(std::string_view op);

 private:
  std::string buf_;
};

// Reads a frame's body (without the length prefix). Every read checks the
// bounds: a short or oversized field throws WireError.
struct WireError {
  std::string what;
};
class FrameReader {
 public:
  explicit FrameReader(std::string_view body) : body_(body) {}
  uint8_t u8();
  uint32_t u32();
  uint64_t u64();
  std::string str(size_t max_bytes);
  std::vector<std::string> keys();  // u32 n (<= kMaxStoreKeys), n keys (each <= kMaxStoreKeyBytes)
  void expect_end() const;          // throws WireError for trailing bytes

 private:
  void need(size_t n) const;
  std::string_view body_;
  size_t pos_ = 0;
};

// Blocking I/O on a socket with a deadline (poll). Results:
enum class IoResult { ok, closed, timeout, error };
// connect(2) on a blocking or non-blocking socket, its outcome awaited with
// poll until the deadline: a connect that a signal interrupts (EINTR) or
// that is in progress (EINPROGRESS) goes on in the kernel, so its result is
// read from SO_ERROR rather than the call's errno. error: *err = the cause
// (ECONNREFUSED, ...).
IoResult connect_within(int fd, const sockaddr* addr, socklen_t len, std::chrono::steady_clock::time_point deadline,
                        int* err);
IoResult send_all(int fd, std::string_view data, std::chrono::steady_clock::time_point deadline, int* err);
IoResult recv_exact(int fd, char* out, size_t n, std::chrono::steady_clock::time_point deadline, int* err);
// Reads one frame's body (length checked against kMaxFrameBytes; error,
// with *err = EMSGSIZE, beyond it).
IoResult recv_frame(int fd, std::string& body, std::chrono::steady_clock::time_point deadline, int* err);

}  // namespace meshtrain::comm::internal
