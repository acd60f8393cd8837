// Mesh-planning tests: size parsing, transformer plans for every n in 1..128 (every device used,
// tensor inside a node, context only for long sequences, monotone in model
// size), validation messages, and the docs table kept in sync.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/testing/testing.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <numeric>
#include <sstream>

#include "meshtrain/core/error.h"
#include "meshtrain/plan/mesh_planning.h"

namespace meshtrain::plan {
namespace {

using ::testing::HasSubstr;
using Ints = std::vector<int>;
using Names = std::vector<std::string>;

using meshtrain::testing::error_of;

int64_t product(const Ints& v) { return std::accumulate(v.begin(), v.end(), int64_t{1}, std::multiplies<>()); }


TEST(ParseModelSize, AcceptsSuffixesInAnyCaseAndDecimals) {
  EXPECT_DOUBLE_EQ(parse_model_size("7B"), 7e9);
  EXPECT_DOUBLE_EQ(parse_model_size("7b"), 7e9);  // reference: 1.0
  EXPECT_DOUBLE_EQ(parse_model_size("350M"), 350e6);
  EXPECT_DOUBLE_EQ(parse_model_size("350m"), 350e6);
  EXPECT_DOUBLE_EQ(parse_model_size("1.5T"), 1.5e12);  // reference: 1.0
  EXPECT_DOUBLE_EQ(parse_model_size("125k"), 125e3);
  EXPECT_DOUBLE_EQ(parse_model_size(" 13B "), 13e9);
  EXPECT_DOUBLE_EQ(parse_model_size("2.7 B"), 2.7e9);
  EXPECT_DOUBLE_EQ(parse_model_size("1000"), 1000);
  EXPECT_DOUBLE_EQ(parse_model_size(".5B"), 0.5e9);
}

TEST(ParseModelSize, RejectsWithMessages) {
  EXPECT_THAT(error_of([] { parse_model_size(""); }), HasSubstr("empty size"));
  EXPECT_THAT(error_of([] { parse_model_size("abc"); }), HasSubstr("'abc' does not start with a number"));
  EXPECT_THAT(error_of([] { parse_model_size("7X"); }), HasSubstr("'7X' has unknown suffix 'X'"));
  EXPECT_THAT(error_of([] { parse_model_size("7X"); }), HasSubstr("use K, M, B or T"));
  EXPECT_THAT(error_of([] { parse_model_size("7BB"); }), HasSubstr("unknown suffix 'BB'"));
  EXPECT_THAT(error_of([] { parse_model_size("-7B"); }), HasSubstr("'-7B' is negative"));
  EXPECT_THAT(error_of([] { parse_model_size("0B"); }), HasSubstr("'0B' is zero"));
  EXPECT_THAT(error_of([] { parse_model_size("inf"); }), HasSubstr("does not start with a number"));
}

TEST(ParseMemorySize, DecimalAndBinaryUnits) {
  EXPECT_DOUBLE_EQ(parse_memory_size("80GB"), 80e9);
  EXPECT_DOUBLE_EQ(parse_memory_size("80G"), 80e9);
  EXPECT_DOUBLE_EQ(parse_memory_size("80gb"), 80e9);
  EXPECT_DOUBLE_EQ(parse_memory_size("24GiB"), 24.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(parse_memory_size("512MB"), 512e6);
  EXPECT_DOUBLE_EQ(parse_memory_size("512MiB"), 512.0 * (1 << 20));
  EXPECT_DOUBLE_EQ(parse_memory_size("1TiB"), 1099511627776.0);
  EXPECT_DOUBLE_EQ(parse_memory_size("4096"), 4096);
  EXPECT_DOUBLE_EQ(parse_memory_size("1.5 TB"), 1.5e12);
}

TEST(ParseMemorySize, RejectsWithMessages) {
  EXPECT_THAT(error_of([] { parse_memory_size("80XB"); }), HasSubstr("'80XB' has unknown unit 'XB'"));
  EXPECT_THAT(error_of([] { parse_memory_size("80XB"); }), HasSubstr("KiB/MiB/GiB/TiB"));
  EXPECT_THAT(error_of([] { parse_memory_size("0GB"); }), HasSubstr("'0GB' is zero"));
  EXPECT_THAT(error_of([] { parse_memory_size(""); }), HasSubstr("empty size"));
  // Errors name the flag or field the text came from.
  EXPECT_THAT(error_of([] { parse_memory_size("-80GB", "--device-memory"); }),
              HasSubstr("--device-memory: '-80GB' is negative"));
  EXPECT_THAT(error_of([] { parse_memory_size("nanGB", "--device-memory"); }),
              HasSubstr("--device-memory: 'nanGB' does not start with a number"));
  EXPECT_THAT(error_of([] { parse_model_size("-7B", "--model-size"); }), HasSubstr("--model-size: '-7B' is negative"));
}

// ---- optimize_for_transformer ---------------------------------------------------

void expect_consistent(const MeshPlan& p, int n, int64_t seq, int per_node, const std::string& what) {
  EXPECT_EQ(p.device_count(), n) << what;
  EXPECT_EQ(product(p.shape), n) << what;
  ASSERT_EQ(p.shape.size(), p.axis_names.size()) << what;
  EXPECT_NO_THROW(validate_mesh_config(p.named_shape(), n)) << what;
  const mesh::NamedShape ns = p.named_shape();
  EXPECT_EQ(ns.size_of("pipeline"), p.pipeline) << what;
  EXPECT_EQ(ns.size_of("data"), p.data) << what;
  EXPECT_EQ(ns.size_of("fsdp"), p.fsdp) << what;
  EXPECT_EQ(ns.size_of("context"), p.context) << what;
  EXPECT_EQ(ns.size_of("tensor"), p.tensor) << what;
  if (n > per_node) {
    EXPECT_EQ(per_node % p.tensor, 0) << what;  // tensor groups stay inside a node
  }
  EXPECT_LE(p.tensor, std::max(per_node, 1)) << what;
  if (seq < kLongSequence) {
    EXPECT_EQ(p.context, 1) << what;
  }
  EXPECT_EQ(p.fits, p.bytes_per_device <= p.usable_bytes) << what;
  EXPECT_GE(p.reasons.size(), 9u) << what;
}

TEST(OptimizeForTransformer, UsesEveryDeviceForEveryNUpTo128) {
  for (const char* model : {"125M", "1B", "7b", "13B", "70B", "405B"})
    for (int64_t seq : {2048, 8192, 32768, 131072})
      for (int n = 1; n <= 128; ++n) {
        const MeshPlan p = optimize_for_transformer(n, model, seq);
        expect_consistent(p, n, seq, 8, fmt::format("{} seq {} n {}: {}", model, seq, n, p.to_spec()));
      }
  for (int per_node : {1, 2, 4, 6})
    for (int n = 1; n <= 64; ++n) {
      const MeshPlan p = optimize_for_transformer(n, "70B", 4096, "80GB", per_node);
      expect_consistent(p, n, 4096, per_node, fmt::format("per node {} n {}: {}", per_node, n, p.to_spec()));
    }
}

TEST(OptimizeForTransformer, SeventyBillionOnOneDeviceSaysItDoesNotFit) {
  // The reference divided by zero here.
  const MeshPlan p = optimize_for_transformer(1, "70B", 4096);
  EXPECT_EQ(p.shape, Ints{1});
  EXPECT_EQ(p.axis_names, Names{"data"});
  EXPECT_FALSE(p.fits);
  EXPECT_THAT(p.reasons.back(), HasSubstr("does not fit"));
  EXPECT_THAT(p.reasons.back(), HasSubstr("enable activation recomputation"));
}

TEST(OptimizeForTransformer, SevenBillionOnEightDevicesShardsStateWithFsdp) {
  const MeshPlan p = optimize_for_transformer(8, "7B", 4096);
  EXPECT_EQ(p.to_spec(), "data=2,fsdp=4");
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(optimize_for_transformer(8, "7b", 4096).to_spec(), p.to_spec());
  const std::string all = fmt::format("{}", fmt::join(p.reasons, "\n"));
  EXPECT_THAT(all, HasSubstr("16 bytes/parameter"));
  EXPECT_THAT(all, HasSubstr("= 112.0 GB"));
  EXPECT_THAT(all, HasSubstr("90% of 80.0 GB = 72.0 GB"));
  EXPECT_THAT(all, HasSubstr("fsdp=2 with the other axes unchanged would need 75.4 GB > 72.0 GB"));
  EXPECT_THAT(all, HasSubstr("context=1: sequence 4096 < 32768"));
  EXPECT_THAT(all, HasSubstr("every device used"));
  EXPECT_THAT(all, HasSubstr("pipeline=1: pipeline stages would divide the model state exactly like fsdp"));
}

TEST(OptimizeForTransformer, SixteenDevicesCannotHoldSeventyBillionWithAdam) {
  // 1120 GB of model state / 16 = 70 GB + activations > 72 GB usable.
  const MeshPlan p = optimize_for_transformer(16, "70B", 4096);
  EXPECT_FALSE(p.fits);
  EXPECT_EQ(p.to_spec(), "fsdp=2,tensor=8");  // the least memory, tensor inside the node
  EXPECT_THAT(p.reasons.back(), HasSubstr("needs 81.2 GB per device > 72.0 GB usable"));
}

TEST(OptimizeForTransformer, SmallModelIsPureDataParallel) {
  for (int n : {1, 5, 8, 32, 128}) {
    const MeshPlan p = optimize_for_transformer(n, "125M", 2048);
    EXPECT_EQ(p.data, n);
    EXPECT_EQ(p.to_spec(), fmt::format("data={}", n));
  }
}

TEST(OptimizeForTransformer, LongSequencesUseContextParallelism) {
  // The reference ignored the sequence length.
  const MeshPlan short_seq = optimize_for_transformer(16, "7B", 4096);
  const MeshPlan long_seq = optimize_for_transformer(16, "7B", 131072);
  EXPECT_EQ(short_seq.context, 1);
  EXPECT_GT(long_seq.context, 1);
  EXPECT_NE(short_seq.to_spec(), long_seq.to_spec());
  const std::string all = fmt::format("{}", fmt::join(long_seq.reasons, "\n"));
  EXPECT_THAT(all, HasSubstr("131072 >= 32768 is split into"));
}

TEST(OptimizeForTransformer, LargeModelKeepsTensorInsideANode) {
  for (int n : {24, 32, 64, 128}) {
    const MeshPlan p = optimize_for_transformer(n, "70B", 4096);
    EXPECT_GT(p.tensor, 1) << p.to_spec();
    EXPECT_EQ(8 % p.tensor, 0) << p.to_spec();
    EXPECT_TRUE(p.fits) << p.to_spec();
  }
  // 4 devices per node: tensor may not exceed 4 even when it would help.
  const MeshPlan p = optimize_for_transformer(32, "70B", 4096, "80GB", 4);
  EXPECT_LE(p.tensor, 4);
}

TEST(OptimizeForTransformer, MoreParametersNeverMeansLessModelParallelism) {
  const char* sizes[] = {"125M", "350M", "1B", "3B", "7B", "13B", "34B", "70B", "175B", "405B"};
  for (int64_t seq : {2048, 32768, 131072})
    for (int n = 1; n <= 128; ++n) {
      std::tuple<int, int, int, int> prev{0, 0, 0, 0};
      for (const char* s : sizes) {
        const MeshPlan p = optimize_for_transformer(n, s, seq);
        if (!p.fits) break;  // past the last fitting size the fallback minimizes memory instead
        const std::tuple<int, int, int, int> key{p.pipeline, p.tensor, p.context, p.fsdp};
        EXPECT_GE(key, prev) << s << " n=" << n << " seq=" << seq << ": " << p.to_spec();
        prev = key;
      }
    }
}

TEST(OptimizeForTransformer, SmallerDevicesNeedMoreSharding) {
  const MeshPlan big = optimize_for_transformer(8, "7B", 4096, "80GB");
  const MeshPlan small = optimize_for_transformer(8, "7B", 4096, "24GiB");
  EXPECT_LT(big.fsdp * big.tensor * big.pipeline, small.fsdp * small.tensor * small.pipeline);
}

TEST(OptimizeForTransformer, RejectsBadArguments) {
  EXPECT_THAT(error_of([] { optimize_for_transformer(0, "7B", 4096); }), HasSubstr("device count 0 < 1"));
  EXPECT_THAT(error_of([] { optimize_for_transformer(8, "7B", 0); }), HasSubstr("sequence length 0 < 1"));
  EXPECT_THAT(error_of([] { optimize_for_transformer(8, "7B", 4096, "80GB", 0); }),
              HasSubstr("devices per node 0 < 1"));
  EXPECT_THAT(error_of([] { optimize_for_transformer(8, "seven", 4096); }), HasSubstr("does not start with a number"));
  EXPECT_THAT(error_of([] { optimize_for_transformer(8, "7B", 4096, "80 bananas"); }), HasSubstr("unknown unit"));
}

// ---- validate_mesh_config ---------------------------------------------------------

// ---- the docs table ---------------------------------------------------------------

TEST(MeshPlanningTable, DocsHoldTheCurrentTable) {
  const std::string table = mesh_planning_table(128);
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 130);
  std::ifstream in(std::string(MESHTRAIN_SOURCE_DIR) + "/docs/mesh-planning.md");
  ASSERT_TRUE(in) << "docs/mesh-planning.md is missing";
  std::stringstream doc;
  doc << in.rdbuf();
  EXPECT_NE(doc.str().find(table), std::string::npos)
      << "docs/mesh-planning.md is stale: regenerate the table with build/.../mesh_planning_table";
}

}  // namespace
}  // namespace meshtrain::plan
