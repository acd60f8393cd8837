#include "meshtrain/comm/gloo/internal/channel.h"

#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gloo/transport/tcp/device.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "meshtrain/comm/internal/fingerprint.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::gloo::internal {
namespace {

// Gloo waits are interrupted by fail(), never by Gloo's own timeout (which
// would close every pair of the context): the deadline is the caller's.
constexpr std::chrono::milliseconds kNoGlooTimeout = std::chrono::hours(24 * 365);

std::string describe(const Op& op) {
  if (op.kind == CollectiveOp::send || op.kind == CollectiveOp::recv)
    return fmt::format("{} (tag {}, {} x {}) with rank {}", collective_op_name(op.kind), op.tag,
                       dtype_name(op.dtype), op.count, op.peer);
  return op.fingerprint().to_string();
}

}  // namespace

// --- Transfers --------------------------------------------------------------

Transfers::~Transfers() {
  bool unfinished = false;
  for (Pending& p : pending_) {
    if (p.waited || p.eager_bytes > 0) continue;  // an eager message lands in the channel's slots
    unfinished = true;
    channel_.orphan(std::move(p.buf));
  }
  for (Scratch& m : scratch_) {
    if (unfinished) channel_.orphan(std::move(m.memory));
    else channel_.give_back(std::move(m));
  }
}

std::byte* Transfers::scratch(size_t bytes) {
  scratch_.push_back(channel_.take_scratch(bytes));
  return scratch_.back().memory.get();
}

size_t Transfers::send(int peer, const void* data, size_t bytes) {
  if (bytes > 0 && bytes <= Eager::kMessageBytes) {  // in slots of at most kMaxBytes, in order
    for (size_t at = 0; at < bytes; at += Eager::kMaxBytes)
      channel_.eager_send(peer, op_, phase_, static_cast<const std::byte*>(data) + at,
                          std::min(Eager::kMaxBytes, bytes - at));
    pending_.push_back(
        {.buf = nullptr, .peer = peer, .is_send = true, .waited = true, .eager_into = nullptr, .eager_bytes = bytes});
    return pending_.size() - 1;
  }
  auto buf = channel_.buffer(const_cast<void*>(data), bytes, /*is_send=*/true, peer);
  channel_.post(*buf, /*is_send=*/true, peer, slot_);  // moves once the peer posted the recv
  pending_.push_back(
      {.buf = std::move(buf), .peer = peer, .is_send = true, .waited = false, .eager_into = nullptr, .eager_bytes = 0});
  return pending_.size() - 1;
}

size_t Transfers::recv(int peer, void* data, size_t bytes) {
  if (bytes > 0 && bytes <= Eager::kMessageBytes) {
    pending_.push_back(
        {.buf = nullptr, .peer = peer, .is_send = false, .waited = false, .eager_into = data, .eager_bytes = bytes});
    return pending_.size() - 1;
  }
  auto buf = channel_.buffer(data, bytes, /*is_send=*/false, peer);
  channel_.post(*buf, /*is_send=*/false, peer, slot_);
  pending_.push_back(
      {.buf = std::move(buf), .peer = peer, .is_send = false, .waited = false, .eager_into = nullptr, .eager_bytes = 0});
  return pending_.size() - 1;
}

void Transfers::wait(size_t i) {
  Pending& p = pending_[i];
  if (p.waited) return;
  if (p.eager_bytes > 0) {  // the peer's eager messages arrive in order: read the earlier ones first
    for (size_t j = 0; j <= i; ++j) {
      Pending& q = pending_[j];
      if (q.waited || q.eager_bytes == 0 || q.is_send || q.peer != p.peer) continue;
      for (size_t at = 0; at < q.eager_bytes; at += Eager::kMaxBytes)
        channel_.eager_recv(q.peer, op_, phase_, static_cast<std::byte*>(q.eager_into) + at,
                            std::min(Eager::kMaxBytes, q.eager_bytes - at));
      q.waited = true;
    }
    return;
  }
  channel_.await(*p.buf, p.is_send, p.peer, op_);
  p.waited = true;
  p.buf.reset();
}

void Transfers::wait_all() {
  for (size_t i = 0; i < pending_.size(); ++i) wait(i);
}

// --- LoopPoster ---------------------------------------------------------------

// Posting an unbound receive writes Gloo's "recv ready" notice to the
// sender while holding the pair's lock, and the sender's reply, the data,
// comes back on that same connection. On loopback the notice's write wakes
// the sender's event loop, which may preempt the posting thread as its
// write returns, lock still held; this rank's event loop, woken by the
// data, then finds the lock taken and busy-spins (pytorch/gloo#246) until
// the poster runs again, a scheduler slice later (measured with uprobes on
// 4 ranks, 1 MiB all_reduce: 90% of the loop's skipped events came while a
// receive was being posted on the same pair, the rest while a send was).
// So the channel posts its unbound transfers from Gloo's event-loop thread
// itself, through an eventfd registered on the loop: that thread is the
// only one reading the pair, so it never spins on its own lock.
class Channel::LoopPoster final : public ::gloo::transport::tcp::Handler {
 public:
  explicit LoopPoster(std::shared_ptr<::gloo::transport::Device> device)
      : device_(std::dynamic_pointer_cast<::gloo::transport::tcp::Device>(device)),
        fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (!device_) throw EngineError("gloo::Communicator", "the Gloo device is not a TCP device", "");
    if (fd_ < 0) throw EngineError("gloo::Communicator", "eventfd failed", "raise the open-file limit (ulimit -n)");
    device_->registerDescriptor(fd_, EPOLLIN, this);
  }
  ~LoopPoster() override {
    device_->unregisterDescriptor(fd_, this);  // waits for the loop's tick: handleEvents has returned
    ::close(fd_);
  }
  LoopPoster(const LoopPoster&) = delete;
  LoopPoster& operator=(const LoopPoster&) = delete;

  // Queues a transfer; the loop thread posts them in this order (Gloo
  // matches the transfers of a peer and slot in posting order).
  void post(::gloo::transport::UnboundBuffer* buf, bool is_send, int peer, uint64_t slot) {
    bool wake;
    {
      std::lock_guard lock(mu_);
      wake = queue_.empty();
      queue_.push_back({buf, is_send, peer, slot});
    }
    if (!wake) return;  // the loop is already due to drain the queue
    const uint64_t one = 1;
    while (::write(fd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
  }
  // The I/O error that kept `buf` from being posted, if one did (taken).
  std::optional<std::string> take_error(::gloo::transport::UnboundBuffer* buf) {
    std::lock_guard lock(mu_);
    auto it = errors_.find(buf);
    if (it == errors_.end()) return std::nullopt;
    std::string why = std::move(it->second);
    errors_.erase(it);
    return why;
  }

  void handleEvents(int /*events*/) override {
    uint64_t count;
    while (::read(fd_, &count, sizeof count) < 0 && errno == EINTR) {
    }
    std::vector<Item> items;
    {
      std::lock_guard lock(mu_);
      items.swap(queue_);
    }
    for (const Item& i : items) {
      try {
        if (i.is_send) i.buf->send(i.peer, i.slot);
        else i.buf->recv(i.peer, i.slot);
      } catch (const std::exception& e) {  // gloo::IoException: the pair is closed
        {
          std::lock_guard lock(mu_);
          errors_[i.buf] = e.what();
        }
        if (i.is_send) i.buf->abortWaitSend();  // its waiter reads the error
        else i.buf->abortWaitRecv();
      }
    }
  }

 private:
  struct Item {
    ::gloo::transport::UnboundBuffer* buf;
    bool is_send;
    int peer;
    uint64_t slot;
  };
  std::shared_ptr<::gloo::transport::tcp::Device> device_;
  const int fd_;
  std::mutex mu_;
  std::vector<Item> queue_;
  std::map<::gloo::transport::UnboundBuffer*, std::string> errors_;
};

// --- Channel ----------------------------------------------------------------

Channel::Channel(std::shared_ptr<World> world, Directions contexts, std::string uid, std::vector<int> world_ranks,
                 int rank)
    : world_(std::move(world)),
      contexts_(std::move(contexts)),
      uid_(std::move(uid)),
      world_ranks_(std::move(world_ranks)),
      rank_(rank),
      size_(static_cast<int>(world_ranks_.size())) {
  poster_ = std::make_unique<LoopPoster>(world_->device());
  eager_connect();
  world_->attach(uid_, this);
  worker_ = std::thread([this] { worker_loop(); });
  if (size_ > 1) watchdog_ = std::thread([this] { watchdog_loop(); });
}

Channel::~Channel() {
  world_->detach(uid_);
  bool busy;
  {
    std::lock_guard lock(mu_);
    busy = in_flight();
  }
  if (busy)
    fail(std::make_exception_ptr(AbortedError("gloo::~Communicator",
                                              fmt::format("rank {} destroyed the communicator with operations "
                                                          "in flight",
                                                          rank_),
                                              "wait for every operation before destroying the communicator",
                                              {rank_})),
         /*tell_peers=*/true);
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_cv_.notify_all();
  waiter_cv_.notify_all();
  watchdog_cv_.notify_all();
  worker_.join();
  if (watchdog_.joinable()) watchdog_.join();
  for (std::thread& t : waiters_) t.join();
  poster_.reset();  // nothing is posted from here on
  eager_close();
  contexts_ = {};  // closes the pairs: Gloo lets go of every buffer
  orphans_.clear();
  orphan_memory_.clear();
}

std::unique_ptr<::gloo::transport::UnboundBuffer> Channel::buffer(void* data, size_t bytes, bool is_send, int peer) {
  ::gloo::Context& c = is_send ? contexts_.at(rank_, peer) : contexts_.at(peer, rank_);
  return c.createUnboundBuffer(data, bytes);
}

void Channel::orphan(std::unique_ptr<::gloo::transport::UnboundBuffer> buf) {
  if (!buf) return;
  std::lock_guard lock(mu_);
  orphans_.push_back(std::move(buf));
}

void Channel::orphan(std::unique_ptr<std::byte[]> memory) {
  std::lock_guard lock(mu_);
  orphan_memory_.push_back(std::move(memory));
}

Scratch Channel::take_scratch(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  {
    std::lock_guard lock(mu_);
    // The smallest spare that fits.
    auto best = spares_.end();
    for (auto it = spares_.begin(); it != spares_.end(); ++it)
      if (it->bytes >= bytes && (best == spares_.end() || it->bytes < best->bytes)) best = it;
    if (best != spares_.end()) {
      Scratch s = std::move(*best);
      spares_.erase(best);
      return s;
    }
  }
  return {.memory = std::make_unique_for_overwrite<std::byte[]>(bytes), .bytes = bytes};
}

void Channel::give_back(Scratch s) {
  std::lock_guard lock(mu_);
  size_t kept = s.bytes;
  for (const Scratch& t : spares_) kept += t.bytes;
  // Over the cap: drop the smallest spares first (the big ones are the
  // expensive ones to fault in again), the new one if it alone is too big.
  std::sort(spares_.begin(), spares_.end(), [](const Scratch& a, const Scratch& b) { return a.bytes > b.bytes; });
  while (kept > kSpareBytes && !spares_.empty() && spares_.back().bytes < s.bytes) {
    kept -= spares_.back().bytes;
    spares_.pop_back();
  }
  if (kept <= kSpareBytes) spares_.push_back(std::move(s));
}

std::shared_ptr<Task> Channel::start(const Op& op, std::chrono::milliseconds timeout, bool blocking) {
  auto t = std::make_shared<Task>();
  t->op = op;
  return submit(std::move(t), timeout, blocking);
}

std::shared_ptr<Task> Channel::start_split(const Op& op, int color, int key) {
  auto t = std::make_shared<Task>();
  t->op = op;
  t->split_table = {color, key};
  return submit(std::move(t));
}

std::shared_ptr<Task> Channel::submit(std::shared_ptr<Task> t, std::chrono::milliseconds timeout, bool blocking) {
  const Op& op = t->op;
  const bool p2p = op.kind == CollectiveOp::send || op.kind == CollectiveOp::recv;
  if (p2p && op.count > 0 && op.peer != rank_) {
    // Made outside mu_ (Gloo takes its context's lock); posted below by
    // Gloo's loop thread, and a failed post fails its waiter.
    const bool is_send = op.kind == CollectiveOp::send;
    t->p2p = buffer(is_send ? const_cast<void*>(op.send) : op.recv, op.bytes(), is_send, op.peer);
  }
  std::unique_lock lock(mu_);
  if (error_)
    throw AbortedError(op_name(op.kind), "the communicator was aborted earlier: " + abort_reason_,
                       "create a new communicator (or restart the job); see the first error for the cause");
  if (!p2p) {
    issued_ = op.seq;
    last_op_ = static_cast<uint8_t>(op.kind);
    if (blocking && queue_.empty() && !running_) {
      running_ = inline_ = t;
      inline_timeout_ = timeout;
      inline_deadline_ = Clock::now() + timeout;
      recent_timeout_ = timeout;
      ++waiting_;  // what a peer's probe hears: this rank is inside the call
      // The worker wakes by itself before this deadline when it planned to
      // (a run of calls with the same timeout costs it no wake-up per call).
      if (inline_deadline_ < worker_wake_) worker_cv_.notify_one();
      lock.unlock();
      run_inline(t);
      return t;
    }
    queue_.push_back(t);
    worker_cv_.notify_one();
    return t;
  }
  if (op.count == 0) {
    t->done = true;
    return t;
  }
  if (op.peer == rank_) {  // to self: matched here, in order per tag
    const bool is_send = op.kind == CollectiveOp::send;
    auto& mine = (is_send ? self_sends_ : self_recvs_)[op.tag];
    auto& theirs = (is_send ? self_recvs_ : self_sends_)[op.tag];
    if (theirs.empty()) {
      mine.push_back(t);
      return t;
    }
    std::shared_ptr<Task> other = theirs.front();
    theirs.pop_front();
    const Task& s = is_send ? *t : *other;
    Task& r = is_send ? *other : *t;
    if (s.op.bytes() != r.op.bytes()) {
      auto e = std::make_exception_ptr(InvalidArgument(
          op_name(op.kind), fmt::format("a send to self of {} bytes met a recv of {} bytes (tag {})", s.op.bytes(),
                                        r.op.bytes(), op.tag),
          "post matching counts and dtypes"));
      t->error = other->error = e;
    } else {
      std::memcpy(r.op.recv, s.op.send, s.op.bytes());
    }
    t->done = other->done = true;
    cv_.notify_all();
    return t;
  }
  post(*t->p2p, op.kind == CollectiveOp::send, op.peer, p2p_slot(op.tag));
  p2p_.push_back(t);
  p2p_live_.push_back(t);
  if (static_cast<int>(p2p_.size()) > idle_waiters_) waiters_.emplace_back([this] { waiter_loop(); });
  waiter_cv_.notify_one();
  return t;
}

std::exception_ptr Channel::execute(Task& t) {
  try {
    run_collective(t);
    return nullptr;
  } catch (...) {
    std::exception_ptr error = std::current_exception();
    fail(error, /*tell_peers=*/true);
    return error;
  }
}

void Channel::run_inline(const std::shared_ptr<Task>& t) {
  const std::exception_ptr error = execute(*t);
  {
    std::lock_guard lock(mu_);
    running_.reset();
    inline_.reset();
    --waiting_;
    if (error_) worker_cv_.notify_one();  // a worker that timed the call out waits for its end
  }
  finish(*t, error);
}

void Channel::wait(Task& t, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  ++waiting_;
  const bool done = cv_.wait_until(lock, Clock::now() + timeout, [&] { return t.done; });
  --waiting_;
  if (!done) {
    lock.unlock();
    fail(timeout_error(t, timeout), /*tell_peers=*/true);
    lock.lock();
    cv_.wait(lock, [&] { return t.done; });  // fail() interrupted every Gloo wait
  }
  if (t.error) std::rethrow_exception(t.error);
}

bool Channel::test(Task& t) {
  std::lock_guard lock(mu_);
  return t.done;
}

void Channel::finish(Task& t, std::exception_ptr error) {
  std::lock_guard lock(mu_);
  t.done = true;
  t.error = error ? (error_ ? error_ : error) : nullptr;
  if (t.op.kind != CollectiveOp::send && t.op.kind != CollectiveOp::recv) finished_ = t.op.seq;
  std::erase_if(p2p_live_, [&](const std::shared_ptr<Task>& p) { return p.get() == &t; });
  cv_.notify_all();
}

void Channel::fail(std::exception_ptr error, bool tell_peers) {
  comm::internal::FingerprintTable mismatch;
  {
    std::lock_guard lock(mu_);
    if (error_) return;
    error_ = error;
    abort_reason_ = comm::internal::reason_of(error);
    mismatch = mismatch_table_;
    for (auto* b : inflight_) {
      b->abortWaitRecv();
      b->abortWaitSend();
    }
    complete_bound_waits();  // Gloo's bound waits have no abort
    auto fail_all = [&](std::deque<std::shared_ptr<Task>>& q) {
      for (auto& t : q) {
        t->done = true;
        t->error = error;
        if (t->p2p) orphans_.push_back(std::move(t->p2p));
      }
      q.clear();
    };
    fail_all(queue_);
    fail_all(p2p_);
    for (auto* self : {&self_sends_, &self_recvs_})
      for (auto& [tag, q] : *self) fail_all(q);
    p2p_live_.clear();
    cv_.notify_all();
    worker_cv_.notify_all();
  }
  if (tell_peers) {
    comm::internal::Notice notice;
    notice.mismatch = std::move(mismatch);
    notice.reason = abort_reason_;
    const std::string bytes = comm::internal::encode_notice(notice);
    for (int p = 0; p < size_; ++p)
      if (p != rank_) world_->send_notice(world_ranks_[static_cast<size_t>(p)], uid_, bytes);
  }
  if (const auto& on_error = options().on_error) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      on_error(e, world_->rank());
    } catch (...) {
    }
  }
}

ChannelStatus Channel::status() const {
  std::lock_guard lock(mu_);
  return {.issued = issued_, .finished = finished_, .last_op = last_op_, .waiting = waiting_ > 0,
          .aborted = error_ != nullptr};
}

void Channel::on_notice(std::string_view bytes, int from) {
  const comm::internal::Notice notice = comm::internal::decode_notice(bytes);
  const auto it = std::find(world_ranks_.begin(), world_ranks_.end(), from);
  const int peer = it == world_ranks_.end() ? from : static_cast<int>(it - world_ranks_.begin());
  std::exception_ptr e;
  const auto& table = notice.mismatch;
  if (static_cast<int>(table.size()) == size_ && table[static_cast<size_t>(rank_)])
    e = std::make_exception_ptr(
        comm::internal::mismatch_error(op_name(table[static_cast<size_t>(rank_)]->op), table, rank_));
  else
    e = std::make_exception_ptr(AbortedError("gloo::communicator",
                                             fmt::format("rank {} failed: {}", peer, notice.reason),
                                             fmt::format("see rank {}'s error for the cause", peer), {peer}));
  fail(e, /*tell_peers=*/false);
}

EngineError Channel::connection_error(int peer, const Op& op, const std::string& what) {
  return EngineError(op_name(op.kind),
                     fmt::format("the connection to rank {} failed during {}: {}", peer, describe(op), what),
                     fmt::format("rank {} exited, was killed or lost its network: see its log", peer), {peer});
}

void Channel::post(::gloo::transport::UnboundBuffer& buf, bool is_send, int peer, uint64_t slot) {
  poster_->post(&buf, is_send, peer, slot);
}

void Channel::await(::gloo::transport::UnboundBuffer& buf, bool is_send, int peer, const Op& op) {
  {
    std::lock_guard lock(mu_);
    if (error_) std::rethrow_exception(error_);
    inflight_.insert(&buf);
  }
  bool ok = false;
  std::string io_error;
  try {
    ok = is_send ? buf.waitSend(nullptr, kNoGlooTimeout) : buf.waitRecv(nullptr, kNoGlooTimeout);
  } catch (const std::exception& e) {  // gloo::IoException: the pair broke
    io_error = e.what();
  }
  std::lock_guard lock(mu_);
  inflight_.erase(&buf);
  if (!io_error.empty()) {
    if (error_) std::rethrow_exception(error_);  // a failure closed it: the cause is already known
    throw connection_error(peer, op, io_error);
  }
  if (!ok && !error_)
    if (auto why = poster_->take_error(&buf)) throw connection_error(peer, op, *why);  // never posted
  if (!ok) std::rethrow_exception(error_);  // interrupted by fail()
}

void Channel::worker_loop() {
  for (;;) {
    std::shared_ptr<Task> t;
    {
      std::unique_lock lock(mu_);
      // Idle, the worker watches the deadline of a collective the caller
      // runs (inline_) by waking at it; while calls keep coming it wakes once
      // per timeout to look, and a call notifies it only when its deadline
      // comes before the planned wake-up.
      if (queue_.empty() && !stop_) {
        const Clock::time_point now = Clock::now();
        if (inline_ && inline_deadline_ <= now) {
          const std::shared_ptr<Task> watched = inline_;
          const std::chrono::milliseconds timeout = inline_timeout_;
          lock.unlock();
          fail(timeout_error(*watched, timeout), /*tell_peers=*/true);
          lock.lock();
          worker_cv_.wait(lock, [&] { return inline_ != watched; });  // the caller saw the failure
          continue;
        }
        if (inline_) worker_wake_ = inline_deadline_;
        else if (recent_timeout_ > std::chrono::milliseconds::zero()) worker_wake_ = now + recent_timeout_;
        else worker_wake_ = Clock::time_point::max();
        recent_timeout_ = std::chrono::milliseconds::zero();  // set again by the next inline call
        worker_cv_.wait_until(lock, worker_wake_, [&] {
          return stop_ || !queue_.empty() || (inline_ && inline_deadline_ < worker_wake_);
        });
        worker_wake_ = Clock::time_point::min();  // awake: no call needs to notify
        continue;
      }
      if (queue_.empty()) return;
      t = queue_.front();
      queue_.pop_front();
      running_ = t;
    }
    const std::exception_ptr error = execute(*t);
    {
      std::lock_guard lock(mu_);
      running_.reset();
    }
    finish(*t, error);
  }
}

void Channel::waiter_loop() {
  for (;;) {
    std::shared_ptr<Task> t;
    {
      std::unique_lock lock(mu_);
      ++idle_waiters_;
      waiter_cv_.wait(lock, [&] { return stop_ || !p2p_.empty(); });
      --idle_waiters_;
      if (p2p_.empty()) return;
      t = p2p_.front();
      p2p_.pop_front();
    }
    std::exception_ptr error;
    try {
      await(*t->p2p, t->op.kind == CollectiveOp::send, t->op.peer, t->op);
      t->p2p.reset();
    } catch (...) {
      error = std::current_exception();
      fail(error, /*tell_peers=*/true);
      orphan(std::move(t->p2p));
    }
    finish(*t, error);
  }
}

}  // namespace meshtrain::comm::gloo::internal
