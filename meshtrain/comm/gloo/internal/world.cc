#include "meshtrain/comm/gloo/internal/world.h"

#include <fmt/format.h>
#include <gloo/transport/tcp/device.h>

#include <charconv>
#include <exception>
#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo::internal {
namespace {

// How long the agent blocks on its mailbox before looking at stop_.
constexpr std::chrono::milliseconds kAgentPoll{1000};

std::string mailbox_key(const std::string& name, int rank, int64_t k) {
  return fmt::format("{}/mail/{}/{}", name, rank, k);
}
std::string mailbox_counter(const std::string& name, int rank) { return fmt::format("{}/mail/{}/n", name, rank); }

// Messages: a kind byte, then fields separated by '\n' (the last field may
// hold any bytes).
//   'P' reply_key \n uid       a probe
//   'N' uid \n from \n notice  an abort notice
//   'S'                        stop
// Answers to a probe: "U" (no such communicator) or "A issued finished
// last_op waiting aborted".
std::vector<std::string_view> fields(std::string_view body, size_t n) {
  std::vector<std::string_view> out;
  while (out.size() + 1 < n) {
    const size_t nl = body.find('\n');
    if (nl == std::string_view::npos) break;
    out.push_back(body.substr(0, nl));
    body.remove_prefix(nl + 1);
  }
  out.push_back(body);
  return out;
}

std::string encode_status(const ChannelStatus& s) {
  return fmt::format("A {} {} {} {} {}", s.issued, s.finished, int{s.last_op}, int{s.waiting}, int{s.aborted});
}

PeerStatus decode_status(const std::string& answer) {
  PeerStatus p;
  if (answer == "U") {
    p.state = PeerStatus::State::unknown_channel;
    return p;
  }
  unsigned op = 0, waiting = 0, aborted = 0;
  unsigned long long issued = 0, finished = 0;
  if (std::sscanf(answer.c_str(), "A %llu %llu %u %u %u", &issued, &finished, &op, &waiting, &aborted) != 5)
    return p;  // garbled: as if it did not answer
  p.state = PeerStatus::State::answered;
  p.issued = issued;
  p.finished = finished;
  p.last_op = static_cast<uint8_t>(op);
  p.waiting = waiting != 0;
  p.aborted = aborted != 0;
  return p;
}

}  // namespace

World::World(WorldConfig config, std::shared_ptr<void> keep_alive)
    : config_(std::move(config)), keep_alive_(std::move(keep_alive)) {
  ::gloo::transport::tcp::attr attr;
  if (!config_.hostname.empty())
    attr.hostname = config_.hostname;
  else
    attr.iface = config_.iface;
  try {
    device_ = ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw InvalidArgument("gloo::create_world",
                          fmt::format("cannot listen for Gloo connections on {} '{}': {}",
                                      config_.hostname.empty() ? "interface" : "address",
                                      config_.hostname.empty() ? config_.iface : config_.hostname, e.what()),
                          "set GLOO_SOCKET_IFNAME to an interface of this machine (ip -brief addr) or "
                          "MESHTRAIN_GLOO_HOSTNAME to one of its addresses");
  }
  store_ = config_.store();
  agent_store_ = config_.store();
  agent_ = std::thread([this] { agent_loop(); });
}

World::~World() {
  stop_ = true;
  try {
    post(config_.rank, "S");
  } catch (...) {  // the agent sees stop_ within kAgentPoll
  }
  agent_.join();
}

void World::attach(const std::string& uid, Listener* l) {
  std::lock_guard lock(listeners_mu_);
  listeners_[uid] = l;
}

void World::detach(const std::string& uid) {
  std::lock_guard lock(listeners_mu_);
  listeners_.erase(uid);
}

void World::post(int to, const std::string& message) {
  std::lock_guard lock(store_mu_);
  const int64_t k = store_->add(mailbox_counter(config_.name, to), 1);
  store_->set(mailbox_key(config_.name, to, k), message);
}

void World::send_notice(int to, const std::string& uid, std::string_view notice) noexcept {
  try {
    post(to, fmt::format("N{}\n{}\n", uid, config_.rank) + std::string(notice));
  } catch (...) {
  }
}

std::vector<PeerStatus> World::probe(const std::string& uid, const std::vector<int>& peers,
                                     std::chrono::milliseconds grace) {
  const uint64_t id = ++probes_;
  std::vector<std::string> keys;
  for (int p : peers) {
    keys.push_back(fmt::format("{}/probe/{}/{}/{}", config_.name, config_.rank, id, p));
    post(p, fmt::format("P{}\n{}", keys.back(), uid));
  }
  std::lock_guard lock(store_mu_);
  try {
    store_->wait(keys, grace);
  } catch (const TimeoutError&) {  // some did not answer: read those that did
  }
  std::vector<PeerStatus> out(peers.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!store_->check({keys[i]})) continue;
    out[i] = decode_status(store_->get(keys[i]));
    store_->delete_key(keys[i]);
  }
  return out;
}

void World::agent_loop() {
  for (int64_t k = 1; !stop_;) {
    const std::string key = mailbox_key(config_.name, config_.rank, k);
    std::string message;
    try {
      agent_store_->wait({key}, kAgentPoll);
      message = agent_store_->get(key);
      agent_store_->delete_key(key);
    } catch (const TimeoutError&) {
      continue;
    } catch (const std::exception&) {
      return;  // the store is gone (its host ended): nobody can reach this mailbox
    }
    ++k;
    if (message == "S") continue;  // stop_ is set
    try {
      handle(message);
    } catch (const std::exception&) {  // a reply the store refused: the prober reads no answer
    }
  }
}

void World::handle(const std::string& message) {
  if (message.empty()) return;
  const std::string_view body = std::string_view(message).substr(1);
  if (message[0] == 'P') {
    const auto f = fields(body, 2);
    if (f.size() != 2) return;
    std::string answer = "U";
    {
      std::lock_guard lock(listeners_mu_);
      if (auto it = listeners_.find(f[1]); it != listeners_.end()) answer = encode_status(it->second->status());
    }
    agent_store_->set(f[0], answer);
  } else if (message[0] == 'N') {
    const auto f = fields(body, 3);
    if (f.size() != 3) return;
    int from = -1;
    std::from_chars(f[1].data(), f[1].data() + f[1].size(), from);
    std::lock_guard lock(listeners_mu_);
    if (auto it = listeners_.find(f[0]); it != listeners_.end()) it->second->on_notice(f[2], from);
  }
}

}  // namespace meshtrain::comm::gloo::internal
