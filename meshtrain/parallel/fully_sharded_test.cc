// FullyShardedDataParallel on the threads engine: every stage, hybrid
// sharding, accumulation and prefetch settings equal one device over several
// AdamW steps; mixed precision stores what the formulas say; an fp16
// overflow on one rank makes every rank skip the step; a stalled rank in a
// parameter all-gather is named within twice the deadline.
#include "meshtrain/parallel/fully_sharded.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/linear.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/optim/clip.h"
#include "meshtrain/optim/loss_scaler.h"
#include "meshtrain/optim/sgd.h"
#include "meshtrain/parallel/fully_sharded_test_util.h"

namespace meshtrain::parallel {
namespace {

using ::testing::HasSubstr;
using namespace fsdp_testing;


TEST(FullySharded, EveryStageEqualsOneDevice) {
  const Outcome want = reference();
  for (ZeroStage stage : {ZeroStage::no_shard, ZeroStage::zero1, ZeroStage::zero2, ZeroStage::zero3})
    for (int ranks : {1, 2, 4}) {
      RunSpec s;
      s.ranks = ranks;
      s.strategy = {stage, false};
      expect_close(run(s), want, 1e-5, fmt::format("{} on {} ranks", s.strategy.name(), ranks));
    }
}

TEST(FullySharded, BlockUnitsSplitBackwardAndInterleavedMicroBatchesEqualOneDevice) {
  const Outcome want = reference();
  for (ZeroStage stage : {ZeroStage::zero1, ZeroStage::zero2, ZeroStage::zero3})
    for (bool whole : {false, true})
      for (bool split : {false, true}) {
        RunSpec s;
        s.ranks = 2;
        s.strategy = {stage, false};
        s.micro_batches = 2;
        s.interleave = true;
        s.whole_model_unit = whole;
        s.split_backward = split;
        expect_close(run(s), want, 1e-5,
                     fmt::format("{}, {} units, {} backward, interleaved micro-batches", s.strategy.name(),
                                 whole ? "whole-model" : "per-layer", split ? "split" : "fused"));
      }
}

TEST(FullySharded, ShardPlacementsTileEveryParameterExactlyOnce) {
  nn::MLP whole(mlp_config());
  std::map<std::string, std::vector<double>> want;
  for (nn::Parameter* p : whole.parameters()) want[p->name] = p->value.to_vector();
  std::mutex mu;
  std::map<std::string, std::vector<int>> covered;  // parameter -> ranks holding each element
  comm::launch({.engine = comm::Engine::threads, .ranks = 4}, [&](comm::Communicator& world) {
    nn::MLP model(mlp_config(/*defer_init=*/true));
    FullyShardedDataParallel fsdp(model, world, nullptr, opts(ZeroStage::zero3));
    std::lock_guard lock(mu);
    for (nn::Parameter* p : fsdp.optimizer_parameters()) {
      std::vector<int>& c = covered[p->name];
      c.resize(static_cast<size_t>(p->info.numel()));
      const sharding::Placement& pl = p->placement;
      EXPECT_EQ(pl.shape, p->info.shape) << p->name;
      if (!pl.is_flat()) {
        EXPECT_EQ(p->value.to_vector(), want.at(p->name)) << p->name;
        for (int& n : c) ++n;  // this rank holds all of it
        continue;
      }
      ASSERT_EQ(p->value.numel(), pl.count) << p->name << " " << pl.to_string();
      const std::vector<double> v = p->value.to_vector();
      for (int64_t i = 0; i < pl.count; ++i) {
        ++c[static_cast<size_t>(pl.start + i)];
        EXPECT_EQ(v[static_cast<size_t>(i)], want.at(p->name)[static_cast<size_t>(pl.start + i)]) << p->name;
      }
    }
  });
  ASSERT_EQ(covered.size(), want.size());
  for (const auto& [name, c] : covered) {
    const bool replicated = want.at(name).size() < static_cast<size_t>(kMinWeight);
    for (int n : c) ASSERT_EQ(n, replicated ? 4 : 1) << name;
  }
}

// The GPT with FSDP2-style units: every block, then the model itself (what
// the blocks leave: embeddings, the final norm and the head tied to wte,
// whose two uses both sit inside the root's scope).
Params gpt_run(int ranks, ZeroStage stage, bool recompute) {
  const nn::GPTConfig cfg{.vocab = 11, .block_size = 8, .layers = 2, .heads = 2, .width = 16, .seed = 5,
                          .recompute = recompute};
  constexpr int64_t kB = 4, kT = 8;
  std::vector<int64_t> ids(kB * kT), tg(kB * kT);
  for (size_t k = 0; k < ids.size(); ++k) {
    ids[k] = static_cast<int64_t>((k * 7 + 3) % 11);
    tg[k] = static_cast<int64_t>((k * 5 + 1) % 11);
  }
  const Tensor x = Tensor::from_vector(ids, {kB, kT}), y = Tensor::from_vector(tg, {kB * kT});
  Params out;
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = ranks}, [&](comm::Communicator& world) {
    nn::GPT model(cfg);
    FullyShardedOptions o = opts(stage);
    o.unit_modules = model.blocks();
    o.unit_modules.push_back(&model);
    FullyShardedDataParallel fsdp(model, world, nullptr, o);
    EXPECT_EQ(fsdp.units().size(), 3u);
    // SGD, not AdamW: the key part of c_attn.bias has an exactly zero
    // gradient (softmax ignores a shift shared by all keys), so what each
    // layout computes there is rounding noise, which AdamW's m / sqrt(v)
    // would blow up to +-lr per step.
    optim::SGD opt(fsdp.optimizer_parameters(), 0.1, 0.9);
    nn::CrossEntropyLoss ce;
    const int64_t local = kB / world.size(), first = local * world.rank();
    for (int s = 0; s < 3; ++s) {
      ce.forward(model.forward(x.narrow(0, first, local)), y.narrow(0, first * kT, local * kT),
                 static_cast<double>(kB * kT));
      model.backward(ce.backward());
      fsdp.finish();
      opt.step();
      fsdp.after_step();
      fsdp.zero_grad();
    }
    fsdp.gather_full_parameters();
    if (world.rank() == 0) {
      std::lock_guard lock(mu);
      out = snapshot(model);
    }
  });
  return out;
}

TEST(FullySharded, GptWithBlockAndRootUnitsEqualsOneDevice) {
  const Params want = gpt_run(1, ZeroStage::no_shard, false);
  for (ZeroStage stage : {ZeroStage::zero2, ZeroStage::zero3})
    for (bool recompute : {false, true}) {
      const Params got = gpt_run(2, stage, recompute);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, w] : want) {
        double scale = 0, diff = 0;
        for (size_t i = 0; i < w.size(); ++i) {
          scale = std::max(scale, std::abs(w[i]));
          diff = std::max(diff, std::abs(w[i] - got.at(name)[i]));
        }
        EXPECT_LE(diff, 1e-5 * scale) << name << " stage " << static_cast<int>(stage) << " recompute " << recompute;
      }
    }
}

TEST(FullySharded, DeferredInitBuildsTheSameShardsWithoutTheFullModel) {
  for (ZeroStage stage : {ZeroStage::no_shard, ZeroStage::zero1, ZeroStage::zero2, ZeroStage::zero3}) {
    RunSpec s;
    s.ranks = 4;
    s.strategy = {stage, false};
    const Outcome eager = run(s);
    s.defer_init = true;
    const Outcome deferred = run(s);
    EXPECT_EQ(deferred.losses, eager.losses) << s.strategy.name();  // bit for bit
    EXPECT_EQ(deferred.params, eager.params) << s.strategy.name();
  }
  nn::MLP deferred(mlp_config(true)), eager(mlp_config());
  EXPECT_EQ(deferred.num_parameters(), eager.num_parameters());
  for (nn::Parameter* p : deferred.parameters()) {
    EXPECT_FALSE(p->value.defined()) << p->name;
    nn::materialize(*p);
  }
  const std::vector<nn::Parameter*> ps = eager.parameters();
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_EQ(deferred.parameters()[i]->value.to_vector(), ps[i]->value.to_vector()) << ps[i]->name;
}

TEST(FullySharded, HybridShardingEqualsOneDevice) {
  const Outcome want = reference();
  for (ZeroStage stage : {ZeroStage::zero2, ZeroStage::zero3}) {
    RunSpec s;
    s.ranks = 4;
    s.strategy = {stage, true};
    expect_close(run(s), want, 1e-5, s.strategy.name());
  }
}

TEST(FullySharded, AccumulationAndPrefetchSettingsEqualOneDevice) {
  const Outcome want = reference();
  for (ZeroStage stage : {ZeroStage::no_shard, ZeroStage::zero1, ZeroStage::zero2, ZeroStage::zero3}) {
    RunSpec s;
    s.ranks = 2;
    s.strategy = {stage, false};
    s.micro_batches = 2;
    expect_close(run(s), want, 1e-5, s.strategy.name() + " with 2 micro-batches");
  }
  for (BackwardPrefetch bp : {BackwardPrefetch::none, BackwardPrefetch::pre, BackwardPrefetch::post})
    for (bool reshard : {true, false}) {
      RunSpec s;
      s.ranks = 4;
      s.options.backward_prefetch = bp;
      s.options.forward_prefetch = !reshard;
      s.options.reshard_after_forward = reshard;
      expect_close(run(s), want, 1e-5,
                   fmt::format("zero3 prefetch {} reshard {}", to_string(bp), reshard));
    }
}

TEST(FullySharded, GradientAverageDividesByRanksAndMicroBatches) {
  // avg with each loss normalized by its own micro-batch equals sum with the
  // global normalizer: the same training.
  const Outcome want = reference();
  Outcome got;
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = 4}, [&](comm::Communicator& world) {
    nn::MLP model(mlp_config());
    FullyShardedOptions o = opts(ZeroStage::zero2);
    o.reduce = GradReduce::avg;
    FullyShardedDataParallel fsdp(model, world, nullptr, o);
    optim::AdamW opt(fsdp.optimizer_parameters(), 1e-2, {0.9, 0.999}, 1e-8, 0.1);
    nn::CrossEntropyLoss ce;
    const int64_t local = kBatch / 4, first = local * world.rank();
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = batch(s);
      for (int i = 0; i < 2; ++i) {
        fsdp.begin_micro_batch(i, 2);
        const int64_t lo = first + local / 2 * i;
        ce.forward(model.forward(x.narrow(0, lo, local / 2)), y.narrow(0, lo, local / 2));
        model.backward(ce.backward());
      }
      fsdp.finish();
      opt.step();
      fsdp.after_step();
      fsdp.zero_grad();
    }
    fsdp.gather_full_parameters();
    if (world.rank() == 0) {
      std::lock_guard lock(mu);
      got.params = snapshot(model);
    }
  });
  got.losses = want.losses;
  expect_close(got, want, 1e-5, "avg");
}

TEST(FullySharded, MixedPrecisionTracksTheReferenceLoosely) {
  const Outcome want = reference(8);
  for (DType dt : {DType::bf16, DType::f16})
    for (ZeroStage stage : {ZeroStage::zero1, ZeroStage::zero2, ZeroStage::zero3}) {
      RunSpec s;
      s.ranks = 2;
      s.steps = 8;
      s.strategy = {stage, false};
      s.options.param_dtype = dt;
      const Outcome got = run(s);
      for (size_t i = 0; i < want.losses.size(); ++i)
        EXPECT_NEAR(got.losses[i], want.losses[i], 2e-2 * want.losses[i]) << dtype_name(dt) << " step " << i;
      // Not the f32 numbers: the rounding really happened.
      EXPECT_NE(got.losses.back(), want.losses.back());
    }
}

TEST(FullySharded, OptimizerRoundsTheWorkingCopyAsAfterStepWould) {
  // AdamW writes the param_dtype copy as it updates the masters
  // (nn::Parameter::rounded); without that copy after_step rounds them
  // itself. Both give the same numbers, bit for bit.
  for (DType dt : {DType::bf16, DType::f16})
    for (ZeroStage stage : {ZeroStage::no_shard, ZeroStage::zero2, ZeroStage::zero3}) {
      RunSpec s;
      s.ranks = 2;
      s.strategy = {stage, false};
      s.options.param_dtype = dt;
      const Outcome fused = run(s);
      s.round_in_wrapper = true;
      const Outcome plain = run(s);
      EXPECT_EQ(fused.losses, plain.losses) << dtype_name(dt) << " " << static_cast<int>(stage);
      EXPECT_EQ(fused.params, plain.params) << dtype_name(dt) << " " << static_cast<int>(stage);
    }
}

TEST(FullySharded, ModelStateMatchesTheFormulaExactly) {
  // Bytes charged to each category equal the table of the header for the
  // padded units, plus replicated f32 parameters (value + grad).
  for (DType dt : {DType::f32, DType::bf16})
    for (ZeroStage stage : {ZeroStage::no_shard, ZeroStage::zero1, ZeroStage::zero2, ZeroStage::zero3}) {
      comm::launch({.engine = comm::Engine::threads, .ranks = 4}, [&](comm::Communicator& world) {
        MemoryTracker tracker;
        nn::MLP model(mlp_config());
        FullyShardedOptions o = opts(stage, dt);
        o.tracker = &tracker;
        FullyShardedDataParallel fsdp(model, world, nullptr, o);
        optim::AdamW opt(fsdp.optimizer_parameters(), 1e-2, {0.9, 0.999}, 1e-8, 0.1, &tracker);
        int64_t padded = 0;
        for (const UnitInfo& u : fsdp.units()) padded += u.padded;
        const int d = stage == ZeroStage::no_shard ? 1 : 4;
        // State is charged for owned, non-padding elements only: compare
        // the optimizer through the tracker's own count of what AdamW holds.
        const ModelStateBytes want = predicted_model_state(stage, padded, d, dt, dt, 0.0);
        const double rep = 4.0 * static_cast<double>(fsdp.replicated_elements());
        EXPECT_EQ(static_cast<double>(tracker.in_use(MemoryCategory::parameters)), want.parameters + rep) << dtype_name(dt);
        EXPECT_EQ(static_cast<double>(tracker.in_use(MemoryCategory::gradients)), want.gradients + rep);
        EXPECT_EQ(static_cast<double>(tracker.in_use(MemoryCategory::optimizer)), want.optimizer + static_cast<double>(opt.state_bytes()));
        EXPECT_EQ(tracker.in_use(MemoryCategory::working), 0u);
        // One step: working copies come and go.
        local_forward_backward(model, 0, world.rank(), 4);
        fsdp.finish();
        opt.step();
        fsdp.after_step();
        EXPECT_EQ(tracker.in_use(MemoryCategory::working), 0u);
        if (stage == ZeroStage::zero3 || dt != DType::f32) {
          EXPECT_GT(tracker.peak(MemoryCategory::working), 0u);
        }
      });
    }
}

TEST(FullySharded, GradNormIsTheOneDeviceNorm) {
  nn::MLP ref(mlp_config());
  local_forward_backward(ref, 0, 0, 1);
  const double want = std::sqrt(optim::local_sq_norm(ref.parameters()));
  for (FsdpMode st : {FsdpMode{ZeroStage::zero1, false}, FsdpMode{ZeroStage::zero3, false},
                              FsdpMode{ZeroStage::zero3, true}, FsdpMode{ZeroStage::no_shard, false}})
    comm::launch({.engine = comm::Engine::threads, .ranks = 4}, [&](comm::Communicator& world) {
      mesh::DeviceMesh mesh(world, {2, 2}, {"data", "fsdp"});
      nn::MLP model(mlp_config());
      FullyShardedDataParallel fsdp(model, st.hybrid ? mesh.comm("fsdp") : world,
                                    st.hybrid ? &mesh.comm("data") : nullptr, opts(st.stage));
      local_forward_backward(model, 0, world.rank(), 4);
      fsdp.finish();
      EXPECT_NEAR(fsdp.grad_norm(), want, 1e-6 * want) << st.name();
    });
}

// Multiplies the gradient passing through by `factor` on one rank at one
// step: in fp16 the next layer's weight gradient overflows when rounded for
// the reduce-scatter.
class GradBlowUp final : public nn::Module {
 public:
  GradBlowUp(int rank, int step) : rank_(rank), step_(step) {}
  std::vector<nn::Parameter*> parameters() override { return {}; }

 protected:
  Tensor do_forward(const Tensor& x, nn::Saved&) override { return x; }
  Tensor do_backward_input(const Tensor& dy, nn::Saved&) override {
    if (static_cast<int>(batch_context().step) == step_ && batch_context().first_global_sample / 4 == rank_) {
      Tensor out = dy.clone();
      scale(out, 1e30);
      return out;
    }
    return dy;
  }

 private:
  int rank_, step_;
};

TEST(FullySharded, Fp16OverflowOnOneRankSkipsTheStepEverywhere) {
  constexpr int kBad = 2;
  std::mutex mu;
  std::vector<std::pair<int64_t, double>> seen;  // (skipped, scale) per rank
  comm::launch({.engine = comm::Engine::threads, .ranks = 4}, [&](comm::Communicator& world) {
    nn::Sequential model("m");
    model.add(std::make_unique<nn::Linear>(kIn, 40, model.next_name(), 3));
    model.add(std::make_unique<GradBlowUp>(1, kBad));
    model.add(std::make_unique<nn::Linear>(40, kClasses, model.next_name(), 3));
    FullyShardedDataParallel fsdp(model, world, nullptr, opts(ZeroStage::zero3, DType::f16));
    optim::AdamW opt(fsdp.optimizer_parameters(), 1e-3);
    optim::DynamicLossScaler scaler;
    const int64_t local = kBatch / 4;
    for (int s = 0; s < 4; ++s) {
      model.set_batch_context(static_cast<uint64_t>(s), local * world.rank());
      const double S = scaler.scale();
      local_forward_backward(model, s, world.rank(), 4, S);
      fsdp.finish();
      const bool finite = fsdp.grads_finite();
      EXPECT_EQ(finite, s != kBad) << "rank " << world.rank() << " step " << s;
      std::vector<double> before;
      for (nn::Parameter* p : fsdp.optimizer_parameters())
        for (double v : p->value.to_vector()) before.push_back(v);
      if (scaler.update(!finite)) {
        opt.set_grad_scale(1.0 / S);
        opt.step();
        fsdp.after_step();
      }
      std::vector<double> after;
      for (nn::Parameter* p : fsdp.optimizer_parameters())
        for (double v : p->value.to_vector()) after.push_back(v);
      if (s == kBad) {
        EXPECT_EQ(before, after) << "the skipped step changed rank " << world.rank();
      } else {
        EXPECT_NE(before, after);
      }
      fsdp.zero_grad();
    }
    std::lock_guard lock(mu);
    seen.push_back({scaler.skipped_steps(), scaler.scale()});
  });
  ASSERT_EQ(seen.size(), 4u);
  for (const auto& [skipped, scale] : seen) {
    EXPECT_EQ(skipped, 1);
    EXPECT_EQ(scale, 32768.0 / 2);
  }
}

// Sleeps on one rank before the forward of the next unit.
class Stall final : public nn::Module {
 public:
  Stall(int rank, std::chrono::milliseconds d) : rank_(rank), d_(d) {}
  std::vector<nn::Parameter*> parameters() override { return {}; }

 protected:
  Tensor do_forward(const Tensor& x, nn::Saved&) override {
    if (batch_context().first_global_sample == rank_) std::this_thread::sleep_for(d_);
    return x;
  }
  Tensor do_backward_input(const Tensor& dy, nn::Saved&) override { return dy; }

 private:
  int rank_;
  std::chrono::milliseconds d_;
};

TEST(FullySharded, StalledRankInParameterGatherIsNamedWithinTwiceTheDeadline) {
  constexpr auto kDeadline = std::chrono::milliseconds(400);
  std::mutex mu;
  std::map<int, std::pair<std::string, double>> errors;  // rank -> (what, seconds)
  try {
    comm::launch({.engine = comm::Engine::threads, .ranks = 3, .timeout = kDeadline},
                 [&](comm::Communicator& world) {
                   nn::Sequential model("m");
                   model.add(std::make_unique<nn::Linear>(kIn, 40, model.next_name(), 3));
                   model.add(std::make_unique<Stall>(1, 4 * kDeadline));
                   model.add(std::make_unique<nn::Linear>(40, kClasses, model.next_name(), 3));
                   FullyShardedDataParallel fsdp(model, world, nullptr, opts(ZeroStage::zero3));
                   model.set_batch_context(0, world.rank());
                   auto [x, y] = batch(0);
                   const auto t0 = std::chrono::steady_clock::now();
                   try {
                     model.forward(x.narrow(0, 0, 4));
                   } catch (const CommError& e) {
                     std::lock_guard lock(mu);
                     errors[world.rank()] = {
                         e.what(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
                     throw;
                   }
                 });
    FAIL() << "launch returned without an error";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("all_gather"));
    EXPECT_THAT(e.ranks(), ::testing::Contains(1));
  }
  for (int r : {0, 2}) {
    ASSERT_TRUE(errors.count(r)) << "rank " << r << " did not fail";
    EXPECT_THAT(errors[r].first, HasSubstr("1"));
    EXPECT_LT(errors[r].second, 2 * std::chrono::duration<double>(kDeadline).count()) << errors[r].first;
  }
}

TEST(FullySharded, StrategyNamesAndErrors) {
  EXPECT_EQ(parse_fsdp_mode("full"), (FsdpMode{ZeroStage::zero3, false}));
  EXPECT_EQ(parse_fsdp_mode("zero2"), (FsdpMode{ZeroStage::zero2, false}));
  EXPECT_EQ(parse_fsdp_mode("hybrid_shard_grad_op"), (FsdpMode{ZeroStage::zero2, true}));
  for (const char* n : {"full", "shard_grad_op", "no_shard", "zero1", "hybrid_full", "hybrid_shard_grad_op"})
    EXPECT_EQ(parse_fsdp_mode(n).name(), n);
  try {
    parse_fsdp_mode("zero4");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("Unknown sharding strategy: zero4"));
  }
  EXPECT_EQ(parse_backward_prefetch("backward_post"), BackwardPrefetch::post);
  EXPECT_THROW(parse_backward_prefetch("later"), InvalidArgument);
  // Formula: bf16 AdamW, 1000 elements on 4 ranks.
  const ModelStateBytes z1 = predicted_model_state(ZeroStage::zero1, 1000, 4, DType::bf16, DType::bf16, 8);
  EXPECT_DOUBLE_EQ(z1.total(), 1000 * (4 + 12.0 / 4));
  EXPECT_DOUBLE_EQ(predicted_model_state(ZeroStage::zero2, 1000, 4, DType::bf16, DType::bf16, 8).total(),
                   1000 * (2 + 14.0 / 4));
  EXPECT_DOUBLE_EQ(predicted_model_state(ZeroStage::zero3, 1000, 4, DType::bf16, DType::bf16, 8).total(),
                   1000 * 16.0 / 4);
  EXPECT_DOUBLE_EQ(predicted_model_state(ZeroStage::no_shard, 1000, 4, DType::bf16, DType::bf16, 8).total(),
                   1000 * 16.0);
}

TEST(FullySharded, DifferentModelsOnRanksAreRejected) {
  std::mutex mu;
  std::vector<std::string> msgs;
  EXPECT_THROW(comm::launch({.engine = comm::Engine::threads, .ranks = 2},
                            [&](comm::Communicator& world) {
                              nn::MLPConfig c = mlp_config();
                              if (world.rank() == 1) c.sizes[1] = 36;
                              nn::MLP model(c);
                              try {
                                FullyShardedDataParallel fsdp(model, world, nullptr, FullyShardedOptions{});
                              } catch (const InvalidArgument& e) {
                                std::lock_guard lock(mu);
                                msgs.push_back(e.what());
                                throw;
                              }
                            }),
               InvalidArgument);
  ASSERT_FALSE(msgs.empty());
  EXPECT_THAT(msgs[0], HasSubstr("rank(s) 1"));
}

}  // namespace
}  // namespace meshtrain::parallel
