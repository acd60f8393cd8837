// Every name of the vocabulary round-trips through its one parser, the
// aliases land on the same value, and unknown names are refused with the
// choices listed.
#include "meshtrain/layout/vocabulary.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::layout {
namespace {

using ::testing::HasSubstr;
using meshtrain::testing::error_of;

TEST(Vocabulary, Precision) {
  for (std::string_view n : kPrecisionNames) EXPECT_EQ(precision_name(parse_precision(n)), n);
  EXPECT_EQ(parse_precision("no"), DType::f32);  // the seeds' mixed_precision spelling
  EXPECT_THAT(error_of([] { parse_precision("fp8", "--precision"); }),
              HasSubstr("--precision: precision 'fp8' (hint: use fp32 (or no), bf16 or fp16)"));
  EXPECT_THAT(error_of([] { precision_name(DType::i64); }), HasSubstr("i64 is not a training precision"));
}

TEST(Vocabulary, FsdpModes) {
  for (std::string_view n : {"full", "shard_grad_op", "no_shard", "zero1", "hybrid_full", "hybrid_shard_grad_op"})
    EXPECT_EQ(parse_fsdp_mode(n).name(), n);
  EXPECT_EQ(parse_fsdp_mode("zero3"), parse_fsdp_mode("full"));
  EXPECT_EQ(parse_fsdp_mode("zero2"), parse_fsdp_mode("shard_grad_op"));
  EXPECT_EQ(parse_fsdp_mode("hybrid_full"), (FsdpMode{ZeroStage::zero3, true}));
  EXPECT_THAT(error_of([] { parse_fsdp_mode("zero4"); }), HasSubstr("Unknown sharding strategy: zero4"));
  for (auto p : {BackwardPrefetch::none, BackwardPrefetch::pre, BackwardPrefetch::post})
    EXPECT_EQ(parse_backward_prefetch(to_string(p)), p);
  EXPECT_EQ(parse_backward_prefetch("backward_post"), BackwardPrefetch::post);
  EXPECT_THAT(error_of([] { parse_backward_prefetch("later"); }), HasSubstr("use none, pre or post"));
}

TEST(Vocabulary, PipelineSchedules) {
  for (auto k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved_1f1b,
                 ScheduleKind::zero_bubble})
    EXPECT_EQ(parse_schedule_kind(to_string(k)), k);
  EXPECT_THAT(error_of([] { parse_schedule_kind("zb-v"); }), HasSubstr("use gpipe, 1f1b, interleaved or zb"));
}

TEST(Vocabulary, ContextComm) {
  for (auto c : {ContextComm::ring, ContextComm::all_to_all}) EXPECT_EQ(parse_context_comm(context_comm_name(c)), c);
  EXPECT_EQ(parse_context_comm("ulysses"), ContextComm::all_to_all);
  EXPECT_THAT(error_of([] { parse_context_comm("star"); }),
              HasSubstr("--cp-comm: 'star' (hint: use ring or all_to_all)"));
}

TEST(Vocabulary, RouterScore) {
  for (auto r : {RouterScore::softmax, RouterScore::sigmoid}) EXPECT_EQ(parse_router_score(router_score_name(r)), r);
  EXPECT_THAT(error_of([] { parse_router_score("sparsemax"); }),
              HasSubstr("--router-score: router score 'sparsemax' (hint: use softmax or sigmoid)"));
}

TEST(Vocabulary, ZeroPP) {
  EXPECT_FALSE(parse_zeropp("").any());
  EXPECT_EQ(parse_zeropp(" hpz , qwz"), (ZeroPPParts{.qwz = true, .hpz = true}));
  EXPECT_EQ(parse_zeropp("hpz,qwz").to_string(), "qwz,hpz");
  EXPECT_EQ(parse_zeropp("qwz,qgz,hpz").to_string(), "qwz,qgz,hpz");
  EXPECT_THAT(error_of([] { parse_zeropp("qwz,zpp"); }), HasSubstr("zeropp 'qwz,zpp': unknown part 'zpp'"));
}

}  // namespace
}  // namespace meshtrain::layout
