#include "meshtrain/checkpoint/async_save.h"

#include <sys/resource.h>
#include <unistd.h>

#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::checkpoint {
namespace {
constexpr int kNice = 10;
}  // namespace

AsyncCheckpointSaver::AsyncCheckpointSaver(std::unique_ptr<comm::Communicator> world) : world_(std::move(world)) {
  if (!world_)
    throw InvalidArgument("AsyncCheckpointSaver", "no communicator", "pass world.split(0, world.rank())");
}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (thread_.joinable()) thread_.join();
}

std::optional<CheckpointSaveStats> AsyncCheckpointSaver::wait() {
  if (!step_) return std::nullopt;
  thread_.join();
  step_.reset();
  staged_.clear();  // the staging copy goes with its save
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return stats_;
}

std::optional<CheckpointSaveStats> AsyncCheckpointSaver::start(const std::string& root, int64_t step,
                                                               const std::vector<CheckpointPiece>& pieces,
                                                               std::string metadata, CheckpointOptions options) {
  std::optional<CheckpointSaveStats> done = wait();
  // The staging copy: the pieces' values as they are now (the caller's
  // tensors change with the next step). save_checkpoint checks the rest.
  staged_.clear();  // a copy that failed part-way before
  staged_.reserve(pieces.size());
  for (const CheckpointPiece& p : pieces) {
    Tensor copy = p.data;
    if (p.data.defined()) {  // untracked storage (clone() would charge the rank's tracker)
      copy = Tensor::empty(p.data.shape(), p.data.dtype());
      copy.copy_from(p.data);
    }
    staged_.push_back({p.name, p.placement, copy});
  }
  step_ = step;
  thread_ = std::thread([this, root, step, metadata = std::move(metadata), options] {
    // Below training's threads: on a machine without an idle core the save
    // takes the time they spend waiting (Linux: the nice value is per thread).
    setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), kNice);
    try {
      stats_ = save_checkpoint(*world_, root, step, staged_, metadata, options);
    } catch (...) {
      error_ = std::current_exception();
    }
  });
  return done;
}

}  // namespace meshtrain::checkpoint
