// Learning-rate schedules: a pure function lr(step) of a small config, and an
// LrScheduler that drives an Optimizer's lr like torch.optim.lr_scheduler.
//
//   optim::LrSchedule s = optim::LrSchedule::cosine_with_warmup(
//       /*base_lr=*/3e-4, /*warmup_steps=*/100, /*total_steps=*/1000, /*min_lr_ratio=*/0.1);
//   s.lr(0);     // 0       (first update: warmup starts at 0, as in transformers)
//   s.lr(50);    // 1.5e-4
//   s.lr(100);   // 3e-4    (peak)
//   s.lr(550);   // 1.65e-4 (half way: min + (base - min) / 2)
//   s.lr(1000);  // 3e-5    (and every later step)
//
// `step` counts optimizer updates already taken: lr(step) is the rate of the
// update with 0-based index `step`. With W = warmup_steps, T = total_steps,
// r = min_lr_ratio:
//   constant:            lr(step) = base_lr
//   cosine_with_warmup:  step <  W:  base_lr * step / max(1, W)
//                        step >= W:  progress = min(1, (step - W) / max(1, T - W))
//                                    cosine   = 0.5 * (1 + cos(pi * progress))
//                                    lr(step) = base_lr * (r + (1 - r) * cosine)
// This is transformers' get_cosine_with_min_lr_schedule_with_warmup
// (num_cycles = 0.5, min_lr_rate = r) with one deliberate difference: past
// total_steps the rate stays at base_lr * r (transformers lets the cosine rise
// again). r = 0 gives get_cosine_schedule_with_warmup.
//
// Thread-safety: LrSchedule is an immutable value; lr() is pure. An
// LrScheduler belongs to the thread of its optimizer.
#pragma once

#include <cstdint>

#include "meshtrain/optim/optimizer.h"

namespace meshtrain::optim {

enum class LrScheduleKind : uint8_t { constant, cosine_with_warmup };

class LrSchedule {
 public:
  // Needs a finite base_lr >= 0.
  static LrSchedule constant(double base_lr);
  // Needs a finite base_lr >= 0, 0 <= warmup_steps <= total_steps and
  // min_lr_ratio in [0, 1]. Throws InvalidArgument otherwise.
  static LrSchedule cosine_with_warmup(double base_lr, int64_t warmup_steps, int64_t total_steps,
                                       double min_lr_ratio = 0.0);

  // The learning rate of update number `step` (0-based); needs step >= 0.
  double lr(int64_t step) const;

  LrScheduleKind kind() const { return kind_; }
  double base_lr() const { return base_lr_; }
  int64_t warmup_steps() const { return warmup_steps_; }
  int64_t total_steps() const { return total_steps_; }
  double min_lr_ratio() const { return min_lr_ratio_; }

 private:
  LrSchedule(LrScheduleKind kind, double base_lr, int64_t warmup_steps, int64_t total_steps,
             double min_lr_ratio)
      : kind_(kind),
        base_lr_(base_lr),
        warmup_steps_(warmup_steps),
        total_steps_(total_steps),
        min_lr_ratio_(min_lr_ratio) {}

  LrScheduleKind kind_;
  double base_lr_;
  int64_t warmup_steps_;
  int64_t total_steps_;
  double min_lr_ratio_;
};

// Keeps an optimizer's lr on a schedule. Like a PyTorch LR scheduler: the
// constructor sets lr(first_step), and step(), called after each
// optimizer.step(), advances the count and sets the next update's rate.
//
//   LrScheduler sched(opt, schedule);
//   for (...) { ...; opt.step(); sched.step(); }
class LrScheduler {
 public:
  // `optimizer` is borrowed and must outlive the scheduler. first_step >= 0
  // resumes a run: the next update is number first_step.
  LrScheduler(Optimizer& optimizer, LrSchedule schedule, int64_t first_step = 0);

  // One more update was taken: sets the optimizer's lr to lr(next_step()).
  void step();
  // The 0-based number of the next update (what a checkpoint stores).
  int64_t next_step() const { return next_step_; }
  // The rate the next update uses (the optimizer's lr).
  double current_lr() const { return schedule_.lr(next_step_); }
  const LrSchedule& schedule() const { return schedule_; }

 private:
  Optimizer& optimizer_;
  LrSchedule schedule_;
  int64_t next_step_;
};

}  // namespace meshtrain::optim
