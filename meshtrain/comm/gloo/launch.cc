// The gloo engine's entry in the engine registry (Gloo's own algorithms
// and the TCP rate as benchmark peers: native.h), and its rendezvous from
// the environment torchrun and `meshtrain launch` set.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/gloo/communicator.h"
#include "meshtrain/comm/gloo/internal/world.h"
#include "meshtrain/comm/gloo/native.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/comm/tcp_store.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo {
namespace {

constexpr const char* kHowToStart =
    "start the job with `meshtrain launch --nproc-per-node N -- ...` (or torchrun), or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT in every process";

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

long env_int(const char* name, long lo, long hi, bool required, long fallback) {
  const std::string v = env(name);
  if (v.empty()) {
    if (required)
      throw InvalidArgument("gloo::Rendezvous::from_env", fmt::format("{} is not set", name), kHowToStart);
    return fallback;
  }
  long x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || x < lo || x > hi)
    throw InvalidArgument("gloo::Rendezvous::from_env",
                          fmt::format("{}='{}' is not an integer in [{}, {}]", name, v, lo, hi), kHowToStart);
  return x;
}

// The local address the route to host:port leaves from (a UDP connect
// sends nothing): the address peers on that network can reach us at.
std::string local_address_toward(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return "";
  std::string out;
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char text[INET_ADDRSTRLEN] = {};
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)))
      out = text;
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

void launch_gloo(const LaunchOptions& options, const SpmdFunction& fn) {
  Rendezvous r = Rendezvous::from_env();
  r.timeout = options.timeout;
  Options go{.check_fingerprints = options.check_fingerprints, .on_error = nullptr};
  if (options.abort_on_error && r.world_size > 1) go.on_error = report_and_exit;
  if (options.ranks != 0 && options.ranks != r.world_size)
    throw InvalidArgument("comm::launch",
                          fmt::format("asked for {} ranks but WORLD_SIZE is {}", options.ranks, r.world_size),
                          "pass the same count to the launcher and --ranks, or --ranks 0");
  auto world = create_world(r, go);
  if (!options.abort_on_error || world->size() == 1) return fn(*world);
  try {
    fn(*world);
  } catch (const std::exception& e) {
    report_and_exit(e, world->rank());
  }
}

}  // namespace

Rendezvous Rendezvous::from_env() {
  Rendezvous r;
  r.rank = static_cast<int>(env_int("RANK", 0, 1 << 20, true, 0));
  r.world_size = static_cast<int>(env_int("WORLD_SIZE", 1, 1 << 20, true, 1));
  if (r.rank >= r.world_size)
    throw InvalidArgument("gloo::Rendezvous::from_env",
                          fmt::format("RANK={} is not below WORLD_SIZE={}", r.rank, r.world_size), kHowToStart);
  r.master_addr = env("MASTER_ADDR");
  if (r.master_addr.empty())
    throw InvalidArgument("gloo::Rendezvous::from_env", "MASTER_ADDR is not set", kHowToStart);
  r.master_port = static_cast<uint16_t>(env_int("MASTER_PORT", 1, 65535, true, 0));
  r.token = env("MESHTRAIN_JOB_TOKEN");
  r.launcher_store = env("MESHTRAIN_AGENT_STORE") == "1";
  r.iface = env("GLOO_SOCKET_IFNAME");
  r.hostname = env("MESHTRAIN_GLOO_HOSTNAME");
  r.restart = static_cast<int>(env_int("MESHTRAIN_RESTART_COUNT", 0, 1 << 20, false, 0));
  return r;
}

std::unique_ptr<Communicator> create_world(const Rendezvous& r, Options options) {
  TcpStoreOptions so;
  so.host = r.master_addr;
  so.port = r.master_port;
  so.timeout = r.timeout;
  so.connect_timeout = r.timeout;
  so.token = r.token;
  // A process may create several worlds in turn (one per comm::launch, as
  // `meshtrain train` runs do): they share one store for the whole process
  // (hosted by rank 0 unless the launcher hosts it; a server that came and
  // went between worlds would strand the peers that connected to the old
  // one) and take the names world1, world2, ... in creation order (per launcher round), which is
  // the same on every process because create_world is collective.
  static std::mutex mu;
  static std::map<std::string, std::pair<std::shared_ptr<TcpStore>, int>>* jobs =
      new std::map<std::string, std::pair<std::shared_ptr<TcpStore>, int>>;  // lives until exit
  std::string name;
  {
    std::lock_guard lock(mu);
    auto& [server, worlds] = (*jobs)[fmt::format("{}:{}", r.master_addr, r.master_port)];
    if (!server && !r.launcher_store && r.rank == 0) {  // torch's env:// rendezvous: rank 0 hosts the store
      TcpStoreOptions s = so;
      s.is_server = true;
      server = std::make_shared<TcpStore>(s);
    }
    if (server) so.port = server->port();
    // After a restart the launcher's store still holds the last round's
    // keys: each round has its own names.
    name = fmt::format("r{}.world{}", r.restart, ++worlds);
  }
  WorldConfig c;
  c.store = [so] { return std::make_unique<TcpStore>(so); };
  c.name = name;
  c.rank = r.rank;
  c.size = r.world_size;
  c.iface = r.iface;
  c.hostname = r.hostname;
  if (c.hostname.empty() && c.iface.empty()) c.hostname = local_address_toward(r.master_addr, r.master_port);
  c.timeout = r.timeout;
  c.options = std::move(options);
  return internal::create_world(std::move(c), nullptr);
}

void register_engine(EngineRegistry& registry) {
  registry.add({.name = "gloo",
                .description = "Gloo over TCP: one process per rank, started by `meshtrain launch` or torchrun, "
                               "any number of machines",
                .ranks_in_process = false,
                .launch = launch_gloo,
                .native_peers = native_peers,
                .bench_variants = nullptr,
                .variant_choices = {}});
}

}  // namespace meshtrain::comm::gloo
