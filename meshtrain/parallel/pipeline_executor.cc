#include "meshtrain/parallel/pipeline_executor.h"

#include <fmt/format.h>

#include <utility>

#include "meshtrain/core/error.h"

namespace meshtrain::parallel {

// A posted receive: its buffer (declared before the Work, so the Work's
// destructor, which waits, runs before the buffer is freed) and its entry of
// the timeline, which spans the wait once the compute needing it waits.
struct PipelineExecutor::Inbox {
  Tensor buffer;
  comm::Work work;
  size_t event = 0;
  bool posted = false;
};

// What one (stage, micro-batch) holds between its actions.
struct PipelineExecutor::Slot {
  std::unique_ptr<nn::Saved> saved;   // forward -> backward_weight
  Tensor output;                      // forward's output: sent, or handed to the next stage here
  Tensor input_grad;                  // backward_input's result: sent, or handed to the previous stage
  std::vector<int64_t> output_shape;  // of forward's output: the gradient received for it
  Inbox input, grad;                  // the received input and output gradient
};

namespace {

constexpr const char* kOp = "PipelineExecutor";

double micros(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

size_t count(const Tensor& t) { return static_cast<size_t>(t.numel()); }

}  // namespace

PipelineExecutor::PipelineExecutor(Schedule schedule, comm::Communicator& comm, std::map<int, PipelineStage*> stages)
    : schedule_(std::move(schedule)), comm_(comm), stages_(std::move(stages)) {
  if (schedule_.ranks != comm_.size() || static_cast<int>(schedule_.programs.size()) != schedule_.ranks)
    throw InvalidArgument(kOp,
                          fmt::format("a schedule for {} ranks on a pipeline communicator of {}", schedule_.ranks,
                                      comm_.size()),
                          "make the schedule for the pipeline axis's size");
  for (int s = 0; s < schedule_.num_stages(); ++s) {
    const bool mine = schedule_.stage_rank(s) == comm_.rank();
    const auto it = stages_.find(s);
    if (mine != (it != stages_.end() && it->second != nullptr))
      throw InvalidArgument(kOp,
                            fmt::format("rank {} {} stage {}, which the schedule places on rank {}", comm_.rank(),
                                        mine ? "lacks" : "was given", s, schedule_.stage_rank(s)),
                            "pass exactly the stages s with stage_rank(s) == this rank");
  }
  if (stages_.size() != static_cast<size_t>(schedule_.virtual_stages))
    throw InvalidArgument(kOp,
                          fmt::format("{} stages for {} chunks per rank", stages_.size(), schedule_.virtual_stages),
                          "pass one stage per chunk");
}

PipelineExecutor::~PipelineExecutor() = default;

PipelineExecutor::Slot& PipelineExecutor::slot(int stage, int mb) {
  std::unique_ptr<Slot>& s = slots_[{stage, mb}];
  if (!s) s = std::make_unique<Slot>();
  return *s;
}

// Unique per transfer: kind (activation 0, gradient 1), stage, micro-batch.
int PipelineExecutor::tag(ActionKind kind, int stage, int mb) const {
  const bool grad = kind == ActionKind::send_grad || kind == ActionKind::recv_grad;
  return ((grad ? 1 : 0) * schedule_.num_stages() + stage) * schedule_.micro_batches + mb;
}

// The input of a forward of a.stage: none on stage 0, the previous stage's
// output on this rank, else the received buffer (waited for now).
Tensor PipelineExecutor::take_input(const Action& a) {
  if (a.stage == 0) return Tensor();
  if (schedule_.stage_rank(a.stage - 1) == comm_.rank())
    return std::exchange(slot(a.stage - 1, a.micro_batch).output, {});
  return receive(slot(a.stage, a.micro_batch).input, a);
}

// The output gradient of a backward of a.stage: none on the last stage.
Tensor PipelineExecutor::take_grad(const Action& a) {
  if (a.stage == schedule_.num_stages() - 1) return Tensor();
  if (schedule_.stage_rank(a.stage + 1) == comm_.rank())
    return std::exchange(slot(a.stage + 1, a.micro_batch).input_grad, {});
  return receive(slot(a.stage, a.micro_batch).grad, a);
}

// Waits for a posted receive and takes its buffer; its timeline entry spans the wait.
Tensor PipelineExecutor::receive(Inbox& box, const Action& a) {
  if (!box.posted)
    throw InvalidArgument(kOp, fmt::format("rank {}: {} before its receive", comm_.rank(), a.to_string()),
                          "check the schedule with check_schedule");
  const double start = micros(t0_);
  box.work.wait();
  timeline_[box.event].start_us = start;
  timeline_[box.event].end_us = micros(t0_);
  box.posted = false;
  return std::exchange(box.buffer, {});
}

// Posts a receive of `shape` into `box` for action a (its timeline entry is the next one).
void PipelineExecutor::post(Inbox& box, const Action& a, const std::vector<int64_t>& shape, ActionKind send_kind) {
  box.buffer = Tensor::empty(shape, DType::f32);
  box.work = comm_.recv_async(box.buffer.data<float>(), count(box.buffer), DType::f32, a.peer,
                              tag(send_kind, a.stage, a.micro_batch));
  box.posted = true;
  box.event = timeline_.size();
}

void PipelineExecutor::compute(const Action& a) {
  PipelineStage& stage = *stages_.at(a.stage);
  Slot& s = slot(a.stage, a.micro_batch);
  switch (a.kind) {
    case ActionKind::forward: {
      const Tensor input = take_input(a);
      const double start = micros(t0_);
      s.saved = std::make_unique<nn::Saved>();
      peak_saved_ = std::max(peak_saved_, ++live_saved_);
      Tensor out = stage.forward(a.micro_batch, input, *s.saved);
      if (a.stage + 1 < schedule_.num_stages()) {
        s.output = out.to(DType::f32).contiguous();
        s.output_shape = s.output.shape();
      }
      timeline_.push_back({a, start, micros(t0_)});
      return;
    }
    case ActionKind::backward:
    case ActionKind::backward_input: {
      const Tensor grad = take_grad(a);
      const double start = micros(t0_);
      const bool fused = a.kind == ActionKind::backward;
      Tensor gi = fused ? stage.backward(a.micro_batch, grad, *s.saved)
                        : stage.backward_input(a.micro_batch, grad, *s.saved);
      if (a.stage > 0) s.input_grad = gi.to(DType::f32).contiguous();
      if (fused) {
        s.saved.reset();
        --live_saved_;
      }
      timeline_.push_back({a, start, micros(t0_)});
      return;
    }
    case ActionKind::backward_weight: {
      const double start = micros(t0_);
      stage.backward_weight(a.micro_batch, *s.saved);
      s.saved.reset();
      --live_saved_;
      timeline_.push_back({a, start, micros(t0_)});
      return;
    }
    default: break;
  }
}

void PipelineExecutor::run() {
  t0_ = std::chrono::steady_clock::now();
  start_time_us_ = std::chrono::duration<double, std::micro>(t0_.time_since_epoch()).count();
  timeline_.clear();
  slots_.clear();
  live_saved_ = peak_saved_ = 0;
  for (const Action& a : schedule_.programs[static_cast<size_t>(comm_.rank())]) {
    if (is_compute(a.kind)) {
      compute(a);
      reap_sends();
      continue;
    }
    const double start = micros(t0_);
    switch (a.kind) {
      case ActionKind::send_activation:
      case ActionKind::send_grad: {
        // The tensor leaves the slot: the pending send keeps it until it completes.
        Slot& s = slot(a.stage, a.micro_batch);
        const bool grad = a.kind == ActionKind::send_grad;
        Tensor data = std::exchange(grad ? s.input_grad : s.output, {});
        if (!data.defined())
          throw InvalidArgument(kOp, fmt::format("rank {}: {} before its compute", comm_.rank(), a.to_string()),
                                "check the schedule with check_schedule");
        comm::Work w = comm_.send_async(data.data<float>(), count(data), DType::f32, a.peer,
                                        tag(a.kind, grad ? a.stage - 1 : a.stage + 1, a.micro_batch));
        sends_.push_back({std::move(data), std::move(w)});
        break;
      }
      case ActionKind::recv_activation:
        post(slot(a.stage, a.micro_batch).input, a, stages_.at(a.stage)->input_shape(a.micro_batch),
             ActionKind::send_activation);
        break;
      case ActionKind::recv_grad: {
        Slot& s = slot(a.stage, a.micro_batch);
        // The gradient of this stage's output, of the output's shape.
        if (s.output_shape.empty())
          throw InvalidArgument(kOp, fmt::format("rank {}: {} before its forward", comm_.rank(), a.to_string()),
                                "check the schedule with check_schedule");
        post(s.grad, a, s.output_shape, ActionKind::send_grad);
        break;
      }
      default: break;
    }
    timeline_.push_back({a, start, micros(t0_)});
    reap_sends();
  }
  for (PendingSend& p : sends_) p.work.wait();
  sends_.clear();
  slots_.clear();
}

// Frees the tensors of the sends that completed (rethrowing their errors).
void PipelineExecutor::reap_sends() {
  while (!sends_.empty() && sends_.front().work.is_completed()) {
    sends_.front().work.wait();
    sends_.pop_front();
  }
}

}  // namespace meshtrain::parallel
