// TensorParallel: tensor and sequence parallelism's part of the step
// protocol (parallelism.h), around the strategy over the data-parallel
// ranks (DataParallel, FullyShardedDataParallel, or a PipelineParallel of
// them).
//
//   auto inner = std::make_unique<DataParallel>(tp_model, dp_comm, options);
//   TensorParallel par(std::move(inner), {.comm = &mesh.comm("tensor"), .sequence_parallel = true},
//                      sequence_parallel_names);        // collective over the tensor axis
//   ... the step protocol, as with any Parallelism ...
//
// The model's blocks are split over the tensor axis by its own modules
// (nn/parallel/tensor_parallel.h: column/row-parallel Linears, the
// vocabulary-parallel embedding and loss communicate inside forward and
// backward); what the axis needs once per step is here:
//   finish()        the inner strategy's, then the sequence-parallel
//                   parameters' partial gradients summed over the axis
//                   (nn::reduce_sequence_parallel_grads) and replicated
//                   key/value heads' over the ranks holding each;
//   grads_finite()  true only when it holds on every rank of the axis;
//   grad_norm()     the blocks' squares summed over the axis, the
//                   replicated parameters' counted once (one reduction);
//   grad_sq_split() the same per part, for an enclosing composition;
//   describe()      the inner strategy's, then "tensor parallel k" (and
//                   "sequence parallel").
// Everything else is the inner strategy's. Construction checks, collective
// over the axis, that every tensor rank holds the same elements of the
// sequence-parallel parameters (unequal vocabulary blocks under fsdp would
// shift the flat shards): InvalidArgument naming --sequence-parallel.
//
// Thread-safety: one rank's thread, like the strategy it wraps.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/parallel/parallelism.h"

namespace meshtrain::parallel {

class TensorParallel final : public WrappedParallelism {
 public:
  // group: the tensor axis (size > 1); sequence_parallel: the names of the
  // parameters whose gradients are partial over it (Parameter::
  // sequence_parallel); partial: parameters whose gradients are partial
  // over a subgroup of it (Parameter::partial_over: replicated key/value
  // heads), by name, summed there in finish too.
  TensorParallel(std::unique_ptr<Parallelism> inner, nn::TensorParallelGroup group,
                 std::vector<std::string> sequence_parallel,
                 std::vector<std::pair<std::string, comm::Communicator*>> partial = {});

  std::string describe() const override;
  void finish() override;
  bool grads_finite() override { return grads_finite_over(*group_.comm); }
  double grad_norm() override;
  std::pair<double, double> grad_sq_split(const std::function<bool(const nn::Parameter&)>& first) override;

 private:
  nn::TensorParallelGroup group_;
  std::vector<std::string> sequence_parallel_;
  std::vector<std::pair<std::string, comm::Communicator*>> partial_;
};

}  // namespace meshtrain::parallel
