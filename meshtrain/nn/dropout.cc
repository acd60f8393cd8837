#include "meshtrain/nn/dropout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"

namespace meshtrain::nn {

Dropout::Dropout(double p, const std::string& name, uint64_t seed, DropoutShard shard)
    : p_(p), name_(name), seed_(seed), shard_(shard) {
  if (!(p >= 0.0 && p <= 1.0))
    throw InvalidArgument("Dropout", fmt::format("'{}': p = {}", name, p), "use a probability 0 <= p <= 1");
  for (int64_t piece : shard.pieces)
    if (piece < 0 || piece >= shard.total_pieces)
      throw InvalidArgument("Dropout", fmt::format("'{}': piece {} of {}", name, piece, shard.total_pieces),
                            "pass pieces in [0, total_pieces)");
  if (shard.ranks < 1 || shard.rank < 0 || shard.rank >= shard.ranks || shard.features < 0)
    throw InvalidArgument("Dropout",
                          fmt::format("'{}': shard rank {} of {}, {} features", name, shard.rank, shard.ranks,
                                      shard.features),
                          "pass 0 <= rank < ranks and features >= 0");
}

Tensor Dropout::do_forward(const Tensor& x, Saved& saved) {
  const char* op = "Dropout::forward";
  Tensor xc = internal::f32_contiguous(x, op, "input");
  if (xc.dim() < 1)
    throw InvalidArgument(op, fmt::format("'{}': input is a scalar", name_), "dim 0 must be the batch");
  State& st = saved.state<State>();
  st.shape = xc.shape();
  st.identity = !training_ || p_ == 0.0;
  if (st.identity) return x;

  const BatchContext& ctx = saved.batch;
  if (ctx.first_global_sample < 0)
    throw InvalidArgument(op, fmt::format("'{}': first_global_sample {}", name_, ctx.first_global_sample),
                          "set_batch_context needs the global index of the first local sample, >= 0");
  const int64_t n = xc.numel();
  const int64_t batch = xc.size(0);
  const int64_t features = batch == 0 ? 0 : n / batch;  // F: elements per sample
  Tensor& scale = internal::reuse_or_allocate(st.scale, {n}, tracker_);
  // u at global index (first_global_sample + i) * G + o + f (G = F, o = 0
  // unsplit: the local elements are one contiguous run of the global stream).
  int64_t global = features * shard_.ranks, offset = features * shard_.rank;
  if (shard_.features > 0) {
    const ShardRange s = shard_range(shard_.features, shard_.rank, shard_.ranks);
    if (s.size() != features)
      throw InvalidArgument(op,
                            fmt::format("'{}': input {} has {} features per sample; rank {} of {} holds {} of {}",
                                        name_, shape_to_string(xc.shape()), features, shard_.rank, shard_.ranks,
                                        s.size(), shard_.features),
                            "pass this rank's slice of the features");
    global = shard_.features;
    offset = s.begin;
  } else if (shard_.ranks > 1 && shard_.pieces.empty() && ctx.sequence_length > 0) {
    // A sequence split of (B, s, C) padded to ranks x s >= T steps: the
    // one-device numbering counts T C features per sample, so a real
    // step's mask does not depend on the padding (padded steps draw
    // whatever their index gives; they never reach a real step).
    const int64_t steps = xc.dim() >= 2 ? xc.size(1) : 0;
    const int64_t padded = steps * shard_.ranks;
    if (steps == 0 || ctx.sequence_length > padded || ctx.sequence_length <= padded - shard_.ranks)
      throw InvalidArgument(op,
                            fmt::format("'{}': input {} split over {} ranks for a sequence of {} steps", name_,
                                        shape_to_string(xc.shape()), shard_.ranks, ctx.sequence_length),
                            "pass this rank's ceil(T / ranks) steps of (batch, steps, features)");
    global = ctx.sequence_length * (features / steps);
  }
  const uint64_t key = internal::step_key(name_, ctx.step);
  const auto first = static_cast<uint64_t>(ctx.first_global_sample);
  if (!shard_.pieces.empty() && shard_.ranks > 1) {
    // The pieces' steps, concatenated, padded to ranks x s and split: this
    // rank holds s of them; each real step draws at its place in the sample.
    const int64_t whole = ctx.sequence_length, np = static_cast<int64_t>(shard_.pieces.size());
    const int64_t steps = xc.dim() >= 2 ? xc.size(1) : 0, padded = steps * shard_.ranks;
    const int64_t run = shard_.total_pieces > 0 ? whole / shard_.total_pieces : 0, real = np * run;
    if (steps == 0 || whole <= 0 || whole % shard_.total_pieces != 0 || real > padded ||
        real <= padded - shard_.ranks)
      throw InvalidArgument(op,
                            fmt::format("'{}': input {} split over {} ranks for {} of {} pieces of a sequence of {} "
                                        "steps",
                                        name_, shape_to_string(xc.shape()), shard_.ranks, np, shard_.total_pieces,
                                        whole),
                            "pass this rank's ceil(pieces' steps / ranks) steps and the batch context's "
                            "sequence_length T");
    const int64_t c = features / steps;
    const auto g = static_cast<uint64_t>(whole * c);
    for (int64_t i = 0; i < batch; ++i)
      for (int64_t j = 0; j < steps; ++j) {
        const int64_t l = shard_.rank * steps + j;  // in the pieces' concatenation
        Tensor dst = scale.narrow(0, i * features + j * c, c);
        if (l >= real) {  // padding: dropped (it reaches no real step)
          std::fill_n(dst.data<float>(), c, 0.0f);
          continue;
        }
        const int64_t at = shard_.pieces[static_cast<size_t>(l / run)] * run + l % run;  // the step in the sample
        functional::dropout_mask(seed_, key, (first + static_cast<uint64_t>(i)) * g + static_cast<uint64_t>(at * c),
                                 p_, dst);
      }
  } else if (!shard_.pieces.empty()) {  // runs of equal length, each from its place in the sample
    const auto np = static_cast<int64_t>(shard_.pieces.size());
    if (features % np != 0)
      throw InvalidArgument(op,
                            fmt::format("'{}': {} features per sample do not split into {} pieces", name_, features, np),
                            "pass this rank's sequence chunks whole");
    const int64_t run = features / np;
    const auto g = static_cast<uint64_t>(shard_.total_pieces * run);
    for (int64_t i = 0; i < batch; ++i)
      for (int64_t j = 0; j < np; ++j)
        functional::dropout_mask(seed_, key,
                                 (first + static_cast<uint64_t>(i)) * g +
                                     static_cast<uint64_t>(shard_.pieces[static_cast<size_t>(j)] * run),
                                 p_, scale.narrow(0, i * features + j * run, run));
  } else if (global == features) {
    functional::dropout_mask(seed_, key, first * static_cast<uint64_t>(features), p_, scale);
  } else {
    for (int64_t i = 0; i < batch; ++i)
      functional::dropout_mask(seed_, key, (first + static_cast<uint64_t>(i)) * static_cast<uint64_t>(global) +
                                               static_cast<uint64_t>(offset),
                               p_, scale.narrow(0, i * features, features));
  }
  Tensor& y = internal::reuse_or_allocate(st.y, st.shape, tracker_);
  mul(xc, scale.view(st.shape), y);
  return y;
}

Tensor Dropout::do_backward_input(const Tensor& grad_out, Saved& saved) {
  const char* op = "Dropout::backward";
  State& st = saved.state<State>();
  if (st.identity) {
    internal::check_shape(grad_out, st.shape, op, "grad_out");
    return grad_out;
  }
  Tensor dy = internal::f32_contiguous(grad_out, op, "grad_out");
  internal::check_shape(dy, st.shape, op, "grad_out");
  Tensor& dx = internal::reuse_or_allocate(st.dx, st.shape, tracker_);
  mul(dy, st.scale.view(st.shape), dx);
  return dx;
}

}  // namespace meshtrain::nn
