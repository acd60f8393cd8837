// The Work of an engine whose operations are tasks of a channel with
// wait(task, timeout) and test(task) (the mpi and gloo engines).
#pragma once

#include <chrono>
#include <memory>
#include <utility>

#include "meshtrain/comm/work.h"

namespace meshtrain::comm::internal {

template <class Channel, class Task>
class ChannelWork final : public WorkState {
 public:
  ChannelWork(std::shared_ptr<Channel> channel, std::shared_ptr<Task> task, std::chrono::milliseconds timeout)
      : channel_(std::move(channel)), task_(std::move(task)), timeout_(timeout) {}
  void wait() override { channel_->wait(*task_, timeout_); }
  bool test() override { return channel_->test(*task_); }

 private:
  std::shared_ptr<Channel> channel_;
  std::shared_ptr<Task> task_;
  std::chrono::milliseconds timeout_;
};

}  // namespace meshtrain::comm::internal
