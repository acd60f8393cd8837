// Mixture of experts (Switch, GShard, Mixtral, DeepSeek-V3): a router picks
// top_k of `experts` SwiGLU MLPs per token and the layer returns their
// outputs weighted by the router's scores, plus optional shared experts
// every token goes through. Under the names of Hugging Face's DeepSeek/Qwen
// MoE models:
//
//   nn::MoE moe({.width = 512,
//                .moe = {.experts = 8, .top_k = 2, .expert_hidden = 256, .aux_loss_coef = 0.01,
//                        .capacity_factor = 1.25},
//                .prefix = "model.layers.0.mlp"});
//   // "model.layers.0.mlp.gate.weight" (512, 8): the router
//   // "model.layers.0.mlp.experts.3.gate_proj.weight" (512, 256), .up_proj, .down_proj
//   Tensor y = moe.forward(x);   // (B, T, 512) -> (B, T, 512)
//   Tensor dx = moe.backward(dy);
//
// Routing, per token x (one row):
//   logits = x Wr (the router "gate", a Linear without bias, (width, experts))
//   s = softmax(logits) (RouterScore::softmax) or sigmoid(logits) (sigmoid)
//   the top_k experts by s + bias (bias: DeepSeek-V3's load-balancing
//   correction, zero unless update_bias runs; ties: the lower index),
//   their weights w_j = s_j, divided by their sum when normalize_top_k
//   y = sum_j w_j expert_j(x) (in slot order) + shared(x)
// Capacity: capacity_factor > 0 lets each expert take at most
// ceil(capacity_factor * T * top_k / experts) assignments of each sequence
// (T steps), first slot 0 of every step in order, then slot 1, and so on;
// the rest are dropped (weight 0: the token keeps its residual). Counted
// per sequence, the decisions never depend on how a batch is split over
// devices (data, pipeline micro-batches, expert ranks). 0: no token dropped.
// Auxiliary load-balancing loss (aux_loss_coef > 0), the Switch/GShard form
// per sequence (DeepSeek-V3's sequence-wise loss):
//   L_aux = coef * experts / (top_k T) * sum_e count_e * mean_t p_{t,e}
// with count_e the sequence's top-k selections of expert e (before
// dropping) and p the scores normalized over experts (softmax: s itself),
// averaged over the step's sequences (BatchContext::global_samples; 0: the
// call's). Its gradient reaches the router in backward; its value and the
// expert loads are in load() (the trainer reports them).
// Expert parallelism (config.expert, a group of P ranks; experts % P == 0):
// rank r holds experts [r E/P, (r+1) E/P) and parameters() lists only those
// (the router and shared experts are on every rank). Each rank routes its
// own tokens, sends each assignment's row to the rank of its expert (an
// all_to_all_v, counts exchanged first), runs its experts on what arrived
// and sends the outputs back; backward does the same with the gradients.
// A rank or expert that receives no token is a normal case (empty GEMMs;
// every parameter's grad_ready still fires). Tensor parallelism
// (config.tensor, no sequence parallelism): every expert and the shared
// experts split as SwiGLUMLP splits (the router is replicated).
// Rows travel in f32. Memory: keeps the router's scores and each
// assignment's row and output for backward.
// Thread-safety: one thread at a time (a module belongs to one rank).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/nn/module.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/nn/swiglu.h"

namespace meshtrain::nn {

using layout::RouterScore;

// The ranks the experts are split over (null or size 1: all on this rank).
struct ExpertParallelGroup {
  comm::Communicator* comm = nullptr;
  int size() const { return comm == nullptr ? 1 : comm->size(); }
  int rank() const { return comm == nullptr ? 0 : comm->rank(); }
};

// What a decoder's MoE layers share (GPTConfig::moe; layout/vocabulary.h).
using layout::MoEOptions;

struct MoEConfig {
  int64_t width = 0;               // input and output features, >= 1
  MoEOptions moe = {};             // experts >= 1, expert_hidden >= 1
  std::string prefix = "";         // module path ("" at the root)
  uint64_t seed = 0;               // initialization seed
  double init_std = 0.0;           // > 0: N(0, init_std) weights (SwiGLUConfig::init_std)
  double out_std = 0.0;            // > 0: the down projections' std
  bool defer_init = false;         // LinearOptions::defer_init
  TensorParallelGroup tensor = {};
  ExpertParallelGroup expert = {};
};

// What the routed forwards of this rank counted since the last take_load()
// (training forwards only; a recompute replay is not counted twice).
struct MoELoad {
  std::vector<int64_t> tokens;  // per expert (all of them): top-k selections, before dropping
  int64_t assignments = 0;      // selections in all (tokens x top_k)
  int64_t dropped = 0;          // selections over capacity
  double aux_loss = 0.0;        // sum of the sequences' L_aux (coef included; divide by sequences)
  int64_t sequences = 0;
};

class MoE final : public Module {
 public:
  explicit MoE(const MoEConfig& config);
  // The router, this rank's experts (by global index), the shared experts.
  std::vector<Parameter*> parameters() override;
  std::vector<Module*> children() override;
  const MoEConfig& config() const { return config_; }
  // This rank's experts: [first_expert(), first_expert() + local_experts()).
  int first_expert() const { return first_; }
  int local_experts() const { return static_cast<int>(experts_.size()); }

  // Counts of the training forwards since the last call (then reset).
  MoELoad take_load();
  // DeepSeek-V3's auxiliary-loss-free balancing: bias_e += rate *
  // sign(mean(load) - load_e), with load the step's selections per expert
  // over every rank (a sum of take_load().tokens); shifts selection only.
  void update_bias(std::span<const int64_t> load, double rate);
  // The selection bias: (experts,) f32, updated in place (checkpoints load
  // into it), named bias_name() = "<prefix>.gate.e_score_correction_bias"
  // (Hugging Face DeepSeek-V3's name).
  const Tensor& bias() const { return bias_; }
  std::string bias_name() const;
  void set_bias(std::span<const float> bias);

 protected:
  Tensor do_forward(const Tensor& x, Saved& saved) override;
  Tensor do_backward_input(const Tensor& grad_out, Saved& saved) override;
  void do_backward_weight(Saved& saved) override;
  std::string describe() const override { return "MoE '" + config_.prefix + "'"; }

 private:
  struct State;
  // Sends rows (this rank's dispatch order) to the experts' ranks and
  // returns, per local expert, the rows it received (contiguous).
  std::vector<Tensor> dispatch(State& st, const Tensor& rows);
  // The reverse: the local experts' rows back to their tokens' ranks, in
  // the dispatch order.
  Tensor combine(State& st, const std::vector<Tensor>& per_expert);

  MoEConfig config_;
  int first_ = 0;
  std::unique_ptr<Module> router_;
  std::vector<std::unique_ptr<SwiGLUMLP>> experts_;
  std::unique_ptr<SwiGLUMLP> shared_;
  Tensor bias_;
  MoELoad load_;
};

}  // namespace meshtrain::nn
