// The run of issue 42's expert-parallel parity (tests/expert_parity_test.cc
// on the threads engine, tests/expert_parity_mpi_main.cc under mpirun): the
// small GPT of tests/gpt_parity.h with Llama's blocks whose MLPs are
// mixtures of 4 SwiGLU experts (top-2 of a softmax router, one shared
// expert, the auxiliary loss on), 30 steps of fp32 training with a batch of
// 16 in 2 micro-batches, in no-drop mode or with a capacity factor that
// drops tokens, optionally with gradient clipping that is active.
#pragma once

#include <fmt/format.h>

#include <string>

#include "tests/gpt_parity.h"

namespace meshtrain {

struct ExpertLayout {
  std::string mesh = "";  // "" = one device
  std::string fsdp = "";
  std::string schedule = "1f1b";
  double capacity_factor = 0.0;  // 0: no token dropped
  double clip_norm = 0.0;        // > 0: clipping (active at 0.05)
  std::string router = "softmax";
  double bias_update_rate = 0.0;  // DeepSeek-V3's balancing
  bool recompute = false;
  int top_k = 2;
  std::string init_from = "";  // a model file to start from (--init-from)

  // "data=2,expert=2 zero3 cf 1", ...
  std::string name() const {
    return fmt::format("{}{}{}{}{}{}{}{}{}", mesh.empty() ? "one device" : mesh, fsdp.empty() ? "" : " " + fsdp,
                       mesh.find("pipeline") != std::string::npos ? " " + schedule : "",
                       capacity_factor > 0 ? fmt::format(" cf {}", capacity_factor) : " no-drop",
                       clip_norm > 0 ? fmt::format(" clip {}", clip_norm) : "", router == "softmax" ? "" : " " + router,
                       bias_update_rate > 0 ? fmt::format(" bias {}", bias_update_rate) : "",
                       recompute ? " recompute" : "", init_from.empty() ? "" : " from " + init_from);
  }
  // The one-device run this layout must equal (same model and optimization).
  ExpertLayout reference() const {
    return {.capacity_factor = capacity_factor, .clip_norm = clip_norm, .router = router,
            .bias_update_rate = bias_update_rate, .top_k = top_k, .init_from = init_from};
  }
};

inline train::TrainConfig expert_config(const ExpertLayout& l, const std::string& tag) {
  train::TrainConfig tc = gpt_parity_config("expert_" + tag);
  tc.arch = layout::DecoderArch::llama;
  tc.kv_heads = 2;
  tc.dropout = 0.0;
  tc.batch_size = 16;
  tc.micro_batches = 2;
  tc.moe = {.experts = 4, .top_k = l.top_k, .expert_hidden = 32, .shared_experts = 1, .aux_loss_coef = 0.01,
            .capacity_factor = l.capacity_factor, .bias_update_rate = l.bias_update_rate};
  tc.recompute = l.recompute;
  tc.init_from = l.init_from;
  tc.set("router_score", l.router, "ExpertLayout.router");
  tc.clip_norm = l.clip_norm;
  tc.set("fsdp", l.fsdp, "ExpertLayout.fsdp");
  tc.set("pipeline_schedule", l.schedule, "ExpertLayout.schedule");
  return tc;
}

}  // namespace meshtrain
