// Checkpoints through the trainer: the small GPT of tests/gpt_parity.h
// (threads engine, SGD with momentum, 30 steps) saved at step 15 and
// resumed to step 30.
// - The resharding matrix: saved under each of data=4, fsdp=4 (zero3),
//   data=2 x tensor=2, data=2 x pipeline=2, data=2 x context=2,
//   fsdp=2 x pipeline=2 (zero3) and pipeline=2 x context=2, resumed under
//   each of them (49 pairs):
//   the losses of steps 16-30 and the final parameters within 1e-5 of the
//   uninterrupted one-device run; on the mesh it was saved from, bit for
//   bit the uninterrupted run on that mesh.
// - AdamW, bf16 zero3 and an interrupted run (its staging directory)
//   resume bit for bit; a failed run keeps its checkpoints and a fresh run
//   refuses to discard them; --keep-last keeps the newest.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>

#include "meshtrain/core/error.h"
#include "meshtrain/testing/parity.h"
#include "meshtrain/testing/testing.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/trainer.h"
#include "tests/expert_parity.h"
#include "tests/gpt_parity.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int64_t kSave = kGptParitySteps / 2;

struct Layout {
  std::string mesh;  // "" = one device
  std::string fsdp = "";
  std::string optimizer = "sgd";
  DType precision = DType::f32;
};

train::TrainConfig config_of(const Layout& r, const std::string& tag) {
  train::TrainConfig tc = gpt_parity_config(tag, r.optimizer);
  tc.set("fsdp", r.fsdp, "test");
  if (r.mesh.find("pipeline") != std::string::npos) tc.micro_batches = 2;
  return tc;
}

train::TrainResult train(const Layout& r, const train::TrainConfig& tc) {
  config::DistributedConfig dc = testing::threads_mesh_config(r.mesh);
  dc.mixed_precision = r.precision;
  return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                      .timeout = std::chrono::seconds(120)});
}

// The run to step 15 with a checkpoint there, committed to its directory.
std::string saved_run(const Layout& r, const std::string& tag) {
  train::TrainConfig tc = config_of(r, "save_" + tag);
  tc.max_steps = kSave;
  tc.checkpoint_every = kSave;
  (void)train(r, tc);
  return tc.run_dir;
}

// A copy of a saved run (each resume continues, and so changes, its own).
std::string copy_of(const std::string& run, const std::string& tag) {
  const std::string to = (fs::temp_directory_path() / ("meshtrain_resume_" + tag)).string();
  fs::remove_all(to);
  fs::remove_all(to + ".incomplete");
  fs::copy(run, to, fs::copy_options::recursive);
  return to;
}

train::TrainResult resumed(const Layout& r, const std::string& run_dir) {
  train::TrainConfig tc = config_of(r, "unused");
  tc.resume = run_dir;
  tc.run_dir = run_dir;
  return train(r, tc);
}

// The reference's last 15 steps (a resumed run reports the steps it ran).
train::TrainResult tail_of(train::TrainResult r) {
  r.step_losses.erase(r.step_losses.begin(), r.step_losses.begin() + kSave);
  return r;
}

void expect_bitwise(const train::TrainResult& got, const train::TrainResult& want, const std::string& what) {
  for (const std::string& p : testing::run_differences(got, want, 0.0)) ADD_FAILURE() << what << ": " << p;
}

TEST(CheckpointResume, EveryMeshLoadsEveryOthersCheckpoint) {
  const std::vector<Layout> meshes = {{.mesh = "data=4"},
                                   {.mesh = "fsdp=4", .fsdp = "zero3"},
                                   {.mesh = "data=2,tensor=2"},
                                   {.mesh = "data=2,pipeline=2"},
                                   {.mesh = "data=2,context=2"},
                                   {.mesh = "fsdp=2,pipeline=2", .fsdp = "zero3"},
                                   {.mesh = "pipeline=2,context=2"}};
  const train::TrainResult one = tail_of(train({}, config_of({}, "resume_one")));
  for (const Layout& from : meshes) {
    const std::string saved = saved_run(from, from.mesh);
    const train::TrainResult whole = tail_of(train(from, config_of(from, "whole_" + from.mesh)));
    for (const Layout& to : meshes) {
      const std::string what = fmt::format("saved on {}, resumed on {}", from.mesh, to.mesh);
      const train::TrainResult got = resumed(to, copy_of(saved, from.mesh + "_to_" + to.mesh));
      ASSERT_EQ(got.step_losses.size(), static_cast<size_t>(kGptParitySteps - kSave)) << what;
      for (const std::string& p : testing::run_differences(got, one, 1e-5)) ADD_FAILURE() << what << ": " << p;
      if (&from == &to) expect_bitwise(got, whole, what);
    }
  }
}

// A mixture-of-experts run with DeepSeek-V3's bias balancing (the bias is
// state outside the optimizer: a "buffer/" piece) saved on data=2 x
// expert=2 and resumed on one device, on expert=4 and on fsdp=2 (zero3) x
// expert=2 continues the uninterrupted one-device run within 1e-5, and bit
// for bit on the mesh it was saved on.
TEST(CheckpointResume, MixtureOfExpertsResumesOnAnyExpertLayout) {
  const ExpertLayout base{.capacity_factor = 1.0, .router = "sigmoid", .bias_update_rate = 0.01};
  auto run = [](const ExpertLayout& l, train::TrainConfig tc) {
    const config::DistributedConfig dc = testing::threads_mesh_config(l.mesh);
    return train::run_training(tc, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size,
                                        .timeout = std::chrono::seconds(120)});
  };
  ExpertLayout from = base;
  from.mesh = "data=2,expert=2";
  const train::TrainResult one = tail_of(run(base, expert_config(base, "resume_moe_one")));
  const train::TrainResult whole = tail_of(run(from, expert_config(from, "resume_moe_whole")));
  train::TrainConfig save = expert_config(from, "resume_moe_save");
  save.max_steps = kSave;
  save.checkpoint_every = kSave;
  (void)run(from, save);
  for (const auto& [mesh, fsdp] : std::vector<std::pair<std::string, std::string>>{
           {"", ""}, {"expert=4", ""}, {"fsdp=2,expert=2", "zero3"}, {"data=2,expert=2", ""}}) {
    ExpertLayout to = base;
    to.mesh = mesh;
    to.fsdp = fsdp;
    train::TrainConfig tc = expert_config(to, "unused");
    tc.run_dir = tc.resume = copy_of(save.run_dir, "moe_to_" + (mesh.empty() ? std::string("one") : mesh));
    const train::TrainResult got = run(to, tc);
    const std::string what = "saved on data=2,expert=2, resumed on " + to.name();
    ASSERT_EQ(got.step_losses.size(), static_cast<size_t>(kGptParitySteps - kSave)) << what;
    for (const std::string& p : testing::run_differences(got, one, 1e-5)) ADD_FAILURE() << what << ": " << p;
    if (mesh == from.mesh) expect_bitwise(got, whole, what);
  }
}

TEST(CheckpointResume, AdamWAndBf16Zero3ResumeBitForBit) {
  for (const Layout& r : {Layout{.mesh = "data=2", .optimizer = "adamw"},
                       Layout{.mesh = "fsdp=2", .fsdp = "zero3", .optimizer = "adamw",
                           .precision = DType::bf16}}) {
    const train::TrainResult whole = tail_of(train(r, config_of(r, "adam_whole_" + r.mesh)));
    const train::TrainResult got = resumed(r, copy_of(saved_run(r, "adam_" + r.mesh), "adam_" + r.mesh));
    expect_bitwise(got, whole, r.mesh + " " + r.optimizer);
  }
}

TEST(CheckpointResume, AFailedRunKeepsItsCheckpoints) {
  // Step 1's update overflows (lr 1e30): step 2 stops the run, after the
  // checkpoint of step 1. Its staging directory stays, and a fresh run into
  // the same directory refuses to discard it.
  const Layout r{.mesh = "data=2"};
  train::TrainConfig tc = config_of(r, "failed");
  fs::remove_all(tc.run_dir);  // an earlier test run's
  tc.checkpoint_every = 1;
  tc.lr = 1e30;
  tc.warmup_steps = 0;
  EXPECT_THROW((void)train(r, tc), train::TrainingDiverged);
  const fs::path staging = tc.run_dir + ".incomplete";
  EXPECT_TRUE(fs::exists(staging / "checkpoints" / "step_00000001" / "index.json"));
  tc.overwrite = false;
  EXPECT_THAT([&] { (void)train(r, tc); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("holds the checkpoints of an interrupted run")));
  EXPECT_TRUE(fs::exists(staging / "checkpoints" / "step_00000001" / "index.json"));
  tc.overwrite = true;  // discards them
  tc.lr = 0.1;
  tc.max_steps = 2;
  (void)train(r, tc);
  EXPECT_FALSE(fs::exists(staging));
}

TEST(CheckpointResume, AnInterruptedRunContinuesBitForBit) {
  // What a killed run leaves: its staging directory with checkpoints (here
  // steps 5, 10 and 15 with --keep-last 2), and its reserved, empty run
  // directory.
  const Layout r{.mesh = "data=2"};
  train::TrainConfig tc = config_of(r, "interrupted");
  tc.max_steps = kSave;
  tc.checkpoint_every = 5;
  tc.keep_last = 2;
  (void)train(r, tc);
  const fs::path run = tc.run_dir, staging = tc.run_dir + ".incomplete";
  EXPECT_FALSE(fs::exists(run / "checkpoints" / "step_00000005"));
  EXPECT_TRUE(fs::exists(run / "checkpoints" / "step_00000010" / "index.json"));
  fs::rename(run, staging);
  fs::create_directory(run);
  train::TrainConfig cont = config_of(r, "interrupted");
  cont.resume = cont.run_dir;
  const train::TrainResult got = train(r, cont);
  expect_bitwise(got, tail_of(train(r, config_of(r, "interrupted_whole"))), "interrupted");
  EXPECT_FALSE(fs::exists(staging));  // committed
  EXPECT_TRUE(fs::exists(run / "checkpoints" / "step_00000015" / "index.json"));
}

// meshtrain export writes the run's model in PyTorch's layout (the GPT's
// GPT-2 names and Conv1D layout as they are); --init-from reads it back on
// any mesh: a step at lr 1e-30 leaves exactly the file's values.
TEST(CheckpointResume, ExportAndInitFromRoundTrip) {
  const std::string run = saved_run({.mesh = "data=2,tensor=2"}, "export");
  const std::string file = (fs::temp_directory_path() / "meshtrain_export_gpt.safetensors").string();
  EXPECT_THAT(train::export_model(run, file), HasSubstr("model gpt, "));
  // Into the run's own files: refused, however the path is spelled; the
  // run's model stays as it was.
  const std::string model_before = testing::read_file(fs::path(run) / "model.safetensors");
  for (const std::string& inside : {run + "/model.safetensors", run + "/../" + fs::path(run).filename().string() +
                                                                  "/checkpoints/x.safetensors"})
    EXPECT_THAT([&] { (void)train::export_model(run, inside); },
                ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("is inside the run directory")))
        << inside;
  EXPECT_EQ(testing::read_file(fs::path(run) / "model.safetensors"), model_before);
  const train::NamedTensors exported = checkpoint::load_safetensors(file);
  const train::NamedTensors back = train::load_model_file(file, "gpt");
  EXPECT_EQ(exported.size(), back.size());
  bool has_attn = false;
  for (const auto& [name, t] : exported) has_attn |= name == "h.0.attn.c_attn.weight" && t.shape() == std::vector<int64_t>{32, 96};
  EXPECT_TRUE(has_attn) << "GPT-2's c_attn (in, 3 C)";
  for (const Layout& to : {Layout{.mesh = "fsdp=2", .fsdp = "zero3"}, Layout{.mesh = "data=2,pipeline=2"}}) {
    train::TrainConfig tc = config_of(to, "init_from");
    tc.init_from = file;
    tc.lr = 1e-30;  // far below half an ulp of every value: the step changes nothing
    tc.max_steps = 1;
    const train::TrainResult r = train(to, tc);
    ASSERT_EQ(r.final_parameters.size(), back.size()) << to.mesh;
    for (const auto& [name, t] : r.final_parameters) {
      auto it = std::find_if(back.begin(), back.end(), [&](const auto& b) { return b.first == name; });
      ASSERT_NE(it, back.end()) << name;
      EXPECT_EQ(t.to_vector(), it->second.to_vector()) << to.mesh << " " << name;
    }
  }
  // A file of another model is refused naming the file and the tensor.
  train::TrainConfig tc = config_of({}, "init_from_bad");
  tc.init_from = file;
  tc.width = 64;
  EXPECT_THAT([&] { (void)train({}, tc); },
              ::testing::ThrowsMessage<IoError>(HasSubstr(file + " holds 'wte.weight' as [512, 32], this model needs "
                                                          "[512, 64]")));
  // A file with a NaN or an inf is refused at load, naming the tensor (it
  // used to surface as "the update of step 0 overflowed").
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    train::NamedTensors copy = exported;
    Tensor& t = copy.back().second;
    t = t.clone();
    t.data<float>()[t.numel() - 1] = bad;
    const std::string bad_file = (fs::temp_directory_path() / "meshtrain_export_nan.safetensors").string();
    checkpoint::save_safetensors(bad_file, copy, {{"format", "pt"}});
    EXPECT_THAT([&] { (void)train::load_model_file(bad_file, "gpt"); },
                ::testing::ThrowsMessage<IoError>(HasSubstr(fmt::format(
                    "--init-from: {}: tensor '{}' holds NaN or infinite values", bad_file, copy.back().first))));
  }
}

// The MLP's Linear weights leave in nn.Linear's (out, in), the biases as they are.
// A Llama run exports under Hugging Face Llama's names and layout
// (model.layers.<i>.self_attn.q_proj.weight as nn.Linear's (out, in), no
// wpe, model.norm.weight, the tied head without lm_head), and --init-from
// reads that file back into the run's values bit for bit on another mesh.
TEST(CheckpointResume, LlamaExportsHuggingFaceNames) {
  train::TrainConfig tc = config_of({.mesh = "data=2,tensor=2"}, "export_llama");
  tc.arch = layout::DecoderArch::llama;
  tc.kv_heads = 2;
  tc.dropout = 0.0;
  tc.max_steps = 2;
  const train::TrainResult r = train({.mesh = "data=2,tensor=2"}, tc);
  const std::string file = (fs::temp_directory_path() / "meshtrain_export_llama.safetensors").string();
  EXPECT_THAT(train::export_model(tc.run_dir, file), HasSubstr("model llama, "));
  const train::NamedTensors exported = checkpoint::load_safetensors(file);
  ASSERT_EQ(exported.size(), r.final_parameters.size());
  std::map<std::string, Tensor> by_name(exported.begin(), exported.end());
  for (const char* name : {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                           "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                           "model.norm.weight"})
    EXPECT_EQ(by_name.count(name), 1u) << name;
  for (const auto& [name, t] : by_name) EXPECT_EQ(name.find("wpe"), std::string::npos) << name;
  for (const auto& [name, want] : r.final_parameters) {
    if (name != "h.0.self_attn.k_proj.weight") continue;
    const Tensor& got = by_name.at("model.layers.0.self_attn.k_proj.weight");
    ASSERT_EQ(got.shape(), (std::vector<int64_t>{want.shape()[1], want.shape()[0]}));  // (out, in)
    EXPECT_EQ(got.to_vector(), want.transpose(0, 1).contiguous().to_vector());
  }
  train::TrainConfig again = config_of({.mesh = "fsdp=2"}, "init_llama");
  again.arch = layout::DecoderArch::llama;
  again.kv_heads = 2;
  again.dropout = 0.0;
  again.set("fsdp", "zero3", "test");
  again.init_from = file;
  again.lr = 1e-30;  // the step changes nothing
  again.max_steps = 1;
  const train::TrainResult back = train({.mesh = "fsdp=2"}, again);
  ASSERT_EQ(back.final_parameters.size(), r.final_parameters.size());
  for (size_t i = 0; i < back.final_parameters.size(); ++i)
    EXPECT_EQ(back.final_parameters[i].second.to_vector(), r.final_parameters[i].second.to_vector())
        << back.final_parameters[i].first;
}

// An untied head (--tie-embeddings false) trains as its own table on the
// pipeline's last stage, leaves as Hugging Face's lm_head.weight (vocab,
// width), untransposed beside model.embed_tokens.weight, and comes back bit
// for bit on another mesh.
TEST(CheckpointResume, LlamaUntiedHeadExportsLmHead) {
  train::TrainConfig tc = config_of({.mesh = "pipeline=2"}, "export_llama_untied");
  tc.arch = layout::DecoderArch::llama;
  tc.kv_heads = 2;
  tc.dropout = 0.0;
  tc.tie_embeddings = false;
  tc.max_steps = 2;
  tc.micro_batches = 2;
  const train::TrainResult r = train({.mesh = "pipeline=2"}, tc);
  const std::string file = (fs::temp_directory_path() / "meshtrain_export_llama_untied.safetensors").string();
  (void)train::export_model(tc.run_dir, file);
  const train::NamedTensors exported = checkpoint::load_safetensors(file);
  ASSERT_EQ(exported.size(), r.final_parameters.size());
  std::map<std::string, Tensor> by_name(exported.begin(), exported.end());
  ASSERT_EQ(by_name.count("lm_head.weight"), 1u);
  ASSERT_EQ(by_name.count("model.embed_tokens.weight"), 1u);
  for (const auto& [name, want] : r.final_parameters)
    if (name == "lm_head.weight") {
      EXPECT_EQ(by_name.at(name).shape(), (std::vector<int64_t>{tc.vocab, tc.width}));
      EXPECT_EQ(by_name.at(name).to_vector(), want.to_vector());
    }
  EXPECT_NE(by_name.at("lm_head.weight").to_vector(), by_name.at("model.embed_tokens.weight").to_vector());
  train::TrainConfig again = tc;
  again.run_dir = (fs::temp_directory_path() / "meshtrain_init_llama_untied").string();
  again.init_from = file;
  again.lr = 1e-30;  // the step changes nothing
  again.max_steps = 1;
  again.micro_batches = 1;
  const train::TrainResult back = train({.mesh = "data=2"}, again);
  ASSERT_EQ(back.final_parameters.size(), r.final_parameters.size());
  for (size_t i = 0; i < back.final_parameters.size(); ++i)
    EXPECT_EQ(back.final_parameters[i].second.to_vector(), r.final_parameters[i].second.to_vector())
        << back.final_parameters[i].first;
}

TEST(CheckpointResume, ExportTransposesTheMlpsLinears) {
  train::TrainConfig tc;
  tc.hidden = {64, 32};
  tc.batch_size = 64;
  tc.max_steps = 2;
  tc.checkpoint_every = 2;
  tc.threads_per_rank = 1;
  tc.run_dir = (fs::temp_directory_path() / "meshtrain_export_mlp").string();
  tc.overwrite = true;
  const train::TrainResult r = train({.mesh = "data=2"}, tc);
  const std::string file = (fs::temp_directory_path() / "meshtrain_export_mlp.safetensors").string();
  (void)train::export_model(tc.run_dir, file);
  const train::NamedTensors exported = checkpoint::load_safetensors(file);
  ASSERT_EQ(exported.size(), r.final_parameters.size());
  for (const auto& [name, want] : r.final_parameters) {
    auto it = std::find_if(exported.begin(), exported.end(), [&](const auto& e) { return e.first == name; });
    ASSERT_NE(it, exported.end()) << name;
    const Tensor& got = it->second;
    if (want.dim() == 1) {
      EXPECT_EQ(got.to_vector(), want.to_vector()) << name;
      continue;
    }
    ASSERT_EQ(got.shape(), (std::vector<int64_t>{want.shape()[1], want.shape()[0]})) << name;
    const std::vector<double> g = got.to_vector(), w = want.to_vector();
    const int64_t rows = want.shape()[0], cols = want.shape()[1];
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) ASSERT_EQ(g[j * rows + i], w[i * cols + j]) << name;
  }
}

}  // namespace
}  // namespace meshtrain
