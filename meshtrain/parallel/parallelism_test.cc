// The Parallelism protocol: one training loop, written once against the
// interface, drives DataParallel, FullyShardedDataParallel and
// TensorParallel around DataParallel alike and matches one device;
// parameter_shards() says what each rank holds.
#include "meshtrain/parallel/parallelism.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/optim/sgd.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/parallel/tensor_parallel.h"

namespace meshtrain::parallel {
namespace {

using ::testing::HasSubstr;
using Params = std::map<std::string, std::vector<double>>;

// Widths chosen so that units do not split evenly over 2 ranks (a parameter
// spans both shards) and the biases stay replicated (< 64 elements).
const std::vector<int64_t> kSizes = {11, 23, 17, 4};
constexpr int64_t kBatch = 8;
constexpr int kSteps = 3, kMicro = 2;
constexpr double kClip = 0.5;  // small enough to clip every step

std::pair<Tensor, Tensor> batch(int s) {
  Tensor x = Tensor::empty({kBatch, kSizes.front()}, DType::f32);
  fill_normal(x, 5, key_from_name("x") + static_cast<uint64_t>(s), 0.0, 1.0);
  Tensor y = Tensor::empty({kBatch}, DType::i64);
  for (int64_t i = 0; i < kBatch; ++i) y.data<int64_t>()[i] = (i * 3 + s) % kSizes.back();
  return {x, y};
}

nn::MLPConfig mlp_config(bool defer) {
  nn::MLPConfig c;
  c.sizes = kSizes;
  c.seed = 3;
  c.defer_init = defer;
  return c;
}

nn::MLPConfig mlp_config(bool defer, comm::Communicator* tensor) {
  nn::MLPConfig c = mlp_config(defer);
  c.tensor = {.comm = tensor};
  return c;
}

// The loop under test: only the protocol, whatever the strategy. Rows
// [lo, hi) of each global batch are this rank's, split into kMicro
// micro-batches; losses are normalized by the global batch.
void train(nn::Module& model, Parallelism& par, int64_t lo, int64_t hi) {
  optim::SGD opt(par.optimizer_parameters(), 0.1, 0.9);
  nn::CrossEntropyLoss ce;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    for (int i = 0; i < kMicro; ++i) {
      par.begin_micro_batch(i, kMicro);
      const int64_t a = lo + (hi - lo) * i / kMicro, b = lo + (hi - lo) * (i + 1) / kMicro;
      ce.forward(model.forward(x.narrow(0, a, b - a)), y.narrow(0, a, b - a), static_cast<double>(kBatch));
      model.backward(ce.backward());
    }
    par.finish();
    ASSERT_TRUE(par.grads_finite());
    opt.set_grad_scale(optim::clip_factor(par.grad_norm(), kClip));
    opt.step();
    par.after_step();
    par.zero_grad();
  }
  par.gather_full_parameters();
}

Params snapshot(nn::Module& m) {
  Params out;
  for (nn::Parameter* p : m.parameters()) out[p->name] = p->value.to_vector();
  return out;
}

Params one_device() {
  nn::MLP model(mlp_config(false));
  optim::SGD opt(model.parameters(), 0.1, 0.9);
  nn::CrossEntropyLoss ce;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    ce.forward(model.forward(x), y, static_cast<double>(kBatch));
    model.backward(ce.backward());
    optim::clip_grad_norm(model.parameters(), kClip);
    opt.step();
    model.zero_grad();
  }
  return snapshot(model);
}

struct RankResult {
  Params params;
  std::vector<ParamShard> shards;
  std::string description;
};

// Runs `train` on 2 ranks with the strategy `make` builds; rank r's result.
std::vector<RankResult> on_two_ranks(
    const std::function<std::unique_ptr<Parallelism>(nn::Module&, comm::Communicator&)>& make, bool defer) {
  std::vector<RankResult> out(2);
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = 2}, [&](comm::Communicator& c) {
    nn::MLP model(mlp_config(defer));
    std::unique_ptr<Parallelism> par = make(model, c);
    const int64_t lo = kBatch * c.rank() / 2, hi = kBatch * (c.rank() + 1) / 2;
    train(model, *par, lo, hi);
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(c.rank())] = {snapshot(model), par->parameter_shards(), par->describe()};
  });
  return out;
}

void expect_close(const Params& want, const Params& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (const auto& [name, w] : want) {
    const std::vector<double>& g = got.at(name);
    ASSERT_EQ(w.size(), g.size()) << what << " " << name;
    for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], g[i], 1e-5 * (1 + std::fabs(w[i]))) << what << " " << name;
  }
}

TEST(Parallelism, OneLoopDrivesDataParallelAndFullySharded) {
  const Params want = one_device();
  const auto ddp = on_two_ranks(
      [](nn::Module& m, comm::Communicator& c) -> std::unique_ptr<Parallelism> {
        return std::make_unique<DataParallel>(m, c, DataParallelOptions{.reduce = GradReduce::sum});
      },
      false);
  EXPECT_EQ(ddp[0].description, "data parallel 2");
  for (const ZeroStage stage : {ZeroStage::zero1, ZeroStage::zero3}) {
    const auto fsdp = on_two_ranks(
        [stage](nn::Module& m, comm::Communicator& c) -> std::unique_ptr<Parallelism> {
          return std::make_unique<FullyShardedDataParallel>(
              m, c, nullptr, FullyShardedOptions{.stage = stage, .min_weight_size = 64, .reduce = GradReduce::sum});
        },
        true);
    const std::string what = stage == ZeroStage::zero1 ? "zero1" : "zero3";
    for (int r = 0; r < 2; ++r) expect_close(want, fsdp[static_cast<size_t>(r)].params, what);
    EXPECT_THAT(fsdp[0].description, HasSubstr(stage == ZeroStage::zero1 ? "fsdp zero1 (" : "fsdp full ("));
  }
  for (int r = 0; r < 2; ++r) expect_close(want, ddp[static_cast<size_t>(r)].params, "ddp");
}

TEST(Parallelism, ParameterShardsCoverEveryParameterOnce) {
  const auto ddp = on_two_ranks(
      [](nn::Module& m, comm::Communicator& c) -> std::unique_ptr<Parallelism> {
        return std::make_unique<DataParallel>(m, c);
      },
      false);
  const auto fsdp = on_two_ranks(
      [](nn::Module& m, comm::Communicator& c) -> std::unique_ptr<Parallelism> {
        return std::make_unique<FullyShardedDataParallel>(m, c, nullptr,
                                                          FullyShardedOptions{.min_weight_size = 64});
      },
      true);
  nn::MLP model(mlp_config(false));
  const auto params = model.parameters();
  ASSERT_EQ(ddp[0].shards.size(), params.size());
  ASSERT_EQ(fsdp[0].shards.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i]->value.numel();
    const ParamShard whole{params[i]->name, sharding::Placement::whole(params[i]->value.shape()), true};
    EXPECT_EQ(ddp[0].shards[i], whole);
    EXPECT_EQ(ddp[1].shards[i], whole);
    const ParamShard &a = fsdp[0].shards[i], &b = fsdp[1].shards[i];
    EXPECT_EQ(a.name, params[i]->name);
    EXPECT_EQ(a.placement.shape, params[i]->value.shape());
    if (n < 64) {  // biases: replicated
      EXPECT_EQ(a, whole);
      EXPECT_EQ(b, whole);
      continue;
    }
    EXPECT_FALSE(a.replicated);
    // Rank 0 holds a prefix, rank 1 the rest (the unit's flat order).
    ASSERT_TRUE(a.placement.is_flat()) << a.name;
    EXPECT_EQ(a.placement.count + b.placement.count, n) << a.name;
    if (a.placement.count > 0 && b.placement.count > 0) {
      EXPECT_EQ(a.placement.start + a.placement.count, b.placement.start) << a.name;
    }
  }
  // Each Linear is a unit; its weight alone is sharded: 253 elements padded
  // to 254 split 127 + 126.
  EXPECT_EQ(fsdp[0].shards[0].placement.count, 127);
  EXPECT_EQ(fsdp[1].shards[0].placement.start, 127);
}

// The elements of a whole parameter's values that `where` holds (row-major
// over its block).
std::vector<double> held_part(const std::vector<double>& whole, const sharding::Placement& where) {
  const std::vector<int64_t>& view = where.view_shape();
  const sharding::Box box = where.block_box();
  std::vector<double> out;
  std::vector<int64_t> idx(view.size(), 0);
  for (int64_t k = 0; k < box.numel(); ++k) {
    int64_t rem = k, flat = 0, stride = 1;
    for (size_t d = view.size(); d-- > 0;) {
      flat += (box.offsets[d] + rem % box.sizes[d]) * stride;
      rem /= box.sizes[d];
      stride *= view[d];
    }
    out.push_back(whole[static_cast<size_t>(flat)]);
  }
  return out;
}

// Tensor parallelism joins the protocol: DataParallel (over one rank here)
// wrapped by TensorParallel on 2 tensor ranks trains like one device, with
// the clipping norm summing the blocks over the axis, and grad_sq_split
// gives one device's sums of squares for each part.
TEST(Parallelism, TensorParallelWrapsTheDataParallelStrategy) {
  const Params want = one_device();
  double want_split[2] = {0, 0};  // one device's first gradients: layer 0 (split), the rest
  {
    nn::MLP model(mlp_config(false));
    nn::CrossEntropyLoss ce;
    auto [x, y] = batch(0);
    ce.forward(model.forward(x), y, static_cast<double>(kBatch));
    model.backward(ce.backward());
    for (nn::Parameter* p : model.parameters())
      for (double g : p->grad.to_vector()) want_split[p->name.starts_with("0.") ? 0 : 1] += g * g;
  }
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = 2}, [&](comm::Communicator& c) {
    const std::unique_ptr<comm::Communicator> alone = c.split(c.rank(), 0);
    nn::MLP model(mlp_config(false, &c));
    auto par = std::make_unique<TensorParallel>(
        std::make_unique<DataParallel>(model, *alone, DataParallelOptions{.reduce = GradReduce::sum}),
        nn::TensorParallelGroup{.comm = &c}, std::vector<std::string>{});
    {  // the first step's gradients, split by part
      nn::CrossEntropyLoss ce;
      auto [x, y] = batch(0);
      par->begin_micro_batch(0, 1);
      ce.forward(model.forward(x), y, static_cast<double>(kBatch));
      model.backward(ce.backward());
      par->finish();
      const auto [first, rest] = par->grad_sq_split([](const nn::Parameter& p) { return p.name.starts_with("0."); });
      EXPECT_NEAR(first, want_split[0], 1e-6 * want_split[0]);  // f32 gradients, summed in another order
      EXPECT_NEAR(rest, want_split[1], 1e-6 * want_split[1]);
      EXPECT_NEAR(par->grad_norm(), std::sqrt(want_split[0] + want_split[1]), 1e-6);
      par->zero_grad();
    }
    train(model, *par, 0, kBatch);  // every tensor rank sees the whole batch
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(par->describe(), "data parallel 1, tensor parallel 2");
    int blocks = 0;
    for (nn::Parameter* p : model.parameters()) {
      blocks += p->placement.is_block();
      const std::vector<double> got = p->value.to_vector(), mine = held_part(want.at(p->name), p->placement);
      ASSERT_EQ(got.size(), mine.size()) << p->name;
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_NEAR(got[i], mine[i], 1e-5 * (1 + std::fabs(mine[i]))) << p->name << " rank " << c.rank();
    }
    EXPECT_GT(blocks, 0);
  });
}

}  // namespace
}  // namespace meshtrain::parallel
