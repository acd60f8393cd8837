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

// Every field of a config, as flag text: equal configs give equal lists.
std::vector<std::string> values_of(const TrainConfig& c) {
  std::vector<std::string> out;
  for (const auto& f : train_config_fields()) out.push_back(std::string(f.key) + "=" + f.format(c));
  return out;
}

TEST(TrainConfig, TomlValuesHaveTheirTomlTypes) {
  const std::string toml = TrainConfig{}.to_toml();
  EXPECT_THAT(toml, HasSubstr("\nhidden = [512, 512, 256]\n"));  // an array, as in examples/
  EXPECT_THAT(toml, HasSubstr("\nmodel = \"mlp\"\n"));
  EXPECT_THAT(toml, HasSubstr("\nlr = 0.001\n"));
  EXPECT_THAT(toml, HasSubstr("\nbucket_mb = 25.0\n"));  // a float, not the integer 25
  EXPECT_THAT(toml, HasSubstr("\nepochs = 10\n"));
  EXPECT_THAT(toml, HasSubstr("\ndrop_last = true\n"));
  EXPECT_THAT(toml, HasSubstr("\nrun_dir = \"\"\n"));
  EXPECT_THAT(toml, HasSubstr("\non_nonfinite = \"error\"\n"));
  TrainConfig one;
  one.hidden = {7};
  EXPECT_THAT(one.to_toml(), HasSubstr("\nhidden = [7]\n"));
}

TEST(TrainConfig, WrittenTomlReloadsToTheSameConfig) {
  TrainConfig c;
  c.model = "vae";
  c.hidden = {300, 100};
  c.lr = 2.5e-4;
  c.bucket_mb = 4;
  c.min_lr_ratio = 0.1;
  c.lr_decay_steps = 1000;
  c.on_nonfinite = "skip";
  c.max_consecutive_skips = 3;
  c.drop_last = false;
  c.overwrite = true;
  c.run_dir = "runs/a \"quoted\" dir\\with\tescapes\x01";
  c.data_dir = "/data/fashion";
  c.fsdp = "zero2";
  const TrainConfig back = TrainConfig::from_toml(c.to_toml(), "config.toml");
  EXPECT_EQ(values_of(back), values_of(c));
  EXPECT_EQ(back.run_dir, c.run_dir);
  EXPECT_EQ(values_of(TrainConfig::from_toml(TrainConfig{}.to_toml())), values_of(TrainConfig{}));
}

TEST(TrainConfig, NewKeysAreValidated) {
  EXPECT_THAT(error_of([] { TrainConfig c; c.on_nonfinite = "ignore"; c.validate(); }),
              HasSubstr("on_nonfinite 'ignore'"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.max_consecutive_skips = 0; c.validate(); }),
              HasSubstr("max_consecutive_skips 0"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.lr_decay_steps = -1; c.validate(); }), HasSubstr("lr_decay_steps -1"));
}

}  // namespace
}  // namespace meshtrain::train
