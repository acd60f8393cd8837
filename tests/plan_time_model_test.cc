// Time-model tests: every figure is worked out here by hand from the model
// stated at the top of time_model.h (compute from FLOPs and bytes, each
// communication call as latency + wire bytes / bandwidth on its link,
// overlap, the pipeline's bubble, shared cores), on a synthetic Hardware
// whose rates keep the arithmetic plain, and on a small GPT: V 1000,
// T 128, 2 blocks of C 256 (4 heads), global batch 8.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/time_model.h"
#include "meshtrain/plan/traffic_model.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/train/model_parameters.h"

namespace meshtrain::plan {
namespace {

using meshtrain::testing::error_of;
using ::testing::HasSubstr;

// Within a relative 1e-12: the code sums in another order.
#define EXPECT_REL(actual, expected) EXPECT_NEAR((actual), (expected), 1e-12 * std::abs(expected) + 1e-300)

constexpr double V = 1000, T = 128, C = 256, L = 2;
// The model from the gpt recipe itself (what the trainer builds).
const GptShape kGpt = train::with_gpt_model({.vocab = 1000, .seq = 128, .layers = 2, .heads = 4, .width = 256});

Hardware easy(bool overlap) {
  Hardware h;
  h.name = "easy";
  h.gemm_flops = 1e12;
  h.gemm_overhead_flops = 0;
  h.attention_efficiency = 0.5;
  h.elementwise_bandwidth = 1e11;
  h.intra = {.latency = 1e-6, .bandwidth = 1e10};
  h.inter = {.latency = 1e-5, .bandwidth = 1e9};
  h.devices_per_node = 4;
  h.overlap = overlap;
  h.cores = 0;
  return h;
}

TrainingLayout layout(int data, int tensor, int pipeline, int micro_batches) {
  TrainingLayout l;
  l.data = data;
  l.tensor = tensor;
  l.pipeline = pipeline;
  l.micro_batches = micro_batches;
  l.batch = 8;
  return l;
}

// Parameters of one block: ln_1 2C, c_attn 3C^2 + 3C, attn.c_proj C^2 + C,
// ln_2 2C, c_fc 4C^2 + 4C, mlp.c_proj 4C^2 + C.
constexpr double kBlockParams = 12 * C * C + 13 * C;

// The header's compute on one device (k = 1, no recompute, one micro-batch
// of B samples, t = T tokens), for `blocks` blocks, with or without the
// embedding and the tied head: seconds on easy().
struct Compute {
  double gemm, attention, elementwise, backward;
};
Compute by_hand(double B, double blocks, bool embed, bool head) {
  const double tokens = B * T;
  // GEMMs: 24 B t C^2 forward per block, twice that backward; head 2 B t C V, x3.
  const double block_gemm = 24 * tokens * C * C, head_gemm = head ? 2 * tokens * C * V : 0;
  // Attention: 4 B C T (T + 1) / 2 forward, 2.5x backward, at 1e12 x 0.5.
  const double att = 4 * B * C * T * (T + 1) / 2 / 0.5e12;
  // Elementwise: (10 C + 16 C) x 4 bytes per token and block forward, 2x
  // backward; the loss 5 V x 4 and the embedding 3 C x 4 per token; 1e11 B/s.
  const double block_bytes = tokens * 26 * C * 4;
  const double once = tokens * ((head ? 5 * V * 4 : 0) + (embed ? 3 * C * 4 : 0));
  return {.gemm = blocks * 3 * block_gemm / 1e12 + 3 * head_gemm / 1e12,
          .attention = blocks * 3.5 * att,
          .elementwise = (blocks * 3 * block_bytes + once) / 1e11,
          // what gradient reductions hide under: the backward GEMMs, the
          // backward attention and the blocks' backward elementwise bytes
          .backward = blocks * 2 * block_gemm / 1e12 + 2 * head_gemm / 1e12 + blocks * 2.5 * att +
                      blocks * 2 * block_bytes / 1e11};
}

// All parameters on one device: wte V C, wpe T C, the blocks, ln_f 2C.
constexpr double kAllParams = V * C + T * C + L * kBlockParams + 2 * C;

// ---- One device ---------------------------------------------------------------

TEST(TimeModel, OneDeviceComputeIsTheHeadersFormulas) {
  const TimePrediction t = predict_time(kGpt, layout(1, 1, 1, 1), easy(true));
  ASSERT_EQ(t.devices.size(), 1u);
  const DeviceTime& d = t.devices[0];
  // B t = 8 x 128 = 1024 tokens. GEMMs: 2 blocks x 3 x 24 x 1024 x 256^2
  // + 3 x 2 x 1024 x 256 x 1000 = 9,663,676,416 + 1,572,864,000 FLOPs at 1e12.
  EXPECT_REL(d.gemm, 11'236'540'416.0 / 1e12);
  // Attention: 4 x 8 x 256 x 128 x 129 / 2 = 67,633,152 FLOPs forward,
  // x 3.5 x 2 blocks = 473,432,064 at 0.5e12.
  EXPECT_REL(d.attention, 473'432'064.0 / 0.5e12);
  // Elementwise: 1024 x (26 x 256 x 4 x 3 x 2 + 5 x 1000 x 4 + 3 x 256 x 4)
  // = 163,577,856 + 20,480,000 + 3,145,728 = 187,203,584 bytes at 1e11.
  EXPECT_REL(d.elementwise, 187'203'584.0 / 1e11);
  // Optimizer: 32 bytes x (256,000 + 32,768 + 2 x 789,760 + 512 = 1,868,800).
  EXPECT_REL(d.optimizer, 32 * 1'868'800.0 / 1e11);
  EXPECT_REL(kAllParams, 1'868'800.0);
  const Compute hand = by_hand(8, 2, true, true);  // the helper agrees
  EXPECT_REL(d.gemm, hand.gemm);
  EXPECT_REL(d.attention, hand.attention);
  EXPECT_REL(d.elementwise, hand.elementwise);
  EXPECT_EQ(d.comm, 0);
  EXPECT_EQ(d.comm_exposed, 0);
  EXPECT_EQ(d.bubble, 0);
  EXPECT_TRUE(d.comm_by_group.empty());
  EXPECT_REL(d.step, d.compute());
  EXPECT_REL(t.step, d.compute());
  // PaLM's count: tokens x (6 N + 12 L C T), N = 12 L C^2 + V C.
  EXPECT_REL(t.model_flops, 8 * T * (6 * (12 * L * C * C + V * C) + 12 * L * C * T));
}

TEST(TimeModel, GemmOverheadIsPerGemmCall) {
  Hardware h = easy(true);
  h.gemm_overhead_flops = 1e6;
  const double base = predict_time(kGpt, layout(1, 1, 1, 1), easy(true)).devices[0].gemm;
  // 4 GEMMs per block forward and 8 backward, x 2 blocks, + the head's 1 + 2 = 27 calls.
  EXPECT_REL(predict_time(kGpt, layout(1, 1, 1, 1), h).devices[0].gemm, base + 27 * 1e6 / 1e12);
}

// ---- The bubble ---------------------------------------------------------------

TEST(TimeModel, PipelineBubbleClosedForms) {
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("gpipe"), 4, 8), 3.0 / 11);        // (p-1)/(m+p-1)
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("1f1b"), 4, 8), 3.0 / 11);
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("1f1b"), 2, 4), 1.0 / 5);
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("interleaved"), 4, 8, 2), 3.0 / 19);  // (p-1)/(vm+p-1)
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("interleaved"), 2, 4, 3), 1.0 / 13);
  // 1 - 3m/(2m+p-1+max(m,p))
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("zb"), 4, 8), 1 - 24.0 / 27);
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("zb"), 4, 2), 1 - 6.0 / 11);
  EXPECT_DOUBLE_EQ(pipeline_bubble(layout::parse_schedule_kind("gpipe"), 1, 4), 0);
}

// ---- Communication ------------------------------------------------------------

// all_reduce over n ranks: latency + 2 (n - 1) / n bytes / bandwidth.
double all_reduce(double n, double bytes, const LinkRate& link) {
  return link.latency + 2 * (n - 1) / n * bytes / link.bandwidth;
}
// Plain data parallelism's one bucket (all gradients, f32, under 25 MiB).
constexpr double kBucket = 4 * kAllParams;  // 7,475,200 bytes

TEST(TimeModel, DataParallelWithoutOverlapExposesEveryCall) {
  const Hardware h = easy(false);
  const TimePrediction t = predict_time(kGpt, layout(2, 1, 1, 1), h);
  ASSERT_EQ(t.devices.size(), 1u);
  const DeviceTime& d = t.devices[0];
  // n = 2: wire = bytes; both ranks in one node of 4: intra.
  // The loss's all_reduce: 3 f64 (loss, parameter check, stop request).
  const double comm = all_reduce(2, kBucket, h.intra) + all_reduce(2, 24, h.intra);
  EXPECT_REL(comm, 2e-6 + (7'475'200.0 + 24) / 1e10);
  EXPECT_REL(d.comm, comm);
  EXPECT_REL(d.comm_exposed, comm);
  const Compute hand = by_hand(4, 2, true, true);  // 4 samples per rank
  EXPECT_REL(d.compute(), hand.gemm + hand.attention + hand.elementwise + 32 * kAllParams / 1e11);
  EXPECT_REL(d.step, d.compute() + comm);
  ASSERT_EQ(d.comm_by_group.size(), 1u);
  EXPECT_EQ(d.comm_by_group[0].first, "data");
  EXPECT_REL(d.comm_by_group[0].second, comm);
}

TEST(TimeModel, DataParallelBucketsHideUnderTheBackward) {
  const Hardware h = easy(true);
  const DeviceTime d = predict_time(kGpt, layout(2, 1, 1, 1), h).devices[0];
  const double bucket = all_reduce(2, kBucket, h.intra), loss = all_reduce(2, 24, h.intra);
  ASSERT_GT(by_hand(4, 2, true, true).backward, bucket);  // 7.5e-4 s under ~4e-3 s
  EXPECT_REL(d.comm, bucket + loss);
  EXPECT_REL(d.comm_exposed, loss);  // the loss is always exposed
  EXPECT_REL(d.step, d.compute() + loss);

  // A slow link: the bucket outlasts the backward by bucket - backward.
  Hardware slow = h;
  slow.intra.bandwidth = 1e8;
  const DeviceTime s = predict_time(kGpt, layout(2, 1, 1, 1), slow).devices[0];
  const double slow_bucket = all_reduce(2, kBucket, slow.intra), backward = by_hand(4, 2, true, true).backward;
  ASSERT_GT(slow_bucket, backward);
  EXPECT_REL(s.comm_exposed, all_reduce(2, 24, slow.intra) + slow_bucket - backward);
  EXPECT_REL(s.step, s.compute() + s.comm_exposed);
}

TEST(TimeModel, TensorParallelCommunicationIsAlwaysExposed) {
  const Hardware h = easy(true);
  const TimePrediction t = predict_time(kGpt, layout(1, 2, 1, 1), h);
  ASSERT_EQ(t.devices.size(), 2u);  // both ranks hold 500 rows of wte
  // a = B t C x 4 = 8 x 128 x 256 x 4 = 1,048,576 bytes: 2 blocks x 2 x 2
  // all_reduces (forward, backward), the embedding's and the head's: 10;
  // the loss's row maxima 4 x 1024 and sums 16 x 1024 bytes; the parameter
  // check with the stop request (16 bytes) and the gradient check (8).
  const double a = 8 * T * C * 4;
  const double comm = 10 * all_reduce(2, a, h.intra) + all_reduce(2, 4 * 1024, h.intra) +
                      all_reduce(2, 16 * 1024, h.intra) + all_reduce(2, 16, h.intra) + all_reduce(2, 8, h.intra);
  EXPECT_REL(comm, 14e-6 + (10 * 1'048'576.0 + 4096 + 16384 + 24) / 1e10);
  for (const DeviceTime& d : t.devices) {
    EXPECT_REL(d.comm, comm);
    EXPECT_REL(d.comm_exposed, comm);  // overlap or not
    EXPECT_REL(d.step, d.compute() + comm);
    // k = 2 halves the GEMMs: (144 x 1024 x 256^2 + 6 x 1024 x 256 x 1000) / 2 FLOPs.
    EXPECT_REL(d.gemm, 11'236'540'416.0 / 2 / 1e12);
  }
  EXPECT_REL(predict_time(kGpt, layout(1, 2, 1, 1), easy(false)).devices[0].comm_exposed, comm);
}

TEST(TimeModel, InterNodeGroupsUseTheInterLink) {
  Hardware h = easy(false);
  const TrainingLayout l = layout(8, 1, 1, 1);
  // n = 8: wire = 2 x 7 / 8 = 1.75 x bytes.
  h.devices_per_node = 8;  // one node: intra
  EXPECT_REL(predict_time(kGpt, l, h).devices[0].comm, 2e-6 + 1.75 * (kBucket + 24) / 1e10);
  h.devices_per_node = 4;  // two nodes of 4 ranks: inter latency, min(1e10, 4 x 1e9)
  EXPECT_REL(predict_time(kGpt, l, h).devices[0].comm, 2e-5 + 1.75 * (kBucket + 24) / 4e9);
  h.devices_per_node = 2;  // four nodes of 2: min(1e10, 2 x 1e9)
  EXPECT_REL(predict_time(kGpt, l, h).devices[0].comm, 2e-5 + 1.75 * (kBucket + 24) / 2e9);
  h.devices_per_node = 4;
  h.inter.bandwidth = 5e9;  // min(1e10, 4 x 5e9): the intra bandwidth bounds it
  EXPECT_REL(predict_time(kGpt, l, h).devices[0].comm, 2e-5 + 1.75 * (kBucket + 24) / 1e10);
}

// The runtime numbers ranks in the order --mesh lists the axes: tensor
// first (slowest) puts each tensor pair on two nodes of 2.
TEST(TimeModel, TheMeshOrderDecidesWhichGroupsShareANode) {
  Hardware h = easy(false);
  h.devices_per_node = 2;
  const auto tensor_comm = [&](std::vector<std::string> order) {
    TrainingLayout l = layout(2, 2, 1, 1);
    l.axis_order = std::move(order);
    const TimePrediction tp = predict_time(kGpt, l, h);
    for (const auto& [group, sec] : tp.devices[0].comm_by_group)
      if (group == "tensor") return sec;
    return -1.0;
  };
  const double inside = tensor_comm({}), same = tensor_comm({"data", "tensor"}), across = tensor_comm({"tensor", "data"});
  EXPECT_GT(inside, 0);
  EXPECT_EQ(same, inside);
  // Across nodes every call pays the inter latency and min(1e10, 1 x 1e9).
  EXPECT_GT(across, 5 * inside);
  TrainingLayout l;
  l.set_mesh({{2, 4}, {"tensor", "data"}});
  EXPECT_EQ(l.rank_order(), (std::vector<std::string>{"tensor", "data", "pipeline", "fsdp", "expert", "context"}));
}

// Ulysses: 4 all_to_alls per block and pass, each sending one block of
// B t C / n f32 to each of the n - 1 peers.
TEST(TimeModel, AllToAllContextParallelismSendsNMinusOneBlocks) {
  const Hardware h = easy(false);  // 4 per node: context=4 is intra-node
  TrainingLayout l = layout(1, 1, 1, 1);
  l.context = 4;
  l.cp_comm = layout::ContextComm::all_to_all;
  const double batch = 8, t = T / 4, block = batch * t * C / 4 * 4;  // bytes per peer
  const double calls = L * 4 * 2;                                    // blocks x 4 x (forward, backward)
  double got = -1;
  const TimePrediction tp = predict_time(kGpt, l, h);
  for (const auto& [group, sec] : tp.devices[0].comm_by_group)
    if (group == "context") got = sec;
  // The context group also sums the gradients (all_reduce: 2 (n - 1) / n).
  double want = 0;
  int all_to_alls = 0;
  const std::vector<DeviceTraffic> traffic = predict_traffic(kGpt, l);
  for (const CommCall& c : traffic[0].calls) {
    if (c.group != "context") continue;
    if (c.kind == CommKind::all_to_all) {
      ++all_to_alls;
      EXPECT_EQ(c.bytes, block);
      EXPECT_EQ(static_cast<double>(c.calls), calls);
      want += c.calls * (1e-6 + 3 * c.bytes / 1e10);
    } else {
      ASSERT_EQ(c.kind, CommKind::all_reduce);
      want += c.calls * (1e-6 + 1.5 * c.bytes / 1e10);
    }
  }
  EXPECT_EQ(all_to_alls, 1);
  EXPECT_REL(got, want);
}

// ---- Pipeline -----------------------------------------------------------------

TEST(TimeModel, PipelineStepIsTheSlowestStageOverOneMinusTheBubble) {
  const Hardware h = easy(true);
  const TimePrediction t = predict_time(kGpt, layout(1, 1, 2, 4), h);
  ASSERT_EQ(t.devices.size(), 2u);
  // One block per stage; 4 micro-batches of B = 2. Per rank F + B over the
  // micro-batches: compute and one send of a = 2 x 128 x 256 x 4 bytes each
  // (activations forward on stage 0, gradients back on stage 1).
  const double send = h.intra.latency + 2 * T * C * 4 / h.intra.bandwidth;
  const Compute c0 = by_hand(2, 1, true, false), c1 = by_hand(2, 1, false, true);
  const double work[2] = {4 * (c0.gemm + c0.attention + c0.elementwise + send),
                          4 * (c1.gemm + c1.attention + c1.elementwise + send)};
  // The step's own work: AdamW over the stage's parameters (stage 0: wte,
  // wpe, block 0; stage 1: block 1, ln_f, the tied wte's copy), the loss's
  // and the gradient check's all_reduces over the pipeline (24 and 4
  // bytes) and the tied wte's gradient (V C x 4 bytes) between the stages.
  const double comm = all_reduce(2, 24, h.intra) + all_reduce(2, 4, h.intra) + all_reduce(2, V * C * 4, h.intra);
  const double own[2] = {32 * (V * C + T * C + kBlockParams) / 1e11 + comm,
                         32 * (kBlockParams + 2 * C + V * C) / 1e11 + comm};
  const double bubble = 1.0 / 5;  // (p - 1) / (m + p - 1), p = 2, m = 4
  const double span = std::max(work[0], work[1]) / (1 - bubble);
  for (int s = 0; s < 2; ++s) {
    const DeviceTime& d = t.devices[static_cast<size_t>(s)];
    EXPECT_EQ(d.stage, s);
    EXPECT_REL(d.comm, comm + 4 * send);  // recvs are not counted again
    EXPECT_REL(d.step, span + own[s]);
    EXPECT_REL(d.bubble, span - work[s]);
    EXPECT_GT(d.bubble, 0);
  }
  EXPECT_REL(t.step, std::max(span + own[0], span + own[1]));
  EXPECT_EQ(&t.slowest(), &t.devices[t.devices[1].step >= t.devices[0].step ? 1 : 0]);
}

// ---- Shared cores -------------------------------------------------------------

TEST(TimeModel, SharedCoresBoundTheStepByAllWorkOverTheCores) {
  Hardware h = easy(true);
  const DeviceTime alone = predict_time(kGpt, layout(4, 1, 1, 1), h).devices[0];
  h.cores = 2;  // 4 devices take turns on 2 cores
  const TimePrediction t = predict_time(kGpt, layout(4, 1, 1, 1), h);
  const DeviceTime& d = t.devices[0];
  EXPECT_REL(d.gemm, alone.gemm);  // one thread each, at the full rate
  // One device's work: B = 2 samples, the bucket hidden under its backward
  // (1.5 x 7,475,200 bytes / 1e10 = 1.1e-3 s under ~2e-3 s), the loss's
  // all_reduce over 4 ranks exposed.
  const Compute c = by_hand(2, 2, true, true);
  ASSERT_GT(c.backward, all_reduce(4, kBucket, h.intra));
  const double work = c.gemm + c.attention + c.elementwise + 32 * kAllParams / 1e11 + all_reduce(4, 24, h.intra);
  EXPECT_REL(d.compute() + d.comm_exposed, work);
  EXPECT_GE(t.step, 4 * work / 2 * (1 - 1e-12));
  EXPECT_REL(t.step, 4 * work / 2);  // > the critical path, work
  EXPECT_REL(d.step, t.step);
  EXPECT_REL(d.bubble, t.step - work);

  // 8 cores for 4 devices: 2 threads each, at 0.9 (GEMMs) and 0.6 (the rest).
  h.cores = 8;
  h.thread_efficiency = 0.9;
  h.other_thread_efficiency = 0.6;
  const DeviceTime two = predict_time(kGpt, layout(4, 1, 1, 1), h).devices[0];
  EXPECT_REL(two.gemm, alone.gemm / 1.8);
  EXPECT_REL(two.attention, alone.attention / 1.2);
  EXPECT_REL(two.elementwise, alone.elementwise / 1.2);
  EXPECT_REL(two.optimizer, alone.optimizer / 1.2);
}

// ---- Hardware -----------------------------------------------------------------

TEST(TimeModel, PresetsHaveRatesAndUnknownNamesThrow) {
  for (const char* name : {"H100", "A100"}) {
    const Hardware h = hardware_preset(name);
    EXPECT_EQ(h.name, name);
    EXPECT_GT(h.gemm_flops, 0) << name;
    EXPECT_GT(h.gemm_flops_bf16, h.gemm_flops) << name;
    EXPECT_GT(h.elementwise_bandwidth, 0) << name;
    EXPECT_GT(h.intra.bandwidth, h.inter.bandwidth) << name;
    EXPECT_GT(h.inter.bandwidth, 0) << name;
    EXPECT_GT(h.attention_efficiency, 0) << name;
    EXPECT_LE(h.attention_efficiency, 1) << name;
    EXPECT_GT(predict_time(kGpt, layout(2, 2, 2, 2), h).step, 0) << name;
  }
  EXPECT_GT(hardware_preset("H100").gemm_flops, hardware_preset("A100").gemm_flops);
  EXPECT_THAT(hardware_preset_names(), ::testing::ElementsAre("A100", "H100"));
  EXPECT_THROW(hardware_preset("V100"), InvalidArgument);
  EXPECT_THAT(error_of([] { hardware_preset("V100"); }), HasSubstr("V100"));
}

TEST(TimeModel, HardwareWithoutRatesThrows) {
  Hardware none;
  none.name = "blank";
  EXPECT_THROW(predict_time(kGpt, layout(1, 1, 1, 1), none), InvalidArgument);
  EXPECT_THAT(error_of([&] { predict_time(kGpt, layout(1, 1, 1, 1), none); }), HasSubstr("blank"));
  Hardware no_link = easy(true);
  no_link.inter.bandwidth = 0;
  EXPECT_THROW(predict_time(kGpt, layout(1, 1, 1, 1), no_link), InvalidArgument);
}

}  // namespace
}  // namespace meshtrain::plan
