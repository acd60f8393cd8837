// Per-call state (Saved): interleaved micro-batches, split backward,
// recompute, stacked hooks, tied parameters and the misuse errors, for every
// module kind.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/core/memory.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/nn/activations.h"
#include "meshtrain/nn/dropout.h"
#include "meshtrain/testing/grad_check.h"
#include "meshtrain/nn/layer_norm.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/nn/sequential.h"
#include "meshtrain/nn/vae.h"

namespace meshtrain::nn {
namespace {

using testing::random_tensor;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using meshtrain::testing::error_of;

constexpr int64_t kBatch = 6, kIn = 8;

// One kind of module under test: how to build it and its output width.
struct Case {
  std::string name;
  std::function<std::unique_ptr<Module>()> build;
  int64_t out;
};

std::vector<Case> cases() {
  auto block = [] {
    auto s = std::make_unique<Sequential>("blk");
    s->add(std::make_unique<Linear>(kIn, 12, s->next_name(), 3));
    s->add(std::make_unique<LayerNorm>(12, s->next_name()));
    s->add(std::make_unique<GELU>(GeluApproximation::tanh));
    s->add(std::make_unique<Dropout>(0.3, s->next_name(), 5));
    s->add(std::make_unique<Linear>(12, 5, s->next_name(), 3));
    return s;
  };
  return {
      {"Linear", [] { return std::make_unique<Linear>(kIn, 5, "fc", 1); }, 5},
      {"LinearBf16",
       [] {
         auto l = std::make_unique<Linear>(kIn, 5, "fc", 1);
         l->set_compute_dtype(DType::bf16);
         return l;
       },
       5},
      {"ReLU", [] { return std::make_unique<ReLU>(); }, kIn},
      {"GELU", [] { return std::make_unique<GELU>(); }, kIn},
      {"Sigmoid", [] { return std::make_unique<Sigmoid>(); }, kIn},
      {"LayerNorm", [] { return std::make_unique<LayerNorm>(kIn, "ln"); }, kIn},
      {"Dropout", [] { return std::make_unique<Dropout>(0.4, "drop", 9); }, kIn},
      {"Block", block, 5},
      {"MLP",
       [] { return std::make_unique<MLP>(MLPConfig{.sizes = {kIn, 16, 10, 4}, .dropout = 0.2, .seed = 7, .prefix = ""}); }, 4},
      {"VAE",
       [] {
         return std::make_unique<VAE>(
             VAEConfig{.input = kIn, .hidden = {10, 6}, .latent = 3, .seed = 2, .needs_input_grad = true, .defer_init = false, .prefix = ""});
       },
       kIn},
  };
}

// Everything a backward produced: the input gradient and every parameter's grad.
struct Result {
  std::vector<double> dx;
  std::vector<std::vector<double>> grads;
  bool operator==(const Result&) const = default;
};

Result collect(Module& m, const std::vector<Tensor>& dxs) {
  Result r;
  for (const Tensor& dx : dxs)
    if (dx.defined())
      for (double v : dx.contiguous().to_vector()) r.dx.push_back(v);
  for (Parameter* p : m.parameters()) r.grads.push_back(p->grad.to_vector());
  return r;
}

Tensor copy(const Tensor& t) { return t.defined() ? t.clone() : Tensor(); }

Tensor input(int i) { return random_tensor({kBatch, kIn}, 100 + static_cast<uint64_t>(i), 0.0, 1.0); }
Tensor grad_of(int i, int64_t out) { return random_tensor({kBatch, out}, 200 + static_cast<uint64_t>(i)); }

// Micro-batch i runs at batch context (step 3, first sample i * kBatch).
void context(Module& m, int i) { m.set_batch_context(3, static_cast<int64_t>(i) * kBatch); }

TEST(Saved, InterleavedMicroBatchesEqualTheSequentialOrderForEveryModule) {
  for (const Case& c : cases()) {
    auto seq = c.build(), inter = c.build();
    std::vector<Tensor> dseq, dinter;
    for (int i = 0; i < 2; ++i) {  // forward(i), backward(i), forward(i+1), backward(i+1)
      context(*seq, i);
      Saved s;
      seq->forward(input(i), s);
      dseq.push_back(copy(seq->backward(grad_of(i, c.out), s)));
    }
    Saved s0, s1;  // forward(0), forward(1), backward(0), backward(1)
    context(*inter, 0);
    inter->forward(input(0), s0);
    context(*inter, 1);
    inter->forward(input(1), s1);
    context(*inter, 7);  // whatever the current context: each call kept its own
    dinter.push_back(copy(inter->backward(grad_of(0, c.out), s0)));
    dinter.push_back(copy(inter->backward(grad_of(1, c.out), s1)));
    EXPECT_TRUE(collect(*seq, dseq) == collect(*inter, dinter)) << c.name;
  }
}

TEST(Saved, SplitBackwardEqualsFusedBitForBit) {
  for (const Case& c : cases()) {
    auto fused = c.build(), split = c.build();
    context(*fused, 0);
    context(*split, 0);
    Saved a, b;
    fused->forward(input(0), a);
    Tensor dx_fused = fused->backward(grad_of(0, c.out), a);
    split->forward(input(0), b);
    Tensor dx_split = split->backward_input(grad_of(0, c.out), b);
    // The input gradient is final before any weight gradient exists.
    for (Parameter* p : split->parameters())
      EXPECT_EQ(l2_norm(p->grad), 0.0) << c.name << " " << p->name << " before backward_weight";
    split->backward_weight(b);
    EXPECT_TRUE(collect(*fused, {dx_fused}) == collect(*split, {dx_split})) << c.name;
  }
}

TEST(Saved, SplitBackwardReportsGradReadyInTheFusedOrder) {
  auto order = [](bool split) {
    MLP mlp(MLPConfig{.sizes = {kIn, 16, 10, 4}, .seed = 7, .prefix = ""});
    testing::RecordingHook hook;
    mlp.add_hook(&hook);
    Saved s;
    mlp.forward(input(0), s);
    if (split) {
      mlp.backward_input(grad_of(0, 4), s);
      EXPECT_TRUE(hook.names.empty());
      mlp.backward_weight(s);
    } else {
      mlp.backward(grad_of(0, 4), s);
    }
    return hook.names;
  };
  EXPECT_EQ(order(true), order(false));
  EXPECT_THAT(order(true), ElementsAre("4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"));
}

// Outer Sequential of 4 blocks (Linear, ReLU, Dropout, Linear).
std::unique_ptr<Sequential> deep(MemoryTracker* tracker) {
  auto net = std::make_unique<Sequential>();
  for (int b = 0; b < 4; ++b) {
    auto blk = std::make_unique<Sequential>(net->next_name());
    blk->add(std::make_unique<Linear>(32, 64, blk->next_name(), 11));
    blk->add(std::make_unique<ReLU>());
    blk->add(std::make_unique<Dropout>(0.25, blk->next_name(), 11));
    blk->add(std::make_unique<Linear>(64, 32, blk->next_name(), 11));
    net->add(std::move(blk));
  }
  net->set_memory_tracker(tracker);
  return net;
}

TEST(Saved, RecomputeEqualsNoRecomputeBitForBitAndKeepsLessMemory) {
  MemoryTracker plain_mem, re_mem;
  auto plain = deep(&plain_mem), re = deep(&re_mem);
  for (Module* blk : re->children()) blk->set_recompute(true);
  const Tensor x = random_tensor({64, 32}, 5);
  const Tensor dy = random_tensor({64, 32}, 6);
  uint64_t held[2] = {0, 0};  // activation bytes between forward and backward
  std::vector<Tensor> dxs[2];
  int k = 0;
  for (auto* pair : {&plain, &re}) {
    Sequential& net = **pair;
    MemoryTracker& mem = k == 0 ? plain_mem : re_mem;
    for (int step = 0; step < 2; ++step) {  // the second step reuses buffers
      net.set_batch_context(static_cast<uint64_t>(step), 0);
      Saved s;
      net.forward(x, s);
      held[k] = mem.in_use(MemoryCategory::activations);
      net.set_batch_context(99, 0);  // recompute replays the forward's own context
      dxs[k].push_back(copy(net.backward(dy, s)));
    }
    ++k;
  }
  EXPECT_TRUE(collect(*plain, dxs[0]) == collect(*re, dxs[1]));
  // Without recompute every block keeps its hidden activations (64 x 64 floats
  // several times); with it only the blocks' inputs and outputs survive.
  EXPECT_LT(held[1], held[0] / 3) << "recompute held " << held[1] << " bytes, plain " << held[0];
  EXPECT_GT(held[1], 0u);
}

TEST(Saved, RecomputeWorksWithSplitBackward) {
  auto a = deep(nullptr), b = deep(nullptr);
  for (Module* blk : b->children()) blk->set_recompute(true);
  const Tensor x = random_tensor({16, 32}, 5), dy = random_tensor({16, 32}, 6);
  Saved sa, sb;
  a->forward(x, sa);
  Tensor da = a->backward(dy, sa);
  b->forward(x, sb);
  Tensor db = b->backward_input(dy, sb);
  b->backward_weight(sb);
  EXPECT_TRUE(collect(*a, {da}) == collect(*b, {db}));
}

// Logs every hook call as "<tag>:<event>".
class LoggingHook : public ParamHook {
 public:
  LoggingHook(std::string tag, std::vector<std::string>* log, Module* claim = nullptr)
      : tag_(std::move(tag)), log_(log), claim_(claim) {}
  void grad_ready(Parameter& p) override { log_->push_back(tag_ + ":ready " + p.name); }
  bool scopes(Module& m) override { return claim_ ? &m == claim_ : ParamHook::scopes(m); }
  void before_use(Module& m, Pass pass) override { log_->push_back(tag_ + ":+" + what(m, pass)); }
  void after_use(Module& m, Pass pass) override { log_->push_back(tag_ + ":-" + what(m, pass)); }

 private:
  static std::string what(Module& m, Pass pass) {
    const char* names[] = {"F", "B", "BI", "BW"};
    return std::string(names[static_cast<int>(pass)]) + " " +
           (m.parameters().empty() ? std::string("?") : m.parameters()[0]->name);
  }
  std::string tag_;
  std::vector<std::string>* log_;
  Module* claim_;
};

TEST(Hooks, StackedHooksNestAndBothSeeEveryGradient) {
  std::vector<std::string> log;
  Linear fc(4, 3, "fc", 1);
  LoggingHook a("a", &log), b("b", &log);
  fc.add_hook(&a);
  fc.add_hook(&b);
  Saved s;
  fc.forward(random_tensor({2, 4}, 1), s);
  fc.backward(random_tensor({2, 3}, 2), s);
  EXPECT_THAT(log, ElementsAre("a:+F fc.weight", "b:+F fc.weight", "b:-F fc.weight", "a:-F fc.weight",
                               "a:+B fc.weight", "b:+B fc.weight", "a:ready fc.bias", "b:ready fc.bias",
                               "a:ready fc.weight", "b:ready fc.weight", "b:-B fc.weight", "a:-B fc.weight"));
  log.clear();
  fc.remove_hook(&a);
  fc.forward(random_tensor({2, 4}, 1), s);
  EXPECT_THAT(log, ElementsAre("b:+F fc.weight", "b:-F fc.weight"));
  EXPECT_THAT(error_of<InvalidArgument>([&] { fc.add_hook(&b); }), HasSubstr("already installed"));
}

TEST(Hooks, AHookMayClaimAWholeBlockAsItsScope) {
  std::vector<std::string> log;
  Sequential net;
  auto& blk = net.add(std::make_unique<Sequential>(net.next_name()));
  blk.add(std::make_unique<Linear>(4, 4, blk.next_name(), 1));
  blk.add(std::make_unique<Tanh>());
  blk.add(std::make_unique<Linear>(4, 2, blk.next_name(), 1));
  LoggingHook unit("u", &log, &blk);
  net.add_hook(&unit);
  Saved s;
  net.forward(random_tensor({2, 4}, 1), s);
  net.backward_input(random_tensor({2, 2}, 2), s);
  net.backward_weight(s);
  EXPECT_THAT(log, ElementsAre("u:+F 0.0.weight", "u:-F 0.0.weight", "u:+BI 0.0.weight", "u:-BI 0.0.weight",
                               "u:+BW 0.0.weight", "u:ready 0.2.bias", "u:ready 0.2.weight", "u:ready 0.0.bias",
                               "u:ready 0.0.weight", "u:-BW 0.0.weight"));
}

// y = x * w (per feature), w shared with other instances (a tied parameter);
// `lists` says whether parameters() names it (only its first user does).
class Scale final : public Module {
 public:
  Scale(Parameter& w, bool lists) : w_(w), lists_(lists) {}
  std::vector<Parameter*> parameters() override {
    if (lists_) return {&w_};
    return {};
  }

 protected:
  Tensor do_forward(const Tensor& x, Saved& s) override {
    s.state<State>().x = x;
    return times_w(x);
  }
  Tensor do_backward_input(const Tensor& dy, Saved& s) override {
    s.state<State>().dy = dy;
    return times_w(dy);
  }
  void do_backward_weight(Saved& s) override {  // dw += sum over rows of x * dy
    State& st = s.state<State>();
    const int64_t rows = st.x.size(0), d = st.x.size(1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < d; ++j)
        w_.grad.data<float>()[j] += st.x.data<float>()[r * d + j] * st.dy.data<float>()[r * d + j];
    notify_grad_ready(w_);
  }

 private:
  struct State {
    Tensor x, dy;
  };
  Tensor times_w(const Tensor& a) const {
    Tensor out = a.clone();
    for (int64_t r = 0; r < a.size(0); ++r) mul(out.narrow(0, r, 1).view({a.size(1)}), w_.value, out.narrow(0, r, 1).view({a.size(1)}));
    return out;
  }
  Parameter& w_;
  bool lists_;
};

TEST(Hooks, ATiedParameterIsReportedOnceAfterItsLastUser) {
  Parameter w;
  w.name = "tied.weight";
  w.info = sharding::ParamInfo{.name = w.name, .shape = {3}, .kind = sharding::ParamKind::norm};
  w.init = [](int64_t, int64_t n, float* out) { std::fill(out, out + n, 2.0f); };
  materialize(w);
  w.users = 2;
  Sequential net;
  net.add(std::make_unique<Scale>(w, true));
  net.add(std::make_unique<Tanh>());
  net.add(std::make_unique<Scale>(w, false));
  testing::RecordingHook hook;
  net.add_hook(&hook);
  for (int step = 0; step < 2; ++step) {
    Saved s;
    net.forward(random_tensor({2, 3}, 1), s);
    net.backward(random_tensor({2, 3}, 2), s);
  }
  EXPECT_THAT(hook.names, ElementsAre("tied.weight", "tied.weight"));  // once per backward
  // The gradient is the sum of both uses' contributions (finite differences).
  EXPECT_EQ(net.parameters().size(), 1u);
}

TEST(Saved, MisuseNamesTheModuleAndWhatToDo) {
  Linear fc(4, 3, "enc.0", 1);
  Saved s;
  EXPECT_THAT(error_of<InvalidArgument>([&] { fc.backward(random_tensor({2, 3}, 2), s); }),
              HasSubstr("Linear 'enc.0': no forward to go back through"));
  EXPECT_THAT(error_of<InvalidArgument>([&] { fc.backward_weight(s); }),
              HasSubstr("backward_weight without backward_input"));
  fc.forward(random_tensor({2, 4}, 1), s);
  fc.backward_input(random_tensor({2, 3}, 2), s);
  EXPECT_THAT(error_of<InvalidArgument>([&] { fc.backward(random_tensor({2, 3}, 2), s); }),
              HasSubstr("finish a split backward with backward_weight"));
  fc.backward_weight(s);
  ReLU relu;
  EXPECT_THAT(error_of<InvalidArgument>([&] { relu.forward(random_tensor({2, 4}, 1), s); }),
              HasSubstr("another kind of module"));
}

TEST(Saved, OneSavedPerSlotAllocatesNothingInSteadyState) {
  MemoryTracker mem;
  MLP mlp(MLPConfig{.sizes = {kIn, 16, 10, 4}, .dropout = 0.2, .seed = 7, .prefix = ""});
  mlp.set_memory_tracker(&mem);
  Saved slots[2];
  uint64_t peak_after_warmup = 0;
  for (int step = 0; step < 4; ++step) {
    for (int i = 0; i < 2; ++i) mlp.forward(input(i), slots[i]);
    for (int i = 0; i < 2; ++i) mlp.backward(grad_of(i, 4), slots[i]);
    if (step == 1) peak_after_warmup = mem.peak(MemoryCategory::activations);
  }
  EXPECT_GT(peak_after_warmup, 0u);
  EXPECT_EQ(mem.peak(MemoryCategory::activations), peak_after_warmup);
  slots[0].clear();
  slots[1].clear();
  EXPECT_EQ(mem.in_use(MemoryCategory::activations), 0u);
}

TEST(FillBox, AnyBlockEqualsTheSameSliceOfTheWholeParameter) {
  Linear fc(5, 7, "fc", 3, LinearOptions{.defer_init = true});
  Parameter& w = fc.weight();
  Parameter whole = w;
  materialize(whole);
  // Columns [2, 6) of rows [1, 4): a column-parallel shard.
  std::vector<float> block(3 * 4);
  fill_box(w, {1, 2}, {3, 4}, block.data());
  Tensor want = whole.value.narrow(0, 1, 3).narrow(1, 2, 4).contiguous();
  EXPECT_EQ(std::vector<double>(block.begin(), block.end()), want.to_vector());
  EXPECT_THAT(error_of<InvalidArgument>([&] { fill_box(w, {4, 0}, {2, 7}, block.data()); }),
              HasSubstr("inside the parameter"));
}

}  // namespace
}  // namespace meshtrain::nn
