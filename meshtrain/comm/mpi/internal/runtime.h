// The MPI engine's per-process part. Internal: includes mpi.h.
//
// MPI is process-global state, and so is this: one Runtime per process,
// started by the first create_world (which is collective over
// MPI_COMM_WORLD, so every process creates its control communicator at the
// same point) and stopped before MPI_Finalize. It owns:
//
// - The progress thread. OpenMPI advances non-blocking operations only
//   inside MPI calls; without help, a bucket all-reduce started during
//   backward moves only when the training thread next calls into MPI. The
//   thread polls every registered Channel that has operations in flight
//   (every kBusyPoll), and sleeps otherwise (kIdlePoll, or until start()
//   wakes it). It never blocks on a channel: Channel::poll takes the
//   channel's lock only if it is free.
// - Liveness probes. When a wait passes its deadline, the waiting rank asks
//   each peer process, on a private duplicate of MPI_COMM_WORLD, where it
//   is on that communicator (last collective issued and finished, whether a
//   thread of it is waiting). The peer's progress thread answers; a process
//   that does not answer within the grace period is stopped, dead, or stuck
//   outside MPI with its progress thread starved. This is what lets a
//   timeout name the rank that stalled even when every fingerprint arrived
//   (a stop in the middle of a transfer) or fingerprints are off.
//
// Needs MPI_THREAD_MULTIPLE (mpi::initialize asks for it). If MPI was
// initialized with less, there is no thread: operations progress only in
// calls, and probes go unanswered (timeouts then say so).
// Thread-safety: every member may be called from any thread.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "meshtrain/comm/internal/probe.h"

namespace meshtrain::comm::mpi::internal {

using comm::internal::ChannelStatus;
using comm::internal::PeerStatus;

class Channel;

inline constexpr std::chrono::microseconds kBusyPoll{50};
inline constexpr std::chrono::milliseconds kIdlePoll{2};

class Runtime {
 public:
  // Starts the runtime if it is not running. Collective over MPI_COMM_WORLD
  // the first time (it duplicates it): call from create_world only.
  static Runtime& start();
  // The running runtime, or nullptr.
  static Runtime* get();
  // Stops the thread and frees the control communicator; MPI_Finalize may
  // follow. Channels still registered are no longer polled.
  static void stop();

  // Ids of communicators made by create_world: 1, 2, ... in creation order,
  // equal on every process because create_world is collective.
  uint64_t next_world_id() { return ++world_ids_; }

  // Registers c (polled and reported from now on) / unregisters it: returns
  // once the thread no longer touches c.
  void attach(Channel* c);
  void detach(Channel* c);
  // Operations were queued: poll now rather than after the idle sleep.
  void wake();

  // Asks every process in `world_ranks` about channel `id` and waits at most
  // `grace` for the answers (one per entry, in order).
  std::vector<PeerStatus> probe(uint64_t id, const std::vector<int>& world_ranks,
                                std::chrono::milliseconds grace);

  // Whether a progress thread runs while communicators exist (it needs
  // MPI_THREAD_MULTIPLE). It starts with the first registered channel and
  // stops when the last one is gone, so a program that destroys its
  // communicators before MPI_Finalize never races it.
  bool has_thread() const { return threaded_; }

  // A communicator of this process failed; `timeout` was its deadline.
  // MPI_Finalize may then wait forever for a peer that never comes, so
  // finalize_with_deadline() bounds it.
  static void note_failure(std::chrono::milliseconds timeout);
  // MPI_Finalize; if a communicator failed, a watchdog ends the process
  // (status 1, without finalizing: mpirun then ends the job) when it has not
  // returned within twice the longest failed deadline (30 s to 10 min).
  static void finalize_with_deadline();

  ~Runtime();

 private:
  Runtime();
  void loop();
  void stop_thread();  // caller holds thread_mu_
  void answer_requests();
  void test_sends();
  ChannelStatus status_of(uint64_t id, bool& known);

  MPI_Comm ctl_ = MPI_COMM_NULL;  // probes and their answers
  int tag_ub_ = 32767;
  std::atomic<uint64_t> world_ids_{0};
  std::atomic<uint32_t> probes_{0};

  std::mutex poll_mu_;  // guards channels_; held by the thread while it polls them
  std::vector<Channel*> channels_;

  std::mutex send_mu_;  // small sends in flight (requests and answers) with their buffers
  struct Pending {
    MPI_Request request;
    std::shared_ptr<const void> keep_alive;
  };
  std::vector<Pending> sends_;

  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool woken_ = false;
  bool stop_ = false;
  bool threaded_ = false;
  std::mutex thread_mu_;  // serializes attach/detach (starting and stopping the thread)
  std::thread thread_;
};

}  // namespace meshtrain::comm::mpi::internal
