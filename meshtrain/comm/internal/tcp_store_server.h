// TcpStore's server: one thread, poll() over the listening socket, a wake-up
// pipe and every client connection; the keys live in a map only that thread
// touches. Blocking requests (get, wait) are parked with their deadline and
// answered when the keys appear or the deadline passes. A client is
// answered in request order: while one of its requests is parked, its later
// requests wait in its input buffer. With a job token, a connection must
// first send a hello with that token (tcp_store_wire.h); other connections
// are refused, closed and logged to stderr ("meshtrain store: refused a
// connection from ip:port: wrong or missing job token").
// Hostile peers: before its hello is checked a connection may send one
// hello frame (a longer one is refused unread) and has 10 s to send it (no
// token: any first request); at most 1024 such pending connections are held
// (128 per peer address), and a new one closes the oldest pending one, so
// idle connections never keep the job's own clients out. At most 16384
// connections in all (pending ones are closed first to make room); the
// server raises the process's soft descriptor limit toward that.
// Internal to comm (see comm/tcp_store.h for the contracts).
#pragma once

#include <cstdint>
#include <string>
#include <thread>

namespace meshtrain::comm::internal {

class TcpStoreServer {
 public:
  // Listens on host:port (port 0: any free one; host "" or "0.0.0.0": every
  // IPv4 interface; else only the address host resolves to) and starts the
  // thread. `token` empty: no token needed. Throws IoError when it cannot
  // (port in use, host not local), InvalidArgument when host does not resolve.
  TcpStoreServer(const std::string& host, uint16_t port, std::string token = {});
  // Stops the thread and closes every connection: clients see it closed.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const { return port_; }

 private:
  void run();

  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // the destructor writes one byte to wake_[1]
  uint16_t port_ = 0;
  std::string token_;
  std::thread thread_;
};

}  // namespace meshtrain::comm::internal
