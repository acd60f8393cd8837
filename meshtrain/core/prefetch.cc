#include "meshtrain/core/prefetch.h"

#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "meshtrain/core/error.h"

namespace meshtrain::internal {

struct PrefetchQueue::State {
  Produce produce;
  PrefetchOptions options;

  mutable std::mutex mu;
  std::condition_variable room;   // the producer waits here for a free slot
  std::condition_variable ready;  // consumers wait here for an item or the end
  std::deque<Item> queue;         // produced, not yet popped
  int in_flight = 0;              // queue.size() + the item being produced
  int64_t produced = 0;           // source calls started
  int64_t popped = 0;
  bool done = false;         // the producer has finished (end, error or stop)
  bool stop = false;         // the destructor asks the producer to stop
  std::exception_ptr error;  // what the source threw
  std::thread thread;        // last: starts after the members above exist
};

PrefetchQueue::PrefetchQueue(Produce produce, PrefetchOptions options) : state_(std::make_unique<State>()) {
  if (!produce)
    throw InvalidArgument("prefetch_to_device", "the source is empty",
                          "pass a callable that returns the next item, or std::nullopt at the end");
  if (options.buffer_size < 1)
    throw InvalidArgument("prefetch_to_device", fmt::format("buffer_size {} < 1", options.buffer_size),
                          "keep at least one item ahead (the default is 2)");
  if (options.timeout.count() < 0)
    throw InvalidArgument("prefetch_to_device", fmt::format("timeout {} ms is negative", options.timeout.count()),
                          "pass 0 to wait as long as the source takes, or a positive deadline");
  state_->produce = std::move(produce);
  state_->options = options;
  state_->thread = std::thread([this] { run(); });
}

PrefetchQueue::~PrefetchQueue() {
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
  }
  state_->room.notify_all();
  state_->thread.join();
}

void PrefetchQueue::run() {
  State& s = *state_;
  while (true) {
    {
      std::unique_lock lock(s.mu);
      s.room.wait(lock, [&] { return s.stop || s.in_flight < s.options.buffer_size; });
      if (s.stop) break;
      ++s.in_flight;  // reserve the slot before calling the source: the bound counts this item
      ++s.produced;
    }
    Item item;
    std::exception_ptr error;
    try {
      item = s.produce();
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(s.mu);
      if (error || !item) {
        s.error = error;
        --s.in_flight;
        break;
      }
      s.queue.push_back(std::move(item));
    }
    s.ready.notify_one();
  }
  {
    std::lock_guard lock(s.mu);
    s.done = true;
  }
  s.ready.notify_all();
}

PrefetchQueue::Item PrefetchQueue::pop() {
  State& s = *state_;
  Item item;
  {
    std::unique_lock lock(s.mu);
    const auto has_next = [&] { return !s.queue.empty() || s.done; };
    if (s.options.timeout.count() == 0) {
      s.ready.wait(lock, has_next);
    } else if (!s.ready.wait_for(lock, s.options.timeout, has_next)) {
      throw TimeoutError("prefetch_to_device",
                         fmt::format("no item within {} ms (item {}; the source is still producing it)",
                                     s.options.timeout.count(), s.popped),
                         "make the source faster or raise PrefetchOptions::timeout (0 waits as long as it takes)");
    }
    if (s.queue.empty()) {
      if (s.error) std::rethrow_exception(s.error);
      return nullptr;
    }
    item = std::move(s.queue.front());
    s.queue.pop_front();
    --s.in_flight;
    ++s.popped;
  }
  s.room.notify_one();
  return item;
}

int PrefetchQueue::buffered() const {
  std::lock_guard lock(state_->mu);
  return static_cast<int>(state_->queue.size());
}

int64_t PrefetchQueue::produced() const {
  std::lock_guard lock(state_->mu);
  return state_->produced;
}

}  // namespace meshtrain::internal
