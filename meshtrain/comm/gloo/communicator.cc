#include "meshtrain/comm/gloo/communicator.h"

#include <fmt/format.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>

#include <algorithm>
#include <csignal>
#include <exception>
#include <thread>
#include <utility>

#include "meshtrain/comm/gloo/internal/channel.h"
#include "meshtrain/comm/internal/channel_work.h"
#include "meshtrain/comm/internal/fingerprint.h"
#include "meshtrain/comm/gloo/internal/world.h"
#include "meshtrain/core/error.h"

// The operations' life cycle and the failure protocol: internal/channel.h.

namespace meshtrain::comm::gloo {

using internal::Channel;
using internal::Task;
using internal::World;

namespace {

// Gloo's rendezvous store interface over one of ours (one connection).
class GlooStore final : public ::gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::unique_ptr<comm::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::string_view(data.data(), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string v = store_->get(key);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::unique_ptr<comm::Store> store_;
};

}  // namespace

namespace internal {

std::shared_ptr<::gloo::Context> connect(World& world, const std::string& uid, int rank, int size,
                                         std::chrono::milliseconds timeout) {
  GlooStore store(world.connect_store());
  ::gloo::rendezvous::PrefixStore prefixed(fmt::format("{}/ctx/{}", world.config().name, uid), store);
  auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  auto device = world.device();
  try {
    context->connectFullMesh(prefixed, device);
  } catch (const Error&) {
    throw;  // the store's own errors (a timeout naming the keys) say enough
  } catch (const std::exception& e) {
    throw EngineError("gloo::connect",
                      fmt::format("rank {} of {} could not connect to its peers: {}", rank, size, e.what()),
                      "check that every process runs and that the addresses Gloo listens on are reachable "
                      "(GLOO_SOCKET_IFNAME, MESHTRAIN_GLOO_HOSTNAME)");
  }
  return context;
}

Directions connect_directions(World& world, const std::string& uid, int rank, int size,
                              std::chrono::milliseconds timeout) {
  Directions d;
  d.up = connect(world, uid + ".up", rank, size, timeout);
  d.down = connect(world, uid + ".down", rank, size, timeout);
  return d;
}

}  // namespace internal

namespace {

using internal::connect_directions;

using GlooWork = comm::internal::ChannelWork<Channel, Task>;

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<Channel> channel) : channel_(std::move(channel)) {}
  // The goodbye (internal/channel.h), unless an exception is unwinding the
  // stack: this rank failed, and its error, not a peer's echo, must end it.
  ~GlooCommunicator() override {
    if (std::uncaught_exceptions() == 0) channel_->goodbye(timeout());
  }
  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;
  const std::shared_ptr<Channel>& channel() const { return channel_; }

  int rank() const override { return channel_->rank(); }
  int size() const override { return channel_->size(); }
  Capabilities capabilities() const override {
    Capabilities c;
    c.engine = Engine::gloo;
    c.async = true;
    c.send_recv = true;
    c.split = true;
    c.checks_fingerprints = channel_->options().check_fingerprints;
    c.names_missing_ranks = true;  // the agents' probes
    c.device_memory = false;
    c.wait_from_any_thread = true;
    return c;
  }

 protected:
  Work start(const Op& op, Completion completion) override {
    return Work(std::make_unique<GlooWork>(channel_, channel_->start(op, timeout(), completion == Completion::blocking),
                                           timeout()));
  }

  std::unique_ptr<Communicator> do_split(int color, int key, uint64_t seq) override {
    Op op{.kind = CollectiveOp::split, .seq = seq};
    auto task = channel_->start_split(op, color, key);
    channel_->wait(*task, timeout());
    if (color < 0) return nullptr;
    std::vector<std::pair<int, int>> members;  // (key, old rank) of this color
    for (int p = 0; p < size(); ++p)
      if (task->split_table[2 * static_cast<size_t>(p)] == color)
        members.emplace_back(task->split_table[2 * static_cast<size_t>(p) + 1], p);
    std::sort(members.begin(), members.end());
    std::vector<int> world_ranks;
    int new_rank = -1;
    for (const auto& [k, p] : members) {
      if (p == rank()) new_rank = static_cast<int>(world_ranks.size());
      world_ranks.push_back(channel_->world_ranks()[static_cast<size_t>(p)]);
    }
    const std::string uid = fmt::format("{}.{}.{}", channel_->uid(), seq, color);
    const int n = static_cast<int>(world_ranks.size());
    auto contexts = connect_directions(*channel_->world(), uid, new_rank, n, timeout());
    auto sub = std::make_unique<GlooCommunicator>(
        std::make_shared<Channel>(channel_->world(), std::move(contexts), uid, std::move(world_ranks), new_rank));
    sub->set_timeout(timeout());
    return sub;
  }

 private:
  std::shared_ptr<Channel> channel_;
};

}  // namespace

namespace internal {

namespace {

// Gloo writes to its sockets with writev, which has no MSG_NOSIGNAL: a write
// to a peer that just died raises SIGPIPE, whose default action ends this
// process before the engine can name the peer. Ignored (as Python, and so
// every PyTorch job, does at start-up) unless the program set a handler.
void ignore_sigpipe() {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

}  // namespace

std::unique_ptr<Communicator> create_world(WorldConfig config, std::shared_ptr<void> keep_alive) {
  if (config.size < 1 || config.rank < 0 || config.rank >= config.size)
    throw InvalidArgument("gloo::create_world", fmt::format("rank {} of {} ranks", config.rank, config.size),
                          "pass 0 <= rank < size");
  if (!config.store) throw InvalidArgument("gloo::create_world", "no store", "pass a StoreFactory");
  ignore_sigpipe();
  auto world = std::make_shared<World>(std::move(config), std::move(keep_alive));
  const WorldConfig& c = world->config();
  auto contexts = connect_directions(*world, "w", c.rank, c.size, c.timeout);
  std::vector<int> ranks(static_cast<size_t>(c.size));
  for (int p = 0; p < c.size; ++p) ranks[static_cast<size_t>(p)] = p;
  auto comm = std::make_unique<GlooCommunicator>(
      std::make_shared<Channel>(world, std::move(contexts), "w", std::move(ranks), c.rank));
  comm->set_timeout(c.timeout);
  return comm;
}

Channel* channel_of(Communicator& comm) {
  auto* g = dynamic_cast<GlooCommunicator*>(&comm);
  return g ? g->channel().get() : nullptr;
}

}  // namespace internal

std::unique_ptr<Communicator> create_world(WorldConfig config) { return internal::create_world(std::move(config), nullptr); }

void report_and_exit(const std::exception& error, int world_rank) {
  comm::internal::report_rank_error(error, world_rank);
  std::_Exit(1);
}

}  // namespace meshtrain::comm::gloo
