// What one device of a layout holds of the model, shared by the planner's
// memory, traffic and time models: the model's own parameter list
// (GptShape::model) placed by the placement rule over the pipeline and
// tensor axes. Not for use outside plan.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "meshtrain/plan/model_description.h"

namespace meshtrain::plan::internal {

// shape.model's description for `stages` stages, checked against the
// shape. InvalidArgument when the shape has no model source.
std::shared_ptr<const ModelDescription> describe(const GptShape& shape, int stages);

// One parameter a device holds: its local element count (its tensor-
// parallel block) and its fully sharded unit numbered for the models:
// 0..blocks-1 the stage's blocks, blocks the tied embedding as a unit of
// its own, blocks + 1 the rest of the stage. `replicated`: the tensor axis
// does not split it (LayerNorms, row-parallel biases, wpe).
struct StageParam {
  int64_t numel = 0;
  int unit = 0;
  bool replicated = false;
  bool expert = false;  // a routed expert's (ParamInfo::routed_expert): its gradient skips the expert axis
  bool operator==(const StageParam&) const = default;
};

// What every (stage, tensor rank) of a layout holds, placed once per
// prediction (the rule builds names and boxes; the models only count).
// With an expert axis, what its rank 0 holds: every rank of it holds as
// many experts of the same sizes.
class Holdings {
 public:
  // `model` cut into the layout's stages; `tensor`, `expert`: the axes.
  Holdings(std::shared_ptr<const ModelDescription> model, int tensor, int expert);
  const ModelDescription& model() const { return *model_; }
  int tensor() const { return tensor_; }
  int expert() const { return expert_; }
  // What tensor rank t holds of stage s, in the model's parameter order.
  const std::vector<StageParam>& at(int s, int t) const;
  // Whether tensor rank t holds what rank t - 1 does of every stage in
  // `stages` (the same counts): the models price such a rank once.
  bool same_as_previous(const std::vector<int>& stages, int t) const;

 private:
  std::shared_ptr<const ModelDescription> model_;
  int tensor_, expert_;
  std::vector<std::vector<StageParam>> held_;  // [s * tensor + t]
};

// The Holdings of shape.model cut into `stages` stages over `tensor` and
// `expert` ranks: describe() placed once and kept (a small process-wide
// cache keyed by the description, which the entry keeps alive), since the
// layout search prices thousands of layouts that share a few (stages,
// tensor, expert).
std::shared_ptr<const Holdings> holdings(const GptShape& shape, int stages, int tensor, int expert);

}  // namespace meshtrain::plan::internal
