// Llama's pieces split over a tensor axis equal the unsharded ones: the
// SwiGLU MLP, the grouped-query attention, the decoder block (plain,
// sequence-parallel and with communication overlap), and the GPT container
// with Llama's blocks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fmt/format.h>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/llama.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/parallel/parity_test_util.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/nn/swiglu.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::nn {
namespace {

using parity_test::block_of;
using parity_test::expect_near;
using parity_test::randn;

// `ref`'s forward of x (B, T, C) and backward of dy, against the module
// `make(group)` builds over `k` ranks of the threads engine (sequence
// parallelism and overlap as given; sequence parallel: each rank's T / k
// steps in and out). Each rank's initial blocks equal ref's (bit for bit)
// unless `copy_values` (ref's values changed after construction: they are
// copied in); the output, dX and every gradient block (the
// sequence-parallel ones summed over the axis) within 1e-5.
void expect_split_equals(Module& ref, const std::function<std::unique_ptr<Module>(TensorParallelGroup)>& make,
                         const Tensor& x, const Tensor& dy, int k, bool sp, bool overlap, bool copy_values = false) {
  ref.zero_grad();
  const Tensor y_ref = ref.forward(x).contiguous();
  const Tensor dx_ref = ref.backward(dy).contiguous();
  const std::vector<Parameter*> rp = ref.parameters();
  const int64_t steps = x.size(1) / k;
  comm::launch({.engine = comm::Engine::threads, .ranks = k, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 const std::unique_ptr<Module> tp =
                     make(TensorParallelGroup{.comm = &world, .sequence_parallel = sp, .overlap = overlap});
                 const std::vector<Parameter*> ps = tp->parameters();
                 ASSERT_EQ(ps.size(), rp.size());
                 const std::string what = fmt::format("k {} sp {} overlap {} rank {}", k, sp, overlap, world.rank());
                 std::vector<std::string> partial;
                 for (size_t i = 0; i < ps.size(); ++i) {
                   if (copy_values)
                     ps[i]->value.copy_from(
                         Tensor::from_vector(block_of(rp[i]->value, ps[i]->placement), ps[i]->value.shape()));
                   else
                     ASSERT_EQ(ps[i]->value.to_vector(), block_of(rp[i]->value, ps[i]->placement))
                         << what << " " << ps[i]->name;
                   if (ps[i]->sequence_parallel) partial.push_back(ps[i]->name);
                 }
                 const auto mine = [&](const Tensor& t) {
                   return sp ? t.narrow(1, world.rank() * steps, steps).contiguous() : t;
                 };
                 expect_near(tp->forward(mine(x)).contiguous().to_vector(), mine(y_ref).to_vector(), 1e-5,
                             what + " y");
                 expect_near(tp->backward(mine(dy)).contiguous().to_vector(), mine(dx_ref).to_vector(), 1e-5,
                             what + " dx");
                 reduce_sequence_parallel_grads(ps, partial, TensorParallelGroup{.comm = &world});
                 for (Parameter* p : ps)  // replicated key/value heads: summed over the ranks holding them
                   if (p->partial_over != nullptr) sum_grads({p}, *p->partial_over, "test");
                 for (size_t i = 0; i < ps.size(); ++i)
                   expect_near(ps[i]->grad.to_vector(), block_of(rp[i]->grad, ps[i]->placement), 1e-5,
                               what + " " + ps[i]->name + " grad");
               });
}

// The SwiGLU MLP over 2 and 4 ranks (gate and up column-, down
// row-parallel; hidden 10: uneven over 4), plain, sequence-parallel and
// with overlap.
TEST(TensorParallelSwiGLU, EqualsTheUnshardedMlp) {
  const SwiGLUConfig base{.width = 6, .hidden = 10, .prefix = "mlp", .seed = 5, .init_std = 0.4};
  SwiGLUMLP ref(base);
  const Tensor x = randn({2, 4, 6}, "x"), dy = randn({2, 4, 6}, "dy");
  for (const int k : {2, 4})
    for (const bool sp : {false, true})
      for (const bool overlap : {false, true})
        expect_split_equals(
            ref,
            [&](TensorParallelGroup g) {
              SwiGLUConfig c = base;
              c.tensor = g;
              return std::make_unique<SwiGLUMLP>(c);
            },
            x, dy, k, sp, overlap);
}

// Llama attention over 2 ranks (4 query heads, 2 key/value heads: each
// rank holds 2 query heads and the key/value head they read); over 4 ranks
// its 2 key/value heads are refused (replication: not yet).
TEST(TensorParallelLlama, AttentionEqualsTheUnshardedOne) {
  const LlamaAttentionConfig base{.width = 16, .heads = 4, .kv_heads = 2, .prefix = "attn", .seed = 3,
                                  .init_std = 0.3};
  LlamaAttention ref(base);
  const Tensor x = randn({2, 4, 16}, "x"), dy = randn({2, 4, 16}, "dy");
  for (const bool sp : {false, true})
    for (const bool overlap : {false, true})
      expect_split_equals(
          ref,
          [&](TensorParallelGroup g) {
            LlamaAttentionConfig c = base;
            c.tensor = g;
            return std::make_unique<LlamaAttention>(c);
          },
          x, dy, 2, sp, overlap);
  // More tensor ranks than key/value heads: each head replicated on
  // tensor / kv_heads ranks (Megatron's rule): 4 ranks over 2 heads, 4 and
  // 2 ranks over 1; their gradients are partial over those ranks. With
  // sequence parallelism k and v take the gathered input.
  for (const auto& [kv, k] : {std::pair{2, 4}, {1, 4}, {1, 2}}) {
    LlamaAttentionConfig rc = base;
    rc.kv_heads = kv;
    LlamaAttention replicated_ref(rc);
    for (const bool sp : {false, true})
      for (const bool overlap : {false, true})
        expect_split_equals(
            replicated_ref,
            [&](TensorParallelGroup g) {
              LlamaAttentionConfig c = rc;
              c.tensor = g;
              return std::make_unique<LlamaAttention>(c);
            },
            x, dy, k, sp, overlap);
  }
  comm::launch({.engine = comm::Engine::threads, .ranks = 3, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 LlamaAttentionConfig c{.width = 24, .heads = 6, .kv_heads = 2, .prefix = "attn"};
                 c.tensor = {.comm = &world};
                 EXPECT_THAT(testing::error_of([&] { LlamaAttention bad(c); }),
                             ::testing::HasSubstr("2 key/value heads over a tensor-parallel axis of 3 ranks"));
               });
}

// A Llama block over 2 ranks, plain, sequence-parallel (its RMSNorms'
// gradients then partial: summed by reduce_sequence_parallel_grads, 2 of
// them) and with overlap.
TEST(TensorParallelLlama, BlockEqualsTheUnshardedOne) {
  const LlamaBlockConfig base{.width = 16, .heads = 4, .kv_heads = 2, .ffn_hidden = 20, .prefix = "layers.0",
                              .seed = 6, .init_std = 0.3, .out_std = 0.1};
  LlamaBlock ref(base);
  for (Parameter* p : ref.parameters())
    if (p->value.dim() == 1) p->value.copy_from(randn({16}, p->name.c_str()));  // norms off 1
  const Tensor x = randn({2, 4, 16}, "x"), dy = randn({2, 4, 16}, "dy");
  for (const bool sp : {false, true})
    for (const bool overlap : {false, true})
      expect_split_equals(
          ref,
          [&](TensorParallelGroup g) {
            LlamaBlockConfig c = base;
            c.tensor = g;
            auto block = std::make_unique<LlamaBlock>(c);
            int partial = 0;
            for (const Parameter* p : block->parameters()) partial += p->sequence_parallel ? 1 : 0;
            EXPECT_EQ(partial, g.sequence_parallel ? 2 : 0);
            return block;
          },
          x, dy, 2, sp, overlap, /*copy_values=*/true);
}

// The GPT container with Llama's blocks (4 query heads, 2 key/value heads,
// no wpe, RMSNorm ln_f) split over 1 and 2 ranks, plain, sequence-parallel
// and with overlap, equals the unsharded model: initial blocks bit for
// bit, the loss and every gradient block within 1e-5; context parallelism
// and dropout are refused.
TEST(TensorParallelGpt, LlamaEqualsTheUnshardedModel) {
  const GPTConfig base{.arch = layout::DecoderArch::llama, .kv_heads = 2, .ffn_hidden = 24, .vocab = 13,
                       .block_size = 8, .layers = 2, .heads = 4, .width = 16, .seed = 7};
  std::vector<int64_t> ids(2 * 8), next(2 * 8);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i * 5 % 13), next[i] = static_cast<int64_t>((i * 7 + 3) % 13);
  const Tensor x = Tensor::from_vector(ids, {2, 8}), y = Tensor::from_vector(next, {16});
  GPT ref(base);
  std::vector<std::string> names;
  for (const Parameter* p : ref.parameters()) names.push_back(p->name);
  EXPECT_EQ(names.front(), "wte.weight");
  EXPECT_EQ(names[1], "h.0.input_layernorm.weight");
  EXPECT_EQ(names.back(), "ln_f.weight");
  EXPECT_EQ(std::count_if(names.begin(), names.end(), [](const std::string& n) { return n.find("wpe") != std::string::npos; }),
            0);
  CrossEntropyLoss ce;
  const double want = ce.forward(ref.forward(x), y);
  ref.backward(ce.backward());
  const std::vector<Parameter*> rp = ref.parameters();
  struct Mode {
    int k;
    bool sp, overlap;
  };
  for (const Mode m : {Mode{1, false, false}, Mode{2, false, false}, Mode{2, true, false}, Mode{2, true, true}})
    comm::launch({.engine = comm::Engine::threads, .ranks = m.k, .timeout = std::chrono::seconds(30)},
                 [&](comm::Communicator& world) {
                   GPTConfig c = base;
                   c.tensor = {.comm = &world, .sequence_parallel = m.sp, .overlap = m.overlap};
                   GPT tp(c);
                   VocabParallelCrossEntropy vce(c.tensor, base.vocab);
                   const double got = vce.forward(tp.forward(x), y);
                   tp.backward(vce.backward());
                   const std::string what = fmt::format("k {} sp {} overlap {}", m.k, m.sp, m.overlap);
                   EXPECT_NEAR(got, want, 1e-5 * want) << what;
                   std::vector<Parameter*> ps = tp.parameters();
                   std::vector<std::string> partial;
                   for (const Parameter* p : ps)
                     if (p->sequence_parallel) partial.push_back(p->name);
                   EXPECT_EQ(partial.size(), m.sp && m.k > 1 ? 2u * base.layers + 1 : 0u) << what;
                   reduce_sequence_parallel_grads(ps, partial, c.tensor);
                   ASSERT_EQ(ps.size(), rp.size());
                   for (size_t i = 0; i < ps.size(); ++i) {
                     ASSERT_EQ(ps[i]->name, rp[i]->name);
                     std::vector<float> init(static_cast<size_t>(rp[i]->value.numel()));
                     rp[i]->init(0, static_cast<int64_t>(init.size()), init.data());
                     const Tensor whole =
                         Tensor::from_vector(std::vector<double>(init.begin(), init.end()), rp[i]->info.shape);
                     ASSERT_EQ(ps[i]->value.to_vector(), block_of(whole, ps[i]->placement)) << what << " " << ps[i]->name;
                     expect_near(ps[i]->grad.to_vector(), block_of(rp[i]->grad, ps[i]->placement), 1e-5,
                                 what + " " + ps[i]->name + " grad");
                   }
                 });
  GPTConfig bad = base;
  bad.dropout = 0.1;
  EXPECT_THAT(testing::error_of([&] { GPT g(bad); }), ::testing::HasSubstr("arch llama with dropout"));
  EXPECT_THAT(testing::error_of([] { (void)layout::parse_decoder_arch("llama2", "--arch"); }),
              ::testing::HasSubstr("use gpt2 or llama"));
}


}  // namespace
}  // namespace meshtrain::nn
