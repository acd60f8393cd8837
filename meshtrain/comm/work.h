// Work: the handle of an asynchronous communicator operation (c10d style).
//
//   Work w = comm.all_reduce_async(buf, buf, n, DType::f32, ReduceOp::sum);
//   ... compute that does not touch buf ...
//   w.wait();   // rethrows the engine's error (timeout, mismatch, abort)
//
// Until wait() returns, the operation's buffers belong to the engine: do not
// read, write or free them. A default-constructed Work is already complete.
// Destroying an unwaited Work waits for it (errors are then swallowed: call
// wait() to see them). Thread-safety: one Work is used by one thread; its
// Events may be used by others (see stream.h).
//
// Ordering on a stream (see stream.h for what a CUDA engine does):
//   w.wait(Stream::host());   // CPU engines: the same as w.wait()
//   Event e = w.event();      // completes with the operation
#pragma once

#include <memory>

#include "meshtrain/comm/stream.h"

namespace meshtrain::comm {

namespace internal {
// What an engine implements for one in-flight operation.
class WorkState {
 public:
  virtual ~WorkState() = default;
  // Blocks until done; throws the operation's error. Called at most once.
  virtual void wait() = 0;
  // Non-blocking completion test (an error counts as complete).
  virtual bool test() = 0;
};
}  // namespace internal

class [[nodiscard]] Work {
 public:
  Work() = default;
  explicit Work(std::unique_ptr<internal::WorkState> state) : state_(std::move(state)) {}
  Work(Work&&) noexcept = default;
  Work& operator=(Work&& other) noexcept {
    if (this != &other) {
      drain();
      state_ = std::move(other.state_);
      event_ = std::move(other.event_);
    }
    return *this;
  }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work() { drain(); }

  // Blocks until the operation finished; rethrows its error. Idempotent.
  void wait() {
    if (!state_) return;
    auto s = std::move(state_);
    s->wait();
  }
  // True once the operation finished (successfully or not).
  bool is_completed() { return !state_ || state_->test(); }

  // Orders `stream` after this operation: work issued on it later sees the
  // operation's results. Host stream (CPU engines): wait(). Device streams:
  // returns at once, the stream waits (stream.h).
  void wait(const Stream& stream) { stream.wait(event()); }
  // An event that completes when the operation does; its synchronize()
  // rethrows the operation's error, as does wait(). Taken after wait()
  // returned, or from a default Work: complete. stream.cc.
  Event event();

 private:
  void drain() noexcept {
    if (!state_) return;
    try {
      state_->wait();
    } catch (...) {
    }
    state_.reset();
  }
  std::unique_ptr<internal::WorkState> state_;
  std::shared_ptr<internal::EventState> event_;  // set once event() was called
};

}  // namespace meshtrain::comm
