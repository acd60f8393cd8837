#include "meshtrain/optim/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "meshtrain/core/error.h"

namespace meshtrain::optim {

LrSchedule LrSchedule::constant(double base_lr) {
  check_hparam("LrSchedule::constant", "base_lr", base_lr, 0.0, HUGE_VAL, true);
  return LrSchedule(LrScheduleKind::constant, base_lr, 0, 0, 1.0);
}

LrSchedule LrSchedule::cosine_with_warmup(double base_lr, int64_t warmup_steps, int64_t total_steps,
                                          double min_lr_ratio) {
  const std::string op = "LrSchedule::cosine_with_warmup";
  check_hparam(op, "base_lr", base_lr, 0.0, HUGE_VAL, true);
  check_hparam(op, "min_lr_ratio", min_lr_ratio, 0.0, 1.0, false);
  if (warmup_steps < 0 || total_steps < warmup_steps)
    throw InvalidArgument(op,
                          fmt::format("warmup_steps {} and total_steps {} need 0 <= warmup_steps <= total_steps",
                                      warmup_steps, total_steps),
                          "total_steps counts every update, warmup included");
  return LrSchedule(LrScheduleKind::cosine_with_warmup, base_lr, warmup_steps, total_steps, min_lr_ratio);
}

double LrSchedule::lr(int64_t step) const {
  if (step < 0)
    throw InvalidArgument("LrSchedule::lr", fmt::format("step {} < 0", step), "steps count from 0");
  switch (kind_) {
    case LrScheduleKind::constant:
      return base_lr_;
    case LrScheduleKind::cosine_with_warmup: {
      if (step < warmup_steps_)
        return base_lr_ * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps_));
      const double progress =
          std::min(1.0, static_cast<double>(step - warmup_steps_) /
                            static_cast<double>(std::max<int64_t>(1, total_steps_ - warmup_steps_)));
      const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
      return base_lr_ * (min_lr_ratio_ + (1.0 - min_lr_ratio_) * cosine);
    }
  }
  return base_lr_;  // unreachable: every kind is handled above
}

LrScheduler::LrScheduler(Optimizer& optimizer, LrSchedule schedule, int64_t first_step)
    : optimizer_(optimizer), schedule_(schedule), next_step_(first_step) {
  optimizer_.set_lr(schedule_.lr(next_step_));  // throws for first_step < 0
}

void LrScheduler::step() {
  ++next_step_;
  optimizer_.set_lr(schedule_.lr(next_step_));
}

}  // namespace meshtrain::optim
