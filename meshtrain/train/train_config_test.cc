#include "meshtrain/train/train_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/core/error.h"

namespace meshtrain::train {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST(TrainConfig, TomlOverridesDefaultsAndRoundTrips) {
  auto c = TrainConfig::from_toml(R"(
[distributed]
mesh = "data=4"
[train]
model = "vae"
hidden = [512, 256]
epochs = 3
lr = 3e-4
drop_last = false
)");
  EXPECT_EQ(c.model, "vae");
  EXPECT_EQ(c.hidden, (std::vector<int>{512, 256}));
  EXPECT_EQ(c.epochs, 3);
  EXPECT_DOUBLE_EQ(c.lr, 3e-4);
  EXPECT_FALSE(c.drop_last);
  EXPECT_EQ(c.batch_size, 256);  // default kept
  const auto back = TrainConfig::from_toml(c.to_toml());
  EXPECT_EQ(back.to_toml(), c.to_toml());
}

TEST(TrainConfig, EveryFieldHasAFlagAndRoundTripsThroughText) {
  TrainConfig c;
  for (const auto& f : train_config_fields()) {
    EXPECT_EQ(f.flag.substr(0, 2), "--") << f.key;
    TrainConfig d;
    d.set(f.key, f.format(c), f.flag);
    EXPECT_EQ(f.format(d), f.format(c)) << f.key;
  }
}

TEST(TrainConfig, ErrorsSayWhatToChange) {
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("[train]\nepoch = 3\n", "run.toml"); }),
              HasSubstr("run.toml: train.epoch: unknown key 'epoch'"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.set("lr", "fast", "--lr"); }), HasSubstr("--lr: 'fast' is not a number"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.model = "gpt"; c.validate(); }), HasSubstr("use model = \"mlp\" or \"vae\""));
  EXPECT_THAT(error_of([] { TrainConfig c; c.batch_size = 256; c.micro_batches = 3; c.validate(); }),
              HasSubstr("micro_batches must divide batch_size"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.dropout = 1.0; c.validate(); }), HasSubstr("dropout must be in [0, 1)"));
  EXPECT_THAT(error_of([] { TrainConfig::from_toml_file("/nonexistent.toml"); }), HasSubstr("cannot open"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.fsdp = "zero4"; c.validate(); }), HasSubstr("fsdp 'zero4'"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.backward_prefetch = "later"; c.validate(); }),
              HasSubstr("use none, pre or post"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.fsdp_min_weight_size = -1; c.validate(); }),
              HasSubstr("use 0 to shard every parameter"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.reduce_precision = "fp8"; c.validate(); }),
              HasSubstr("reduce_precision 'fp8'"));
}

}  // namespace
}  // namespace meshtrain::train
