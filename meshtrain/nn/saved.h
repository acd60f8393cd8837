// Saved: what one forward call of a module keeps for its backward (the
// activations of one micro-batch), so that several forwards can be in flight
// at once: a pipeline runs forward(i), forward(i + 1), then backward(i).
//
//   nn::Saved s0, s1;                          // one per micro-batch in flight
//   Tensor y0 = model.forward(x0, s0);
//   Tensor y1 = model.forward(x1, s1);
//   model.backward(dy0, s0);                   // uses micro-batch 0's activations
//   model.backward(dy1, s1);
//
// A Saved mirrors the module tree: a module keeps its own state in a typed
// slot (state<S>()) and gives each child a child Saved (child(i)). Its
// buffers (outputs, input gradients) stay in the slot after backward and are
// reused by the next forward into the same Saved when nobody else holds
// them, so a training loop that keeps one Saved per micro-batch slot
// allocates nothing in steady state. clear() frees everything.
//
// Phase: each Saved records where its call stands (forward done, input
// gradient done), so misuse (backward without forward, two backwards, the
// weight pass before the input pass) is an InvalidArgument naming the module
// instead of wrong numbers.
// Thread-safety: one thread at a time (a Saved belongs to one rank's module).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <typeinfo>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/core/tensor.h"

namespace meshtrain::nn {

// Where the current local batch sits in the run: random draws made in
// forward (dropout masks, a VAE's noise) are keyed by it (see module.h).
struct BatchContext {
  uint64_t step = 0;                // advanced by the trainer once per optimizer step
  int64_t first_global_sample = 0;  // global index of local sample 0 (>= 0)
  // The samples' real time steps T when a sequence-parallel split padded
  // them to a multiple of the tensor axis (0: the input's own length). A
  // sequence-split dropout numbers its mask by T, so padding leaves the
  // real steps' masks those of one device; a pipeline stage without the
  // embeddings learns T from it (nn::GPT).
  int64_t sequence_length = 0;
  // The step's samples over every rank and micro-batch: what a loss a
  // module adds itself (a MoE layer's auxiliary loss) is averaged over, as
  // the trainer's loss is (0: the call's own samples).
  double global_samples = 0;
  // The call's samples, where its inputs do not say (a GPT's position
  // table sees one sequence of positions for the whole batch): the
  // deterministic mode's node of the call (nn/deterministic.h). 0: the
  // input's first dim.
  int64_t samples = 0;
  // True while a recompute-mode module replays its forward inside backward
  // (Module::backward): what a forward counts (a MoE layer's expert load)
  // is counted once.
  bool replay = false;
};

class Saved {
 public:
  enum class Phase : uint8_t {
    empty,      // no forward, or its backward is complete
    forwarded,  // forward done; backward (or backward_input) may follow
    input_done  // backward_input done; backward_weight must follow
  };

  Saved() = default;
  Saved(Saved&&) = default;
  Saved& operator=(Saved&&) = default;
  Saved(const Saved&) = delete;
  Saved& operator=(const Saved&) = delete;

  // The module's own state, created (value-initialized) on first use. The
  // same Saved must not be used by two modules of different types: that is
  // an InvalidArgument (the state slot belongs to the first user).
  template <typename S>
  S& state() {
    if (!state_) {
      auto holder = std::make_unique<Holder<S>>();
      S& ref = holder->value;
      state_ = std::move(holder);
      return ref;
    }
    auto* h = dynamic_cast<Holder<S>*>(state_.get());
    if (h == nullptr)
      throw InvalidArgument("Saved::state", "this Saved holds the state of another kind of module",
                            "give every module call its own Saved (containers use child(i))");
    return h->value;
  }

  // The i-th child's Saved (created on first use).
  Saved& child(size_t i) {
    if (children_.size() <= i) children_.resize(i + 1);
    if (!children_[i]) children_[i] = std::make_unique<Saved>();
    return *children_[i];
  }

  Phase phase = Phase::empty;
  BatchContext batch;  // the batch context the forward ran under
  Tensor input;        // recompute mode: the forward's input, kept instead of its activations
  // recompute mode: the activations rebuilt in backward, dropped when the
  // backward is complete.
  std::unique_ptr<Saved> recomputed;

  // Frees every tensor and buffer (this node and below); phase becomes empty.
  void clear() {
    state_.reset();
    children_.clear();
    recomputed.reset();
    input = Tensor();
    phase = Phase::empty;
  }

 private:
  struct HolderBase {
    virtual ~HolderBase() = default;
  };
  template <typename S>
  struct Holder final : HolderBase {
    S value{};
  };
  std::unique_ptr<HolderBase> state_;
  std::vector<std::unique_ptr<Saved>> children_;
};

}  // namespace meshtrain::nn
