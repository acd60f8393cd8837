// The trainer's part for mixture-of-experts layers (RecipeModel::
// moe_layers), once per step: their load counts summed over the ranks,
// DeepSeek-V3's bias update, and what the run reports of them (the
// progress line's imbalance, dropped fraction and auxiliary loss;
// metrics.jsonl's moe_* numbers; expert_load.svg). Internal to the trainer.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/train/model_recipe.h"

namespace meshtrain::train::internal {

class MoeReport {
 public:
  // Collective over `world`: this rank's layers (a pipeline stage may hold
  // none), and the blocks and experts every rank then agrees on.
  MoeReport(MoELayers layers, comm::Communicator& world);
  bool active() const { return blocks_ > 0; }
  const MoELayers& layers() const { return layers_; }

  // Collective, once per step (step: 1-based): the layers' counts of the
  // step's forwards summed over `tokens` (the ranks that route other
  // tokens: data, node, fsdp, expert, context; tensor ranks route the same)
  // and over `stages` (the pipeline axis, or null: each stage holds its own
  // blocks), so every rank holds every block's totals; on an applied step
  // with bias_rate > 0 each layer's bias update; with `record` (the main
  // rank) each expert's share for the picture.
  void step(int64_t step, bool applied, double bias_rate, comm::Communicator& tokens, comm::Communicator* stages,
            bool record);

  // The last step's numbers: the progress line's (imbalance; dropped and
  // aux where the run drops tokens or has the loss) and metrics.jsonl's.
  void add_progress(std::vector<std::pair<std::string, double>>& shown, bool dropping, bool aux) const;
  void add_metrics(std::vector<std::pair<std::string, double>>& numbers) const;
  // expert_load.svg (every expert's share of the routed tokens per step);
  // "" when nothing was recorded.
  std::string picture(int64_t moe_layers) const;

 private:
  MoELayers layers_;
  int64_t blocks_ = 0, experts_ = 0;  // blocks up to the last MoE layer, experts per layer
  double imbalance_ = 0;              // the worst layer's max / mean tokens per expert
  double dropped_ = 0;                // the fraction of assignments over capacity
  double aux_loss_ = 0;               // the auxiliary losses' sum over layers (coefficient included)
  std::vector<double> shares_;        // each expert's share of the routed tokens, all layers
  std::vector<Series> recorded_;      // per expert, per step
};

}  // namespace meshtrain::train::internal
