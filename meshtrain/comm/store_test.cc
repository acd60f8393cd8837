// The Store contracts (store.h) on both implementations, and TcpStore's
// server: concurrent clients, deadlines that name the missing keys, a server
// that goes away under a waiting client, malformed messages, the job token,
// the listening address, two processes.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <thread>

#include "meshtrain/comm/internal/tcp_store_wire.h"
#include "meshtrain/comm/store.h"
#include "meshtrain/comm/tcp_store.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;
using meshtrain::testing::error_of;
using Clock = std::chrono::steady_clock;

// A server on a free port, and a way to make more clients of it.
struct TcpFixture {
  std::unique_ptr<TcpStore> server =
      std::make_unique<TcpStore>(TcpStoreOptions{.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = 5s});
  std::unique_ptr<TcpStore> client(std::chrono::milliseconds timeout = 5s,
                                   std::chrono::milliseconds connect_timeout = 5s) const {
    return std::make_unique<TcpStore>(TcpStoreOptions{
        .host = "127.0.0.1", .port = server->port(), .timeout = timeout, .connect_timeout = connect_timeout});
  }
};

enum class Kind { in_process, tcp };

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    if (GetParam() == Kind::in_process) {
      shared_ = std::make_unique<InProcessStore>(5s);
    } else {
      tcp_ = std::make_unique<TcpFixture>();
    }
  }
  // A handle for one thread: the shared in-process store, or a new TCP client.
  std::shared_ptr<Store> handle(std::chrono::milliseconds timeout = 5s) {
    if (shared_) return std::shared_ptr<Store>(shared_.get(), [](Store*) {});
    return tcp_->client(timeout);
  }

  std::unique_ptr<InProcessStore> shared_;
  std::unique_ptr<TcpFixture> tcp_;
};

TEST_P(StoreTest, SetGetAddCheckDelete) {
  auto s = handle();
  s->set("a", "hello");
  EXPECT_EQ(s->get("a"), "hello");
  s->set("a", std::string("x\0y", 3));  // overwrites; bytes, NULs included
  EXPECT_EQ(s->get("a"), std::string("x\0y", 3));
  EXPECT_EQ(s->add("n", 5), 5);
  EXPECT_EQ(s->add("n", -2), 3);
  EXPECT_EQ(s->get("n"), "3");  // counters are decimal text
  EXPECT_TRUE(s->check({"a", "n"}));
  EXPECT_FALSE(s->check({"a", "missing"}));
  EXPECT_TRUE(s->check({}));
  s->wait({"a", "n"});
  EXPECT_TRUE(s->delete_key("a"));
  EXPECT_FALSE(s->delete_key("a"));
  EXPECT_FALSE(s->check({"a"}));
  const std::string big(1 << 20, 'z');
  s->set("big", big);
  EXPECT_EQ(s->get("big"), big);
}

TEST_P(StoreTest, GetBlocksUntilAnotherThreadSets) {
  auto reader = handle();
  std::thread writer([&] {
    auto w = handle();
    std::this_thread::sleep_for(30ms);
    w->set("late", "v");
    w->add("counter", 7);
  });
  EXPECT_EQ(reader->get("late", 2s), "v");
  reader->wait({"late", "counter"}, 2s);
  EXPECT_EQ(reader->get("counter"), "7");
  writer.join();
}

TEST_P(StoreTest, ConcurrentAddsGiveEveryValueOnce) {
  constexpr int kThreads = 12, kAdds = 50;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      auto s = handle();
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(s->add("counter", 1));
    });
  for (auto& t : threads) t.join();
  std::vector<int64_t> all;
  for (auto& v : seen) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(kThreads * kAdds);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(all, expected);  // atomic: no value returned twice, none lost
  EXPECT_EQ(handle()->get("counter"), std::to_string(kThreads * kAdds));
}

TEST_P(StoreTest, GetDeadlineNamesTheMissingKey) {
  auto s = handle();
  const auto start = Clock::now();
  const std::string e = error_of<TimeoutError>([&] { s->get("rank7/addr", 150ms); });
  const auto took = Clock::now() - start;
  EXPECT_THAT(e, HasSubstr("key 'rank7/addr' was not set"));
  EXPECT_THAT(e, HasSubstr("after waiting 1"));  // 150 ms and a little
  EXPECT_THAT(e, HasSubstr("check that it started"));
  EXPECT_GE(took, 150ms);
  EXPECT_LT(took, 1500ms);
  // The store is usable afterwards.
  s->set("rank7/addr", "x");
  EXPECT_EQ(s->get("rank7/addr", 150ms), "x");
}

TEST_P(StoreTest, WaitDeadlineNamesOnlyTheKeysThatNeverAppeared) {
  auto s = handle();
  s->set("here", "1");
  const std::string e = error_of<TimeoutError>([&] { s->wait({"here", "gone1", "gone2"}, 100ms); });
  EXPECT_THAT(e, HasSubstr("keys 'gone1' and 'gone2' were not set"));
  EXPECT_THAT(e, Not(HasSubstr("'here'")));
  // The store's default deadline applies without a per-call one.
  auto quick = handle(60ms);
  quick->set_timeout(60ms);
  EXPECT_THAT(error_of<TimeoutError>([&] { quick->get("never"); }), HasSubstr("'never'"));
}

TEST_P(StoreTest, BadArgumentsAreRefused) {
  auto s = handle();
  EXPECT_THAT(error_of([&] { s->set("", "v"); }), HasSubstr("empty key"));
  EXPECT_THAT(error_of([&] { s->get(std::string(kMaxStoreKeyBytes + 1, 'k'), 10ms); }), HasSubstr("key of 4097 bytes"));
  EXPECT_THAT(error_of([&] { s->set("v", std::string(kMaxStoreValueBytes + 1, 'v')); }), HasSubstr("more than"));
  EXPECT_THAT(error_of([&] { s->get("k", 0ms); }), HasSubstr("timeout 0 ms is outside"));
  s->set("text", "abc");
  EXPECT_THAT(error_of([&] { s->add("text", 1); }), HasSubstr("not a decimal integer"));
  EXPECT_EQ(s->get("text"), "abc");  // unchanged
  s->set("big", std::to_string(INT64_MAX));
  EXPECT_THAT(error_of([&] { s->add("big", 1); }), HasSubstr("overflows"));
  EXPECT_EQ(s->add("ok", 1), 1);  // still usable (TcpStore: same connection)
}

INSTANTIATE_TEST_SUITE_P(Both, StoreTest, ::testing::Values(Kind::in_process, Kind::tcp),
                         [](const auto& info) { return info.param == Kind::tcp ? "tcp" : "in_process"; });

// --- TcpStore only ------------------------------------------------------------------

TEST(TcpStore, ServerShutdownWhileAClientWaitsIsACleanError) {
  TcpFixture f;
  auto c = f.client(5s, 200ms);
  std::string error;
  auto start = Clock::now();
  std::thread waiter([&] { error = error_of<AbortedError>([&] { c->get("never", 10s); }); });
  std::this_thread::sleep_for(50ms);
  f.server.reset();  // stops the server under the waiting client
  waiter.join();
  EXPECT_LT(Clock::now() - start, 3s);  // not its 10 s deadline
  EXPECT_THAT(error, HasSubstr("closed the connection"));
  // Later calls fail cleanly too (no server to reconnect to).
  EXPECT_THROW(c->set("k", "v"), TimeoutError);
}

TEST(TcpStore, ClientRetriesUntilTheServerStarts) {
  uint16_t port;
  {
    TcpFixture probe;  // find a free port, then free it
    port = probe.server->port();
  }
  std::unique_ptr<TcpStore> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(100ms);
    server = std::make_unique<TcpStore>(TcpStoreOptions{.host = "127.0.0.1", .port = port, .is_server = true});
  });
  TcpStore client({.host = "127.0.0.1", .port = port, .connect_timeout = 5s});
  client.set("k", "v");
  starter.join();
  EXPECT_EQ(server->get("k"), "v");
}

TEST(TcpStore, ConnectDeadlineNamesTheAddress) {
  uint16_t port;
  {
    TcpFixture probe;
    port = probe.server->port();
  }
  const std::string e = error_of<TimeoutError>(
      [&] { TcpStore c({.host = "127.0.0.1", .port = port, .connect_timeout = 100ms}); });
  EXPECT_THAT(e, HasSubstr(fmt::format("127.0.0.1:{}", port)));
  EXPECT_THAT(e, HasSubstr("MASTER_ADDR and MASTER_PORT"));
}

TEST(TcpStore, PortInUseAndBadOptionsAreRefused) {
  TcpFixture f;
  EXPECT_THAT(error_of<IoError>([&] {
                TcpStore s({.host = "127.0.0.1", .port = f.server->port(), .is_server = true});
              }),
              HasSubstr("another process uses this port"));
  EXPECT_THAT(error_of([] { TcpStore s({.host = "127.0.0.1", .port = 0}); }), HasSubstr("port 0 on a client"));
  EXPECT_THAT(error_of([] { TcpStore s({.host = "", .port = 1234}); }), HasSubstr("empty host"));
}

// Sends raw bytes to the server; returns the answer frame's status byte (or
// -1 when the server closed without one) and whether it then closed.
std::pair<int, bool> raw_exchange(uint16_t port, const std::string& bytes, bool then_hang_up = false) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  int err = 0;
  const auto deadline = Clock::now() + 2s;
  EXPECT_EQ(internal::send_all(fd, bytes, deadline, &err), internal::IoResult::ok);
  if (then_hang_up) ::shutdown(fd, SHUT_WR);
  std::string body;
  int status = -1;
  if (internal::recv_frame(fd, body, deadline, &err) == internal::IoResult::ok) status = static_cast<uint8_t>(body[0]);
  char c;
  const bool closed = internal::recv_exact(fd, &c, 1, deadline, &err) == internal::IoResult::closed;
  ::close(fd);
  return {status, closed};
}

TEST(TcpStore, MalformedMessagesAreRefusedAndTheServerGoesOn) {
  TcpFixture f;
  const uint16_t port = f.server->port();
  const auto error = static_cast<int>(internal::StoreStatus::error);
  // Unknown opcode: an error answer, then the connection is closed.
  EXPECT_EQ(raw_exchange(port, std::string("\x01\x00\x00\x00\x63", 5)), std::make_pair(error, true));
  // A length prefix beyond the limit: refused before anything is read.
  EXPECT_EQ(raw_exchange(port, std::string("\xff\xff\xff\x7f", 4)), std::make_pair(error, true));
  // A set whose key length runs past the message.
  internal::FrameWriter w;
  w.u8(static_cast<uint8_t>(internal::StoreOp::set)).u32(1000);
  EXPECT_EQ(raw_exchange(port, w.finish("test")), std::make_pair(error, true));
  // A check that claims more keys than allowed.
  internal::FrameWriter k;
  k.u8(static_cast<uint8_t>(internal::StoreOp::check)).u32(kMaxStoreKeys + 1);
  EXPECT_EQ(raw_exchange(port, k.finish("test")), std::make_pair(error, true));
  // A client that disappears mid-message.
  EXPECT_EQ(raw_exchange(port, std::string("\x10\x00\x00\x00\x01", 5), true), std::make_pair(-1, true));
  // The server still serves everyone else.
  auto c = f.client();
  c->set("after", "ok");
  EXPECT_EQ(f.server->get("after"), "ok");
}

// --- the job token ----------------------------------------------------------------

TcpStoreOptions client_options(uint16_t port, std::string token) {
  return {.host = "127.0.0.1", .port = port, .timeout = 5s, .connect_timeout = 2s, .token = std::move(token)};
}

TEST(TcpStoreToken, TheRightTokenWorks) {
  TcpStore server({.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = 5s, .token = "0123abcd"});
  TcpStore c(client_options(server.port(), "0123abcd"));
  c.set("k", "v");
  EXPECT_EQ(server.get("k"), "v");  // the server's own client sends the token too
  EXPECT_EQ(c.add("n", 2), 2);
  EXPECT_TRUE(c.check({"k", "n"}));
}

TEST(TcpStoreToken, WrongOrMissingTokenIsRefusedAndGoodClientsGoOn) {
  TcpStore server({.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = 5s, .token = "right-token"});
  TcpStore good(client_options(server.port(), "right-token"));
  good.set("before", "1");
  ::testing::internal::CaptureStderr();
  // A wrong token: refused at connect, by the hello.
  const std::string wrong =
      error_of([&] { TcpStore c(client_options(server.port(), "wrong-token")); });
  // A longer token with the right one as prefix is wrong too.
  const std::string longer =
      error_of([&] { TcpStore c(client_options(server.port(), "right-token-and-more")); });
  // No token: the connection is made, its first request refused.
  TcpStore none(client_options(server.port(), ""));
  const std::string missing = error_of([&] { none.set("k", "v"); });
  // Raw bytes without a hello: the error answer, then closed.
  internal::FrameWriter w;
  w.u8(static_cast<uint8_t>(internal::StoreOp::check)).u32(0);
  const std::string raw = w.finish("test");
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(server.port());
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  int err = 0;
  const auto deadline = Clock::now() + 2s;
  ASSERT_EQ(internal::send_all(fd, raw, deadline, &err), internal::IoResult::ok);
  std::string body;
  ASSERT_EQ(internal::recv_frame(fd, body, deadline, &err), internal::IoResult::ok);
  EXPECT_EQ(static_cast<uint8_t>(body[0]), static_cast<uint8_t>(internal::StoreStatus::error));
  EXPECT_THAT(body, HasSubstr("refused: wrong or missing job token"));
  char byte;
  EXPECT_EQ(internal::recv_exact(fd, &byte, 1, deadline, &err), internal::IoResult::closed);
  ::close(fd);
  // Every refusal is logged with the peer's address; wait for the server
  // thread's last line.
  std::this_thread::sleep_for(50ms);
  const std::string log = ::testing::internal::GetCapturedStderr();

  for (const std::string& e : {wrong, longer, missing}) {
    EXPECT_THAT(e, HasSubstr("refused the connection: refused: wrong or missing job token"));
    EXPECT_THAT(e, HasSubstr("MESHTRAIN_JOB_TOKEN"));
  }
  EXPECT_THAT(wrong, HasSubstr("same MESHTRAIN_JOB_TOKEN on every node"));
  EXPECT_THAT(missing, HasSubstr("TcpStoreOptions::token"));
  EXPECT_THAT(log, HasSubstr("meshtrain store: refused a connection from 127.0.0.1:"));
  size_t lines = 0;
  for (size_t at = 0; (at = log.find("wrong or missing job token\n", at)) != std::string::npos; ++at) ++lines;
  EXPECT_EQ(lines, 4u);  // one line per refused connection
  // The server still serves the good clients, old and new.
  EXPECT_EQ(good.get("before"), "1");
  TcpStore later(client_options(server.port(), "right-token"));
  later.set("after", "2");
  EXPECT_EQ(good.get("after"), "2");
  EXPECT_FALSE(good.check({"k"}));  // the refused set did nothing
}

// ---- Hostile peers on the store's port (tcp_store_server.h) ----

int raw_connect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The resident memory of this process (the server runs in it), in bytes.
int64_t resident_bytes() {
  const std::string status = testing::read_file("/proc/self/status");
  const size_t at = status.find("VmRSS:");
  return at == std::string::npos ? 0 : std::stoll(status.substr(at + 6)) * 1024;
}

// A first frame announcing 64 MiB is refused before its body is read (the
// server used to buffer it all before it checked the token).
TEST(TcpStoreHostile, ALongFirstFrameIsRefusedUnread) {
  TcpStore server({.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = 5s, .token = "t0ken"});
  ::testing::internal::CaptureStderr();
  const int fd = raw_connect(server.port());
  ASSERT_GE(fd, 0);
  std::string frame(4 + 4096, 'x');
  const uint32_t n = 64u << 20;
  for (int i = 0; i < 4; ++i) frame[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  int err = 0;
  const auto deadline = Clock::now() + 2s;
  ASSERT_EQ(internal::send_all(fd, frame, deadline, &err), internal::IoResult::ok);
  std::string body;
  ASSERT_EQ(internal::recv_frame(fd, body, deadline, &err), internal::IoResult::ok);
  EXPECT_THAT(body, HasSubstr("refused: wrong or missing job token"));
  char byte;
  EXPECT_EQ(internal::recv_exact(fd, &byte, 1, deadline, &err), internal::IoResult::closed);
  ::close(fd);
  std::this_thread::sleep_for(50ms);
  (void)::testing::internal::GetCapturedStderr();
}

// A connect that a signal interrupts (EINTR) still connects: the kernel
// goes on with it and connect_within waits for the outcome. The listener's
// accept queue is full (backlog 0, one connection queued), so the second
// connect waits for its SYN's retransmission (1 s) while SIGUSR1 arrives;
// a slot is freed after the signal.
TEST(ConnectWithin, ASignalDuringTheConnectDoesNotFailIt) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&a), len), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int first = raw_connect(ntohs(a.sin_port));  // fills the queue
  ASSERT_GE(first, 0);

  struct sigaction quiet {}, old{};
  quiet.sa_handler = [](int) {};
  sigemptyset(&quiet.sa_mask);
  quiet.sa_flags = 0;  // no SA_RESTART: the interrupted call returns EINTR
  ASSERT_EQ(::sigaction(SIGUSR1, &quiet, &old), 0);
  const pthread_t me = ::pthread_self();
  std::thread poke([&] {
    std::this_thread::sleep_for(200ms);
    ::pthread_kill(me, SIGUSR1);
    std::this_thread::sleep_for(200ms);
    ::close(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));  // room for the retransmitted SYN
  });
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int err = 0;
  const auto r = internal::connect_within(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a), Clock::now() + 10s, &err);
  poke.join();
  ::sigaction(SIGUSR1, &old, nullptr);
  EXPECT_EQ(r, internal::IoResult::ok) << std::strerror(err);
  ::close(fd);
  ::close(first);

  // Refused and timed-out connects say so.
  const int gone = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ::close(listener);
  EXPECT_EQ(internal::connect_within(gone, reinterpret_cast<sockaddr*>(&a), sizeof(a), Clock::now() + 2s, &err),
            internal::IoResult::error);
  EXPECT_EQ(err, ECONNREFUSED);
  ::close(gone);
}

// 10,000 connections that never authenticate (5,000 idle, 5,000 that send
// half of a long first frame): the server holds at most 1024 of them (the
// oldest are closed for new ones), stays small, and the job's own clients
// connect and work all along; after 10 s the rest are closed, in one log line.
TEST(TcpStoreHostile, TenThousandIdleConnectionsNeverKeepTheJobOut) {
  rlimit rl{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &rl), 0);
  rl.rlim_cur = rl.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_max < 12000) GTEST_SKIP() << "the descriptor limit " << rl.rlim_max << " is below 12000";
  TcpStore server({.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = 5s, .token = "t0ken"});
  TcpStore before(client_options(server.port(), "t0ken"));
  before.set("k", "1");
  ::testing::internal::CaptureStderr();
  const int64_t rss_before = resident_bytes();
  std::vector<int> hostile;
  std::string half(4 + 512, 'y');
  const uint32_t n = 1000;  // a hello-sized frame, never finished
  for (int i = 0; i < 4; ++i) half[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  for (int i = 0; i < 10000; ++i) {
    const int fd = raw_connect(server.port());
    ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
    if (i % 2 == 1) (void)::send(fd, half.data(), half.size(), MSG_NOSIGNAL);
    hostile.push_back(fd);
    if (i % 2500 == 2499) {  // the job goes on meanwhile: a new client, and the old one
      TcpStore during(client_options(server.port(), "t0ken"));
      during.set(fmt::format("during{}", i), "x");
      EXPECT_EQ(before.get(fmt::format("during{}", i)), "x");
    }
  }
  // A "restart": a fresh client after the flood.
  TcpStore after(client_options(server.port(), "t0ken"));
  EXPECT_EQ(after.get("k"), "1");
  const int64_t grown = resident_bytes() - rss_before;
  std::printf("10000 hostile connections: this process grew by %.1f MiB\n", static_cast<double>(grown) / (1 << 20));
  EXPECT_LT(grown, int64_t{64} << 20) << "the process grew by " << grown << " bytes";
  // Past the hello deadline the pending connections still held are closed.
  std::this_thread::sleep_for(10500ms);
  after.set("k2", "2");
  EXPECT_EQ(before.get("k2"), "2");
  for (int fd : hostile) ::close(fd);
  std::this_thread::sleep_for(50ms);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, ::testing::ContainsRegex("closed [0-9]+ connection\\(s\\) \\(the first from 127\\.0\\.0\\.1:[0-9]+\\) "
                                            "that sent no job token within 10 s"));
}

TEST(TcpStoreToken, AServerWithoutTokenAcceptsClientsWithOne) {
  TcpFixture f;  // no token
  TcpStore with(client_options(f.server->port(), "some-token"));
  TcpStore without(client_options(f.server->port(), ""));
  with.set("k", "v");
  EXPECT_EQ(without.get("k"), "v");
}

TEST(TcpStoreToken, TheHelloIsSentOnEveryConnectAndReconnect) {
  uint16_t port;
  {
    TcpFixture probe;
    port = probe.server->port();
  }
  // The client's first connect retries until the server is up, then says hello.
  std::unique_ptr<TcpStore> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(100ms);
    server = std::make_unique<TcpStore>(
        TcpStoreOptions{.host = "127.0.0.1", .port = port, .is_server = true, .token = "t0k3n"});
  });
  TcpStore client({.host = "127.0.0.1", .port = port, .timeout = 5s, .connect_timeout = 5s, .token = "t0k3n"});
  client.set("k", "v");
  starter.join();
  EXPECT_EQ(server->get("k"), "v");
  // The server goes away and a new one takes the port: the call that sees
  // the connection closed fails, the next one reconnects and must say hello
  // again to be served.
  server.reset();
  EXPECT_THROW(client.set("k", "v"), AbortedError);
  server = std::make_unique<TcpStore>(
      TcpStoreOptions{.host = "127.0.0.1", .port = port, .is_server = true, .token = "t0k3n"});
  client.set("k2", "v2");
  EXPECT_EQ(server->get("k2"), "v2");
  EXPECT_THAT(error_of([&] { TcpStore c({.host = "127.0.0.1", .port = port, .token = std::string(1025, 't')}); }),
              HasSubstr("job token of 1025 bytes"));
}

// --- the listening address ----------------------------------------------------------

// A non-loopback IPv4 address of this machine, or "".
std::string other_local_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string out;
  for (ifaddrs* i = list; i && out.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    const auto* a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if ((ntohl(a->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text))) out = text;
  }
  ::freeifaddrs(list);
  return out;
}

// Whether a TCP connect to ip:port succeeds.
bool reachable(const std::string& ip, uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

TEST(TcpStore, ListensOnlyOnItsHost) {
  const std::string other = other_local_ipv4();
  if (other.empty()) GTEST_SKIP() << "this machine has no non-loopback IPv4 address";
  TcpFixture loopback;  // host 127.0.0.1
  EXPECT_TRUE(reachable("127.0.0.1", loopback.server->port()));
  EXPECT_FALSE(reachable(other, loopback.server->port())) << "a server on 127.0.0.1 answered at " << other;
  // The same check answers when the server listens everywhere.
  TcpStore any({.host = "0.0.0.0", .port = 0, .is_server = true, .timeout = 5s});
  EXPECT_TRUE(reachable(other, any.port()));
  TcpStore there({.host = other, .port = 0, .is_server = true, .timeout = 5s});
  EXPECT_TRUE(reachable(other, there.port()));
  EXPECT_FALSE(reachable("127.0.0.1", there.port()));
}

TEST(TcpStore, TwoProcesses) {
  int to_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  // Fork before the server starts its thread: the child is single-threaded.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(to_child[1]);
    uint16_t port = 0;
    int code = 1;
    if (::read(to_child[0], &port, sizeof(port)) == sizeof(port)) {
      try {
        TcpStore c({.host = "127.0.0.1", .port = port, .timeout = 5s, .token = "job-token"});
        c.add("arrived", 1);
        c.set("child/ready", "pid " + std::to_string(::getpid()));
        code = c.get("parent/reply") == "hello child" ? 0 : 2;
      } catch (...) {
        code = 3;
      }
    }
    ::_exit(code);
  }
  ::close(to_child[0]);
  TcpStore server({.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = 5s, .token = "job-token"});
  const uint16_t port = server.port();
  ASSERT_EQ(::write(to_child[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  ::close(to_child[1]);
  server.wait({"child/ready"});
  EXPECT_EQ(server.get("child/ready"), "pid " + std::to_string(pid));
  EXPECT_EQ(server.add("arrived", 1), 2);
  server.set("parent/reply", "hello child");
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace meshtrain::comm
