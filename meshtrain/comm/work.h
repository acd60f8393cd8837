// Work: the handle of an asynchronous communicator operation (c10d style).
//
//   Work w = comm.all_reduce_async(buf, buf, n, DType::f32, ReduceOp::sum);
//   ... compute that does not touch buf ...
//   w.wait();   // rethrows the engine's error (timeout, mismatch, abort)
//
// Until wait() returns, the operation's buffers belong to the engine: do not
// read, write or free them. A default-constructed Work is already complete.
// Destroying an unwaited Work waits for it (errors are then swallowed: call
// wait() to see them). Thread-safety: one Work is used by one thread.
#pragma once

#include <memory>

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
};

}  // namespace meshtrain::comm
