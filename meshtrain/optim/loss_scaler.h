// DynamicLossScaler: the loss-scale schedule of fp16 mixed-precision training,
// as torch.amp.GradScaler (growth, backoff, growth interval), with the scale
// kept within [min_scale, max_scale].
//
// Why: f16 has a 5-bit exponent (largest 65504, smallest normal 2^-14), so
// small gradients underflow to zero in f16. Multiplying the loss (or its
// gradient) by S moves them into range; the optimizer divides by S again in
// f32. bf16 keeps f32's 8-bit exponent (the same range, less precision), so
// bf16 training needs no scaler; fp16 does.
//
// One training step, on every rank (fp16 grads, `world` = all ranks that hold
// gradients):
//   optim::DynamicLossScaler scaler;                  // S = 2^15
//   for (...) {
//     const double s = scaler.scale();                // read BEFORE update()
//     opt.zero_grad();
//     Tensor dy = loss_grad(...);                     // d loss / d output, f32
//     scale(dy, s);                                   // core/ops.h: gradient of (loss * s)
//     model.backward(dy);                             // grads are s times too large
//     ... reduce the grads as the strategy does ...
//     uint8_t bad = optim::grads_finite(my_params) ? 0 : 1;
//     world.all_reduce(&bad, &bad, 1, DType::u8, ReduceOp::max);  // same answer on every rank
//     if (scaler.update(bad != 0)) {                  // false: skip the step, everywhere
//       opt.set_grad_scale(1.0 / s);                  // unscale in f32 inside step()
//       opt.step();
//     }
//   }
// Unscale with set_grad_scale rather than scale_grads(params, 1 / s): the
// latter rounds the unscaled values back to f16, where small gradients turn
// subnormal or zero, the very loss the scaler exists to avoid.
// With clipping, the grads' norm is s times the true norm; unscale and clip in
// one multiply:
//   double norm = std::sqrt(local_sq_norm summed over the world) / s;
//   opt.set_grad_scale(optim::clip_factor(norm, max_norm) / s);
//
// All-ranks rule: found_nonfinite must be the same on every rank that holds
// gradients (data, tensor and pipeline ranks alike), which is why the flag is
// all-reduced with max before update(). A rank that skipped a step another
// rank applied would leave the replicas' weights and the scalers' scales
// apart for the rest of the run, silently.
//
// A skipped step applies nothing: the optimizer's state and step counts do
// not advance. Whether the learning-rate schedule advances is the trainer's
// choice (PyTorch's schedulers do).
//
// Determinism: arithmetic in double; with the default factors (powers of
// two) every scale is a power of two, exact in f32 and f16.
// Thread-safety: a scaler belongs to one rank's thread.
#pragma once

#include <cstdint>

namespace meshtrain::optim {

struct DynamicLossScalerConfig {
  double initial_scale = 32768.0;  // 2^15
  double growth_factor = 2.0;      // scale *= growth_factor after growth_interval good steps
  double backoff_factor = 0.5;     // scale *= backoff_factor after an overflow
  int64_t growth_interval = 2000;  // consecutive good steps before growing
  double min_scale = 1.0;          // the scale never goes below this
  double max_scale = 16777216.0;   // 2^24; the scale never goes above this

  // Throws InvalidArgument (op "DynamicLossScalerConfig") unless every value
  // is finite, 0 < min_scale <= max_scale, initial_scale is in [min_scale,
  // max_scale], growth_factor > 1, backoff_factor is in (0, 1) and
  // growth_interval >= 1.
  void validate() const;
};

class DynamicLossScaler {
 public:
  // What a checkpoint stores.
  struct State {
    double scale = 0.0;
    int64_t good_steps = 0;     // consecutive good steps since the last growth or overflow
    int64_t skipped_steps = 0;  // overflows seen since the start of the run
    bool operator==(const State&) const = default;
  };

  // Validates `config` (see DynamicLossScalerConfig::validate); the scale
  // starts at config.initial_scale, both counters at 0.
  explicit DynamicLossScaler(DynamicLossScalerConfig config = {});

  // Multiply the loss (or its gradient) by this before backward, and divide
  // the grads by the same value before step().
  double scale() const { return scale_; }

  // Records the outcome of one step and returns true when the step must be
  // APPLIED (no overflow). found_nonfinite must be identical on every rank
  // (see the all-ranks rule above).
  //   found_nonfinite: scale = max(scale * backoff_factor, min_scale),
  //                    good_steps = 0, skipped_steps += 1; returns false.
  //   otherwise:       good_steps += 1; once good_steps >= growth_interval:
  //                    scale = min(scale * growth_factor, max_scale),
  //                    good_steps = 0; returns true.
  bool update(bool found_nonfinite);

  int64_t good_steps() const { return good_steps_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  const DynamicLossScalerConfig& config() const { return config_; }

  State state() const { return State{scale_, good_steps_, skipped_steps_}; }
  // Restores a state(). Needs a finite scale in [min_scale, max_scale] and
  // counts >= 0 (InvalidArgument otherwise, the scaler unchanged). A
  // good_steps at or past growth_interval (a state saved under a longer
  // interval) grows the scale at the next good step.
  void load_state(const State& state);

 private:
  DynamicLossScalerConfig config_;
  double scale_;
  int64_t good_steps_ = 0;
  int64_t skipped_steps_ = 0;
};

}  // namespace meshtrain::optim
