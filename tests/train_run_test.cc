// The trainer end to end on Fashion-MNIST (threads engine, small models, a
// few steps each), for what a run promises beyond its numbers:
// - training that goes wrong stops on every rank with TrainingDiverged
//   (non-finite loss, parameters or test loss; too many skipped steps) and
//   leaves the run directory exactly as it was: a previous run's files byte
//   for byte, nothing staged left behind;
// - a run directory holding a run is refused unless overwrite, which
//   replaces the whole run; without run_dir each run gets its own
//   runs/<model>/version_<N>;
// - --max-steps stops early without changing the schedule: its losses are a
//   prefix of the longer run's;
// - config.toml reloads to the configuration that ran;
// - trainer_state.json says where the run stands (step, data position), and
//   reads back;
// - the VAE logs its sampled negative ELBO and both terms.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

fs::path fresh(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("meshtrain_train_run_" + name);
  fs::remove_all(dir);
  fs::remove_all(dir.string() + ".incomplete");
  return dir;
}

train::TrainConfig small(const fs::path& run_dir) {
  train::TrainConfig tc;
  tc.hidden = {64, 32};
  tc.latent = 4;
  tc.batch_size = 128;
  tc.epochs = 1;
  tc.max_steps = 10;
  tc.log_every = 5;
  tc.threads_per_rank = 1;
  tc.run_dir = run_dir.string();
  return tc;
}

config::DistributedConfig ranks(int n) {
  config::DistributedConfig dc;
  dc.world_size = n;
  dc.num_processes_per_node = n;
  dc.mesh_shape = {n};
  dc.mesh_axis_names = {"data"};
  return dc;
}

train::TrainResult train_on(const train::TrainConfig& tc, int n = 1) {
  return train::run_training(tc, ranks(n),
                             {.engine = comm::Engine::threads, .ranks = n, .timeout = std::chrono::seconds(60)});
}

// The error a run throws ("no error" if it finishes).
std::string error_of(const train::TrainConfig& tc, int n = 1) {
  try {
    (void)train_on(tc, n);
  } catch (const train::TrainingDiverged& e) {
    return std::string("TrainingDiverged: ") + e.what();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

// The number after "key": in a JSON line (NaN when the key is missing).
double json_number(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\":");
  return at == std::string::npos ? std::nan("") : std::stod(line.substr(at + key.size() + 3));
}

using Names = std::vector<std::string>;
const Names kMlpRun = {"config.toml", "loss.svg", "metrics.jsonl", "model.safetensors", "trainer_state.json"};

// A good run, then the same directory with --overwrite and a learning rate
// that makes the loss NaN: the run stops with the step and the value, on
// both ranks, and the first run's files are untouched.
// A good run of 3 steps into `dir`, its files' contents; then the config of
// a run over it (--overwrite) whose SGD at lr 1e6 diverges.
std::map<std::string, std::string> good_run(const fs::path& dir) {
  train::TrainConfig good = small(dir);
  good.max_steps = 3;
  (void)train_on(good);
  EXPECT_EQ(testing::entries(dir), kMlpRun);
  std::map<std::string, std::string> files;
  for (const auto& name : kMlpRun) files[name] = testing::read_file(dir / name);
  return files;
}
train::TrainConfig diverging_over(const fs::path& dir) {
  train::TrainConfig bad = small(dir);
  bad.optimizer = "sgd";
  bad.lr = 1e6;
  bad.max_steps = 30;
  bad.overwrite = true;
  return bad;
}

TEST(TrainRun, NonFiniteLossStopsAndKeepsThePreviousRun) {
  const fs::path dir = fresh("nan_loss");
  const std::map<std::string, std::string> before = good_run(dir);
  const train::TrainConfig bad = diverging_over(dir);
  const std::string error = error_of(bad, 2);
  EXPECT_THAT(error, HasSubstr("TrainingDiverged: meshtrain train: step 3 of 30: the loss is nan (the mean over a "
                               "global batch of 128); training stopped and saved nothing"));
  EXPECT_THAT(error, HasSubstr("lower the learning rate"));
  EXPECT_THAT(error, HasSubstr("--clip-norm"));
  EXPECT_THAT(error, HasSubstr("--on-nonfinite skip"));
  EXPECT_EQ(testing::entries(dir), kMlpRun);
  for (const auto& name : kMlpRun) EXPECT_EQ(testing::read_file(dir / name), before.at(name)) << name;
  EXPECT_FALSE(fs::exists(dir.string() + ".incomplete"));
}

// A loss that explodes without becoming NaN or inf (SGD at lr 1e6, judged
// against the step before: --loss-spike-window 1) stops the run before its
// update, on both ranks, keeping the first run; --loss-spike 0 turns the
// guard off (the run then goes on until the loss is NaN).
TEST(TrainRun, ALossSpikeStopsAndKeepsThePreviousRun) {
  const fs::path dir = fresh("loss_spike");
  const std::map<std::string, std::string> before = good_run(dir);
  train::TrainConfig bad = diverging_over(dir);
  bad.loss_spike_window = 1;
  const std::string error = error_of(bad, 2);
  EXPECT_THAT(error, ::testing::MatchesRegex("TrainingDiverged: meshtrain train: step 2 of 30: the loss is [0-9.e+]+, "
                                             "more than 10 times the mean of the last 1 steps \\(2\\.[0-9]+; "
                                             "--loss-spike, the mean over a global batch of 128\\); training "
                                             "stopped and saved nothing.*lower the learning rate.*"));
  EXPECT_EQ(testing::entries(dir), kMlpRun);
  for (const auto& name : kMlpRun) EXPECT_EQ(testing::read_file(dir / name), before.at(name)) << name;
  bad.loss_spike = 0;
  EXPECT_THAT(error_of(bad, 2), HasSubstr("step 3 of 30: the loss is nan"));
}

// One SGD update of lr 1e300 (inf in f32) makes the weights non-finite with
// a finite loss: caught before the next step, or before the evaluation and
// the save when it was the last one.
TEST(TrainRun, NonFiniteParametersStopTheRun) {
  const fs::path dir = fresh("inf_params");
  train::TrainConfig tc = small(dir);
  tc.optimizer = "sgd";
  tc.momentum = 0;
  tc.lr = 1e300;
  tc.schedule = "constant";
  tc.max_steps = 2;
  EXPECT_THAT(error_of(tc, 2), HasSubstr("step 2 of 2: the parameters are not finite on 2 of 2 data-parallel ranks: "
                                         "the update of step 1 overflowed"));
  tc.max_steps = 1;
  EXPECT_THAT(error_of(tc), HasSubstr("step 1 of 1: the parameters are not finite on 1 of 1 data-parallel ranks "
                                      "after step 1"));
  EXPECT_FALSE(fs::exists(dir));  // nothing was left behind, not even the empty directory
  EXPECT_FALSE(fs::exists(dir.string() + ".incomplete"));
}

// --on-nonfinite skip: non-finite steps are skipped and counted, and the run
// stops after max_consecutive_skips of them in a row.
TEST(TrainRun, SkipPolicyStopsAfterTooManySkipsInARow) {
  const fs::path dir = fresh("skip");
  train::TrainConfig tc = small(dir);
  tc.optimizer = "sgd";
  tc.lr = 1e6;
  tc.max_steps = 30;
  tc.on_nonfinite = train::NonFinitePolicy::skip;
  tc.max_consecutive_skips = 3;
  EXPECT_THAT(error_of(tc, 2), HasSubstr("step 5 of 30: 3 steps in a row were skipped (the last: the loss is nan); "
                                         "3 skipped in all"));
  EXPECT_FALSE(fs::exists(dir));
}

TEST(TrainRun, ARunDirectoryHoldingARunIsRefusedUnlessOverwrite) {
  const fs::path dir = fresh("reuse");
  train::TrainConfig tc = small(dir);
  tc.max_steps = 2;
  const auto first = train_on(tc);
  EXPECT_EQ(first.run_dir, dir.string());
  const std::string model = testing::read_file(dir / "model.safetensors");
  EXPECT_THAT(error_of(tc), HasSubstr(fmt::format("run directory '{}' is not empty (config.toml, loss.svg, "
                                                  "metrics.jsonl, model.safetensors, trainer_state.json): it holds a previous run",
                                                  dir.string())));
  EXPECT_EQ(testing::read_file(dir / "model.safetensors"), model);
  // overwrite replaces the run: one run's metrics (2 steps logged at step 2, then the test line).
  tc.overwrite = true;
  tc.seed = 7;
  (void)train_on(tc);
  EXPECT_EQ(testing::entries(dir), kMlpRun);
  EXPECT_NE(testing::read_file(dir / "model.safetensors"), model);
  const std::string metrics = testing::read_file(dir / "metrics.jsonl");
  EXPECT_EQ(std::count(metrics.begin(), metrics.end(), '\n'), 2) << metrics;
}

TEST(TrainRun, WithoutARunDirEachRunGetsItsOwnVersion) {
  const fs::path cwd = fs::current_path();
  const fs::path dir = fresh("versions");
  fs::create_directories(dir);
  fs::current_path(dir);
  train::TrainConfig tc = small("");
  tc.run_dir = "";
  tc.max_steps = 1;
  const auto a = train_on(tc);
  const auto b = train_on(tc);
  fs::current_path(cwd);
  EXPECT_EQ(a.run_dir, "runs/mlp/version_0");
  EXPECT_EQ(b.run_dir, "runs/mlp/version_1");
  EXPECT_EQ(testing::entries(dir / "runs" / "mlp"), (Names{"version_0", "version_1"}));
  EXPECT_EQ(testing::entries(dir / "runs" / "mlp" / "version_1"), kMlpRun);
}

// --max-steps stops early; the schedule still spans the epochs' steps, so
// the short run is exactly the beginning of the long one.
TEST(TrainRun, MaxStepsRunIsAPrefixOfTheLongerRun) {
  train::TrainConfig tc = small(fresh("prefix_short"));
  tc.warmup_steps = 3;
  tc.max_steps = 5;
  const auto short_run = train_on(tc);
  tc.run_dir = fresh("prefix_long").string();
  tc.max_steps = 12;
  const auto long_run = train_on(tc);
  ASSERT_EQ(short_run.step_losses.size(), 5u);
  ASSERT_EQ(long_run.step_losses.size(), 12u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(short_run.step_losses[i], long_run.step_losses[i]) << "step " << i;
  EXPECT_EQ(short_run.schedule_steps, 60000 / 128);  // one epoch, not max_steps
  EXPECT_EQ(long_run.schedule_steps, 60000 / 128);
  // lr_decay_steps sets the length explicitly.
  tc.run_dir = fresh("prefix_decay").string();
  tc.lr_decay_steps = 12;
  tc.max_steps = 7;
  const auto decayed = train_on(tc);
  EXPECT_EQ(decayed.schedule_steps, 12);
  EXPECT_EQ(decayed.step_losses[4], long_run.step_losses[4]);  // updates 0..3: warmup, the same rates
  EXPECT_NE(decayed.step_losses[6], long_run.step_losses[6]);  // updates 4, 5 decay faster
}

// Batches of 20000 of 60000 images: 3 steps per epoch; after 2 epochs the
// next batch is epoch 2's first, and after 4 steps epoch 1's second. The
// state is the same on 1 and 2 ranks and trainer_state.json reads back to it.
TEST(TrainRun, TrainerStateSaysWhereTheRunStands) {
  train::TrainConfig tc = small(fresh("state"));
  tc.batch_size = 20000;
  tc.epochs = 2;
  tc.max_steps = 0;
  const auto full = train_on(tc);
  EXPECT_EQ(full.state, (train::TrainerState{.step = 6, .data = {.epoch = 2, .batch = 0}, .seed = tc.seed}));
  tc.max_steps = 4;
  tc.run_dir = fresh("state2").string();
  const auto part = train_on(tc, 2);
  EXPECT_EQ(part.state, (train::TrainerState{.step = 4, .data = {.epoch = 1, .batch = 1}, .seed = tc.seed}));
  const std::string file = (fs::path(part.run_dir) / "trainer_state.json").string();
  EXPECT_EQ(train::TrainerState::from_json(testing::read_file(file), file), part.state);
  EXPECT_THAT(testing::error_of<IoError>([] { train::TrainerState::from_json("{\"step\": 3}", "x.json"); }),
              HasSubstr("x.json: format is not \"meshtrain.trainer_state\""));
  EXPECT_THAT(testing::error_of<IoError>([&] {
                std::string text = part.state.to_json();
                text.replace(text.find("\"batch\": 1"), 10, "\"batch\": -1");
                train::TrainerState::from_json(text, "y.json");
              }),
              HasSubstr("y.json: \"batch\" is missing or not a count"));
}

// config.toml holds the configuration that ran, in TOML types, and reads back to it.
TEST(TrainRun, ConfigTomlReloadsToTheSameConfig) {
  const fs::path dir = fresh("config");
  train::TrainConfig tc = small(dir);
  tc.max_steps = 1;
  tc.hidden = {48, 24};
  tc.dropout = 0.1;
  tc.bucket_mb = 2;
  tc.on_nonfinite = train::NonFinitePolicy::skip;
  (void)train_on(tc, 2);
  const std::string text = testing::read_file(dir / "config.toml");
  EXPECT_THAT(text, HasSubstr("\nhidden = [48, 24]\n"));
  EXPECT_THAT(text, HasSubstr("\nbucket_mb = 2.0\n"));
  const train::TrainConfig back = train::TrainConfig::from_toml(text, "config.toml");
  for (const auto& f : train::train_config_fields()) EXPECT_EQ(f.format(back), f.format(tc)) << f.key;
  const config::DistributedConfig dc = config::DistributedConfig::from_toml(text);
  EXPECT_EQ(dc.to_toml(), ranks(2).to_toml());
}

// The VAE's test line: the sampled negative ELBO and its two terms, by
// those names; the same numbers on 1 and 2 ranks (the noise follows the
// global test-sample index).
TEST(TrainRun, VaeLogsTheSampledNegativeElboAndItsTerms) {
  train::TrainConfig tc = small(fresh("vae1"));
  tc.model = "vae";
  tc.max_steps = 3;
  const auto one = train_on(tc);
  tc.run_dir = fresh("vae2").string();
  const auto two = train_on(tc, 2);
  EXPECT_NEAR(one.test_loss, one.test_reconstruction + one.test_kl, 1e-9 * one.test_loss);
  EXPECT_GT(one.test_kl, 0);
  EXPECT_NEAR(two.test_loss, one.test_loss, 1e-5 * one.test_loss);
  std::string line, test;
  std::ifstream in(fs::path(tc.run_dir) / "metrics.jsonl");
  while (std::getline(in, line))
    if (line.find("\"split\":\"test\"") != std::string::npos) test = line;
  ASSERT_FALSE(test.empty());
  EXPECT_NEAR(json_number(test, "neg_elbo"), two.test_loss, 1e-9 * two.test_loss) << test;
  EXPECT_NEAR(json_number(test, "reconstruction"), two.test_reconstruction, 1e-9 * two.test_loss) << test;
  EXPECT_NEAR(json_number(test, "kl"), two.test_kl, 1e-9 * two.test_loss) << test;
  EXPECT_THAT(test, Not(HasSubstr("accuracy")));
  EXPECT_THAT(test, Not(HasSubstr("\"loss\"")));
  EXPECT_EQ(testing::entries(tc.run_dir),
            (Names{"config.toml", "loss.svg", "metrics.jsonl", "model.safetensors", "reconstructions.png",
                   "samples.png", "trainer_state.json"}));
}

}  // namespace
}  // namespace meshtrain
