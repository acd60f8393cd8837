// What every communicator of one Gloo world shares: the store, the Gloo TCP
// device, and the agent thread that answers the peers. Internal.
//
// The agent is the engine's out-of-band channel, carried by the store so
// that it works when the data connections do not (a peer stopped, a pair
// broken): each process has a mailbox on the store, the keys
// "<name>/mail/<rank>/<k>" for k = 1, 2, ... (a sender takes k with add()
// on "<name>/mail/<rank>/n"). The agent thread blocks on its next key,
// with its own store connection, and handles what arrives:
//
// - a liveness probe: "where are you on communicator <uid>?". It answers
//   with the channel's ChannelStatus (last collective issued and finished,
//   whether a thread waits, whether it failed) under the reply key the
//   prober named. A process that is stopped, killed or starved does not
//   answer within the prober's grace period: that is how a timeout names a
//   rank that stalled in the middle of a transfer.
// - an abort notice: a peer failed on communicator <uid>; the channel fails
//   at once with AbortedError naming it (or MismatchError, see channel.h)
//   instead of waiting for its own deadline.
// - stop: sent by the World's destructor to its own mailbox.
//
// Thread-safety: every member may be called from any thread.
#pragma once

#include <gloo/transport/device.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "meshtrain/comm/gloo/communicator.h"
#include "meshtrain/comm/internal/probe.h"
#include "meshtrain/comm/store.h"

namespace meshtrain::comm::gloo::internal {

using comm::internal::ChannelStatus;
using comm::internal::PeerStatus;

// What a channel shows the agent.
class Listener {
 public:
  virtual ~Listener() = default;
  virtual ChannelStatus status() const = 0;
  // A peer (world rank `from`) failed on this channel; `notice` as encoded
  // by comm::internal::encode_notice.
  virtual void on_notice(std::string_view notice, int from) = 0;
};

class World {
 public:
  // Connects to the store twice (one connection for the agent), creates the
  // device and starts the agent. `keep_alive` (e.g. the store server) lives
  // as long as the World.
  World(WorldConfig config, std::shared_ptr<void> keep_alive);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return config_.rank; }
  int size() const { return config_.size; }
  const WorldConfig& config() const { return config_; }
  const std::shared_ptr<::gloo::transport::Device>& device() const { return device_; }

  // A new connection to the store (for a rendezvous that blocks).
  std::unique_ptr<Store> connect_store() const { return config_.store(); }

  // The agent answers probes and delivers notices for `uid` to `l` until
  // detach(uid) returns.
  void attach(const std::string& uid, Listener* l);
  void detach(const std::string& uid);

  // Puts a notice for communicator `uid` into world rank `to`'s mailbox.
  // Never throws (a store that is gone loses it).
  void send_notice(int to, const std::string& uid, std::string_view notice) noexcept;

  // Asks each world rank in `peers` about communicator `uid`; waits at most
  // `grace` for the answers (one per entry). Throws the store's error when
  // the store cannot be reached.
  std::vector<PeerStatus> probe(const std::string& uid, const std::vector<int>& peers,
                                std::chrono::milliseconds grace);

 private:
  void post(int to, const std::string& message);
  void agent_loop();
  void handle(const std::string& message);

  WorldConfig config_;
  std::shared_ptr<void> keep_alive_;
  std::shared_ptr<::gloo::transport::Device> device_;

  std::mutex store_mu_;  // one call at a time on store_
  std::unique_ptr<Store> store_;
  std::unique_ptr<Store> agent_store_;  // the agent thread's alone

  std::mutex listeners_mu_;  // held while a listener is called
  std::map<std::string, Listener*, std::less<>> listeners_;

  std::atomic<uint64_t> probes_{0};
  std::atomic<bool> stop_{false};
  std::thread agent_;
};

// create_world(WorldConfig) with something that must live as long as the
// world (the store server when this process hosts it). communicator.cc.
std::unique_ptr<Communicator> create_world(WorldConfig config, std::shared_ptr<void> keep_alive);

}  // namespace meshtrain::comm::gloo::internal
