#include "meshtrain/comm/mpi/communicator.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <memory>
#include <mutex>
#include <utility>

#include "meshtrain/comm/internal/channel_work.h"
#include "meshtrain/comm/internal/fingerprint.h"
#include "meshtrain/comm/mpi/internal/channel.h"
#include "meshtrain/comm/mpi/internal/mpi_util.h"
#include "meshtrain/comm/mpi/internal/runtime.h"
#include "meshtrain/core/error.h"

// The operations' life cycle and the failure protocol: internal/channel.h.

namespace meshtrain::comm::mpi {

using internal::Channel;
using internal::check;
using internal::Task;

namespace {

using MpiWork = comm::internal::ChannelWork<Channel, Task>;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, Options options, uint64_t id)
      : channel_(std::make_shared<Channel>(comm, std::move(options), id)) {}

  int rank() const override { return channel_->rank(); }
  int size() const override { return channel_->size(); }
  Capabilities capabilities() const override {
    Capabilities c;
    c.engine = Engine::mpi;
    c.async = true;
    c.send_recv = true;
    c.split = true;
    c.checks_fingerprints = channel_->options().check_fingerprints;
    // Fingerprints name the ranks that did not arrive; without them, the
    // liveness probes do (they need the progress thread).
    c.names_missing_ranks = channel_->options().check_fingerprints || channel_->probes_peers();
    c.device_memory = false;
    c.wait_from_any_thread = true;  // a Work waits under its channel's lock
    return c;
  }

 protected:
  Work start(const Op& op, Completion completion) override {
    auto task = channel_->start(op, timeout(), completion == Completion::async);
    return Work(std::make_unique<MpiWork>(channel_, std::move(task), timeout()));
  }

  std::unique_ptr<Communicator> do_split(int color, int key, uint64_t seq) override {
    // Agree first (with a deadline): once every member arrived, the blocking
    // MPI_Comm_split and MPI_Comm_dup calls below cannot hang on a missing peer.
    Op op{.kind = CollectiveOp::split, .seq = seq};
    auto task = channel_->start(op, timeout(), /*async=*/false);
    channel_->wait(*task, timeout());
    MPI_Comm sub = MPI_COMM_NULL;
    try {
      check(MPI_Comm_split(channel_->comm(), color < 0 ? MPI_UNDEFINED : color, key, &sub),
            "MPI_Comm_split", "split");
    } catch (...) {
      channel_->fail_and_throw(std::current_exception());
    }
    if (sub == MPI_COMM_NULL) return nullptr;
    auto child = std::make_unique<MpiCommunicator>(sub, channel_->options(),
                                                   internal::split_id(channel_->id(), seq, color));
    child->set_timeout(timeout());
    return child;
  }

 private:
  std::shared_ptr<Channel> channel_;
};

void finalize_at_exit() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) internal::Runtime::finalize_with_deadline();
}

}  // namespace

std::string_view reduce_scatter_algorithm_name(ReduceScatterAlgorithm a) {
  switch (a) {
    case ReduceScatterAlgorithm::native: return "native";
    case ReduceScatterAlgorithm::ring: return "ring";
    case ReduceScatterAlgorithm::automatic: return "auto";
  }
  return "?";
}

void initialize() {
  // One-time process setup, so one lock for the process (MPI itself is
  // process-global state).
  static std::mutex mu;
  std::lock_guard lock(mu);
  int initialized = 0, finalized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized", "initialize");
  check(MPI_Finalized(&finalized), "MPI_Finalized", "initialize");
  if (finalized)
    throw EngineError("mpi::initialize", "MPI was already finalized",
                      "create MPI communicators before MPI_Finalize (meshtrain finalizes at "
                      "process exit when it initialized MPI)");
  if (initialized) return;
  int provided = 0;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread",
        "initialize");
  std::atexit(finalize_at_exit);
}

bool is_initialized() {
  int initialized = 0, finalized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized", "is_initialized");
  check(MPI_Finalized(&finalized), "MPI_Finalized", "is_initialized");
  return initialized && !finalized;
}

std::unique_ptr<Communicator> create_world(Options options) {
  initialize();
  internal::Runtime& runtime = internal::Runtime::start();
  MPI_Comm comm = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup", "create_world");
  return std::make_unique<MpiCommunicator>(comm, std::move(options), runtime.next_world_id());
}

void report_and_abort(const std::exception& error, int world_rank) {
  comm::internal::report_rank_error(error, world_rank);
  abort_job(1);
}

void abort_job(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; if MPI is gone, end this process at least
}

}  // namespace meshtrain::comm::mpi

