#include "meshtrain/checkpoint/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>

#include "meshtrain/checkpoint/async_save.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"

namespace meshtrain::checkpoint {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// Element g (row-major) of tensor `name`: distinct per tensor and element.
float value_at(const std::string& name, int64_t g) {
  return static_cast<float>(std::hash<std::string>{}(name) % 1000) + 0.25f * static_cast<float>(g);
}

// The piece with its data: element k of the region is value_at(global index).
CheckpointPiece piece(const std::string& name, std::vector<int64_t> shape, std::vector<int64_t> view,
                      sharding::Box box, int64_t start = 0, int64_t count = -1) {
  CheckpointPiece p{name, {shape, view, box, start, count}, Tensor()};
  if (view.empty()) view = shape;
  if (box.offsets.empty()) box = {std::vector<int64_t>(view.size(), 0), view};
  if (count < 0) count = box.numel() - start;
  p.data = Tensor::empty({count}, DType::f32);
  std::vector<int64_t> stride(view.size(), 1);
  for (size_t d = view.size(); d-- > 1;) stride[d - 1] = stride[d] * view[d];
  for (int64_t k = 0; k < count; ++k) {
    int64_t rem = start + k, g = 0;
    for (size_t d = view.size(); d-- > 0;) {
      g += (box.offsets[d] + rem % box.sizes[d]) * stride[d];
      rem /= box.sizes[d];
    }
    p.data.data<float>()[k] = value_at(name, g);
  }
  return p;
}

CheckpointPiece wanted(const CheckpointPiece& p) {
  CheckpointPiece w = p;
  w.data = Tensor();
  return w;
}

std::string scratch(const std::string& tag) {
  const fs::path p = fs::temp_directory_path() / ("meshtrain_checkpoint_test_" + tag);
  fs::remove_all(p);
  return p.string();
}

// What 4 ranks hold, as three strategies would: A (6 x 10) fully sharded in
// flat quarters of 15; B (4 x 15, its (4, 3, 5) view) split by the middle
// axis's... last axis over 2 tensor ranks and replicated over 2 data ranks;
// C (7) whole on every rank; D flat halves of a tensor-parallel block.
std::vector<CheckpointPiece> four_rank_pieces(int rank) {
  std::vector<CheckpointPiece> out;
  out.push_back(piece("A", {6, 10}, {}, {}, 15 * rank, 15));
  const int t = rank % 2;
  out.push_back(piece("B", {4, 15}, {4, 3, 5}, {{0, 0, t == 0 ? 0 : 3}, {4, 3, t == 0 ? 3 : 2}}));  // uneven
  out.push_back(piece("C", {7}, {}, {}));
  out.push_back(piece("D", {8, 6}, {}, {{0, 3 * t}, {8, 3}}, 12 * (rank / 2), 12));
  return out;
}

void save_four(const std::string& root, int64_t step, int keep_last = 0) {
  comm::launch({.engine = comm::Engine::threads, .ranks = 4, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 save_checkpoint(world, root, step, four_rank_pieces(world.rank()),
                                 R"({"model": "test", "step": )" + std::to_string(step) + "}",
                                 {.keep_last = keep_last});
               });
}

void expect_values(const CheckpointPiece& got) {
  const sharding::Placement& w = got.placement;
  const CheckpointPiece want = piece(got.name, w.shape, w.view, w.box, w.start, w.count);
  EXPECT_EQ(got.data.to_vector(), want.data.to_vector()) << got.name;
}

TEST(Checkpoint, SavedOnFourRanksLoadsIntoOtherLayouts) {
  const std::string root = scratch("layouts");
  save_four(root, 7);
  const auto dir = latest_checkpoint(root);
  ASSERT_TRUE(dir.has_value());
  EXPECT_EQ(fs::path(*dir).filename(), "step_00000007");
  const CheckpointIndex index = read_checkpoint_index(*dir);
  EXPECT_EQ(index.step, 7);
  EXPECT_THAT(index.metadata, HasSubstr("\"model\":\"test\""));
  // Replicas are written once: A 4 pieces, B 2 (of 4 holders), C 1, D 4.
  ASSERT_EQ(index.tensors.size(), 4u);
  EXPECT_EQ(index.find("A")->pieces.size(), 4u);
  EXPECT_EQ(index.find("B")->pieces.size(), 2u);
  EXPECT_EQ(index.find("C")->pieces.size(), 1u);
  EXPECT_EQ(index.find("D")->pieces.size(), 4u);
  // One device: whole tensors.
  std::vector<CheckpointPiece> whole = {wanted(piece("A", {6, 10}, {}, {})), wanted(piece("B", {4, 15}, {}, {})),
                                        wanted(piece("C", {7}, {}, {})), wanted(piece("D", {8, 6}, {}, {}))};
  load_checkpoint_pieces(index, whole);
  for (const CheckpointPiece& p : whole) expect_values(p);
  // Three ranks' different cuts: a box of A across the flat shards, B's
  // middle third of its (4, 3, 5) view, a flat range of C, a box of D across
  // both tensor blocks.
  std::vector<CheckpointPiece> other = {wanted(piece("A", {6, 10}, {}, {{1, 2}, {4, 7}})),
                                        wanted(piece("B", {4, 15}, {4, 3, 5}, {{1, 1, 0}, {2, 1, 5}})),
                                        wanted(piece("C", {7}, {}, {}, 2, 3)),
                                        wanted(piece("D", {8, 6}, {}, {{2, 1}, {5, 4}}, 3, 11))};
  load_checkpoint_pieces(index, other);
  for (const CheckpointPiece& p : other) expect_values(p);
}

TEST(Checkpoint, KeepsTheNewestAndLeavesNoTemporaries) {
  const std::string root = scratch("keep");
  for (int64_t step : {10, 20, 30}) save_four(root, step, 2);
  EXPECT_FALSE(fs::exists(fs::path(root) / "step_00000010"));
  EXPECT_TRUE(fs::exists(fs::path(root) / "step_00000020"));
  EXPECT_EQ(*latest_checkpoint(root), (fs::path(root) / "step_00000030").string());
  std::ifstream latest(fs::path(root) / "latest");
  std::string line;
  std::getline(latest, line);
  EXPECT_EQ(line, "step_00000030");
  for (const auto& e : fs::directory_iterator(root)) EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
  // A save that crashed before its rename leaves a temporary that loads ignore.
  fs::create_directory(fs::path(root) / ".step_00000040.tmp");
  EXPECT_EQ(*latest_checkpoint(root), (fs::path(root) / "step_00000030").string());
}

TEST(Checkpoint, AFailedSaveFailsEveryRankAndKeepsThePreviousOne) {
  const std::string root = scratch("fail");
  save_four(root, 1);
  // Rank 2 holds a piece of A that does not lie in A: it fails with its
  // reason, the others with an error naming it, and nothing is written.
  std::mutex mu;
  std::vector<std::string> errors;
  comm::launch({.engine = comm::Engine::threads, .ranks = 4, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 std::vector<CheckpointPiece> mine = four_rank_pieces(world.rank());
                 if (world.rank() == 2) mine[0].placement.start = 50;  // [50, 65) of A's 60
                 try {
                   save_checkpoint(world, root, 2, mine, "{}");
                 } catch (const Error& e) {
                   std::lock_guard lock(mu);
                   errors.push_back(fmt::format("{}: {}", world.rank(), e.what()));
                 }
               });
  ASSERT_EQ(errors.size(), 4u);
  for (const std::string& e : errors)
    EXPECT_THAT(e, ::testing::AnyOf(HasSubstr("2: save_checkpoint: piece of 'A': elements [50, 65) are not inside"),
                                    HasSubstr("save_checkpoint: rank 2: piece of 'A': elements [50, 65)")));
  EXPECT_FALSE(fs::exists(fs::path(root) / "step_00000002"));
  // A directory that cannot be created (even by root): every rank fails.
  errors.clear();
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 try {
                   save_checkpoint(world, "/proc/meshtrain_no_such_dir", 2, four_rank_pieces(world.rank()), "{}");
                 } catch (const IoError& e) {
                   std::lock_guard lock(mu);
                   errors.push_back(e.what());
                 }
               });
  ASSERT_EQ(errors.size(), 2u);
  for (const std::string& e : errors) EXPECT_THAT(e, HasSubstr("/proc/meshtrain_no_such_dir"));
  EXPECT_TRUE(fs::exists(fs::path(root) / "step_00000001" / "index.json"));
  EXPECT_EQ(*latest_checkpoint(root), (fs::path(root) / "step_00000001").string());
}

// The background saver writes the values the pieces had when it started,
// whatever the caller does to them next; saves complete in order; a failed
// one is rethrown on every rank by the next wait(), the previous checkpoint
// kept.
TEST(AsyncCheckpoint, WritesTheValuesAtStartWhileTheCallerChangesThem) {
  const std::string root = scratch("async");
  std::mutex mu;
  std::vector<std::string> errors;
  comm::launch({.engine = comm::Engine::threads, .ranks = 4, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 AsyncCheckpointSaver saver(world.split(0, world.rank()));
                 std::vector<CheckpointPiece> live = four_rank_pieces(world.rank());
                 for (int64_t step : {10, 20}) {
                   EXPECT_EQ(saver.in_flight().has_value(), step == 20);
                   const std::optional<CheckpointSaveStats> previous =
                       saver.start(root, step, live, R"({"model": "test"})", {.keep_last = 2});
                   EXPECT_EQ(previous.has_value(), step == 20);
                   EXPECT_EQ(saver.in_flight(), step);
                   // Training goes on: the live values change at once, and the
                   // job's own communicator keeps working beside the save.
                   for (CheckpointPiece& p : live) p.data.fill(-1.0);
                   float x = 1;
                   world.all_reduce(&x, &x, 1, DType::f32, comm::ReduceOp::sum);
                   EXPECT_EQ(x, 4.0f);
                   live = four_rank_pieces(world.rank());
                 }
                 const std::optional<CheckpointSaveStats> last = saver.wait();
                 ASSERT_TRUE(last.has_value());
                 EXPECT_GT(last->bytes, 0u);
                 EXPECT_FALSE(saver.wait().has_value());
                 // A save that cannot be written fails on every rank, at the next wait.
                 saver.start("/proc/meshtrain_no_such_dir", 30, live, "{}");
                 try {
                   saver.wait();
                 } catch (const IoError& e) {
                   std::lock_guard lock(mu);
                   errors.push_back(e.what());
                 }
               });
  ASSERT_EQ(errors.size(), 4u);
  for (const std::string& e : errors) EXPECT_THAT(e, HasSubstr("/proc/meshtrain_no_such_dir"));
  EXPECT_EQ(*latest_checkpoint(root), (fs::path(root) / "step_00000020").string());
  for (const char* step : {"step_00000010", "step_00000020"}) {
    const CheckpointIndex index = read_checkpoint_index((fs::path(root) / step).string());
    std::vector<CheckpointPiece> whole = {wanted(piece("A", {6, 10}, {}, {})), wanted(piece("B", {4, 15}, {}, {})),
                                          wanted(piece("C", {7}, {}, {})), wanted(piece("D", {8, 6}, {}, {}))};
    load_checkpoint_pieces(index, whole);
    for (const CheckpointPiece& p : whole) expect_values(p);  // not the -1s written after start()
  }
}

// Damage one thing in a copy of a good checkpoint; loading it fails naming
// the file and the tensor.
std::string damaged(const std::string& tag, const std::function<void(const fs::path&)>& damage) {
  const std::string root = scratch(tag);
  save_four(root, 5);
  const fs::path dir = fs::path(root) / "step_00000005";
  damage(dir);
  return dir.string();
}

std::string load_error(const std::string& dir, std::vector<CheckpointPiece> want) {
  try {
    const CheckpointIndex index = read_checkpoint_index(dir);
    load_checkpoint_pieces(index, want);
  } catch (const IoError& e) {
    return e.what();
  }
  return "no error";
}

void edit_index(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  std::ifstream in(dir / "index.json");
  nlohmann::json j = nlohmann::json::parse(in);
  edit(j);
  std::ofstream(dir / "index.json") << j.dump();
}

TEST(Checkpoint, DamagedCheckpointsAreRefusedNamingFileAndTensor) {
  const std::vector<CheckpointPiece> all = {wanted(piece("A", {6, 10}, {}, {})), wanted(piece("C", {7}, {}, {}))};
  // A truncated rank file.
  std::string dir = damaged("truncated", [](const fs::path& d) { fs::resize_file(d / "rank_00001.bin", 64); });
  EXPECT_THAT(load_error(dir, all), HasSubstr("rank_00001.bin' has 64 bytes, the index says"));
  // A flipped byte: rank 0 wrote A's first piece at offset 0.
  dir = damaged("checksum", [](const fs::path& d) {
    std::fstream f(d / "rank_00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x7f');
  });
  EXPECT_THAT(load_error(dir, all), HasSubstr("rank_00000.bin': the piece of 'A' at byte 0 fails its checksum"));
  // An index pointing past a file's end.
  dir = damaged("past_end", [](const fs::path& d) {
    edit_index(d, [](nlohmann::json& j) { j["tensors"][0]["pieces"][0]["offset"] = 1 << 20; });
  });
  EXPECT_THAT(load_error(dir, all), HasSubstr("a piece of tensor 'A' lies at bytes [1048576, 1048636) past the end"));
  // A region that disagrees with its tensor's shape.
  dir = damaged("shape", [](const fs::path& d) {
    edit_index(d, [](nlohmann::json& j) { j["tensors"][0]["pieces"][0]["sizes"] = {6, 11}; });
  });
  EXPECT_THAT(load_error(dir, all), HasSubstr("a piece of tensor 'A': box [0:6, 0:11] is not inside view [6, 10]"));
  // Malformed JSON, and not an index at all.
  dir = damaged("json", [](const fs::path& d) { std::ofstream(d / "index.json") << "{\"format\": "; });
  EXPECT_THAT(load_error(dir, all), HasSubstr("index.json: malformed index"));
  // A checkpoint of a different model: a tensor it lacks, one of another shape.
  dir = damaged("model", [](const fs::path&) {});
  EXPECT_THAT(load_error(dir, {wanted(piece("E", {3}, {}, {}))}), HasSubstr("has no tensor 'E'"));
  EXPECT_THAT(load_error(dir, {wanted(piece("A", {10, 6}, {}, {}))}),
              HasSubstr("holds 'A' as [6, 10], this model needs [10, 6]"));
  // A missing piece (rank 3's quarter of A dropped from the index).
  dir = damaged("missing", [](const fs::path& d) {
    edit_index(d, [](nlohmann::json& j) { j["tensors"][0]["pieces"].erase(3); });
  });
  EXPECT_THAT(load_error(dir, all), HasSubstr("holds 45 of the 60 elements of 'A'"));
}

}  // namespace
}  // namespace meshtrain::checkpoint
