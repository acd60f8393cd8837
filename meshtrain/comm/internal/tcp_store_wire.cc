#include "meshtrain/comm/internal/tcp_store_wire.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::internal {

std::string_view store_op_name(uint8_t op) {
  switch (static_cast<StoreOp>(op)) {
    case StoreOp::set: return "set";
    case StoreOp::get: return "get";
    case StoreOp::add: return "add";
    case StoreOp::check: return "check";
    case StoreOp::wait: return "wait";
    case StoreOp::delete_key: return "delete_key";
    case StoreOp::hello: return "hello";
  }
  return "unknown";
}

bool tokens_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer one is looked at, whatever the contents: an
  // attacker timing the answers learns the length at most.
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff |= static_cast<unsigned>(x ^ y);
  }
  // Through a volatile, so the compiler cannot stop at the first difference.
  volatile unsigned result = diff;
  return result == 0;
}

FrameWriter& FrameWriter::u8(uint8_t v) {
  buf_.push_back(static_cast<char>(v));
  return *this;
}
FrameWriter& FrameWriter::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return *this;
}
FrameWriter& FrameWriter::u64(uint64_t v) {
  for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return *this;
}
FrameWriter& FrameWriter::str(std::string_view s) {
  // Callers check sizes against the store limits first; a string past 4 GiB
  // cannot get here (kMaxFrameBytes is far below), finish() refuses the frame.
  u32(static_cast<uint32_t>(std::min<size_t>(s.size(), UINT32_MAX)));
  buf_.append(s);
  return *this;
}
std::string FrameWriter::finish(std::string_view op) {
  const size_t body = buf_.size() - 4;
  if (body > kMaxFrameBytes)
    throw InvalidArgument(std::string(op), fmt::format("request of {} bytes, more than {}", body, kMaxFrameBytes),
                          "wait on fewer keys at a time, or use shorter keys");
  for (int i = 0; i < 4; ++i) buf_[static_cast<size_t>(i)] = static_cast<char>((body >> (8 * i)) & 0xff);
  return std::move(buf_);
}

void FrameReader::need(size_t n) const {
  if (body_.size() - pos_ < n)
    throw WireError{fmt::format("message ends {} bytes in, {} more needed", pos_, n - (body_.size() - pos_))};
}
uint8_t FrameReader::u8() {
  need(1);
  return static_cast<uint8_t>(body_[pos_++]);
}
uint32_t FrameReader::u32() {
  need(4);
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(body_[pos_++])} << (8 * i);
  return v;
}
uint64_t FrameReader::u64() {
  need(8);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(body_[pos_++])} << (8 * i);
  return v;
}
std::string FrameReader::str(size_t max_bytes) {
  const uint32_t n = u32();
  if (n > max_bytes) throw WireError{fmt::format("string of {} bytes, more than {}", n, max_bytes)};
  need(n);
  std::string s(body_.substr(pos_, n));
  pos_ += n;
  return s;
}
std::vector<std::string> FrameReader::keys() {
  const uint32_t n = u32();
  if (n > kMaxStoreKeys) throw WireError{fmt::format("{} keys, more than {}", n, kMaxStoreKeys)};
  // Each key takes at least 4 bytes: a count the message cannot hold is
  // refused before anything is reserved.
  need(size_t{n} * 4);
  std::vector<std::string> keys;
  keys.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    keys.push_back(str(kMaxStoreKeyBytes));
    if (keys.back().empty()) throw WireError{"empty key"};
  }
  return keys;
}
void FrameReader::expect_end() const {
  if (pos_ != body_.size()) throw WireError{fmt::format("{} unexpected bytes after the message", body_.size() - pos_)};
}

namespace {

// Waits until fd is ready for `events`, at most until the deadline.
IoResult wait_ready(int fd, short events, std::chrono::steady_clock::time_point deadline, int* err) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return IoResult::timeout;
    pollfd p{fd, events, 0};
    // Round up, so a wait of 0.4 ms does not become a busy loop of 0 ms polls.
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, 60'000)));
    if (rc < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return IoResult::error;
    }
    if (rc > 0) return IoResult::ok;  // readable, writable, or hung up: the next call says which
  }
}

}  // namespace

IoResult connect_within(int fd, const sockaddr* addr, socklen_t len, std::chrono::steady_clock::time_point deadline,
                        int* err) {
  if (::connect(fd, addr, len) == 0) return IoResult::ok;
  if (errno != EINTR && errno != EINPROGRESS) {
    *err = errno;
    return IoResult::error;
  }
  if (IoResult r = wait_ready(fd, POLLOUT, deadline, err); r != IoResult::ok) return r;
  int so_error = 0;
  socklen_t n = sizeof(so_error);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &n) != 0) so_error = errno;
  if (so_error == 0) return IoResult::ok;
  *err = so_error;
  return IoResult::error;
}

IoResult send_all(int fd, std::string_view data, std::chrono::steady_clock::time_point deadline, int* err) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (IoResult r = wait_ready(fd, POLLOUT, deadline, err); r != IoResult::ok) return r;
      continue;
    }
    *err = errno;
    return (errno == EPIPE || errno == ECONNRESET) ? IoResult::closed : IoResult::error;
  }
  return IoResult::ok;
}

IoResult recv_exact(int fd, char* out, size_t n, std::chrono::steady_clock::time_point deadline, int* err) {
  size_t off = 0;
  while (off < n) {
    const ssize_t got = ::recv(fd, out + off, n - off, MSG_DONTWAIT);
    if (got > 0) {
      off += static_cast<size_t>(got);
      continue;
    }
    if (got == 0) return IoResult::closed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (IoResult r = wait_ready(fd, POLLIN, deadline, err); r != IoResult::ok) return r;
      continue;
    }
    *err = errno;
    return errno == ECONNRESET ? IoResult::closed : IoResult::error;
  }
  return IoResult::ok;
}

IoResult recv_frame(int fd, std::string& body, std::chrono::steady_clock::time_point deadline, int* err) {
  unsigned char len[4];
  if (IoResult r = recv_exact(fd, reinterpret_cast<char*>(len), 4, deadline, err); r != IoResult::ok) return r;
  const uint32_t n = uint32_t{len[0]} | uint32_t{len[1]} << 8 | uint32_t{len[2]} << 16 | uint32_t{len[3]} << 24;
  if (n > kMaxFrameBytes || n == 0) {
    *err = EMSGSIZE;
    return IoResult::error;
  }
  body.resize(n);
  return recv_exact(fd, body.data(), n, deadline, err);
}

}  // namespace meshtrain::comm::internal
