// Prefetching: a background thread pulls items from a source ahead of the
// consumer into a bounded buffer, so producing item k+1 (reading, decoding,
// placing it) overlaps with the consumer's work on item k.
//
//   int64_t next_batch = 0;
//   auto batches = prefetch_to_device(
//       [&]() -> std::optional<Tensor> {                 // runs on the prefetch thread
//         if (next_batch == num_batches) return std::nullopt;
//         return load_batch(next_batch++);              // (B, 784) f32
//       },
//       {.buffer_size = 2},
//       [](Tensor t) { return t.to(DType::bf16); });  // "placement", also on that thread
//   while (std::optional<Tensor> x = batches.next()) step(*x);
//
// Contract (docs/device-placement.md):
// - The source is called on the prefetcher's own thread, one call at a time,
//   until it returns std::nullopt (the end) or throws; then never again.
//   `place`, if given, runs on the same thread on each item before it is
//   queued (the seeds' device_put; tensors live on the cpu today).
// - Bound: at most buffer_size items are ahead of the consumer, counting the
//   one being produced: the source is called for item k + buffer_size only
//   after next() has handed out item k.
// - next() returns the items in source order, then std::nullopt (on every
//   later call too). It blocks until the next item is ready; with
//   options.timeout > 0 it throws TimeoutError when none arrives in time.
// - An exception from the source (or place) at item k reaches the consumer
//   in place of item k: items before it are delivered, then next() rethrows
//   it, on every later call too.
// - Destruction stops the thread and joins it. A thread waiting for room
//   stops at once; one inside a source call stops when that call returns (a
//   call cannot be interrupted), and the source is not called again.
//
// Thread-safety: next() may be called from several threads (each item goes
// to one caller); `source` and `place` only ever run on the prefetch thread,
// so they need no locking against each other, only against what the
// consumer touches concurrently. A moved-from Prefetcher may only be
// destroyed or assigned to.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

namespace meshtrain {

struct PrefetchOptions {
  int buffer_size = 2;                   // items ahead of the consumer, >= 1
  std::chrono::milliseconds timeout{0};  // next()'s deadline; 0 waits as long as the source takes
};

namespace internal {

// The type-erased engine behind Prefetcher<T>: the thread, the bounded queue,
// the error and stop handling, compiled once in prefetch.cc.
class PrefetchQueue {
 public:
  using Item = std::shared_ptr<void>;
  // Returns the next item, or nullptr at the end.
  using Produce = std::function<Item()>;

  // Throws InvalidArgument unless options.buffer_size >= 1 and timeout >= 0.
  // Starts the thread.
  PrefetchQueue(Produce produce, PrefetchOptions options);
  ~PrefetchQueue();
  PrefetchQueue(const PrefetchQueue&) = delete;
  PrefetchQueue& operator=(const PrefetchQueue&) = delete;

  // The next item, or nullptr at the end; rethrows the source's exception.
  Item pop();
  // Items produced and not yet popped.
  int buffered() const;
  // Source calls started so far.
  int64_t produced() const;

 private:
  void run();

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace internal

template <class T>
class Prefetcher {
 public:
  using Source = std::function<std::optional<T>()>;
  using Place = std::function<T(T)>;

  // Throws InvalidArgument when `source` is empty or options are out of
  // range (see PrefetchOptions). Starts producing at once.
  explicit Prefetcher(Source source, PrefetchOptions options = {}, Place place = {})
      : queue_(std::make_unique<internal::PrefetchQueue>(wrap(std::move(source), std::move(place)), options)) {}

  // The next item in source order; std::nullopt after the last one.
  std::optional<T> next() {
    internal::PrefetchQueue::Item item = queue_->pop();
    if (!item) return std::nullopt;
    return std::optional<T>(std::move(*static_cast<T*>(item.get())));
  }

  // Items ready and not yet taken (at most buffer_size).
  int buffered() const { return queue_->buffered(); }

 private:
  static internal::PrefetchQueue::Produce wrap(Source source, Place place) {
    if (!source) return nullptr;  // PrefetchQueue names the problem
    return [source = std::move(source), place = std::move(place)]() -> internal::PrefetchQueue::Item {
      std::optional<T> v = source();
      if (!v) return nullptr;
      if (place) return std::make_shared<T>(place(std::move(*v)));
      return std::make_shared<T>(std::move(*v));
    };
  }

  std::unique_ptr<internal::PrefetchQueue> queue_;
};

// A Prefetcher over `source`, any callable returning std::optional<T>; the
// seeds' prefetch_to_device, but asynchronous (see the header comment).
// `place`, if given, maps each item on the prefetch thread.
template <class F, class T = typename std::invoke_result_t<F&>::value_type>
[[nodiscard]] Prefetcher<T> prefetch_to_device(F source, PrefetchOptions options = {},
                                               std::type_identity_t<std::function<T(T)>> place = {}) {
  return Prefetcher<T>(typename Prefetcher<T>::Source(std::move(source)), options, std::move(place));
}

}  // namespace meshtrain
