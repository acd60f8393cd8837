#include "meshtrain/train/artifacts.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "meshtrain/core/error.h"
#include "meshtrain/train/progress.h"

namespace meshtrain::train {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("meshtrain_artifacts_" + name)).string();
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Safetensors, RoundTripAndFormat) {
  const std::string path = temp_path("model.safetensors");
  Tensor w = Tensor::from_vector(std::vector<float>{1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f}, {2, 3});
  Tensor b = Tensor::from_vector(std::vector<int64_t>{4, -5}, {2}, DType::i64);
  save_safetensors(path, {{"0.weight", w}, {"0.bias", b}}, {{"format", "pt"}});
  const std::string bytes = read_all(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  ASSERT_EQ((8 + n) % 8, 0u);
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["0.weight"]["dtype"], "F32");
  EXPECT_EQ(header["0.weight"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(header["0.weight"]["data_offsets"], nlohmann::json({0, 24}));
  EXPECT_EQ(header["0.bias"]["data_offsets"], nlohmann::json({24, 40}));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(bytes.size(), 8 + n + 40);

  const auto back = load_safetensors(path);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].first, "0.weight");
  EXPECT_EQ(back[0].second.to_vector(), w.to_vector());
  EXPECT_EQ(back[1].second.dtype(), DType::i64);
  EXPECT_EQ(back[1].second.to_vector(), (std::vector<double>{4, -5}));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Safetensors, TruncatedFileIsRejected) {
  const std::string path = temp_path("bad.safetensors");
  std::ofstream(path, std::ios::binary) << std::string("\xff\x00\x00\x00\x00\x00\x00\x00{}", 10);
  EXPECT_THROW(load_safetensors(path), IoError);
}

TEST(MetricsLog, WritesJsonLines) {
  const std::string path = temp_path("metrics.jsonl");
  std::filesystem::remove(path);
  {
    MetricsLog log(path);
    log.write({{"step", 10}, {"loss", 0.25}}, {{"split", "train"}});
    log.write({{"step", 20}, {"accuracy", 0.875}}, {{"split", "test"}});
  }
  std::ifstream in(path);
  std::string l1, l2;
  std::getline(in, l1);
  std::getline(in, l2);
  EXPECT_EQ(l1, R"({"split":"train","step":10,"loss":0.25})");
  EXPECT_EQ(nlohmann::json::parse(l2)["accuracy"], 0.875);
}

// A resumed run's log keeps the lines up to its checkpoint's step and says
// how far the dropped ones had gone (the steps it redoes).
TEST(MetricsLog, AResumeKeepsTheLinesUpToItsStepAndCountsTheRest) {
  const std::string path = temp_path("resumed.jsonl");
  std::filesystem::remove(path);
  {
    MetricsLog log(path);
    for (int s = 1; s <= 14; ++s) log.write({{"step", s}, {"loss", 1.0 / s}}, {{"split", "train"}});
  }
  {
    MetricsLog log(path, 10);
    EXPECT_EQ(log.dropped_through(), 14);
    log.write({{"step", 11}, {"loss", 0.5}}, {{"split", "train"}});
  }
  std::ifstream in(path);
  std::vector<int> steps;
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line)["step"].get<int>());
  EXPECT_EQ(steps, (std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(MetricsLog(path, 11).dropped_through(), 11);  // nothing past the step: none redone
}

TEST(Checksums, TheHashSeesNamesShapesAndEveryBit) {
  const Tensor w = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  const std::string base = parameters_checksum({{"w", w}});
  EXPECT_EQ(base.size(), 16u);
  EXPECT_EQ(parameters_checksum({{"w", w.clone()}}), base);
  EXPECT_NE(parameters_checksum({{"v", w}}), base);
  EXPECT_NE(parameters_checksum({{"w", w.view({4})}}), base);
  Tensor nudged = w.clone();
  nudged.data<float>()[3] = std::nextafter(4.0f, 5.0f);  // one ulp
  EXPECT_NE(parameters_checksum({{"w", nudged}}), base);
  Tensor negative_zero = Tensor::zeros({1}, DType::f32), zero = Tensor::zeros({1}, DType::f32);
  negative_zero.data<float>()[0] = -0.0f;
  EXPECT_NE(parameters_checksum({{"z", negative_zero}}), parameters_checksum({{"z", zero}}));
}

TEST(Checksums, ComparisonNamesTheFirstStepThatDiffers) {
  const std::string dir = (std::filesystem::temp_directory_path() / "meshtrain_checksums_test").string();
  std::filesystem::create_directories(dir);
  {
    MetricsLog log(dir + "/a.jsonl");
    log.write({{"step", 10}, {"loss", 1.5}}, {{"split", "train"}});
    for (int s : {10, 20, 30}) log.write({{"step", s}}, {{"checksum", s == 30 ? "ff" : "aa"}});
  }
  const auto a = read_checksums(dir + "/a.jsonl");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[1], (std::pair<int64_t, std::string>{20, "aa"}));
  const std::vector<std::pair<int64_t, std::string>> b = {{10, "aa"}, {20, "aa"}, {30, "aa"}, {40, "aa"}};
  const ChecksumComparison c = compare_checksums(a, b);
  EXPECT_EQ(c.compared, 3);
  ASSERT_TRUE(c.first_difference.has_value());
  EXPECT_EQ(*c.first_difference, 30);
  EXPECT_EQ(c.a, "ff");
  EXPECT_EQ(c.b, "aa");
  const ChecksumComparison same = compare_checksums(b, b);
  EXPECT_FALSE(same.first_difference.has_value());
  EXPECT_EQ(same.compared, 4);
  EXPECT_EQ(same.first_step, 10);
  EXPECT_EQ(same.last_step, 40);
  EXPECT_THROW(read_checksums(dir + "/missing.jsonl"), IoError);
}

TEST(Charts, LineChartHasOnePolylinePerSeries) {
  const std::string svg = line_chart_svg("loss", "step", {{"train", {0, 1, 2}, {2.0, 1.0, 0.5}}, {"test", {2}, {0.7}}});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  size_t count = 0;
  for (size_t p = svg.find("<polyline"); p != std::string::npos; p = svg.find("<polyline", p + 1)) ++count;
  EXPECT_EQ(count, 2u);
  EXPECT_NE(svg.find(">train</text>"), std::string::npos);
}

TEST(Charts, TicksAreRoundNumbersAndTheAxesEndOnThem) {
  // The newcomer's run: steps 0..468, losses 0.567..2.3.
  const std::string svg = line_chart_svg("loss", "step", {{"train", {0, 200, 468}, {2.3, 1.0, 0.567}}});
  for (const char* label : {">0.5</text>", ">1.0</text>", ">2.5</text>", ">0</text>", ">100</text>", ">500</text>"})
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  EXPECT_EQ(svg.find(">468"), std::string::npos);
  EXPECT_EQ(svg.find(">0.567"), std::string::npos);
  EXPECT_EQ(svg.find(">3.0</text>"), std::string::npos);  // the axis ends at the first tick above the data
}

TEST(Images, GridIsAPng) {
  const std::string path = temp_path("grid.png");
  std::vector<std::vector<float>> imgs(5, std::vector<float>(28 * 28, 0.5f));
  write_image_grid_png(path, imgs, 28, 28, 3);
  const std::string bytes = read_all(path);
  ASSERT_GT(bytes.size(), 8u);
  EXPECT_EQ(bytes.substr(1, 3), "PNG");
  EXPECT_THROW(write_image_grid_png(path, {std::vector<float>(3)}, 28, 28, 3), InvalidArgument);
}

// The trainer ends the bar's line before each epoch's summary and goes on
// with the same bar: into a file, each tenth is printed once (no second line
// for the tenth an epoch ended in) and elapsed time covers the whole run.
TEST(Progress, FinishEndsTheLineAndTheBarGoesOn) {
  const std::string path = temp_path("progress.txt");
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  {
    ProgressBar bar(20, true, "train", f);
    for (int64_t step = 1; step <= 10; ++step) bar.update(step, {{"loss", 1.0}}, 100.0);
    bar.finish();
    std::fprintf(f, "epoch 1: summary\n");
    for (int64_t step = 11; step <= 20; ++step) bar.update(step, {{"loss", 1.0}}, 100.0);
    bar.finish();
  }
  std::fclose(f);
  std::istringstream in(read_all(path));
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 12u) << read_all(path);  // tenths 0..10 once each, and the summary
  EXPECT_EQ(lines[6], "epoch 1: summary");
  EXPECT_NE(lines[7].find(" 12/20 "), std::string::npos) << lines[7];  // 11/20 is the tenth printed before
}

TEST(Progress, Durations) {
  EXPECT_EQ(format_duration(12.2), "12s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(3720), "1h02m");
}

}  // namespace
}  // namespace meshtrain::train
