// DataParallel: replicated parameters, a sharded batch and bucketed gradient
// all-reduces that overlap the rest of backward (PyTorch DDP's design over
// meshtrain's Module and Communicator).
//
//   comm::Communicator& dp = mesh.comm("data");
//   DataParallel ddp(model, dp, {.bucket_bytes = 25 << 20, .reduce = GradReduce::avg});
//   for (...) {                                   // one optimizer step
//     Tensor x = shard_batch(global_x, dp);       // (B/d, ...) this rank's rows
//     model.backward(loss_grad(model.forward(x)));// buckets start all-reducing here
//     ddp.finish();                               // waits; grads now hold the result
//     optimizer.step(); model.zero_grad();
//   }
//   ddp.stats().hidden_fraction;                  // share of comm hidden by backward
//
// Gradient accumulation over a window of m micro-batches (no_sync style):
//
//   for (int i = 0; i < m; ++i) {
//     ddp.begin_micro_batch(i, m);                // only i == m - 1 communicates
//     model.backward(...);
//   }
//   ddp.finish();                                 // may also end a window early
//
// Result after finish(), with d = data_comm.size() and m = micro-batches that
// really ran in the window (a window ended early by finish() counts only its
// real micro-batches, never the planned count):
//   GradReduce::sum  g = sum_ranks sum_micro g_local
//   GradReduce::avg  g = (1 / (d * m)) * sum_ranks sum_micro g_local
// For results identical to one big batch of N samples: either normalize each
// micro-batch's loss by N (the window's global sample count) and use sum, or
// average each micro-batch's loss over its own (equal-sized) local samples and
// use avg. docs/data-parallel.md has the derivation.
//
// Buckets: parameters are assigned in REVERSE definition order (the order in
// which backward makes gradients ready), greedily, to contiguous f32 buffers of
// at most bucket_bytes (a parameter larger than that gets a bucket of its
// own). Buffers are charged to options.tracker as comm_buffers. With
// gradient_as_bucket_view (the default) every Parameter::grad is re-pointed to
// a view into its bucket, so backward accumulates straight into the buffer
// that is all-reduced: no copy in either direction. Without it (or when a
// module replaced p.grad after construction) grad_ready copies the gradient
// into the bucket and finish() copies the result back.
//
// Collective order: buckets are launched strictly in bucket order on every
// rank (a bucket that becomes ready early waits for its predecessors), so the
// ranks issue identical collective sequences even if backward orders differ.
// While buckets are in flight, other collectives on data_comm must be issued
// in the same order on every rank (as always).
//
// Thread-safety: a DataParallel belongs to its rank's thread, like the model
// and the communicator it borrows (both must outlive it). With exact timing
// (threads engine) it owns one watcher thread that only waits on the buckets'
// Works; the destructor waits for them and joins it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/parallel/parallelism.h"

namespace meshtrain::parallel {

// How gradients are combined over the data axis (see the formulas above).
enum class GradReduce : uint8_t { avg, sum };

struct DataParallelOptions {
  size_t bucket_bytes = size_t{25} << 20;  // 25 MiB; >= 1
  GradReduce reduce = GradReduce::avg;
  // Gradients live in the bucket buffers (see above). false: copy in and out.
  bool gradient_as_bucket_view = true;
  // Time bucket completion exactly with a watcher thread where the engine
  // allows it (see CommTiming); false: always poll (no extra thread).
  bool exact_timing = true;
  // Charged with the bucket buffers (comm_buffers); must outlive them, i.e.
  // the model's gradients when gradient_as_bucket_view is on. May be null.
  MemoryTracker* tracker = nullptr;
  // The deterministic mode (docs/determinism.md): each bucket is summed in
  // the canonical tree over the ranks (comm::tree_all_reduce's steps: its
  // all_to_all starts when the bucket is complete, overlapped with the rest
  // of backward; the tree and the all_gather run in finish()); buckets
  // padded to a multiple of the ranks, and a receive buffer each (charged
  // as comm_buffers); with reduce sum only.
  bool deterministic = false;
};

// One parameter's place in the buckets.
struct BucketSlot {
  std::string name;
  int64_t offset = 0;  // elements from the start of the bucket
  int64_t numel = 0;
};

// What a bucket holds, in bucket order (bucket 0 is all-reduced first).
struct BucketInfo {
  std::vector<BucketSlot> slots;  // in assignment (reverse parameter) order
  int64_t numel = 0;
  size_t bytes() const { return static_cast<size_t>(numel) * sizeof(float); }
};

// Timing of one bucket in the last synchronized step, in seconds from the
// step's first bucket launch. Completion lies in (seen_incomplete, completed]:
// with exact timing both are the moment a watcher thread's wait returned;
// with polling, the last poll that found the bucket running and the first
// that found it done.
struct BucketTiming {
  double started = 0;
  double seen_incomplete = 0;  // last poll that found it still running (>= started)
  double completed = 0;        // first poll (or wait) that found it done
  bool completed_before_finish = false;  // done before finish() was entered
};

// How bucket completion times are observed.
//   exact: a watcher thread per DataParallel waits on each bucket's Work and
//     stamps the moment it returns (microseconds). Needs
//     Capabilities::wait_from_any_thread (the threads and mpi engines; on
//     mpi the waiting thread also drives progress).
//   polled: engines without it. grad_ready and finish() test the Works in flight
//     (which also drives progress on engines without a progress thread); a
//     completion is known only to lie between two polls, i.e. within one
//     layer's backward.
enum class CommTiming : uint8_t { exact, polled };

struct DataParallelStats {
  int64_t steps = 0;  // synchronized windows so far
  CommTiming timing = CommTiming::polled;
  // The last synchronized step, from the buckets' intervals [launch,
  // completion] (BucketTiming), whose union U is the time during which at
  // least one all-reduce was in flight:
  //   comm_time     |U| with completion = `completed` (an upper bound when polled)
  //   comm_time_min |U| with completion = `seen_incomplete` (a lower bound when
  //                 polled; equal to comm_time when exact)
  //   exposed_time  the part of U after finish() was entered: communication
  //                 the step waited for; the rest ran under backward
  //   wait_time     how long finish() blocked (exact; adds thread wake-up
  //                 latency to exposed_time)
  //   hidden_fraction = 1 - exposed_time / comm_time; 0 when nothing was
  //                 communicated. Optimistic when polled.
  //   hidden_fraction_min = h / (h + exposed_time), h the part of the
  //                 lower-bound union before finish(): a conservative bound
  //                 when polled; equal to hidden_fraction when exact.
  std::chrono::duration<double> comm_time{0};
  std::chrono::duration<double> comm_time_min{0};
  std::chrono::duration<double> exposed_time{0};
  std::chrono::duration<double> wait_time{0};
  double hidden_fraction = 0;
  double hidden_fraction_min = 0;
  int64_t bytes_reduced = 0;       // bucket bytes all-reduced in the step
  int micro_batches = 0;           // m of the step's window
  bool flushed_early = false;      // the window was ended by finish()
  std::vector<BucketTiming> buckets;
  // Sums over all steps.
  std::chrono::duration<double> total_comm_time{0};
  std::chrono::duration<double> total_exposed_time{0};
};

// Parameters differ bit-wise across replicas. Raised identically on every
// rank of the communicator by DataParallel::verify_replicas().
class ReplicaMismatchError : public Error {
 public:
  ReplicaMismatchError(std::string op, std::string detail, std::string hint, std::string parameter,
                       std::vector<int> ranks);
  const std::string& parameter() const noexcept { return parameter_; }  // the first that differs
  const std::vector<int>& ranks() const noexcept { return ranks_; }     // ranks that differ from rank 0

 private:
  std::string parameter_;
  std::vector<int> ranks_;
};

class DataParallel final : public nn::ParamHook, public Parallelism {
 public:
  // Collective over data_comm. Checks that every rank has the same parameter
  // names, shapes and options (InvalidArgument naming the first rank that
  // differs), broadcasts every parameter from rank 0 (bucket-sized, coalesced),
  // verifies replication (verify_replicas), builds the buckets and installs
  // itself as the model's grad hook. Parameters must be f32; a defined grad
  // must have the value's shape (its content is kept). bucket_bytes >= 1.
  DataParallel(nn::Module& model, comm::Communicator& data_comm, DataParallelOptions options = {});
  // Waits for buckets still in flight and removes the grad hook. Gradients
  // that are bucket views stay valid (they share the bucket's storage).
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Collective. Bit-compares every parameter's value with rank 0's (one
  // all_gather of a 64-bit hash per parameter). Throws ReplicaMismatchError on
  // every rank, naming the first differing parameter and the ranks that
  // differ. Call it after a step to catch diverged replicas.
  void verify_replicas();

  // Declares that the next backward is micro-batch `index` of a window of
  // `count` micro-batches. index must be 0 when no window is open, else the
  // previous index + 1 with the same count, and the previous micro-batch's
  // backward must be complete. Micro-batches before the last accumulate
  // locally; the last (index == count - 1) launches the buckets. Without a
  // call, every backward is micro-batch 0 of 1.
  void begin_micro_batch(int index, int count) override;

  // nn::ParamHook. Called by the model's backward: marks p ready (throws
  // InvalidArgument for an unknown parameter or a second call in one
  // backward) and, on a window's last micro-batch, launches every bucket whose
  // gradients are all ready, in bucket order. Also polls buckets in flight.
  void grad_ready(nn::Parameter& p) override;

  // Call after the backward of a window's last micro-batch, before reading
  // gradients. Waits for every bucket, scales (avg), copies back (copy mode)
  // and records stats(). Called after an earlier micro-batch, it ends the
  // window early: it all-reduces now (nothing hidden) and divides by the real
  // number of micro-batches. A no-op when no backward ran since the last
  // finish(). Throws InvalidArgument naming parameters whose grad_ready did
  // not come in the current backward.
  void finish() override;

  // Parallelism (parallelism.h; defined in parallelism.cc): the model's
  // parameters for the optimizer; grads_finite and grad_norm are local (the
  // gradients are bit-identical replicas after finish()); after_step,
  // gather_full_parameters and reshard have nothing to do; every parameter
  // is held whole and replicated.
  std::string describe() const override;
  std::vector<nn::Parameter*> optimizer_parameters() override;
  bool grads_finite() override;
  double grad_norm() override;
  std::pair<double, double> grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) override;
  ExactSquares grad_squares_exact(const std::function<bool(const nn::Parameter&)>& counted) override;
  void after_step() override;
  void zero_grad() override;
  void gather_full_parameters() override;
  void reshard() override;
  bool needs_loss_scaling() const override { return false; }  // f32 only
  std::optional<double> hidden_fraction() const override;
  std::vector<ParamShard> parameter_shards() const override;

  const DataParallelStats& stats() const { return stats_; }
  const std::vector<BucketInfo>& buckets() const { return bucket_info_; }
  const DataParallelOptions& options() const { return options_; }
  comm::Communicator& comm() const { return *comm_; }

 private:
  struct Bucket;
  struct SlotState;
  class Watcher;

  void check_structure(const std::vector<nn::Parameter*>& params);
  void build_buckets(const std::vector<nn::Parameter*>& params);
  void broadcast_parameters();
  void reset_backward();
  void launch_ready_buckets();
  void launch(Bucket& b);
  void poll();
  std::vector<std::string> missing_parameters() const;
  void complete_tree_reductions();

  nn::Module* model_;           // borrowed
  comm::Communicator* comm_;    // borrowed
  DataParallelOptions options_;
  std::vector<nn::Parameter*> params_;        // definition order
  std::vector<BucketInfo> bucket_info_;
  std::vector<Bucket> buckets_;               // owns buffers and Works
  std::vector<SlotState> slots_;              // by parameter index (definition order)
  std::unordered_map<const nn::Parameter*, int> index_of_;
  // Window and backward state.
  int window_count_ = 1;
  int window_index_ = 0;
  bool window_open_ = false;   // begin_micro_batch or a backward happened since finish
  int num_ready_ = 0;          // parameters ready in the current backward
  size_t next_launch_ = 0;     // first bucket not yet launched
  size_t next_poll_ = 0;       // first launched bucket not yet seen complete
  comm::Clock::time_point step_start_{};
  DataParallelStats stats_;
  std::unique_ptr<Watcher> watcher_;  // exact timing; declared last: joined first
};

// Rows [rank * B / size, (rank + 1) * B / size) of dim 0 of `global` (B, ...),
// as a view sharing its storage. Throws InvalidArgument unless global has at
// least one dim, size >= 1, 0 <= rank < size and B % size == 0 (pad or drop
// the last batch: uneven shards would weight samples unequally under avg).
Tensor shard_batch(const Tensor& global, int rank, int size);
// shard_batch(global, comm.rank(), comm.size()).
Tensor shard_batch(const Tensor& global, const comm::Communicator& comm);

}  // namespace meshtrain::parallel
