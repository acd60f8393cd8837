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

TEST(TrainConfig, AResumedRunContinuesInItsOwnDirectory) {
  TrainConfig c;
  c.resume = "runs/a";
  c.continue_in_resumed_directory(false, "--run-dir");
  EXPECT_EQ(c.run_dir, "runs/a");
  c.run_dir = "runs/./a";
  EXPECT_NO_THROW(c.continue_in_resumed_directory(true, "--run-dir"));
  c.run_dir = "runs/b";
  EXPECT_THAT(error_of([&] { c.continue_in_resumed_directory(true, "--run-dir"); }),
              HasSubstr("--run-dir: run_dir runs/b with resume runs/a (hint: a resumed run continues in its own "
                        "directory: drop run_dir)"));
  TrainConfig fresh;
  fresh.run_dir = "runs/b";
  fresh.continue_in_resumed_directory(true, "--run-dir");
  EXPECT_EQ(fresh.run_dir, "runs/b");
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
  EXPECT_THAT(error_of([] { TrainConfig c; c.model = "bert"; c.validate(); }),
              HasSubstr("use model = \"mlp\", \"vae\" or \"gpt\""));
  EXPECT_THAT(error_of([] { TrainConfig c; c.batch_size = 256; c.micro_batches = 3; c.validate(); }),
              HasSubstr("micro_batches must divide batch_size"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.dropout = 1.0; c.validate(); }), HasSubstr("dropout must be in [0, 1)"));
  EXPECT_THAT(error_of([] { TrainConfig::from_toml_file("/nonexistent.toml"); }), HasSubstr("cannot open"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.set("fsdp", "zero4", "--fsdp"); }), HasSubstr("fsdp 'zero4'"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.set("backward_prefetch", "later", "--backward-prefetch"); }),
              HasSubstr("use none, pre or post"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.fsdp_min_weight_size = -1; c.validate(); }),
              HasSubstr("use 0 to shard every parameter"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.set("reduce_precision", "fp8", "--reduce-precision"); }),
              HasSubstr("reduce_precision 'fp8'"));
}

// issue 9: int64 values were narrowed to int (--batch-size 4294967552 trained
// with 256); every number is now range-checked, naming the flag or key.
TEST(TrainConfig, NumbersOutsideTheirRangeAreRefusedNotWrapped) {
  auto set = [](const char* key, const char* value, const char* flag) {
    return error_of([&] { TrainConfig c; c.set(key, value, flag); });
  };
  EXPECT_THAT(set("batch_size", "4294967552", "--batch-size"),
              HasSubstr("--batch-size: 4294967552 is outside [1, 16777216]"));
  EXPECT_THAT(set("hidden", "512,4294967304", "--hidden"), HasSubstr("--hidden: 4294967304 is outside [1, 65536]"));
  EXPECT_THAT(set("epochs", "4294967297", "--epochs"), HasSubstr("--epochs: 4294967297 is outside [1, 1000000]"));
  EXPECT_THAT(set("seed", "-1", "--seed"), HasSubstr("--seed: -1 is outside [0, 9223372036854775807]"));
  EXPECT_THAT(set("latent", "0", "--latent"), HasSubstr("--latent: 0 is outside [1, 65536]"));
  EXPECT_THAT(set("threads_per_rank", "100000", "--threads-per-rank"),
              HasSubstr("--threads-per-rank: 100000 is outside [0, 1024]"));
  EXPECT_THAT(set("lr", "nan", "--lr"), HasSubstr("--lr: 'nan' is not a finite number"));
  EXPECT_THAT(set("lr", "inf", "--lr"), HasSubstr("--lr: 'inf' is not a finite number"));
  EXPECT_THAT(set("lr", "0", "--lr"), HasSubstr("--lr: 0 is outside (0, inf)"));
  EXPECT_THAT(set("dropout", "1", "--dropout"), HasSubstr("--dropout: 1 is outside [0, 1)"));
  EXPECT_THAT(set("bucket_mb", "1e300", "--bucket-mb"), HasSubstr("--bucket-mb: 1e+300 is outside (0, 65536]"));
  EXPECT_THAT(set("max_steps", "99999999999999999999", "--max-steps"),
              HasSubstr("--max-steps: 99999999999999999999 is outside [0, 9223372036854775807]"));
  // The same checks from TOML, naming the file and key.
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("[train]\nbatch_size = 4294967552\n", "run.toml"); }),
              HasSubstr("run.toml: train.batch_size: 4294967552 is outside [1, 16777216]"));
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("[train]\nlr = nan\n", "run.toml"); }),
              HasSubstr("run.toml: train.lr: 'nan' is not a finite number"));
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("[train]\nhidden = [512, 4294967304]\n", "run.toml"); }),
              HasSubstr("run.toml: train.hidden: 4294967304 is outside [1, 65536]"));
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("[train]\nhidden = [512, \"x\"]\n", "run.toml"); }),
              HasSubstr("run.toml: train.hidden[1]: not an integer"));
  // In range: accepted exactly.
  TrainConfig c;
  c.set("max_steps", "9223372036854775807", "--max-steps");
  EXPECT_EQ(c.max_steps, INT64_MAX);
  c.set("batch_size", "16777216", "--batch-size");
  EXPECT_EQ(c.batch_size, 16777216);
}

// issue 9: any subset of the project's sections is accepted; unknown ones,
// and training keys outside [train], are refused; syntax errors carry the
// file, line and column.
TEST(TrainConfig, TomlSectionsAndSyntaxErrors) {
  EXPECT_EQ(TrainConfig::from_toml("[train]\nepochs = 3\n").epochs, 3);
  EXPECT_EQ(TrainConfig::from_toml("[distributed]\nworld_size = 2\n").epochs, TrainConfig{}.epochs);
  EXPECT_EQ(TrainConfig::from_toml("world_size = 2\n").epochs, TrainConfig{}.epochs);
  EXPECT_EQ(TrainConfig::from_toml("").epochs, TrainConfig{}.epochs);
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("[trian]\nepochs = 3\n", "run.toml"); }),
              HasSubstr("run.toml:1:2: unknown section [trian]"));
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("epochs = 3\n[train]\nlr = 0.1\n", "run.toml"); }),
              HasSubstr("run.toml:1:1: training key 'epochs' is outside [train]"));
  EXPECT_THAT(error_of([] { TrainConfig::from_toml("train = 3\n", "run.toml"); }),
              HasSubstr("train must be a table"));
  const std::string syntax = error_of([] { TrainConfig::from_toml("[train]\nepochs = 3\nlr = = 0.1\n", "run.toml"); });
  EXPECT_THAT(syntax, HasSubstr("run.toml:3:6: "));
  EXPECT_THAT(syntax, HasSubstr("fix the TOML syntax at that position"));
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
  c.on_nonfinite = NonFinitePolicy::skip;
  c.max_consecutive_skips = 3;
  c.drop_last = false;
  c.overwrite = true;
  c.run_dir = "runs/a \"quoted\" dir\\with\tescapes\x01";
  c.data_dir = "/data/fashion";
  c.set("fsdp", "zero2", "test");
  const TrainConfig back = TrainConfig::from_toml(c.to_toml(), "config.toml");
  EXPECT_EQ(values_of(back), values_of(c));
  EXPECT_EQ(back.run_dir, c.run_dir);
  EXPECT_EQ(values_of(TrainConfig::from_toml(TrainConfig{}.to_toml())), values_of(TrainConfig{}));
}

TEST(TrainConfig, NewKeysAreValidated) {
  EXPECT_THAT(error_of([] { TrainConfig c; c.set("on_nonfinite", "ignore", "--on-nonfinite"); }),
              HasSubstr("on_nonfinite 'ignore'"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.max_consecutive_skips = 0; c.validate(); }),
              HasSubstr("max_consecutive_skips 0"));
  EXPECT_THAT(error_of([] { TrainConfig c; c.lr_decay_steps = -1; c.validate(); }), HasSubstr("lr_decay_steps -1"));
}

}  // namespace
}  // namespace meshtrain::train
