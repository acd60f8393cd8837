// Where a run stands after its last step: what resuming it needs besides the
// parameters and the optimizer state. The trainer returns it
// (TrainResult::state) and writes it into the run directory as
// trainer_state.json:
//
//   {"format": "meshtrain.trainer_state", "version": 1, "step": 30,
//    "epoch": 0, "batch": 30, "seed": 0, "loss_scale": 0, "skipped_steps": 0}
//
// The data position is the sampler's (sampler.h): the global batch the next
// step would train on, independent of the data-parallel degree, so a resumed
// run on any mesh sees the batches an uninterrupted one would.
// Errors: from_json throws IoError naming `source` for text that is not
// such an object (a missing or mistyped field, a negative count, another
// format or version).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "meshtrain/data/sampler.h"

namespace meshtrain::train {

struct TrainerState {
  int64_t step = 0;           // optimizer steps taken (skipped ones count)
  data::DataPosition data;          // the next step's global batch
  uint64_t seed = 0;          // the run's seed (initialization, dropout, sampler)
  double loss_scale = 0;      // fp16's dynamic loss scale; 0 without a scaler
  int64_t skipped_steps = 0;  // steps whose update was skipped

  std::string to_json() const;
  static TrainerState from_json(std::string_view text, const std::string& source);
  friend bool operator==(const TrainerState&, const TrainerState&) = default;
};

}  // namespace meshtrain::train
