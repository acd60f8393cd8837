#include "meshtrain/optim/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"

namespace meshtrain::optim {
namespace {

constexpr const char* kConfigOp = "DynamicLossScalerConfig";

void check_finite(const char* what, double value) {
  if (!std::isfinite(value))
    throw InvalidArgument(kConfigOp, fmt::format("{} = {} is not finite", what, value),
                          fmt::format("use a finite {}", what));
}

}  // namespace

void DynamicLossScalerConfig::validate() const {
  check_finite("initial_scale", initial_scale);
  check_finite("growth_factor", growth_factor);
  check_finite("backoff_factor", backoff_factor);
  check_finite("min_scale", min_scale);
  check_finite("max_scale", max_scale);
  if (!(min_scale > 0.0))
    throw InvalidArgument(kConfigOp, fmt::format("min_scale = {} must be > 0", min_scale),
                          "a typical min_scale is 1");
  if (!(min_scale <= max_scale))
    throw InvalidArgument(kConfigOp, fmt::format("min_scale = {} > max_scale = {}", min_scale, max_scale),
                          "use 0 < min_scale <= max_scale");
  if (!(initial_scale >= min_scale && initial_scale <= max_scale))
    throw InvalidArgument(kConfigOp,
                          fmt::format("initial_scale = {} is outside [min_scale, max_scale] = [{}, {}]",
                                      initial_scale, min_scale, max_scale),
                          "start within the bounds (the default is 2^15)");
  if (!(growth_factor > 1.0))
    throw InvalidArgument(kConfigOp, fmt::format("growth_factor = {} must be > 1", growth_factor),
                          "a typical growth_factor is 2");
  if (!(backoff_factor > 0.0 && backoff_factor < 1.0))
    throw InvalidArgument(kConfigOp, fmt::format("backoff_factor = {} must be in (0, 1)", backoff_factor),
                          "a typical backoff_factor is 0.5");
  if (growth_interval < 1)
    throw InvalidArgument(kConfigOp, fmt::format("growth_interval = {} must be >= 1", growth_interval),
                          "a typical growth_interval is 2000 steps");
}

DynamicLossScaler::DynamicLossScaler(DynamicLossScalerConfig config) : config_(config) {
  config_.validate();
  scale_ = config_.initial_scale;
}

bool DynamicLossScaler::update(bool found_nonfinite) {
  if (found_nonfinite) {
    scale_ = std::max(scale_ * config_.backoff_factor, config_.min_scale);
    good_steps_ = 0;
    ++skipped_steps_;
    return false;
  }
  if (++good_steps_ >= config_.growth_interval) {
    scale_ = std::min(scale_ * config_.growth_factor, config_.max_scale);
    good_steps_ = 0;
  }
  return true;
}

void DynamicLossScaler::load_state(const State& state) {
  if (!(std::isfinite(state.scale) && state.scale >= config_.min_scale && state.scale <= config_.max_scale))
    throw InvalidArgument("DynamicLossScaler::load_state",
                          fmt::format("scale {} is not a finite value in [min_scale, max_scale] = [{}, {}]",
                                      state.scale, config_.min_scale, config_.max_scale),
                          "load a state saved by a scaler with the same bounds");
  if (state.good_steps < 0 || state.skipped_steps < 0)
    throw InvalidArgument("DynamicLossScaler::load_state",
                          fmt::format("counts must be >= 0 (got good_steps {}, skipped_steps {})",
                                      state.good_steps, state.skipped_steps),
                          "load a state saved by DynamicLossScaler::state()");
  scale_ = state.scale;
  good_steps_ = state.good_steps;
  skipped_steps_ = state.skipped_steps;
}

}  // namespace meshtrain::optim
