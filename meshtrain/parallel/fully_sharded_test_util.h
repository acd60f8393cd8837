// Test support for FullyShardedDataParallel (fully_sharded_test.cc,
// fully_sharded_zeropp_test.cc): a small MLP trained with AdamW for a few
// steps on one device (reference) and data parallel under a sharding
// specification (run), returning losses, final parameters and the
// communication and hpZ counters the tests compare.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/random.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/fully_sharded.h"

namespace meshtrain::parallel::fsdp_testing {

using Params = std::map<std::string, std::vector<double>>;

// Sizes chosen so that no flat unit divides evenly by 2 or 4 (padding) and a
// parameter spans two ranks' shards; biases (< 64 elements) stay replicated.
constexpr int64_t kIn = 13, kClasses = 5, kBatch = 16;
inline const std::vector<int64_t> kSizes = {kIn, 37, 29, kClasses};
constexpr int64_t kMinWeight = 64;
constexpr int kSteps = 4;

inline FullyShardedOptions opts(ZeroStage stage, DType dtype = DType::f32) {
  FullyShardedOptions o;
  o.stage = stage;
  o.min_weight_size = kMinWeight;
  o.param_dtype = dtype;
  return o;
}

inline nn::MLPConfig mlp_config(bool defer_init = false) {
  nn::MLPConfig c;
  c.sizes = kSizes;
  c.seed = 7;
  c.defer_init = defer_init;
  return c;
}

// Step s's global batch: (kBatch, kIn) inputs and labels.
inline std::pair<Tensor, Tensor> batch(int s) {
  Tensor x = Tensor::empty({kBatch, kIn}, DType::f32);
  fill_normal(x, 11, key_from_name("x") + static_cast<uint64_t>(s), 0.0, 1.0);
  Tensor y = Tensor::empty({kBatch}, DType::i64);
  for (int64_t i = 0; i < kBatch; ++i) y.data<int64_t>()[i] = (i * 7 + s * 3) % kClasses;
  return {x, y};
}

// Forward and backward of rank `rank`'s rows of step s's global batch, the
// loss normalized by the global batch and multiplied by `loss_scale`.
inline double local_forward_backward(nn::Module& model, int s, int rank, int ranks, double loss_scale = 1.0) {
  auto [x, y] = batch(s);
  const int64_t local = kBatch / ranks;
  nn::CrossEntropyLoss ce;
  const double loss = ce.forward(model.forward(x.narrow(0, local * rank, local)), y.narrow(0, local * rank, local),
                                 static_cast<double>(kBatch) / loss_scale);
  model.backward(ce.backward());
  return loss;
}

struct Outcome {
  std::vector<double> losses;
  Params params;
  // Rank 0's all-gather bytes over the training steps (Communicator::traffic)
  // on the shard communicator and, with ZeRO++ nodes, within its node.
  uint64_t shard_gather_bytes = 0, local_gather_bytes = 0;
  int64_t padded = 0;  // every unit's Np
  int64_t secondary_bytes = 0, secondary_peak = 0, secondary_after_step = 0;  // hpZ
};

inline Params snapshot(nn::Module& m) {
  Params out;
  for (nn::Parameter* p : m.parameters()) out[p->name] = p->value.to_vector();
  return out;
}

// One device: the reference.
inline Outcome reference(int steps = kSteps) {
  nn::MLP model(mlp_config());
  optim::AdamW opt(model.parameters(), 1e-2, {0.9, 0.999}, 1e-8, 0.1);
  nn::CrossEntropyLoss ce;
  Outcome o;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s);
    o.losses.push_back(ce.forward(model.forward(x), y, static_cast<double>(kBatch)));
    model.backward(ce.backward());
    opt.step();
    model.zero_grad();
  }
  o.params = snapshot(model);
  return o;
}

struct RunSpec {
  int ranks = 2;
  FsdpMode strategy{ZeroStage::zero3, false};
  int micro_batches = 1;
  FullyShardedOptions options;
  int steps = kSteps;
  bool defer_init = false;  // build the model without values; the wrapper builds the shards
  bool whole_model_unit = false;  // unit_modules = {the model}: one unit for every parameter
  bool split_backward = false;    // backward_input, then backward_weight
  bool interleave = false;        // every micro-batch's forward, then every backward (GPipe order)
  bool round_in_wrapper = false;  // mixed precision: after_step rounds the masters, not the optimizer
  int zeropp_nodes = 0;           // > 0: ZeRO++ over a node x fsdp split of the ranks (options' flags)
};

// Backward of one micro-batch, fused or split.
inline void backward(nn::Module& model, const Tensor& dy, nn::Saved& saved, bool split) {
  if (!split) {
    model.backward(dy, saved);
    return;
  }
  model.backward_input(dy, saved);
  model.backward_weight(saved);
}

// The same training, data parallel over every rank, sharded per `setup`.
inline Outcome run(const RunSpec& setup) {
  Outcome out;
  std::mutex mu;
  comm::launch({.engine = comm::Engine::threads, .ranks = setup.ranks}, [&](comm::Communicator& world) {
    std::unique_ptr<mesh::DeviceMesh> mesh;
    comm::Communicator* shard = &world;
    comm::Communicator* replicate = nullptr;
    if (setup.zeropp_nodes > 0) {  // shard over every rank, split node-major for ZeRO++
      mesh = std::make_unique<mesh::DeviceMesh>(
          world, std::vector<int>{setup.zeropp_nodes, setup.ranks / setup.zeropp_nodes},
          std::vector<std::string>{std::string(mesh::kNode), std::string(mesh::kFsdp)});
    }
    if (setup.strategy.hybrid) {
      mesh = std::make_unique<mesh::DeviceMesh>(
          world, std::vector<int>{2, setup.ranks / 2},
          std::vector<std::string>{std::string(mesh::kData), std::string(mesh::kFsdp)});
      shard = &mesh->comm(mesh::kFsdp);
      replicate = &mesh->comm(mesh::kData);
    }
    nn::MLP model(mlp_config(setup.defer_init));
    FullyShardedOptions o = setup.options;
    o.stage = setup.strategy.stage;
    o.min_weight_size = kMinWeight;
    if (setup.whole_model_unit) o.unit_modules = {&model};
    if (setup.zeropp_nodes > 0) {
      o.node_local = &mesh->comm(mesh::kFsdp);
      o.cross_node = setup.zeropp_nodes > 1 ? &mesh->comm("node") : nullptr;
    }
    FullyShardedDataParallel fsdp(model, *shard, replicate, o);
    EXPECT_EQ(fsdp.units().size(), setup.whole_model_unit ? 1u : 3u);
    if (setup.round_in_wrapper)
      for (nn::Parameter* p : fsdp.optimizer_parameters()) p->rounded = Tensor();
    optim::AdamW opt(fsdp.optimizer_parameters(), 1e-2, {0.9, 0.999}, 1e-8, 0.1);
    const int m = setup.micro_batches;
    std::vector<nn::CrossEntropyLoss> ce(static_cast<size_t>(m));
    std::vector<nn::Saved> saved(static_cast<size_t>(m));
    const int64_t local = kBatch / world.size(), first = local * world.rank();
    std::vector<double> losses;
    comm::Communicator* node = setup.zeropp_nodes > 0 ? &mesh->comm(mesh::kFsdp) : nullptr;
    for (comm::Communicator* c : {shard, node})
      if (c != nullptr) c->reset_traffic();  // construction's structure check is not training
    int64_t secondary_peak = 0, secondary_after_step = 0;
    for (int s = 0; s < setup.steps; ++s) {
      auto [x, y] = batch(s);
      double loss = 0;
      auto forward = [&](int i) {
        const int64_t lo = first + local * i / m, hi = first + local * (i + 1) / m;
        loss += ce[i].forward(model.forward(x.narrow(0, lo, hi - lo), saved[i]), y.narrow(0, lo, hi - lo),
                              static_cast<double>(kBatch));
        secondary_peak = std::max(secondary_peak, fsdp.secondary_bytes_held());
      };
      for (int i = 0; i < m; ++i) {
        if (setup.interleave) {
          forward(i);
          continue;
        }
        fsdp.begin_micro_batch(i, m);
        forward(i);
        backward(model, ce[i].backward(), saved[i], setup.split_backward);
      }
      for (int i = 0; setup.interleave && i < m; ++i) {
        fsdp.begin_micro_batch(i, m);
        backward(model, ce[i].backward(), saved[i], setup.split_backward);
      }
      fsdp.finish();
      opt.step();
      fsdp.after_step();
      fsdp.zero_grad();
      secondary_after_step = std::max(secondary_after_step, fsdp.secondary_bytes_held());
      world.all_reduce(&loss, &loss, 1, DType::f64, comm::ReduceOp::sum);
      losses.push_back(loss);
    }
    const uint64_t shard_gathers = shard->traffic(comm::CollectiveOp::all_gather).bytes;
    fsdp.gather_full_parameters();
    if (world.rank() == 0) {
      std::lock_guard lock(mu);
      out.losses = losses;
      out.params = snapshot(model);
      out.shard_gather_bytes = shard_gathers;
      out.local_gather_bytes = node != nullptr ? node->traffic(comm::CollectiveOp::all_gather).bytes : 0;
      for (const UnitInfo& u : fsdp.units()) out.padded += u.padded;
      out.secondary_bytes = fsdp.secondary_bytes();
      out.secondary_peak = secondary_peak;
      out.secondary_after_step = secondary_after_step;
    }
  });
  return out;
}

inline void expect_close(const Outcome& got, const Outcome& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t s = 0; s < want.losses.size(); ++s)
    EXPECT_NEAR(got.losses[s], want.losses[s], rtol * std::abs(want.losses[s])) << what << " step " << s;
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (const auto& [name, w] : want.params) {
    const std::vector<double>& g = got.params.at(name);
    ASSERT_EQ(g.size(), w.size()) << what << " " << name;
    double scale = 0;
    for (double v : w) scale = std::max(scale, std::abs(v));
    for (size_t i = 0; i < w.size(); ++i)
      ASSERT_NEAR(g[i], w[i], rtol * scale) << what << " " << name << "[" << i << "]";
  }
}

}  // namespace meshtrain::parallel::fsdp_testing
