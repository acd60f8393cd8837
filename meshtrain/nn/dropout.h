// Dropout whose mask depends only on (seed, name, step, global sample, feature),
// so every data-parallel layout draws the same mask as one device.
//
//   nn::Dropout drop(0.1, "3", /*seed=*/42);
//   drop.set_batch_context(step, /*first_global_sample=*/rank * local_batch);
//   Tensor y = drop.forward(x);    // (B, ...): y = x * keep / (1 - p); the mask is keyed by the context
//   Tensor dx = drop.backward(dy); // dy * keep / (1 - p)
//
// Mask: dim 0 of x is the batch; F = numel / B is the number of features per
// sample (all other dims, row-major). For local sample i and feature f,
//   u = uniform_at(seed, step_key(name, step), (first_global_sample + i) * F + f, 0, 1)
// rounded to f32 (step_key(name, step) = key_from_name("<name>@step=<step>"),
// see internal/buffers.h), and the element is kept iff u >= p. A rank holding
// samples [a, b) of the global batch thus sees exactly rows [a, b) of the
// single-device mask. The trainer must advance the step (set_batch_context)
// every step, or the same mask repeats; replaying a forward with the same
// context (activation recomputation) reproduces the mask.
//
// Split features (DropoutShard): when a tensor-parallel layout gives this
// rank only some of each sample's features, the mask keeps the one-device
// numbering: rank r of `ranks` holds features [o, o + F) of each sample's
// G, and its element (i, f) draws u at (first_global_sample + i) * G + o + f.
// With `features` = G > 0 the slice is shard_range(G, r, ranks) (a column
// split of a hidden layer); with 0 the slices are equal, G = ranks * F and
// o = r * F (a sequence-parallel split of (B, T, C) along T; when the
// batch context's sequence_length T is set, the input is (B, s, C) with
// ranks x s >= T padded steps and G = T C, so the real steps draw one
// device's masks). With `pieces`
// (context parallelism's zig-zag chunks) each sample's F features are
// |pieces| equal runs of L = F / |pieces|, run j being piece pieces[j] of
// the sample's total_pieces: element (i, j L + f) draws at
// (first_global_sample + i) * total_pieces * L + pieces[j] * L + f. With
// pieces and ranks > 1 (context parallelism with sequence parallelism) the
// input is (B, s, C): the pieces' steps (T / total_pieces each, T the batch
// context's sequence_length), concatenated, padded at the end to ranks x s
// and split over the ranks, this rank's s of them; a real step draws its C
// features at its place in the sample (one device's mask), a padded step
// is dropped.
//
// In evaluation mode, or with p = 0, forward returns x itself and backward
// returns grad_out itself (no copy). p = 1 drops everything (output 0).
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/nn/module.h"

namespace meshtrain::nn {

// Which of each sample's features the input holds (see above); the default: all.
struct DropoutShard {
  int rank = 0;
  int ranks = 1;
  int64_t features = 0;  // G; 0: equal slices of the input's own size
  std::vector<int64_t> pieces = {};  // non-empty: the runs this rank holds (then split by rank/ranks)
  int64_t total_pieces = 0;
};

class Dropout final : public Module {
 public:
  // 0 <= p <= 1. `name` is the module's path; it keys the random stream and
  // must be unique among the model's dropouts.
  Dropout(double p, const std::string& name, uint64_t seed, DropoutShard shard = {});

  // forward: x (B, ...) f32 with B >= 0 -> same shape; backward: dy * mask.
  std::vector<Parameter*> parameters() override { return {}; }

  double p() const { return p_; }
  const std::string& name() const { return name_; }

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  std::string describe() const override { return "Dropout '" + name_ + "'"; }

 private:
  struct State {
    bool identity = false;        // the forward passed x through
    std::vector<int64_t> shape;   // shape of the forward's input
    Tensor scale;                 // (numel) 0 or 1 / (1 - p) per element
    Tensor y, dx;                 // output and input-gradient buffers
  };
  double p_;
  std::string name_;
  uint64_t seed_;
  DropoutShard shard_;
};

}  // namespace meshtrain::nn
