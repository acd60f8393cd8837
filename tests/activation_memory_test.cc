// plan::estimate_activations against what nn::GPT really charges to a
// MemoryTracker's activations: real forward and backward passes, the loss
// the trainer uses (CrossEntropyLoss; VocabParallelCrossEntropy under tensor
// parallelism, with the tracker as train/gpt_recipe.cc gives it) and the
// batch's tokens and targets charged as the data loader charges them
// (data/text_data.cc). Two micro-batches through one Saved per case: the
// first "cold" (a fresh Saved, as a pipeline's), the second "warm" (the
// trainer's reused one). Multi-rank cases run on the threads engine. A
// hook on the GPT and its blocks (the scopes of fully sharded data
// parallelism's units) records the bytes at each of its calls and the most
// between them: the estimate's timelines.
// The table printed at the end is docs/planner.md's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/parallel/context_parallel.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/plan/activation_memory.h"

namespace meshtrain {
namespace {

constexpr MemoryCategory kAct = MemoryCategory::activations;

struct Case {
  std::string name;
  plan::GptShape shape;
  plan::ActivationLayout layout;
};

// What one rank measured, relative to the level with only the batch loaded.
struct Measured {
  double batch = 0, saved = 0, peak = 0, resident = 0, saved_warm = 0, peak_warm = 0, stage_output = 0;
  std::vector<plan::ActivationMoment> timeline, timeline_warm;
};

// Records a plan::ActivationMoment at every before_use / after_use of the
// GPT and its blocks: the level then, and (through the tracker's peak, reset
// at each call) the most until the next call.
class ScopeRecorder final : public nn::ParamHook {
 public:
  ScopeRecorder(nn::GPT& gpt, MemoryTracker& mem, double base, int64_t first_block)
      : gpt_(&gpt), mem_(&mem), base_(base) {
    for (nn::Module* b : gpt.blocks()) index_.push_back({b, first_block++});
  }
  bool scopes(nn::Module& m) override { return &m == gpt_ || block(m) >= 0; }
  void before_use(nn::Module& m, nn::Pass pass) override { add(plan::ScopeEvent::before_use, m, pass); }
  void after_use(nn::Module& m, nn::Pass pass) override { add(plan::ScopeEvent::after_use, m, pass); }
  // A new timeline from here.
  void start() {
    moments_.clear();
    add(plan::ScopeEvent::start, *gpt_, nn::Pass::forward);
  }
  std::vector<plan::ActivationMoment> take() {
    close();
    return std::exchange(moments_, {});
  }

 private:
  int64_t block(const nn::Module& m) const {
    for (const auto& [b, i] : index_)
      if (b == &m) return i;
    return -1;
  }
  double level() const { return static_cast<double>(mem_->in_use(kAct)) - base_; }
  void close() {
    if (!moments_.empty()) moments_.back().peak = static_cast<double>(mem_->peak(kAct)) - base_;
  }
  void add(plan::ScopeEvent event, nn::Module& m, nn::Pass pass) {
    close();
    mem_->reset_peak();
    moments_.push_back({.event = event, .pass = static_cast<plan::ScopePass>(pass), .block = block(m),
                        .at = level(), .peak = level()});
  }

  nn::GPT* gpt_;
  MemoryTracker* mem_;
  double base_;
  std::vector<std::pair<const nn::Module*, int64_t>> index_;
  std::vector<plan::ActivationMoment> moments_;
};

static_assert(static_cast<int>(nn::Pass::backward_weight) == static_cast<int>(plan::ScopePass::backward_weight));

double timeline_peak(const std::vector<plan::ActivationMoment>& t) {
  double p = 0;
  for (const plan::ActivationMoment& m : t) p = std::max(p, m.peak);
  return p;
}

// Token ids in [0, vocab), a function of (seed, index).
Tensor token_tensor(int64_t b, int64_t t, int64_t vocab, uint64_t seed, MemoryTracker* tracker) {
  Tensor out = Tensor::empty({b, t}, DType::i64, Device{}, tracker, kAct);
  std::vector<float> u(static_cast<size_t>(b * t));
  fill_uniform(u.data(), u.size(), seed, 7, 0, 0.0f, 1.0f);
  for (size_t i = 0; i < u.size(); ++i)
    out.data<int64_t>()[i] = std::min<int64_t>(vocab - 1, static_cast<int64_t>(u[i] * static_cast<float>(vocab)));
  return out;
}

// An untracked f32 tensor (a pipeline's receive buffer), values in [-1, 1).
Tensor received(const std::vector<int64_t>& shape, uint64_t seed) {
  Tensor out = Tensor::empty(shape, DType::f32);
  fill_uniform(out.data<float>(), static_cast<size_t>(out.numel()), seed, 11, 0, -1.0f, 1.0f);
  return out;
}

// Two micro-batches of one rank through one GPT and one Saved.
Measured run_rank(const Case& cs, const nn::TensorParallelGroup& tp, const nn::ContextParallelGroup& cp) {
  const plan::GptShape& s = cs.shape;
  const plan::ActivationLayout& l = cs.layout;
  MemoryTracker mem;
  nn::GPT gpt(nn::GPTConfig{.arch = s.arch, .kv_heads = s.kv_heads, .ffn_hidden = s.ffn_hidden, .vocab = s.vocab,
                            .block_size = s.seq, .layers = s.layers, .heads = s.heads, .width = s.width, .seed = 3,
                            .recompute = l.recompute, .dropout = l.dropout, .tensor = tp,
                            .first_block = l.first_block, .last_block = l.last_block, .embed = l.embed,
                            .head = l.head, .context = cp, .moe = s.moe});
  gpt.set_memory_tracker(&mem);
  gpt.set_compute_dtype(l.compute);
  gpt.set_training(l.training);
  nn::CrossEntropyLoss ce;
  std::optional<nn::VocabParallelCrossEntropy> vce;
  if (tp.size() > 1) vce.emplace(tp, s.vocab, &mem);
  const int64_t b = l.micro_batch, steps = l.sequence_parallel && tp.size() > 1 ? s.seq / tp.size() : s.seq;
  const Tensor tokens = token_tensor(b, s.seq, s.vocab, 1, &mem), targets = token_tensor(b, s.seq, s.vocab, 2, &mem);
  Measured m;
  m.batch = static_cast<double>(mem.in_use(kAct));
  const auto level = [&] { return static_cast<double>(mem.in_use(kAct)) - m.batch; };
  ScopeRecorder scopes(gpt, mem, m.batch, l.first_block);
  gpt.add_hook(&scopes);
  nn::Saved saved, loss_saved;
  for (uint64_t step = 0; step < 2; ++step) {
    scopes.start();
    gpt.set_batch_context(step, 0);
    {
      const Tensor out = gpt.forward(l.embed ? tokens : received({b, steps, s.width}, 5 + step), saved);
      if (l.head) {
        const Tensor mine = cp.active() ? nn::shard_sequence(targets, cp, 1) : targets;
        const Tensor t = mine.view({mine.numel()});
        if (vce)
          vce->forward(out, t, loss_saved);
        else
          ce.forward(out, t, loss_saved);
      } else {
        m.stage_output = static_cast<double>(out.numel() * 4);
      }
    }  // the logits die (or the output is handed on)
    (step == 0 ? m.saved : m.saved_warm) = level();
    {
      const Tensor grad = !l.head ? received({b, steps, s.width}, 9 + step)
                          : vce   ? vce->backward(loss_saved)
                                  : ce.backward(loss_saved);
      if (l.split_backward) {
        gpt.backward_input(grad, saved);
        gpt.backward_weight(saved);
      } else {
        gpt.backward(grad, saved);
      }
    }
    std::vector<plan::ActivationMoment>& timeline = step == 0 ? m.timeline : m.timeline_warm;
    timeline = scopes.take();
    (step == 0 ? m.peak : m.peak_warm) = timeline_peak(timeline);
    if (step == 0) m.resident = level();
  }
  return m;
}

// Every rank's measurement (rank order); tensor x context ranks, the tensor
// axis fastest.
std::vector<Measured> run(const Case& cs) {
  const int k = cs.layout.tensor, n = cs.layout.context;
  if (k * n == 1) return {run_rank(cs, {}, {})};
  std::vector<Measured> out(static_cast<size_t>(k * n));
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = k * n, .timeout = std::chrono::seconds(60),
                .bind_to_cores = false},
               [&](comm::Communicator& world) {
                 const int r = world.rank();
                 std::unique_ptr<comm::Communicator> tcomm, ccomm;
                 nn::TensorParallelGroup tp;
                 nn::ContextParallelGroup cp;
                 if (k > 1) {
                   tcomm = world.split(r / k, r % k);
                   tp = {tcomm.get(), cs.layout.sequence_parallel};
                 }
                 if (n > 1) {
                   ccomm = world.split(r % k, r / k);
                   cp = {ccomm.get(), cs.layout.cp_comm, cs.layout.cp_load_balance};
                 }
                 const Measured m = run_rank(cs, tp, cp);
                 std::lock_guard lock(mu);
                 out[static_cast<size_t>(r)] = m;
               });
  return out;
}

std::vector<Case> cases() {
  const plan::GptShape s1{.vocab = 64, .seq = 16, .layers = 2, .heads = 4, .width = 32};
  const plan::GptShape s2{.vocab = 96, .seq = 8, .layers = 1, .heads = 2, .width = 16};
  const plan::GptShape s3{.vocab = 50, .seq = 12, .layers = 3, .heads = 3, .width = 24};
  const plan::GptShape s4{.vocab = 65, .seq = 8, .layers = 2, .heads = 4, .width = 32};
  const plan::GptShape s5{.vocab = 64, .seq = 9, .layers = 1, .heads = 4, .width = 32};
  const plan::GptShape s6{.vocab = 64, .seq = 16, .layers = 4, .heads = 4, .width = 32};
  // Llama's blocks (2 key/value heads, a 40-feature SwiGLU), and with
  // mixture-of-experts layers after the first block (4 experts of 24
  // features, top-2, a shared expert).
  const plan::GptShape l1{.vocab = 64, .seq = 16, .layers = 2, .heads = 4, .width = 32,
                          .arch = layout::DecoderArch::llama, .kv_heads = 2, .ffn_hidden = 40};
  plan::GptShape m1 = l1;
  m1.layers = 3;
  m1.moe = {.experts = 4, .top_k = 2, .expert_hidden = 24, .shared_experts = 1, .first_dense = 1};
  using L = plan::ActivationLayout;
  std::vector<Case> c = {
      {"B2 T16 C32 H4 V64 L2", s1, L{.micro_batch = 2}},
      {"  + recompute", s1, L{.micro_batch = 2, .recompute = true}},
      {"  + dropout", s1, L{.micro_batch = 2, .dropout = 0.1}},
      {"  + recompute + dropout", s1, L{.micro_batch = 2, .recompute = true, .dropout = 0.1}},
      {"  eval mode, dropout", s1, L{.micro_batch = 2, .dropout = 0.1, .training = false}},
      {"  bf16", s1, L{.micro_batch = 2, .compute = DType::bf16}},
      {"  bf16 + recompute + dropout", s1,
       L{.micro_batch = 2, .recompute = true, .compute = DType::bf16, .dropout = 0.1}},
      {"B1 T8 C16 H2 V96 L1", s2, L{.micro_batch = 1}},
      {"B3 T12 C24 H3 V50 L3", s3, L{.micro_batch = 3}},
      {"B1 T16 C32 H4 V64 L4 recompute", s6, L{.micro_batch = 1, .recompute = true}},
      {"  split backward", s6, L{.micro_batch = 1, .split_backward = true}},
      {"  split backward + recompute", s6, L{.micro_batch = 1, .recompute = true, .split_backward = true}},
      {"  split backward + bf16 + dropout", s6,
       L{.micro_batch = 1, .split_backward = true, .compute = DType::bf16, .dropout = 0.1}},
      {"B2 T16 C32 H4 V64 L2 tensor=2", s1, L{.micro_batch = 2, .tensor = 2}},
      {"B2 T8 C32 H4 V65 L2 tensor=2 (uneven vocab)", s4, L{.micro_batch = 2, .tensor = 2}},
      {"  sequence parallel", s4, L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true}},
      {"  sequence parallel + dropout + bf16", s4,
       L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true, .compute = DType::bf16, .dropout = 0.1}},
      {"  sequence parallel + recompute", s4,
       L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true, .recompute = true}},
      {"  sequence parallel, split backward", s4,
       L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true, .split_backward = true}},
      {"B1 T8 C16 H2 V96 L1 tensor=2 sp (1 head per rank)", s2,
       L{.micro_batch = 1, .tensor = 2, .sequence_parallel = true}},
      {"B2 T9 C32 H4 V64 L1 tensor=2 sp (padded to 10)", s5,
       L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true}},
      {"B2 T16 C32 H4 V64 L2 context=2 ring", s1, L{.micro_batch = 2, .context = 2}},
      {"  all_to_all", s1, L{.micro_batch = 2, .context = 2, .cp_comm = layout::ContextComm::all_to_all}},
      {"  ring, in order, recompute + dropout", s1,
       L{.micro_batch = 2, .context = 2, .cp_load_balance = false, .recompute = true, .dropout = 0.1}},
      {"  tensor=2 x context=2 ring", s1, L{.micro_batch = 2, .tensor = 2, .context = 2}},
      {"B3 T12 C24 H3 V50 L3 stage 0: embed + h.0", s3, L{.micro_batch = 3, .last_block = 1, .head = false}},
      {"  stage 1: h.1", s3, L{.micro_batch = 3, .first_block = 1, .last_block = 2, .embed = false, .head = false}},
      {"  stage 2: h.2 + head", s3, L{.micro_batch = 3, .first_block = 2, .embed = false}},
      {"  stage 0, recompute + dropout", s3,
       L{.micro_batch = 3, .recompute = true, .dropout = 0.1, .last_block = 1, .head = false}},
      {"  stage 2, bf16 + dropout", s3,
       L{.micro_batch = 3, .compute = DType::bf16, .dropout = 0.1, .first_block = 2, .embed = false}},
      {"  stage 2, split backward, bf16", s3,
       L{.micro_batch = 3, .split_backward = true, .compute = DType::bf16, .first_block = 2, .embed = false}},
      {"  stage 0, split backward + recompute", s3,
       L{.micro_batch = 3, .recompute = true, .split_backward = true, .last_block = 1, .head = false}},
      {"llama B2 T16 C32 H4 kv2 F40 V64 L2", l1, L{.micro_batch = 2}},
      {"  + recompute", l1, L{.micro_batch = 2, .recompute = true}},
      {"  split backward + bf16", l1, L{.micro_batch = 2, .split_backward = true, .compute = DType::bf16}},
      {"  tensor=2", l1, L{.micro_batch = 2, .tensor = 2}},
      {"  tensor=2 sp", l1, L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true}},
      {"  tensor=4 (key/value heads replicated)", l1, L{.micro_batch = 2, .tensor = 4}},
      {"  tensor=4 sp (key/value heads replicated)", l1, L{.micro_batch = 2, .tensor = 4, .sequence_parallel = true}},
      {"  context=2 ring", l1, L{.micro_batch = 2, .context = 2}},
      {"moe B2 T16 C32 E4 top2 F24 +shared L3", m1, L{.micro_batch = 2}},
      {"  + recompute", m1, L{.micro_batch = 2, .recompute = true}},
      {"  split backward", m1, L{.micro_batch = 2, .split_backward = true}},
      {"  bf16", m1, L{.micro_batch = 2, .compute = DType::bf16}},
      {"  tensor=2", m1, L{.micro_batch = 2, .tensor = 2}},
      {"B2 T8 C32 H4 V65 L2 tensor=2 sp, stage 1 of 2", s4,
       L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true, .last_block = 1, .head = false}},
      {"  stage 2 of 2", s4,
       L{.micro_batch = 2, .tensor = 2, .sequence_parallel = true, .first_block = 1, .embed = false}},
  };
  return c;
}

double rel(double got, double want) { return want == 0 ? std::abs(got) : std::abs(got - want) / want; }

TEST(ActivationMemory, EstimateMatchesTheTrackerWithin2Percent) {
  std::string table =
      "| configuration | rank | saved est. | saved meas. | peak est. | peak meas. | warm peak est. | warm peak meas. "
      "|\n|---|---|---|---|---|---|---|---|\n";
  double worst = 0;
  for (const Case& cs : cases()) {
    SCOPED_TRACE(cs.name);
    const std::vector<Measured> got = run(cs);
    for (size_t r = 0; r < got.size(); ++r) {
      plan::ActivationLayout l = cs.layout;
      l.tensor_rank = static_cast<int>(r) % l.tensor;
      const plan::ActivationEstimate e = plan::estimate_activations(cs.shape, l);
      const Measured& m = got[r];
      const std::string what = fmt::format("rank {}\nsaved at the cold peak ({}):\n{}", r, e.peak_at,
                                           plan::to_string(e.peak_terms));
      EXPECT_EQ(m.batch, e.batch_bytes) << what;
      EXPECT_LE(rel(m.saved, e.saved_per_micro_batch), 0.02) << what << m.saved << " vs " << e.saved_per_micro_batch;
      EXPECT_LE(rel(m.peak, e.peak_one_micro_batch), 0.02) << what << m.peak << " vs " << e.peak_one_micro_batch;
      EXPECT_LE(rel(m.resident, e.resident_after_backward), 0.02) << what;
      EXPECT_LE(rel(m.saved_warm, e.saved_warm), 0.02) << what;
      EXPECT_LE(rel(m.peak_warm, e.peak_warm), 0.02) << what;
      EXPECT_EQ(m.stage_output, e.stage_output) << what;
      for (const auto& [got_t, want_t] : {std::pair{&m.timeline, &e.timeline}, {&m.timeline_warm, &e.timeline_warm}}) {
        ASSERT_EQ(got_t->size(), want_t->size()) << what;
        for (size_t i = 0; i < got_t->size(); ++i) {
          const plan::ActivationMoment &a = (*got_t)[i], &b = (*want_t)[i];
          const std::string at = fmt::format("moment {} ({} {} block {})", i, static_cast<int>(a.event),
                                             static_cast<int>(a.pass), a.block);
          EXPECT_EQ(a.event, b.event) << what << at;
          EXPECT_EQ(a.pass, b.pass) << what << at;
          EXPECT_EQ(a.block, b.block) << what << at;
          EXPECT_LE(rel(a.at, b.at), 0.02) << what << at << ": " << a.at << " vs " << b.at;
          EXPECT_LE(rel(a.peak, b.peak), 0.02) << what << at << ": " << a.peak << " vs " << b.peak;
          worst = std::max({worst, rel(a.at, b.at), rel(a.peak, b.peak)});
        }
      }
      for (double x : {rel(m.saved, e.saved_per_micro_batch), rel(m.peak, e.peak_one_micro_batch),
                       rel(m.saved_warm, e.saved_warm), rel(m.peak_warm, e.peak_warm)})
        worst = std::max(worst, x);
      if (r > 0 && l.tensor == 1) continue;  // context ranks hold the same sizes
      if (l.tensor > 1 && r >= static_cast<size_t>(l.tensor)) continue;
      table += fmt::format("| {} | {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |\n", cs.name, r,
                           e.saved_per_micro_batch, m.saved, e.peak_one_micro_batch, m.peak, e.peak_warm,
                           m.peak_warm);
    }
  }
  fmt::print("{}\nworst relative difference: {:.4f}\n", table, worst);
}

TEST(ActivationMemory, RecomputeCutsThePeakOfTheFusedBackward) {
  // GPT::backward frees each block's rebuilt activations before the next
  // block's backward: the peak is the inputs plus one block. The split
  // passes keep every block's rebuilt activations until the weight passes.
  const plan::GptShape s{.vocab = 8192, .seq = 1024, .layers = 12, .heads = 12, .width = 768};
  const plan::ActivationEstimate plain = plan::estimate_activations(s, {.micro_batch = 8});
  const plan::ActivationEstimate rec = plan::estimate_activations(s, {.micro_batch = 8, .recompute = true});
  const plan::ActivationEstimate split =
      plan::estimate_activations(s, {.micro_batch = 8, .recompute = true, .split_backward = true});
  EXPECT_LT(rec.saved_per_micro_batch, plain.saved_per_micro_batch / 5);
  EXPECT_LT(rec.peak_one_micro_batch, plain.peak_one_micro_batch / 3);
  EXPECT_GT(split.peak_one_micro_batch, 0.9 * plain.peak_one_micro_batch);
  EXPECT_EQ(split.saved_per_micro_batch, rec.saved_per_micro_batch);
}

TEST(ActivationMemory, MegatronFormula) {
  // s b h (34 + 5 a s / h) for GPT-3 175B's layer (s 2048, h 12288, a 96), b 1.
  const plan::GptShape g{.vocab = 51200, .seq = 2048, .layers = 96, .heads = 96, .width = 12288};
  const double sbh = 2048.0 * 12288.0;
  EXPECT_DOUBLE_EQ(plan::megatron_layer_activation_bytes(g, 1), sbh * (34 + 5 * 96 * 2048.0 / 12288));
  EXPECT_DOUBLE_EQ(plan::megatron_layer_activation_bytes(g, 1, 8), sbh * (10 + 24.0 / 8 + 5 * 96 * 2048.0 / 12288 / 8));
  EXPECT_DOUBLE_EQ(plan::megatron_layer_activation_bytes(g, 1, 8, true, plan::MegatronRecompute::selective),
                   sbh * 34 / 8);
  EXPECT_DOUBLE_EQ(plan::megatron_layer_activation_bytes(g, 1, 1, false, plan::MegatronRecompute::full), 2 * sbh);
}

TEST(ActivationMemory, RefusesWhatTheGptRefuses) {
  const plan::GptShape s{.vocab = 64, .seq = 16, .layers = 2, .heads = 4, .width = 32};
  EXPECT_THROW(plan::estimate_activations(s, {.tensor = 3}), InvalidArgument);
  EXPECT_THROW(plan::estimate_activations({.vocab = 64, .seq = 15, .layers = 2, .heads = 4, .width = 32},
                                          {.context = 2}),
               InvalidArgument);
  EXPECT_THROW(plan::estimate_activations(s, {.tensor = 4, .context = 2, .cp_comm = layout::ContextComm::all_to_all}),
               InvalidArgument);  // 1 head per tensor rank over 2 context ranks
  EXPECT_THROW(plan::estimate_activations(s, {.first_block = 2, .last_block = 1}), InvalidArgument);
  EXPECT_THROW(plan::estimate_activations(s, {.compute = DType::f64}), InvalidArgument);
  // What it takes: sequence parallelism padding T = 9 over 2 ranks, with
  // dropout and in a pipeline part; context with sequence parallelism and
  // in a pipeline part.
  const plan::GptShape odd{.vocab = 64, .seq = 9, .layers = 2, .heads = 4, .width = 32};
  EXPECT_NO_THROW(plan::estimate_activations(odd, {.tensor = 2, .sequence_parallel = true}));
  EXPECT_NO_THROW(plan::estimate_activations(odd, {.tensor = 2, .sequence_parallel = true, .dropout = 0.1}));
  EXPECT_NO_THROW(plan::estimate_activations(odd, {.tensor = 2, .sequence_parallel = true, .head = false}));
  EXPECT_NO_THROW(plan::estimate_activations(s, {.tensor = 2, .sequence_parallel = true, .context = 2}));
  EXPECT_NO_THROW(plan::estimate_activations(s, {.context = 2, .embed = false}));
}

}  // namespace
}  // namespace meshtrain
