// The threads engine's Work states: an async collective queued on the
// rank's worker thread (QueuedWork), and a posted send or recv waiting in a
// mailbox for its match (P2PWork). Internal to comm/threads.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

#include "meshtrain/comm/threads/internal/group.h"
#include "meshtrain/comm/work.h"

namespace meshtrain::comm::threads::internal {

// State of one queued async collective.
struct AsyncState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

class QueuedWork final : public comm::internal::WorkState {
 public:
  explicit QueuedWork(std::shared_ptr<AsyncState> s) : s_(std::move(s)) {}
  void wait() override {
    std::unique_lock l(s_->mu);
    s_->cv.wait(l, [&] { return s_->done; });
    if (s_->error) std::rethrow_exception(s_->error);
  }
  bool test() override {
    std::lock_guard l(s_->mu);
    return s_->done;
  }

 private:
  std::shared_ptr<AsyncState> s_;
};

class P2PWork final : public comm::internal::WorkState {
 public:
  P2PWork(std::shared_ptr<Group> g, std::shared_ptr<P2PEntry> e, Mailbox* mb, bool is_send, int peer,
          Clock::time_point deadline, std::chrono::milliseconds timeout)
      : g_(std::move(g)), e_(std::move(e)), mb_(mb), is_send_(is_send), peer_(peer),
        deadline_(deadline), timeout_(timeout) {}

  void wait() override;
  bool test() override { return e_->done.load(std::memory_order_acquire) != 0; }

 private:
  std::shared_ptr<Group> g_;
  std::shared_ptr<P2PEntry> e_;
  Mailbox* mb_;
  bool is_send_;
  int peer_;
  Clock::time_point deadline_;
  std::chrono::milliseconds timeout_;
};

}  // namespace meshtrain::comm::threads::internal
