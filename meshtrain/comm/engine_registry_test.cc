// Engines chosen by name: the built-in list matches what CMake built,
// launch() by name runs, unknown or missing engines get an error that lists
// the available ones, and a program can add its own engine.
#include "meshtrain/comm/engine_registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::comm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using meshtrain::testing::error_of;

std::vector<std::string> built_engines() {
  std::vector<std::string> out;
  for (std::string_view e : split(MESHTRAIN_BUILTIN_ENGINE_LIST)) out.emplace_back(e);
  return out;
}

TEST(EngineRegistry, BuiltInEnginesAreWhatCMakeBuilt) {
  EXPECT_EQ(engines().names(), built_engines());
  EXPECT_EQ(engines().names().front(), "threads");
  const EngineSpec& threads = engines().get("threads");
  EXPECT_TRUE(threads.ranks_in_process);
  EXPECT_FALSE(threads.native_peers);
  if (const EngineSpec* mpi = engines().find("mpi")) {
    // Under mpirun or not, its description and benchmark hooks are there.
    EXPECT_FALSE(mpi->ranks_in_process);
    EXPECT_TRUE(mpi->native_peers);
    EXPECT_THAT(mpi->variant_choices, ElementsAre("native", "ring"));
  }
  if (const EngineSpec* gloo = engines().find("gloo")) {
    EXPECT_FALSE(gloo->ranks_in_process);
    EXPECT_TRUE(gloo->native_peers);  // Gloo's own algorithms and the TCP rate (gloo/native.h)
  }
}

TEST(EngineRegistry, LaunchByName) {
  for (const EngineName& name : {EngineName("threads"), EngineName(Engine::threads)}) {
    std::atomic<int> sum{0};
    launch({.engine = name, .ranks = 3, .timeout = std::chrono::seconds(30)}, [&](Communicator& c) {
      int v = c.rank() + 1;
      c.all_reduce(&v, &v, 1, DType::i32, ReduceOp::sum);
      sum += v;
    });
    EXPECT_EQ(sum.load(), 3 * 6);
  }
}

TEST(EngineRegistry, UnknownAndMissingEnginesListTheAvailableOnes) {
  const std::string available = fmt::format("use one of: {}", fmt::join(built_engines(), ", "));
  auto fn = [](Communicator&) {};
  const std::string unknown = error_of([&] { launch({.engine = "thread", .ranks = 2}, fn); });
  EXPECT_THAT(unknown, HasSubstr("unknown engine 'thread'"));
  EXPECT_THAT(unknown, HasSubstr(available));
  // nccl is a known engine that no build has yet: a different sentence.
  const std::string nccl = error_of([&] { launch({.engine = Engine::nccl}, fn); });
  EXPECT_THAT(nccl, HasSubstr("engine 'nccl' is not built into this program"));
  EXPECT_THAT(nccl, HasSubstr(available));
  if (!engines().find("gloo")) {
    EXPECT_THAT(error_of([&] { launch({.engine = Engine::gloo}, fn); }),
                HasSubstr("engine 'gloo' is not built into this program"));
  }
  if (!engines().find("mpi")) {
    EXPECT_THAT(error_of([&] { launch({.engine = "mpi"}, fn); }), HasSubstr("needs OpenMPI when meshtrain is built"));
  }
  // The name is checked before anything else.
  EXPECT_THAT(error_of([&] { launch({.engine = "nope", .ranks = -1}, fn); }), HasSubstr("unknown engine 'nope'"));
  EXPECT_THAT(error_of([&] { launch({.engine = "threads", .ranks = 0}, fn); }), HasSubstr("ranks 0 is outside"));
}

TEST(EngineRegistry, ProgramsCanAddEngines) {
  EngineRegistry r;
  int launched = 0;
  r.add({.name = "inline",
         .description = "runs fn on a 1-rank threads world",
         .ranks_in_process = true,
         .launch = [&](const LaunchOptions& o, const SpmdFunction& fn) {
           ++launched;
           engines().get("threads").launch(o, fn);
         }});
  int ran = 0;
  r.get("inline").launch({.ranks = 1}, [&](Communicator& c) { ran += c.size(); });
  EXPECT_EQ(launched, 1);
  EXPECT_EQ(ran, 1);
  EXPECT_THAT(r.names(), ElementsAre("inline"));
  EXPECT_THAT(error_of([&] { r.add({.name = "inline", .launch = [](auto&, auto&) {}}); }),
              HasSubstr("already registered"));
  EXPECT_THAT(error_of([&] { r.add({.name = "x"}); }), HasSubstr("has no launch function"));
  EXPECT_THAT(error_of([&] { r.get("threads"); }), HasSubstr("use one of: inline"));
}

}  // namespace
}  // namespace meshtrain::comm
