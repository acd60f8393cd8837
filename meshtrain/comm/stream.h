// Stream and Event: device-neutral ordering of communication with compute,
// after CUDA streams and events (the way c10d orders NCCL work).
//
//   Work w = comm.all_reduce_async(grad, grad, n, DType::f32, ReduceOp::sum);
//   Stream compute = Stream::host();       // a device engine: the device's compute stream
//   w.wait(compute);                       // what runs next on `compute` sees the result
//   Event e = w.event();                   // or: hand the completion to someone else
//   ... e.query() (non-blocking), e.synchronize() (blocks, rethrows the operation's error)
//
// A Stream is an ordered queue of work on one device; an Event marks a point
// in such a queue (or the completion of a communicator operation).
//
// CPU engines (threads, mpi), what this file implements: the host stream is
// the calling thread itself, whose work runs in program order, so
// - Stream::host().wait(event) blocks the calling thread until the event is
//   complete and rethrows the operation's error: Work::wait(stream) is
//   exactly Work::wait();
// - Stream::record() returns an event that is already complete (everything
//   issued on the host stream so far has run), and synchronize() returns at once;
// - Work::event() is complete once the operation finished (Work::wait
//   would return or throw at once); query() never blocks, synchronize()
//   waits like Work::wait and rethrows the same error, as often as called.
// A CUDA engine (nccl, to come) will instead:
// - run each operation on the communicator's own CUDA stream, made to wait
//   (cudaStreamWaitEvent) on an event recorded on the caller's current
//   stream when the operation is issued, so it reads its inputs after the
//   compute that produced them;
// - make Work::event() a cudaEvent recorded on that communicator stream
//   right after the operation's kernel is launched;
// - implement Stream::wait(event) as cudaStreamWaitEvent: it returns at once,
//   the host does not block, and kernels issued later on that stream run
//   after the operation (Work::wait(stream) = stream.wait(work.event()));
// - implement Event::query as cudaEventQuery and Event::synchronize (and
//   Work::wait()) as a host wait bounded by the communicator's deadline
//   (polling cudaEventQuery and ncclCommGetAsyncError; past the deadline the
//   communicator is aborted and TimeoutError thrown), so a failure is
//   reported at the next host wait or query, never as a hang;
// - keep the operation's buffers alive until the event completed on the
//   device (the caching allocator must not hand them out earlier: record
//   the communicator stream on them);
// - Stream::record() is cudaEventRecord; Stream::synchronize() is
//   cudaStreamSynchronize.
// Capabilities::stream_ordered tells the two apart: true when
// Work::wait(stream) returns before the operation completed.
// Thread-safety: Event copies share one state; query() and synchronize() may
// be called from any thread when the engine's capabilities say
// wait_from_any_thread. A Stream is a handle: copy it freely.
#pragma once

#include <memory>

#include "meshtrain/core/tensor.h"

namespace meshtrain::comm {

namespace internal {
// What an engine implements for an event.
class EventState {
 public:
  virtual ~EventState() = default;
  // Non-blocking; true once complete (successfully or not).
  virtual bool query() = 0;
  // Blocks until complete; rethrows the operation's error (every time).
  virtual void synchronize() = 0;
};
}  // namespace internal

class Event {
 public:
  Event() = default;  // complete
  explicit Event(std::shared_ptr<internal::EventState> state) : state_(std::move(state)) {}

  bool query() const { return !state_ || state_->query(); }
  void synchronize() const {
    if (state_) state_->synchronize();
  }

 private:
  std::shared_ptr<internal::EventState> state_;
};

class Stream {
 public:
  // The calling thread: host work runs in program order.
  static Stream host() { return Stream(Device::cpu(), nullptr); }
  // A device engine's stream (handle: a cudaStream_t for CUDA).
  Stream(Device device, void* handle) : device_(device), handle_(handle) {}

  Device device() const { return device_; }
  void* native_handle() const { return handle_; }
  bool is_host() const { return device_.type == DeviceType::cpu; }

  // Orders everything issued on this stream after `event`. Host: blocks
  // until the event is complete and rethrows its error. Throws Unsupported
  // for a device stream in a build without that device's engine.
  void wait(const Event& event) const;
  // An event that completes once everything issued on this stream so far
  // has. Host: complete at once.
  Event record() const;
  // Blocks the host until everything issued on this stream has run. Host: no-op.
  void synchronize() const;

 private:
  Device device_;
  void* handle_;
};

}  // namespace meshtrain::comm
