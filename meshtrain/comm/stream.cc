#include "meshtrain/comm/stream.h"

#include <mutex>

#include "meshtrain/comm/work.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm {

namespace {

[[noreturn]] void no_device_engine(const Stream& s, const char* op) {
  throw Unsupported(op, "stream on " + s.device().to_string() + ": no engine of this build runs on that device",
                    "use Stream::host() with the threads and mpi engines");
}

// A Work's completion shared by the Work and its Events: the engine's
// WorkState is waited for once, by whoever comes first, and its outcome
// kept for everyone else.
class SharedCompletion final : public internal::EventState {
 public:
  explicit SharedCompletion(std::unique_ptr<internal::WorkState> work) : work_(std::move(work)) {}

  bool query() override {
    // A thread inside synchronize() holds the lock: not known complete yet.
    std::unique_lock l(mu_, std::try_to_lock);
    if (!l.owns_lock()) return false;
    return done_ || work_->test();
  }
  void synchronize() override {
    std::lock_guard l(mu_);
    if (!done_) {
      try {
        work_->wait();
      } catch (...) {
        error_ = std::current_exception();
      }
      done_ = true;
      work_.reset();
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mu_;
  std::unique_ptr<internal::WorkState> work_;
  bool done_ = false;
  std::exception_ptr error_;
};

// What the Work keeps once it has handed out an Event: the same completion.
class SharedWork final : public internal::WorkState {
 public:
  explicit SharedWork(std::shared_ptr<SharedCompletion> c) : c_(std::move(c)) {}
  void wait() override { c_->synchronize(); }
  bool test() override { return c_->query(); }

 private:
  std::shared_ptr<SharedCompletion> c_;
};

}  // namespace

void Stream::wait(const Event& event) const {
  if (!is_host()) no_device_engine(*this, "Stream::wait");
  event.synchronize();  // the host stream is this thread: wait here
}

Event Stream::record() const {
  if (!is_host()) no_device_engine(*this, "Stream::record");
  return Event{};  // host work issued so far has already run
}

void Stream::synchronize() const {
  if (!is_host()) no_device_engine(*this, "Stream::synchronize");
}

Event Work::event() {
  if (state_ && !event_) {
    auto c = std::make_shared<SharedCompletion>(std::move(state_));
    state_ = std::make_unique<SharedWork>(c);
    event_ = std::move(c);
  }
  return Event(event_);  // a Work completed before any event was asked for: complete
}

}  // namespace meshtrain::comm
