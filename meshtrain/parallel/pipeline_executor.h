// PipelineExecutor: runs one rank's list of a pipeline schedule
// (pipeline_schedule.h) over real stages of a model, with asynchronous
// send/recv between the ranks of the pipeline axis.
//
//   Schedule s = make_schedule(ScheduleKind::one_f_one_b, pp.size(), /*micro_batches=*/8);
//   MyStage stage(...);                                  // a PipelineStage: this rank's model part
//   PipelineExecutor exec(s, pp, {{pp.rank(), &stage}});
//   exec.run();                                          // one optimizer step's forwards and backwards
//   exec.timeline();                                     // when each action ran
//   gather_timelines(exec);                              // every rank's, on rank 0 (pipeline_timeline.h)
//
// Contracts:
// - The executor calls a stage's forward, backward (fused), backward_input
//   and backward_weight in the order of the rank's list, each micro-batch
//   with its own nn::Saved (kept from its forward until its backward or
//   backward_weight, then freed: the live count is peak_saved()). A fused
//   backward ("B") computes what backward_input then backward_weight do
//   (Module's contract: the same numbers).
// - Transfers: a stage's forward output goes to the next stage, its input
//   gradient to the previous one; across ranks as one asynchronous send and
//   receive per transfer (tag from the kind, stage and micro-batch), on the
//   same rank (ranks == 1) handed over directly. Receives are posted where
//   the list says and waited for just before the compute that needs them;
//   sends are waited for at the end of run(). That is the checker's
//   execution model (sends never block), so every list check_schedule
//   accepts runs without deadlock; a rank that stops makes its peers' waits
//   fail at the communicator's deadline, naming it.
// - Stage 0's forward gets an undefined input (it reads its own data) and
//   its backward_input's result is not sent; the last stage's forward output
//   is not sent (it keeps its loss) and its backward_input gets an undefined
//   gradient (it starts from the loss).
// - Activations and gradients cross ranks as f32: the receiver sizes an
//   activation by input_shape() (the shape the previous stage's forward
//   returns) and a gradient by its own forward's output. A sent tensor is
//   kept until its send completes (checked after every action), then freed.
// Thread-safety: one rank's thread, like its communicator.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/saved.h"
#include "meshtrain/parallel/pipeline_schedule.h"

namespace meshtrain::parallel {

// One stage (chunk) of the model as the executor drives it.
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // Micro-batch mb: `input` from the previous stage (undefined on stage 0) ->
  // the output for the next stage (ignored on the last stage).
  virtual Tensor forward(int mb, const Tensor& input, nn::Saved& saved) = 0;
  // The gradient of the stage's input (ignored on stage 0) from `grad`, that
  // of its output (undefined on the last stage: it starts from its loss).
  virtual Tensor backward_input(int mb, const Tensor& grad, nn::Saved& saved) = 0;
  // The weight gradients of that backward_input.
  virtual void backward_weight(int mb, nn::Saved& saved) = 0;
  // A fused backward ("B"): backward_input and backward_weight as one pass
  // (a model's fused backward frees each layer's buffers as it goes). The
  // default runs the two.
  virtual Tensor backward(int mb, const Tensor& grad, nn::Saved& saved) {
    Tensor g = backward_input(mb, grad, saved);
    backward_weight(mb, saved);
    return g;
  }
  // The shape of the input of micro-batch mb (not called on stage 0).
  virtual std::vector<int64_t> input_shape(int mb) const = 0;
};

// One action as it ran on this rank: microseconds since run() began. A
// compute action spans its work (not the wait for its input); a recv spans
// the wait for its data, from when the compute that needs it asked for it to
// when it was there (start == end when it already was; an unwaited recv
// keeps its posting time); a send is instantaneous (its posting).
struct PipelineEvent {
  Action action;
  double start_us = 0;
  double end_us = 0;
};

class PipelineExecutor {
 public:
  // schedule: made for comm.size() ranks; stages: this rank's stages by
  // index (every stage s with schedule.stage_rank(s) == comm.rank()), borrowed.
  // InvalidArgument when the schedule or the stages do not fit.
  PipelineExecutor(Schedule schedule, comm::Communicator& comm, std::map<int, PipelineStage*> stages);
  ~PipelineExecutor();

  // Collective over comm: runs this rank's list once.
  void run();

  const Schedule& schedule() const { return schedule_; }
  // The last run's actions in list order.
  const std::vector<PipelineEvent>& timeline() const { return timeline_; }
  // When the last run() began, as steady_clock's time since its epoch in
  // microseconds (0 before the first run): timeline()'s times are relative
  // to it. Threads of one process, and processes of one host, share
  // steady_clock, so start_time_us() + start_us puts ranks on one time base
  // there; clocks of different hosts are not synchronized (see
  // gather_timelines in pipeline_timeline.h).
  double start_time_us() const { return start_time_us_; }
  // The pipeline communicator run() uses.
  comm::Communicator& communicator() const { return comm_; }
  // The most micro-batches whose Saved state this rank held at once in the
  // last run (forward done, weight gradients not yet).
  int peak_saved() const { return peak_saved_; }

 private:
  struct Inbox;  // a posted receive
  struct Slot;   // one (stage, micro-batch)'s tensors and state
  Slot& slot(int stage, int mb);
  int tag(ActionKind kind, int stage, int mb) const;
  Tensor take_input(const Action& a);
  Tensor take_grad(const Action& a);
  Tensor receive(Inbox& box, const Action& a);
  void post(Inbox& box, const Action& a, const std::vector<int64_t>& shape, ActionKind send_kind);
  void compute(const Action& a);

  Schedule schedule_;
  comm::Communicator& comm_;
  std::map<int, PipelineStage*> stages_;
  std::map<std::pair<int, int>, std::unique_ptr<Slot>> slots_;
  struct PendingSend {
    Tensor data;      // alive until the send completes: declared first, so
    comm::Work work;  // work's destructor (waiting, on errors too) runs before it is freed
  };
  void reap_sends();
  std::deque<PendingSend> sends_;
  std::vector<PipelineEvent> timeline_;
  std::chrono::steady_clock::time_point t0_;
  double start_time_us_ = 0;
  int live_saved_ = 0, peak_saved_ = 0;
};

}  // namespace meshtrain::parallel
