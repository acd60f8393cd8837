// Stopping a training run cleanly (Ctrl-C, a scheduler's SIGTERM): a request
// every rank reads once per step, signal handlers that make it, and the
// error the run then ends with.
//
//   train::StopRequest stop;
//   train::StopOnSignals on_signals(stop, {SIGINT, SIGTERM});  // while training
//   try {
//     run_training(resolved, dc, launch, &stop);
//   } catch (const train::TrainingInterrupted& e) {
//     // every rank stopped after step e.step(); nothing was committed
//   }
//
// The ranks agree on the step: each reads the request once per step and the
// flag travels in the step's loss reduction, so a request that reaches one
// rank (one process of an mpi or gloo job) stops them all after the same
// step. The run then saves a checkpoint when checkpoint_every is set (its
// staging directory, "<run>.incomplete", is kept for --resume) and every
// rank throws TrainingInterrupted; the run directory is not committed.
#pragma once

#include <atomic>
#include <csignal>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/core/error.h"

namespace meshtrain::train {

// A request to stop after the current step. request() is async-signal-safe.
class StopRequest {
 public:
  void request(int signal = 0) noexcept {
    signal_.store(signal, std::memory_order_relaxed);
    flag_.store(true, std::memory_order_release);
  }
  bool requested() const noexcept { return flag_.load(std::memory_order_acquire); }
  int signal() const noexcept { return signal_.load(std::memory_order_relaxed); }  // 0: not from a signal

 private:
  static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free);
  std::atomic<bool> flag_{false};
  std::atomic<int> signal_{0};
};

// While alive, the first of `signals` to arrive requests `stop`; a second
// one restores the default action and raises the signal again, ending the
// process at once (a second Ctrl-C). The handlers that were there before are
// restored on destruction. One instance at a time per process (a second one
// throws InvalidArgument); construct and destroy it on one thread.
class StopOnSignals {
 public:
  StopOnSignals(StopRequest& stop, std::initializer_list<int> signals);
  ~StopOnSignals();
  StopOnSignals(const StopOnSignals&) = delete;
  StopOnSignals& operator=(const StopOnSignals&) = delete;

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

// Every rank stopped after step() because a StopRequest asked it to; what()
// says where the run stands (not committed; its checkpoint, if any, and how
// to resume).
class TrainingInterrupted : public Error {
 public:
  TrainingInterrupted(int64_t step, int signal, std::string op, std::string detail, std::string hint)
      : Error(std::move(op), std::move(detail), std::move(hint)), step_(step), signal_(signal) {}
  int64_t step() const noexcept { return step_; }
  int signal() const noexcept { return signal_; }  // 0: not from a signal

 private:
  int64_t step_;
  int signal_;
};

}  // namespace meshtrain::train
