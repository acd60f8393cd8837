// plan::predict_traffic against what real training runs send: the GPT of
// tests/gpt_parity.h (AdamW, 2 steps) through the trainer on the threads
// engine, every rank's Communicator::traffic counters through the training
// steps (TrainResult::traffic_by_rank), per communicator and operation:
// calls and bytes exactly equal to the prediction, for data parallelism
// (with buckets and micro-batches), zero1/2/3 (bf16 too), no_shard,
// hybrid_full, tensor (with sequence parallelism and recompute), pipelines
// (1F1B, GPipe, interleaved, zero bubble; with fsdp and tensor),
// ring-attention context parallelism and 3-D meshes; Llama's blocks (with
// key/value heads replicated over the tensor axis) likewise; MoE layers
// over an expert axis (beside data, fsdp and tensor): calls exactly, the
// bytes of what the routing decides within 10%.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>

#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/plan/time_model.h"
#include "meshtrain/plan/traffic_model.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/train/trainer.h"
#include "tests/plan_case.h"

namespace meshtrain {
namespace {

using Case = PlanCase;

// Measured group names as the model names them: the communicator's axes of
// size > 1 in mesh order; "" for one rank.
std::string canonical(const std::string& group, const mesh::NamedShape& mesh) {
  if (group == "tied") return group;
  std::vector<std::string> axes;
  if (group == "world") axes = mesh.axis_names;
  else
    for (size_t at = 0;;) {
      const size_t plus = group.find('+', at);
      axes.push_back(group.substr(at, plus - at));
      if (plus == std::string::npos) break;
      at = plus + 1;
    }
  std::string out;
  for (std::string_view a : plan::kPlannedAxes)
    if (std::find(axes.begin(), axes.end(), a) != axes.end() && mesh.size_of(a) > 1)
      out.append(out.empty() ? "" : "+").append(a);
  return out;
}

void check(const Case& c) {
  const std::string name = c.name();
  SCOPED_TRACE(name);
  const PlanRun run = run_plan_case(c);
  const train::TrainResult& r = run.result;
  const plan::TrainingLayout& l = run.layout;
  const plan::GptShape& g = run.shape;
  const mesh::NamedShape& mesh = run.mesh;
  const std::vector<plan::DeviceTraffic> want = plan::predict_traffic(g, l);
  ASSERT_EQ(static_cast<int>(r.traffic_by_rank.size()), l.devices());
  ASSERT_EQ(r.traffic_steps, 2);
  const int pipeline_stride = l.devices() / l.pipeline;
  using Key = std::tuple<std::string, std::string>;  // group, operation
  for (int w = 0; w < l.devices(); ++w) {
    const plan::DeviceTraffic& dev = want.at(static_cast<size_t>(w / pipeline_stride * l.tensor + w % l.tensor));
    std::map<Key, std::pair<double, double>> predicted, measured;  // calls, bytes per step
    for (const plan::CommCall& call : dev.calls) {
      auto& [calls, bytes] = predicted[{call.group, std::string(plan::comm_kind_name(call.kind))}];
      calls += static_cast<double>(call.calls);
      bytes += static_cast<double>(call.calls) * call.bytes;
    }
    for (const train::TrafficRecord& t : r.traffic_by_rank[static_cast<size_t>(w)]) {
      const std::string group = canonical(t.group, mesh);
      if (group.empty()) continue;  // one rank: nothing moves
      auto& [calls, bytes] = measured[{group, std::string(comm::collective_op_name(t.op))}];
      calls += static_cast<double>(t.calls) / 2;
      bytes += static_cast<double>(t.bytes) / 2;
    }
    std::string table;
    for (const auto& [key, v] : measured) {
      const auto it = predicted.find(key);
      table += fmt::format("  rank {} {:<14} {:<14} measured {:>4} calls {:>9} bytes, predicted {}\n", w,
                           std::get<0>(key), std::get<1>(key), v.first, v.second,
                           it == predicted.end() ? "none" : fmt::format("{} calls {} bytes", it->second.first,
                                                                        it->second.second));
    }
    for (const auto& [key, v] : predicted)
      if (!measured.count(key))
        table += fmt::format("  rank {} {:<14} {:<14} measured none, predicted {} calls {} bytes\n", w,
                             std::get<0>(key), std::get<1>(key), v.first, v.second);
    if (c.blocks != "moe") {
      EXPECT_EQ(predicted, measured) << "rank " << w << ":\n" << table;
    } else {
      // The model takes routing as even; real tokens are routed unevenly,
      // so what the rows move (the all-to-alls, a tensor axis's experts)
      // differs by that much, as do the replicated gradients' shards fsdp
      // cuts around the experts. The calls are exact.
      ASSERT_EQ(predicted.size(), measured.size()) << "rank " << w << ":\n" << table;
      for (const auto& [key, v] : measured) {
        const auto& [calls, bytes] = predicted[key];
        EXPECT_EQ(calls, v.first) << "rank " << w << ":\n" << table;
        const bool routed = std::get<1>(key) == "all_to_all_v" || std::get<0>(key) == "tensor" ||
                            (!c.fsdp.empty() && key == Key{"expert", "all_reduce"});
        if (routed) {
          EXPECT_NEAR(bytes / v.second, 1.0, 0.1) << "rank " << w << ":\n" << table;
        } else {
          EXPECT_EQ(bytes, v.second) << "rank " << w << ":\n" << table;
        }
      }
    }
    if (w == 0) fmt::print("{}: rank 0 per step\n{}", name, table);
  }
}

TEST(TrafficModel, DataParallel) {
  check({.mesh = ""});
  check({.mesh = "data=2"});
  check({.mesh = "data=2", .micro_batches = 2});
  check({.mesh = "data=2", .bucket_mb = 0.05});
}
TEST(TrafficModel, FullySharded) {
  check({.mesh = "data=2", .fsdp = "zero1"});
  check({.mesh = "data=2", .fsdp = "zero1", .micro_batches = 2});
  check({.mesh = "data=2", .fsdp = "zero2", .micro_batches = 2});
  check({.mesh = "fsdp=2", .fsdp = "zero3", .micro_batches = 2});
  check({.mesh = "fsdp=2", .fsdp = "zero3", .reshard_after_forward = false});
  check({.mesh = "fsdp=2", .fsdp = "zero3", .precision = DType::bf16});
  check({.mesh = "data=2", .fsdp = "no_shard"});
  check({.mesh = "data=2,fsdp=2", .fsdp = "hybrid_full"});
}
// Llama's blocks: q, k and v column-parallel Linears of their own, the
// SwiGLU's gate and up; key/value heads replicated over tensor=4.
TEST(TrafficModel, Llama) {
  check({.mesh = "tensor=2", .blocks = "llama"});
  check({.mesh = "tensor=2", .sequence_parallel = true, .blocks = "llama"});
  check({.mesh = "tensor=4", .blocks = "llama"});
  check({.mesh = "tensor=4", .sequence_parallel = true, .blocks = "llama"});
  check({.mesh = "fsdp=2", .fsdp = "zero3", .blocks = "llama"});
}
TEST(TrafficModel, MixtureOfExperts) {
  check({.mesh = "expert=2", .blocks = "moe"});
  check({.mesh = "data=2,expert=2", .blocks = "moe"});
  check({.mesh = "fsdp=2,expert=2", .fsdp = "zero3", .blocks = "moe"});
  check({.mesh = "expert=2,tensor=2", .blocks = "moe"});
  check({.mesh = "expert=2", .recompute = true, .blocks = "moe"});
  check({.mesh = "pipeline=2,expert=2", .micro_batches = 2, .blocks = "moe"});
}
// An uneven expert axis (the fullest rank's experts run 1.5x the even
// share): the rows coming back to it and its experts' tensor all-reduces
// grow by that much, its own rows out do not, and so do the activations
// its experts keep; without an expert axis the sums over experts do not
// depend on it.
TEST(TrafficModel, ExpertImbalanceScalesWhatTheExpertsRun) {
  train::TrainConfig tc = gpt_parity_config("imbalance", "adamw");
  tc.arch = layout::DecoderArch::llama;
  tc.kv_heads = 2;
  tc.moe = {.experts = 4, .top_k = 2, .expert_hidden = 16, .first_dense = 1};
  const plan::GptShape g = train::with_gpt_model(train::gpt_shape(tc));
  const auto bytes = [&](const plan::TrainingLayout& l, const std::string& what) {
    double b = 0;
    const std::vector<plan::DeviceTraffic> traffic = plan::predict_traffic(g, l);
    for (const plan::CommCall& c : traffic.at(0).calls)
      if (c.what == what) b += c.bytes * static_cast<double>(c.calls);
    return b;
  };
  plan::TrainingLayout even{.tensor = 2, .expert = 2, .batch = 8}, uneven = even;
  uneven.expert_imbalance = 1.5;
  EXPECT_GT(bytes(even, "MoE rows"), 0);
  EXPECT_EQ(bytes(uneven, "MoE rows"), bytes(even, "MoE rows"));
  EXPECT_DOUBLE_EQ(bytes(uneven, "MoE expert rows"), 1.5 * bytes(even, "MoE expert rows"));
  EXPECT_DOUBLE_EQ(bytes(uneven, "expert rows"), 1.5 * bytes(even, "expert rows"));
  EXPECT_GT(plan::predict_memory(g, uneven).worst().activations, plan::predict_memory(g, even).worst().activations);
  EXPECT_GT(plan::predict_time(g, uneven, plan::hardware_preset("H100")).step,
            plan::predict_time(g, even, plan::hardware_preset("H100")).step);
  plan::TrainingLayout one{.tensor = 2, .batch = 8}, one_uneven = one;
  one_uneven.expert_imbalance = 1.5;
  EXPECT_EQ(plan::predict_memory(g, one_uneven).worst().total(), plan::predict_memory(g, one).worst().total());
  plan::TrainingLayout bad = even;
  bad.expert_imbalance = 0.5;
  EXPECT_THROW((void)plan::predict_traffic(g, bad), InvalidArgument);
}

TEST(TrafficModel, Tensor) {
  check({.mesh = "tensor=2"});
  check({.mesh = "tensor=2", .sequence_parallel = true});
  check({.mesh = "tensor=2", .recompute = true});
  check({.mesh = "tensor=2", .sequence_parallel = true, .recompute = true});
}
TEST(TrafficModel, Pipeline) {
  check({.mesh = "pipeline=2", .micro_batches = 4});
  check({.mesh = "pipeline=2", .micro_batches = 4, .schedule = "gpipe"});
  check({.mesh = "pipeline=2", .micro_batches = 4, .schedule = "zb"});
  check({.mesh = "pipeline=2", .micro_batches = 4, .schedule = "interleaved", .virtual_stages = 2,
         .layers = 4});
  check({.mesh = "pipeline=2,fsdp=2", .fsdp = "zero1", .micro_batches = 4});
  check({.mesh = "pipeline=2,fsdp=2", .fsdp = "zero2", .micro_batches = 2});
  check({.mesh = "pipeline=2,fsdp=2", .fsdp = "zero3", .micro_batches = 4});
  check({.mesh = "pipeline=2,fsdp=2", .fsdp = "zero3", .micro_batches = 2, .reshard_after_forward = false});
  check({.mesh = "pipeline=2,fsdp=2", .fsdp = "zero3", .micro_batches = 4, .schedule = "zb"});
  check({.mesh = "pipeline=2,tensor=2", .sequence_parallel = true, .micro_batches = 2});
}
TEST(TrafficModel, Context) {
  check({.mesh = "context=2"});
  check({.mesh = "context=4"});
  check({.mesh = "context=2", .recompute = true});
  check({.mesh = "fsdp=2,context=2", .fsdp = "zero3"});
  check({.mesh = "context=2", .cp_comm = "all_to_all"});
  check({.mesh = "pipeline=2,context=2", .micro_batches = 2});
  check({.mesh = "pipeline=2,context=2", .micro_batches = 2, .schedule = "zb", .cp_comm = "all_to_all"});
  check({.mesh = "context=2,tensor=2", .sequence_parallel = true});
  check({.mesh = "context=4", .recompute = true, .cp_comm = "all_to_all"});
}
TEST(TrafficModel, ThreeD) {
  check({.mesh = "pipeline=2,data=2,tensor=2", .micro_batches = 2});
  check({.mesh = "data=2,context=2,tensor=2", .fsdp = "zero2"});
}

}  // namespace
}  // namespace meshtrain
