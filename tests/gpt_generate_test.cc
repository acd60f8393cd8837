// Generation from a saved GPT run (train/generate.h): the run directory
// alone (config.toml, model.safetensors, tokenizer.model) reproduces the
// run's own sample.txt; top-k 1 is greedy decoding; a run directory that is
// not a GPT's, lacks a file or whose weights do not fit the configuration
// is refused naming what is wrong.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "meshtrain/testing/testing.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/train/trainer.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

const train::TrainResult& trained() {
  static const train::TrainResult r = [] {
    train::TrainConfig tc = gpt_parity_config("generate");
    tc.max_steps = 5;
    tc.seed = 7;
    return train::run_training(tc, config::DistributedConfig{}, {.engine = comm::Engine::threads, .ranks = 1});
  }();
  return r;
}

train::TrainConfig run_config() {
  return train::TrainConfig::from_toml_file((fs::path(trained().run_dir) / "config.toml").string());
}

TEST(GptGenerate, TheRunDirectoryReproducesSampleTxt) {
  const auto& r = trained();
  EXPECT_THAT(r.artifacts, ::testing::Contains("tokenizer.model"));
  train::LoadedGpt run = train::load_gpt_run(r.run_dir, run_config());
  const std::string text = train::generate_text(*run.model, run.tokenizer, {.seed = 7});
  EXPECT_EQ(text + "\n", testing::read_file(fs::path(r.run_dir) / "sample.txt"));
  EXPECT_EQ(text.rfind("The ", 0), 0u);
  // Another seed draws other tokens.
  EXPECT_NE(train::generate_text(*run.model, run.tokenizer, {.seed = 8}), text);
}

TEST(GptGenerate, TopOneIsGreedy) {
  train::LoadedGpt run = train::load_gpt_run(trained().run_dir, run_config());
  const auto greedy = train::generate_text(*run.model, run.tokenizer, {.tokens = 20, .temperature = 0});
  EXPECT_EQ(train::generate_text(*run.model, run.tokenizer, {.tokens = 20, .temperature = 2.0, .top_k = 1, .seed = 3}),
            greedy);
}

TEST(GptGenerate, BadRunsAndOptionsAreRefused) {
  const std::string dir = trained().run_dir;
  train::TrainConfig tc = run_config();
  tc.width = 48;
  EXPECT_THAT(testing::error_of([&] { train::load_gpt_run(dir, tc); }),
              HasSubstr("model.safetensors: wte.weight has shape 512x32, the configuration's model 512x48"));
  tc = run_config();
  tc.model = "mlp";
  EXPECT_THAT(testing::error_of([&] { train::load_gpt_run(dir, tc); }), HasSubstr("trained model \"mlp\", not a GPT"));
  const fs::path copy = testing::fresh_dir("meshtrain_gpt_generate_copy");
  fs::copy_file(fs::path(dir) / "model.safetensors", copy / "model.safetensors");
  EXPECT_THAT(testing::error_of<IoError>([&] { train::load_gpt_run(copy.string(), run_config()); }),
              HasSubstr("tokenizer.model does not exist"));
  train::LoadedGpt run = train::load_gpt_run(dir, run_config());
  EXPECT_THAT(testing::error_of([&] { train::generate_text(*run.model, run.tokenizer, {.tokens = 0}); }),
              HasSubstr("0 new tokens"));
  EXPECT_THAT(testing::error_of([&] { train::generate_text(*run.model, run.tokenizer, {.temperature = -1}); }),
              HasSubstr("temperature -1"));
  EXPECT_THAT(testing::error_of([&] { train::generate_text(*run.model, run.tokenizer, {.prompt = ""}); }),
              HasSubstr("an empty prompt"));
}

}  // namespace
}  // namespace meshtrain
