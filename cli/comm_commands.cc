// meshtrain check, demo and bench collectives.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>

#include "bench/collectives.h"
#include "cli/command.h"
#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/selftest.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/mesh/mesh_shape.h"

namespace meshtrain::cli {

using comm::CollectiveOp;
using comm::Communicator;

void EngineFlags::add(CLI::App* app, int max_ranks) {
  // Not checked here: launch_options() asks the engine registry, whose error
  // also says what building a missing engine takes.
  app->add_option("--engine", engine,
                  fmt::format("{} (built in; mpi: start under mpirun)", fmt::join(comm::engines().names(), " | ")))
      ->capture_default_str();
  app->add_option("--ranks", ranks, fmt::format("ranks (threads engine, 1 to {}; mpi: taken from mpirun)", max_ranks))
      ->capture_default_str()
      ->check(CLI::Range(1, max_ranks));
  app->add_option("--timeout", timeout, std::string(kTimeoutHelp))->capture_default_str();
}

std::chrono::milliseconds parse_timeout(std::string_view text, std::string_view flag) {
  const NumberRange range{.min = std::chrono::duration<double>(comm::kMinTimeout).count(),
                          .max = std::chrono::duration<double>(comm::kMaxTimeout).count()};
  try {
    return std::chrono::milliseconds(std::llround(parse_double_in_range(text, flag, range, "deadline") * 1000));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(e.op(), e.detail(),
                          fmt::format("give {} in seconds, from 0.001 (1 ms) to 604800 (7 days)", flag));
  }
}

comm::LaunchOptions EngineFlags::launch_options() const {
  const comm::EngineSpec& e = comm::engines().get(engine);
  return {.engine = engine,
          .ranks = e.ranks_in_process ? ranks : 0,
          .timeout = parse_timeout(timeout),
          .abort_on_error = true};
}

int ranks_in_process(const comm::LaunchOptions& launch) {
  return comm::engines().get(launch.engine.str()).ranks_in_process ? launch.ranks : 1;
}

std::vector<int64_t> parse_int_list(std::string_view text, std::string_view flag, int64_t lo, int64_t hi,
                                    std::string_view example) {
  std::vector<int64_t> out;
  for (const std::string_view piece : split(text)) {
    const std::string item(piece);
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || v < lo || v > hi)
      throw InvalidArgument(std::string(flag),
                            fmt::format("'{}' is not a comma list of integers in [{}, {}]", text, lo, hi),
                            fmt::format("write e.g. {}", example));
    out.push_back(v);
  }
  return out;
}

void print_config(const std::string& command, const std::vector<std::pair<std::string, std::string>>& kv) {
  fmt::print("meshtrain {}:", command);
  for (const auto& [k, v] : kv) fmt::print(" {}={}", k, v);
  fmt::print("\n");
  std::fflush(stdout);
}

namespace {

// --- check --------------------------------------------------------------------

// `check` on the threads engine: every collective, dtype and op, with a
// broadcast from every root, takes about 2 minutes on 2 cores at this many
// ranks (and grows with the square of the rank count).
constexpr int kMaxCheckRanks = 128;

// The suite's largest buffer, in elements: 2^20 + 3 up to 64 ranks, then
// smaller so that all ranks of one process hold about 2 GiB at most (about
// 32 bytes per element per rank at the peak).
size_t largest_check_size(int ranks_in_process) {
  return std::min<size_t>(size_t{1} << 20, (size_t{1} << 26) / static_cast<size_t>(std::max(ranks_in_process, 1))) + 3;
}

int run_check(const EngineFlags& flags) {
  std::atomic<size_t> checks{0};
  int size = 0;
  const comm::LaunchOptions launch = flags.launch_options();  // validates before anything starts
  comm::SuiteOptions suite;
  suite.sizes.back() = largest_check_size(ranks_in_process(launch));
  comm::launch(launch, [&](Communicator& c) {
    if (c.rank() == 0) print_config("check", {{"engine", flags.engine}, {"ranks", std::to_string(c.size())}});
    checks += comm::run_collective_suite(c, suite);
    if (c.rank() == 0) size = c.size();
  });
  if (size) fmt::print("collective self-test passed: {} ranks, {} buffers compared on each rank\n", size,
                       checks.load() / static_cast<size_t>(ranks_in_process(launch) > 1 ? size : 1));
  return 0;
}

// --- bench --------------------------------------------------------------------

struct BenchFlags {
  EngineFlags engine;
  std::string min = "4K", max = "256M", dtype = "f32", json, ops = "all_reduce,reduce_scatter,all_gather,broadcast,all_to_all";
  std::string mpi_reduce_scatter = "both";  // an engine variant choice, or both
  size_t step = 4;
  std::string seconds = "0.2";
  bool check_fingerprints = false;
  bool peer = true;  // time the engine's own collectives too, if it has them (mpi: OpenMPI's)
};

std::vector<CollectiveOp> parse_ops(const std::string& list) {
  std::vector<CollectiveOp> ops;
  for (const std::string_view name : split(list)) {
    bool found = false;
    for (CollectiveOp op : {CollectiveOp::all_reduce, CollectiveOp::reduce_scatter, CollectiveOp::all_gather,
                            CollectiveOp::broadcast, CollectiveOp::all_to_all})
      if (comm::collective_op_name(op) == name) ops.push_back(op), found = true;
    if (!found)
      throw InvalidArgument("--ops", fmt::format("unknown op '{}'", name),
                            "use all_reduce, reduce_scatter, all_gather, broadcast, all_to_all");
  }
  return ops;
}

int run_bench_collectives(const BenchFlags& f) {
  bench::CollectiveOptions o;
  o.min_bytes = bench::parse_size(f.min, "--min");
  o.max_bytes = bench::parse_size(f.max, "--max");
  o.step = f.step;
  o.dtype = parse_dtype(f.dtype);
  o.ops = parse_ops(f.ops);
  o.seconds_per_size = parse_double_in_range(f.seconds, "--seconds", {.min = 0, .max = bench::kMaxSecondsPerSize,
                                                                     .min_open = true},
                                             "bench collectives");
  comm::LaunchOptions launch = f.engine.launch_options();
  launch.check_fingerprints = f.check_fingerprints;
  const comm::EngineSpec& engine = comm::engines().get(launch.engine.str());
  // Every rank of an in-process engine allocates its buffers in this process.
  bench::validate_collective_options(o, ranks_in_process(launch));
  std::mutex mu;
  std::vector<bench::CollectiveRow> rows;
  int ranks = 0;
  auto report = [&](Communicator& c, const std::vector<bench::CollectiveRow>& got) {
    if (c.rank() != 0) return;
    std::lock_guard l(mu);
    rows.insert(rows.end(), got.begin(), got.end());
    ranks = c.size();
  };
  auto banner = [&](Communicator& c) {
    if (c.rank() == 0)
      print_config("bench collectives",
                   {{"engine", f.engine.engine}, {"ranks", std::to_string(c.size())}, {"min", f.min}, {"max", f.max},
                    {"step", std::to_string(f.step)}, {"dtype", f.dtype}, {"seconds", f.seconds},
                    {"check_fingerprints", f.check_fingerprints ? "on" : "off"}});
  };
  o.label = f.check_fingerprints && !engine.ranks_in_process ? engine.name + "+check" : engine.name;
  const bool want_rs = std::find(o.ops.begin(), o.ops.end(), CollectiveOp::reduce_scatter) != o.ops.end();
  std::vector<std::string> choices;  // the engine's variants to time (reduce_scatter algorithms)
  if (want_rs && engine.bench_variants) {
    choices = engine.variant_choices;
    if (f.mpi_reduce_scatter != "both") choices = {f.mpi_reduce_scatter};
  }
  comm::launch(launch, [&](Communicator& world) {
    banner(world);
    // With variants, reduce_scatter runs once per variant; everything else once.
    auto main = o;
    if (!choices.empty())
      main.ops.erase(std::remove(main.ops.begin(), main.ops.end(), CollectiveOp::reduce_scatter), main.ops.end());
    // The peers (the engine's own blocking collectives, reference rates),
    // each on the ops it supports, timed in the engine's rounds.
    std::vector<std::unique_ptr<comm::PeerCollectives>> natives;
    if (f.peer && engine.native_peers) natives = engine.native_peers(world);
    for (std::unique_ptr<comm::PeerCollectives>& native : natives) {
      comm::PeerCollectives* p = native.get();
      main.peers.push_back({.label = p->label(),
                            .supports = [p, dtype = o.dtype](CollectiveOp op) { return p->supports(op, dtype); },
                            .call = [p](CollectiveOp op, std::byte* a, std::byte* b, size_t count, DType t) {
                              p->run(op, a, b, count, t);
                            }});
    }
    if (!main.ops.empty()) report(world, bench::run_collectives(world, main));
    if (!choices.empty()) {
      bool first = true;  // the peers' reduce_scatter rows come with the first variant's
      for (comm::EngineVariant& v : engine.bench_variants(launch, world, choices)) {
        auto opts = o;
        opts.ops = v.ops;
        opts.label = v.label;
        if (first) opts.peers = main.peers;
        first = false;
        report(*v.comm, bench::run_collectives(*v.comm, opts));
      }
    }
  });
  if (ranks == 0) return 0;  // not rank 0
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return std::tie(a.op, a.bytes) < std::tie(b.op, b.bytes);
  });
  fmt::print("{}", bench::format_table(rows, ranks));
  if (!f.json.empty()) {
    std::ofstream out(f.json, std::ios::app);
    if (!out) throw IoError("bench collectives", fmt::format("cannot open '{}'", f.json), "check the path");
    out << bench::format_jsonl(rows, ranks);
  }
  return 0;
}

// --- demo ---------------------------------------------------------------------

int run_demo(int ranks, const std::string& max) {
  const std::vector<int> shape = {ranks / 2, 2};
  const std::vector<std::string> names = {std::string(mesh::kData), std::string(mesh::kTensor)};
  fmt::print("meshtrain demo: {} simulated devices (threads engine), mesh data={},tensor=2\n\n", ranks, ranks / 2);
  std::mutex mu;
  std::vector<std::string> lines;
  comm::launch({.engine = comm::Engine::threads, .ranks = ranks, .timeout = std::chrono::seconds(120)},
               [&](Communicator& world) {
                 mesh::DeviceMesh m(world, shape, names);
                 if (world.rank() == 0) fmt::print("{}\n", m.to_string());
                 comm::SuiteOptions small{.sizes = {0, 1, 7, 1000, 100'003}};
                 auto check = [&](const std::string& what, Communicator& c) {
                   const size_t n = comm::run_collective_suite(c, small);
                   std::lock_guard l(mu);
                   if (world.rank() == 0)
                     lines.push_back(fmt::format("  {:<34} {} ranks  {:>5} buffers checked  ok", what, c.size(), n));
                 };
                 check("world", world);
                 for (const auto& axis : names) check(fmt::format("axis '{}' sub-communicators", axis), m.comm(axis));
                 if (world.rank() == 0) {
                   fmt::print("every collective x every dtype x every reduce op, checked against closed-form "
                              "values:\n");
                   for (const auto& l : lines) fmt::print("{}\n", l);
                   fmt::print("\n");
                 }
               });
  BenchFlags f;
  f.engine.ranks = ranks;
  f.max = max;
  f.seconds = "0.05";
  f.ops = "all_reduce,reduce_scatter,all_gather";
  return run_bench_collectives(f);
}

}  // namespace

std::vector<Command> add_comm_commands(CLI::App& app) {
  std::vector<Command> out;

  auto demo_ranks = std::make_shared<int>(4);
  auto demo_max = std::make_shared<std::string>("16M");
  auto* demo = app.add_subcommand("demo", "mesh on simulated devices, every collective checked, benchmark table");
  demo->add_option("--ranks", *demo_ranks, "simulated devices (even)")->capture_default_str()->check(CLI::Range(2, 64));
  demo->add_option("--max", *demo_max, "largest benchmark size")->capture_default_str();
  out.push_back({demo, [=] { return run_demo(*demo_ranks, *demo_max); }});

  auto check_flags = std::make_shared<EngineFlags>();
  auto* check = app.add_subcommand("check", "run the collective self-test on an engine");
  check_flags->add(check, kMaxCheckRanks);
  out.push_back({check, [=] { return run_check(*check_flags); }});

  auto bf = std::make_shared<BenchFlags>();
  auto* bench_cmd = app.add_subcommand("bench", "benchmarks");
  bench_cmd->require_subcommand(1);
  auto* coll = bench_cmd->add_subcommand("collectives", "time/algbw/busbw per size against the memory-traffic bound");
  bf->engine.add(coll);
  coll->add_option("--min", bf->min, "smallest size (4K, 1M, ...; 1 byte to 4G)")->capture_default_str();
  coll->add_option("--max", bf->max, "largest size (at most 4G; all buffers must fit in memory)")
      ->capture_default_str();
  coll->add_option("--step", bf->step, "size multiplier between rows (2 to 1024)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{2}, bench::kMaxCollectiveStep));
  coll->add_option("--dtype", bf->dtype, "element type")->capture_default_str();
  coll->add_option("--ops", bf->ops, "comma-separated collectives")->capture_default_str();
  coll->add_option("--seconds", bf->seconds, "timing budget per (op, size), in (0, 60]")->capture_default_str();
  coll->add_option("--json", bf->json, "append rows as JSON lines to this file");
  coll->add_option("--mpi-reduce-scatter", bf->mpi_reduce_scatter, "mpi: native | ring | both (engine variants)")
      ->check(CLI::IsMember({"native", "ring", "both"}))
      ->capture_default_str();
  coll->add_flag("--check-fingerprints", bf->check_fingerprints, "mpi: exchange fingerprints on every collective");
  coll->add_flag("--peer,!--no-peer", bf->peer,
                 "also time what the engine compares with (mpi: OpenMPI's collectives, rows 'openmpi'; gloo: "
                 "Gloo's own algorithms, rows 'gloo-ring' etc., and the raw TCP rate, rows 'tcp')")
      ->capture_default_str();
  out.push_back({coll, [=] { return run_bench_collectives(*bf); }});
  return out;
}

}  // namespace meshtrain::cli
