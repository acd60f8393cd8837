// TcpStore: the Store (store.h) of a job whose processes share only a
// network, like c10d's TCPStore: one process (rank 0, `is_server`) runs the
// server on host:port, every process (the server's too) is a client.
//
//   // rank 0                                      // other ranks
//   TcpStore s({.host = addr, .port = 29500,       TcpStore s({.host = addr, .port = 29500});
//               .is_server = true});                s.add("arrived", 1);
//   s.wait({"rank1/ready"});                        s.set("rank1/ready", "1");
//
// - port 0 on the server picks a free port; port() reports it (hand it to the
//   others, e.g. through the launcher). The server listens on `host` (as
//   resolved; "" or "0.0.0.0" = every IPv4 interface).
// - Clients connect with retry (the server may start later) until
//   connect_timeout, then throw TimeoutError naming host:port.
// - Every call is one request and one answer on the client's TCP connection.
//   get() and wait() carry their deadline to the server, which answers when
//   the keys exist or with the keys still missing at the deadline (the
//   TimeoutError of store.h); every other answer, and a server that does not
//   answer, are bounded by timeout() too.
// - The server runs one thread (poll() over its sockets), checks every
//   message (sizes within store.h's limits, known opcodes) and drops a client
//   that sends a malformed one. Destroying the server's TcpStore stops it:
//   clients waiting on it fail at once with AbortedError ("the store server
//   at host:port closed the connection"), never hang.
// - A client whose call failed on the connection (timeout without an answer,
//   server gone) reconnects on its next call.
// - Job token (`token`, empty = none): a server with a token serves only
//   connections whose first message is a hello carrying the same token
//   (compared in constant time); any other connection gets the error "refused:
//   wrong or missing job token" and is closed, and the server logs "meshtrain
//   store: refused a connection from ip:port: wrong or missing job token" to
//   stderr. A client with a token sends hello after every connect (and
//   reconnect); refused, it throws InvalidArgument naming the token. A server
//   without a token accepts a hello with any token, and plain requests. The
//   token keeps other jobs and stray clients out; it is not encryption (the
//   bytes, token included, cross the network in the clear). TcpStore reads no
//   environment: callers take the token from MESHTRAIN_JOB_TOKEN (`meshtrain
//   launch` sets it in every worker, see docs/launch.md) and pass it here.
// Wire format (little-endian): request = u32 length, u8 opcode, payload;
// answer = u32 length, u8 status (ok, timeout, error), payload; strings are
// u32 length + bytes; opcodes set, get, add, check, wait, delete_key, hello
// (token). See internal/tcp_store_wire.h.
// Thread-safety: calls on one TcpStore are serialized (a blocking get holds
// the connection); give each thread its own TcpStore to wait concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "meshtrain/comm/store.h"

namespace meshtrain::comm {

namespace internal {
class TcpStoreServer;
}

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // the server's address (clients); where it listens (server)
  uint16_t port = 29500;           // 0 (server only): any free port, see TcpStore::port()
  bool is_server = false;
  std::chrono::milliseconds timeout = kDefaultStoreTimeout;          // Store::timeout()
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(60);  // retrying until the server is up
  std::string token = "";  // the job token (at most 1024 bytes); empty: none (see above)
};

class TcpStore final : public Store {
 public:
  // Starts the server first when options.is_server, then connects. Throws
  // InvalidArgument for bad options or a refused token, IoError when the
  // server cannot listen (port in use: the message says so), TimeoutError
  // when no server answers within connect_timeout.
  explicit TcpStore(TcpStoreOptions options);
  ~TcpStore() override;

  const std::string& host() const { return options_.host; }
  // The server's port (the one picked when options.port was 0).
  uint16_t port() const { return port_; }

  using Store::get;
  using Store::wait;
  void set(std::string_view key, std::string_view value) override;
  std::string get(std::string_view key, std::chrono::milliseconds timeout) override;
  int64_t add(std::string_view key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool delete_key(std::string_view key) override;

 private:
  struct Answer;
  // Sends one request and reads its answer (connecting first if needed);
  // `wait_for` is how long the server may take to answer.
  Answer call(std::string_view op, const std::string& request, std::chrono::milliseconds wait_for);
  Answer exchange_locked(std::string_view op, const std::string& request, std::chrono::milliseconds wait_for);
  void connect_locked(std::string_view op);  // and sends hello when there is a token
  void disconnect_locked();
  std::string where() const;

  TcpStoreOptions options_;
  uint16_t port_ = 0;
  std::unique_ptr<internal::TcpStoreServer> server_;
  std::mutex mu_;  // one request at a time on fd_
  int fd_ = -1;
};

}  // namespace meshtrain::comm
