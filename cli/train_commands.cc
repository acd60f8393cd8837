// meshtrain train: TOML config < launcher environment < command-line flags.
// meshtrain bench train, bench memory, bench gemm: the training benchmarks (bench/).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <memory>

#include "bench/attention_bench.h"
#include "bench/fusion_bench.h"
#include "bench/gemm_bench.h"
#include "bench/checkpoint_bench.h"
#include "bench/moe_bench.h"
#include "bench/zeropp_bench.h"
#include "bench/gpt_bench.h"
#include "bench/memory_bench.h"
#include "bench/pipeline_bench.h"
#include "bench/train_bench.h"
#include "cli/command.h"
#include "meshtrain/comm/engine_registry.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/config/distributed_config.h"
#include "meshtrain/config/job_overrides.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/matmul.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/strings.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/train/model_recipe.h"
#include "meshtrain/train/run_dir.h"
#include "meshtrain/checkpoint/checkpoint.h"
#include "meshtrain/train/artifacts.h"
#include "meshtrain/train/device_memory.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::cli {
namespace {

struct TrainFlags {
  std::string config;
  std::string engine;
  std::string devices;
  std::string mesh;
  std::string mixed_precision;  // no | fp16 | bf16
  std::string precision;        // fp32 | bf16 | fp16: an alias of --mixed-precision
  std::string timeout = "300";  // seconds, parse_timeout
  std::map<std::string, std::string> values;  // train key -> flag text
  CLI::App* app = nullptr;
};

// --resume RUN without --config: the run's own config.toml (an interrupted
// run's staging directory first), so only what changes needs a flag.
std::string resumed_config(const TrainFlags& f) {
  if (!f.config.empty() || f.app->get_option("--resume")->count() == 0) return f.config;
  return train::resume_config(f.values.at("resume"));
}

// A worker that `meshtrain launch --max-restarts` restarted
// (MESHTRAIN_RESTART_COUNT > 0, as torchrun's TORCHELASTIC_RESTART_COUNT)
// continues its run from the latest checkpoint, as if --resume RUN_DIR were
// given, when the run directory (or its interrupted staging) holds one.
void resume_after_restart(TrainFlags& f) {
  const config::LauncherEnv env = config::read_launcher_env();
  const std::string* count = env.find("MESHTRAIN_RESTART_COUNT");
  if (!count || *count == "0" || count->empty()) return;
  if (f.app->get_option("--resume")->count() > 0 || f.app->get_option("--run-dir")->count() == 0) return;
  const std::string run = f.values.at("run_dir");
  if (!train::holds_checkpoint(run)) return;
  f.values["resume"] = run;
  f.app->get_option("--resume")->add_result(run);
  if (const std::string* rank = env.find("RANK"); !rank || *rank == "0")
    fmt::print("meshtrain train: restart {}: resuming {} from its latest checkpoint\n", *count, run);
}

int run_train(TrainFlags& f) {
  const std::chrono::milliseconds timeout = parse_timeout(f.timeout);  // refuse bad flags before reading files
  resume_after_restart(f);
  f.config = resumed_config(f);
  train::TrainConfig tc = f.config.empty() ? train::TrainConfig{} : train::TrainConfig::from_toml_file(f.config);
  for (const auto& field : train::train_config_fields())
    if (f.app->get_option(std::string(field.flag))->count() > 0) {
      const std::string& text = f.values[std::string(field.key)];
      // A boolean flag alone means true: --overwrite, --drop-last.
      tc.set(field.key, text.empty() && field.kind == train::TrainFieldKind::boolean ? "true" : text, field.flag);
    }
  tc.continue_in_resumed_directory(f.app->get_option("--run-dir")->count() > 0, "--run-dir");
  tc.validate();

  config::DistributedConfig dc =
      f.config.empty() ? config::DistributedConfig{} : config::DistributedConfig::from_toml_file(f.config);
  dc = dc.with_env(config::read_launcher_env());
  const auto plan_start = std::chrono::steady_clock::now();  // the re-plan of a resumed run, timed
  std::vector<std::string> notes;  // a resumed run's new mesh
  // A resumed run's mesh as its config.toml has it (its last part's).
  const mesh::NamedShape saved = !tc.resume.empty() && !dc.mesh_shape.empty() ? dc.mesh() : mesh::NamedShape{};
  dc = config::apply_job_overrides(dc, {.engine = f.engine,
                                        .devices = f.devices,
                                        .mesh = f.mesh,
                                        .mixed_precision = f.mixed_precision,
                                        .precision = f.precision,
                                        .config_source = f.config,
                                        .gloo_available = comm::engines().find("gloo") != nullptr,
                                        .resuming = !tc.resume.empty(),
                                        .notes = &notes});
  if (!saved.shape.empty() && f.app->get_option("--micro-batches")->count() == 0)
    train::keep_micro_batch_size(tc, saved, dc.mesh(), &notes);
  // The devices' memory (--device-memory): a resumed run that no longer fits is re-planned.
  const train::ResolvedTraining resolved =
      train::fit_device_memory(train::resolve_training(tc, dc), dc, !tc.resume.empty(), &notes);
  dc.restart.replan_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - plan_start).count();

  const comm::LaunchOptions launch{.engine = dc.backend,
                                   .ranks = dc.backend == comm::Engine::threads ? dc.world_size : 0,
                                   .timeout = timeout,
                                   .abort_on_error = true};
  const bool main = dc.rank == 0;
  // One process (threads engine): refuse a run directory that holds a run
  // before the start-up dump. Under mpirun run_training does it collectively.
  if (dc.backend == comm::Engine::threads && !tc.run_dir.empty() && tc.resume.empty())
    train::RunDirectory::check(tc.run_dir, tc.overwrite, train::find_model_recipe(tc.model).artifacts);
  if (main) {
    fmt::print("meshtrain train: engine {}, {} ranks, mesh {}\n", comm::engine_name(dc.backend), dc.world_size,
               dc.mesh().to_spec());
    fmt::print("# CPU ISA {}; GEMMs {}; idle GEMM threads: {}\n", cpu_isa_summary(), gemm_policy_summary(),
               idle_waits_summary());
    if (const std::string note = openblas_core_note(); !note.empty()) fmt::print("# note: {}\n", note);
    fmt::print("{}", resolved.config.to_toml());
    for (const auto& note : notes) fmt::print("# {}\n", note);
    for (const auto& note : resolved.notes) fmt::print("# {}\n", note);
    fmt::print("\n[distributed]\n# (resolved)\n{}\n\n", dc.to_string());
    const mesh::NamedShape m = dc.mesh();
    fmt::print("{}\n", mesh::render_mesh(m.shape, m.axis_names));
    fmt::print("layout: {}\n", resolved.layout.describe());
    std::fflush(stdout);
  }
  // Ctrl-C (or a scheduler's SIGTERM) stops every rank after the same step,
  // with a checkpoint when --checkpoint-every is set; a second one kills.
  train::StopRequest stop;
  train::TrainResult r;
  try {
    train::StopOnSignals on_signals(stop, {SIGINT, SIGTERM});
    r = train::run_training(resolved, dc, launch, &stop);
  } catch (const train::TrainingInterrupted& e) {
    if (main) fmt::print(stderr, "{}\n", e.what());
    return e.signal() > 0 ? 128 + e.signal() : 1;
  }
  if (main) {
    // "1234 samples/s", or with the recipe's unit "56789 tokens/s, 1234 samples/s".
    const std::string rate =
        r.rate_unit.empty() ? fmt::format("{:.0f} samples/s", r.samples_per_second)
                            : fmt::format("{:.0f} {}/s, {:.0f} samples/s", r.units_per_second, r.rate_unit,
                                          r.samples_per_second);
    if (r.fsdp.empty())
      fmt::print("done: {} steps in {:.1f} s ({}), data-parallel communication hidden {:.0f}%\n", r.steps, r.seconds,
                 rate, 100 * r.hidden_fraction);
    else
      fmt::print("done: {} steps in {:.1f} s ({}), fsdp {}, {}\n", r.steps, r.seconds, rate, r.fsdp,
                 layout::precision_name(dc.mixed_precision));
    if (r.loss_scale > 0)
      fmt::print("loss scale {} at the end, {} of {} steps skipped (fp16 overflows{})\n", r.loss_scale,
                 r.skipped_steps, r.steps,
                 tc.on_nonfinite == train::NonFinitePolicy::skip ? ", non-finite losses or gradients" : "");
    else if (tc.on_nonfinite == train::NonFinitePolicy::skip)
      fmt::print("{} of {} steps skipped for a non-finite loss or gradients\n", r.skipped_steps, r.steps);
    std::string peaks;
    for (MemoryCategory c : kAllMemoryCategories)
      if (r.memory_peak[static_cast<size_t>(c)] > 0)
        peaks += fmt::format("{} {}, ", memory_category_name(c), format_bytes(r.memory_peak[static_cast<size_t>(c)]));
    fmt::print("peak memory per rank (rank 0): {}total {}\n", peaks, format_bytes(r.memory_total_peak));
    fmt::print("final {}\n", r.test_summary);  // the model recipe's line
    std::string files;
    for (const std::string& f : r.artifacts) files += ", " + f;
    if (!r.pipeline_schedule.empty()) files += ", pipeline.svg, pipeline.trace.json";
    fmt::print("run directory: {} (config.toml, metrics.jsonl, model.safetensors, loss.svg{})\n", r.run_dir, files);
  }
  return 0;
}

struct MemoryBenchFlags {
  std::string model = "mlp";
  std::string hidden = "1024,1024,1024,1024,1024,1024,1024,1024";
  std::string strategies = "zero1,zero2,zero3";
  std::string ranks = "1,2,4,8";
  std::string precisions = "bf16";
  int steps = bench::MemoryBenchOptions{}.steps;
  int batch = bench::MemoryBenchOptions{}.batch;
  int64_t min_weight_size = bench::MemoryBenchOptions{}.min_weight_size;
};

int run_bench_memory(const MemoryBenchFlags& f) {
  bench::MemoryBenchOptions o;
  o.hidden.clear();
  for (int64_t h : parse_int_list(f.hidden, "--hidden", 1, 1 << 20, "1024,1024")) o.hidden.push_back(static_cast<int>(h));
  o.strategies.clear();
  for (const std::string_view s : split(f.strategies)) {
    (void)layout::parse_fsdp_mode(s);  // fail before running
    o.strategies.emplace_back(s);
  }
  o.ranks.clear();
  for (int64_t r : parse_int_list(f.ranks, "--ranks", 1, 4096, "1,2,4,8")) o.ranks.push_back(static_cast<int>(r));
  o.precisions.clear();
  for (const auto& p : split(f.precisions)) o.precisions.push_back(layout::parse_precision(trim(p), "--precision"));
  o.steps = f.steps;
  o.batch = f.batch;
  o.min_weight_size = f.min_weight_size;
  if (o.hidden.empty() || o.strategies.empty() || o.ranks.empty() || o.precisions.empty() || o.steps < 1 ||
      o.batch < 1)
    throw InvalidArgument("meshtrain bench memory", "an empty list, or steps / batch below 1",
                          "give at least one value per list and positive --steps and --batch");
  print_config("bench memory", {{"model", f.model},
                                {"hidden", f.hidden},
                                {"strategy", f.strategies},
                                {"ranks", f.ranks},
                                {"precision", f.precisions},
                                {"steps", std::to_string(f.steps)},
                                {"batch", std::to_string(f.batch)},
                                {"min_weight_size", std::to_string(f.min_weight_size)}});
  fmt::print("{}", bench::format_memory_bench(bench::run_memory_bench(o), o));
  return 0;
}

struct ExportFlags {
  std::string run_dir, out;
  int64_t step = -1;
};

int run_export(const ExportFlags& f) {
  print_config("export", {{"run_dir", f.run_dir}, {"out", f.out}, {"step", f.step < 0 ? "newest" : std::to_string(f.step)}});
  fmt::print("wrote {}\n", train::export_model(f.run_dir, f.out,
                                                f.step < 0 ? std::nullopt : std::optional<int64_t>(f.step)));
  return 0;
}

struct ChecksumFlags {
  std::string a, b;
};

// A run directory or its metrics.jsonl.
std::string metrics_file(const std::string& path) {
  return std::filesystem::is_directory(path) ? (std::filesystem::path(path) / "metrics.jsonl").string() : path;
}

int run_checksums(const ChecksumFlags& f) {
  const auto a = train::read_checksums(metrics_file(f.a)), b = train::read_checksums(metrics_file(f.b));
  const train::ChecksumComparison c = train::compare_checksums(a, b);
  if (c.compared == 0)
    throw InvalidArgument("meshtrain checksums",
                          fmt::format("no step has a checksum in both runs ({} has {}, {} has {})", f.a, a.size(), f.b,
                                      b.size()),
                          "train both with --checksum-every N (the same N)");
  if (c.first_difference) {
    fmt::print("the runs differ at step {} (the first of {} compared steps from {}): {} in {}, {} in {}\n",
               *c.first_difference, c.compared, c.first_step, c.a, f.a, c.b, f.b);
    return 1;
  }
  fmt::print("identical: {} checksums, steps {} to {}\n", c.compared, c.first_step, c.last_step);
  return 0;
}

struct GenerateFlags {
  std::string run_dir;
  train::SampleOptions sample;
  bool seed_given = false;
};

// The run's config.toml names the model; its seed is the draws' seed unless
// --seed is given, so the defaults reproduce the run's sample.txt.
int run_generate(GenerateFlags& f) {
  const std::string config = (std::filesystem::path(f.run_dir) / "config.toml").string();
  if (!std::filesystem::exists(config))
    throw IoError("--run-dir", fmt::format("{} does not exist", config),
                  "give the directory of a finished run (meshtrain train --run-dir ...)");
  const train::TrainConfig tc = train::TrainConfig::from_toml_file(config);
  if (!f.seed_given) f.sample.seed = tc.seed;
  print_config("generate", {{"run_dir", f.run_dir},
                            {"model", fmt::format("gpt {} layers x {} width, {} heads, vocab {}, context {}", tc.layers,
                                                  tc.width, tc.heads, tc.vocab, tc.context)},
                            {"prompt", fmt::format("\"{}\"", f.sample.prompt)},
                            {"tokens", std::to_string(f.sample.tokens)},
                            {"temperature", fmt::format("{}", f.sample.temperature)},
                            {"top_k", std::to_string(f.sample.top_k)},
                            {"seed", std::to_string(f.sample.seed)}});
  train::LoadedGpt run = train::load_gpt_run(f.run_dir, tc);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string text = train::generate_text(*run.model, run.tokenizer, f.sample);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("{}\n", text);
  fmt::print("({} tokens in {:.2f} s, {:.0f} tokens/s)\n", f.sample.tokens, s, f.sample.tokens / s);
  return 0;
}

}  // namespace

std::vector<Command> add_train_commands(CLI::App& app) {
  std::vector<Command> out;
  auto bo = std::make_shared<bench::TrainBenchOptions>();
  CLI::App* bench_cmd = app.get_subcommand("bench");
  auto* tb = bench_cmd->add_subcommand(
      "train", "MLP step time, its GEMMs alone, data-parallel scaling 1 -> 2 ranks, fully sharded strategies on 2 ranks");
  tb->add_option("--steps", bo->steps, "timed steps (1 to 100000)")->capture_default_str()->check(CLI::Range(1, 100000));
  tb->add_option("--batch", bo->batch, "batch per rank (1 to 65536)")->capture_default_str()->check(CLI::Range(1, 65536));
  tb->add_flag("!--no-sharded", bo->sharded, "skip the fully sharded strategies");
  tb->add_flag("--deterministic", bo->deterministic,
               "also time the fp32 step in the deterministic mode (docs/determinism.md), interleaved with the others");
  tb->add_option("--bucket-mb", bo->bucket_mb, "data-parallel gradient bucket size in MiB, (0, 1024]")
      ->capture_default_str()
      ->check(CLI::Range(1e-6, 1024.0));
  auto tb_engine = std::make_shared<std::string>("threads");
  tb->add_option("--engine", *tb_engine,
                 "threads (everything) | mpi (under mpirun: data parallelism on the mpirun world only)")
      ->check(CLI::IsMember({"threads", "mpi"}))
      ->capture_default_str();
  out.push_back({tb, [=] {
                   auto banner = [&] {
                     print_config("bench train", {{"engine", *tb_engine}, {"steps", std::to_string(bo->steps)},
                                                  {"batch", std::to_string(bo->batch)},
                                                  {"bucket_mb", fmt::format("{}", bo->bucket_mb)}});
                   };
                   if (*tb_engine == "mpi") {
                     const bench::DataParallelRun r = bench::run_train_bench_mpi(*bo);
                     if (r.ranks == 0) return 0;  // not rank 0
                     banner();
                     fmt::print("{}", bench::format_train_bench_mpi(r, *bo));
                     return 0;
                   }
                   banner();
                   fmt::print("{}", bench::format_train_bench(bench::run_train_bench(*bo), *bo));
                   return 0;
                 }});

  auto go = std::make_shared<bench::GemmBenchOptions>();
  auto* gb = bench_cmd->add_subcommand(
      "gemm",
      "the MLP's and a GPT-2 124M step's GEMMs (forward, input and weight gradients) on OpenBLAS f32, oneDNN f32 "
      "and oneDNN bf16: GFLOP/s against the core's FMA peak measured in the same run");
  gb->add_option("--sets", go->sets, "comma list of mlp (784-512-512-10), gpt (GPT-2 124M block and head)")
      ->delimiter(',')
      ->check(CLI::IsMember({"mlp", "gpt"}))
      ->capture_default_str();
  gb->add_option("--m", go->m, "rows: MLP batch / GPT tokens per step (1 to 65536)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  gb->add_option("--reps", go->reps, "timed rounds, each GEMM once per round (median; 1 to 10000)")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  gb->add_option("--threads", go->threads, "GEMM threads (set_blas_threads) and peak-loop threads (1 to 1024)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  gb->add_option("--vocab", go->vocab, "the GPT head's vocabulary (1 to 1000000)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1000000}));
  out.push_back({gb, [=] {
                   print_config("bench gemm", {{"sets", fmt::format("{}", fmt::join(go->sets, ","))},
                                               {"m", std::to_string(go->m)},
                                               {"reps", std::to_string(go->reps)},
                                               {"threads", std::to_string(go->threads)},
                                               {"vocab", std::to_string(go->vocab)}});
                   fmt::print("{}", bench::format_gemm_bench(bench::run_gemm_bench(*go), *go));
                   return 0;
                 }});

  auto fo = std::make_shared<bench::FusionBenchOptions>();
  auto* fb = bench_cmd->add_subcommand(
      "fusions",
      "oneDNN's fused post-ops (bias, GELU, residual add in the GEMM), layer normalization and log-softmax against "
      "meshtrain's own kernels on a GPT-2 step's shapes: time and the largest difference");
  fb->add_option("--rows", fo->rows, "tokens per step (1 to 65536)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  fb->add_option("--width", fo->width, "model width C; the MLP is C -> 4C -> C (1 to 16384)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{16384}));
  fb->add_option("--vocab", fo->vocab, "log-softmax columns (1 to 1000000)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1000000}));
  fb->add_option("--threads", fo->threads, "threads of both sides (1 to 1024)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  fb->add_option("--reps", fo->reps, "timed runs per kernel (median; 1 to 10000)")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  out.push_back({fb, [=] {
                   print_config("bench fusions", {{"rows", std::to_string(fo->rows)},
                                                  {"width", std::to_string(fo->width)},
                                                  {"vocab", std::to_string(fo->vocab)},
                                                  {"threads", std::to_string(fo->threads)},
                                                  {"reps", std::to_string(fo->reps)}});
                   fmt::print("{}", bench::format_fusion_bench(bench::run_fusion_bench(*fo), *fo));
                   return 0;
                 }});

  auto co = std::make_shared<bench::CheckpointBenchOptions>();
  auto* cb = bench_cmd->add_subcommand(
      "checkpoint",
      "sharded checkpoint save and load throughput (GPT-2 124M, zero3, AdamW) beside the disk's sequential write "
      "and read rates measured in the same run");
  cb->add_option("--ranks", co->ranks, "ranks of the threads engine (1 to 64)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cb->add_option("--layers", co->layers, "GPT layers")->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{96}));
  cb->add_option("--width", co->width, "GPT width (divisible by --heads)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{16384}));
  cb->add_option("--heads", co->heads, "attention heads")->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{256}));
  cb->add_option("--vocab", co->vocab, "vocabulary")->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1000000}));
  cb->add_option("--context", co->context, "longest sequence (rows of wpe)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1000000}));
  cb->add_option("--dir", co->dir, "where the checkpoints and the disk probe go (removed afterwards)")
      ->capture_default_str();
  cb->add_option("--reps", co->reps, "saves and loads (1 to 100)")->capture_default_str()->check(CLI::Range(1, 100));
  cb->add_flag("--drop-caches", co->drop_caches, "drop the page cache before each load and the disk read (root)");
  out.push_back({cb, [=] {
                   print_config("bench checkpoint", {{"ranks", std::to_string(co->ranks)},
                                                     {"layers", std::to_string(co->layers)},
                                                     {"width", std::to_string(co->width)},
                                                     {"vocab", std::to_string(co->vocab)},
                                                     {"dir", co->dir},
                                                     {"reps", std::to_string(co->reps)},
                                                     {"drop_caches", co->drop_caches ? "true" : "false"}});
                   fmt::print("{}", bench::format_checkpoint_bench(bench::run_checkpoint_bench(*co), *co));
                   return 0;
                 }});

  auto moe = std::make_shared<bench::MoeBenchOptions>();
  auto* moeb = bench_cmd->add_subcommand(
      "moe",
      "a mixture-of-experts GPT: tokens/s of expert=N against data=N on the same model, and the all-to-all's "
      "share of the step");
  moeb->add_option("--layers", moe->layers, "blocks (1 to 64)")->capture_default_str()->check(CLI::Range(1, 64));
  moeb->add_option("--width", moe->width, "model width (heads x 16 to 4096)")
      ->capture_default_str()
      ->check(CLI::Range(16, 4096));
  moeb->add_option("--heads", moe->heads, "attention heads (1 to 64)")->capture_default_str()->check(CLI::Range(1, 64));
  moeb->add_option("--kv-heads", moe->kv_heads, "key/value heads, dividing --heads")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  moeb->add_option("--experts", moe->experts, "routed experts per layer (2 to 256)")
      ->capture_default_str()
      ->check(CLI::Range(2, 256));
  moeb->add_option("--top-k", moe->top_k, "experts per token (1 to --experts)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  moeb->add_option("--expert-hidden", moe->expert_hidden, "each expert's hidden width (1 to 16384)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{16384}));
  moeb->add_option("--capacity-factor", moe->capacity_factor, "token dropping (0: none)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 64.0));
  moeb->add_option("--context", moe->context, "tokens per sample (2 to 4096)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{4096}));
  moeb->add_option("--batch", moe->batch, "global batch (divisible by --ranks)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  moeb->add_option("--ranks", moe->ranks, "ranks of the data=N and expert=N meshes (2 to 64, dividing --experts)")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  moeb->add_option("--steps", moe->steps, "measured steps (1 to 1000)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  moeb->add_option("--threads", moe->threads, "GEMM threads in all (1 to 1024)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  out.push_back({moeb, [=] {
                   if (moe->heads % moe->kv_heads != 0 || moe->width % moe->heads != 0 || moe->top_k > moe->experts)
                     throw InvalidArgument("bench moe",
                                           fmt::format("--heads {}, --kv-heads {}, --width {}, --top-k {} of {}",
                                                       moe->heads, moe->kv_heads, moe->width, moe->top_k,
                                                       moe->experts),
                                           "kv-heads must divide heads, heads width, top-k at most --experts");
                   print_config("bench moe",
                                {{"layers", std::to_string(moe->layers)},
                                 {"width", std::to_string(moe->width)},
                                 {"experts", std::to_string(moe->experts)},
                                 {"top_k", std::to_string(moe->top_k)},
                                 {"expert_hidden", std::to_string(moe->expert_hidden)},
                                 {"capacity_factor", fmt::format("{}", moe->capacity_factor)},
                                 {"batch", std::to_string(moe->batch)},
                                 {"context", std::to_string(moe->context)},
                                 {"ranks", std::to_string(moe->ranks)},
                                 {"steps", std::to_string(moe->steps)},
                                 {"threads", std::to_string(moe->threads)}});
                   fmt::print("{}", bench::format_moe_bench(bench::run_moe_bench(*moe), *moe));
                   return 0;
                 }});

  auto zo = std::make_shared<bench::ZeroppBenchOptions>();
  auto* zb = bench_cmd->add_subcommand(
      "zeropp",
      "ZeRO++ (qwZ, qgZ) against ZeRO-3 on simulated nodes: bytes each rank receives per step from other nodes and "
      "its own, beside the paper's formula, and the step time");
  zb->add_option("--nodes", zo->nodes, "simulated nodes K (1 to 64)")->capture_default_str()->check(CLI::Range(1, 64));
  zb->add_option("--ranks-per-node", zo->ranks_per_node, "ranks per node L (1 to 64)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  zb->add_option("--hidden", zo->hidden, "MLP hidden sizes (784 -> hidden -> 10)")->delimiter(',')->capture_default_str();
  zb->add_option("--batch", zo->batch, "samples per rank per step (1 to 65536)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  zb->add_option("--steps", zo->steps, "measured steps after one warm-up (1 to 1000)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  zb->add_option("--bits", zo->bits, "code width: 8 or 4")->capture_default_str()->check(CLI::IsMember({8, 4}));
  zb->add_option("--block", zo->block, "values per f32 scale (2 to 65536; even for 4 bits)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{65536}));
  out.push_back({zb, [=] {
                   print_config("bench zeropp", {{"nodes", std::to_string(zo->nodes)},
                                                 {"ranks_per_node", std::to_string(zo->ranks_per_node)},
                                                 {"hidden", fmt::format("{}", fmt::join(zo->hidden, ","))},
                                                 {"batch", std::to_string(zo->batch)},
                                                 {"steps", std::to_string(zo->steps)},
                                                 {"bits", std::to_string(zo->bits)},
                                                 {"block", std::to_string(zo->block)}});
                   fmt::print("{}", bench::format_zeropp_bench(bench::run_zeropp_bench(*zo), *zo));
                   return 0;
                 }});

  auto mo = std::make_shared<MemoryBenchFlags>();
  auto* mb = bench_cmd->add_subcommand(
      "memory", "memory per rank of zero1/zero2/zero3/no_shard training against the ZeRO formulas");
  mb->add_option("--model", mo->model, "model (mlp)")->check(CLI::IsMember({"mlp"}))->capture_default_str();
  mb->add_option("--hidden", mo->hidden, "MLP hidden sizes (784 -> hidden -> 10)")->capture_default_str();
  mb->add_option("--strategy", mo->strategies, "comma list of zero1, zero2, zero3, no_shard (or full, shard_grad_op)")
      ->capture_default_str();
  mb->add_option("--ranks", mo->ranks, "comma list of rank counts (threads engine)")->capture_default_str();
  mb->add_option("--precision", mo->precisions, "comma list of bf16, fp32, fp16 (parameter and gradient dtype)")
      ->capture_default_str();
  mb->add_option("--steps", mo->steps, "training steps measured (after one warm-up step), 1 to 100000")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  mb->add_option("--batch", mo->batch, "samples per rank per step (1 to 65536)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  mb->add_option("--min-weight-size", mo->min_weight_size, "smaller parameters stay replicated")
      ->capture_default_str();
  out.push_back({mb, [=] { return run_bench_memory(*mo); }});

  auto ao = std::make_shared<bench::AttentionBenchOptions>();
  auto* ab = bench_cmd->add_subcommand(
      "attention", "the blockwise attention kernel (forward, backward) against the plain reference: time and memory");
  ab->add_option("--lengths", ao->lengths, "comma list of sequence lengths")->delimiter(',')->capture_default_str();
  ab->add_option("--heads", ao->heads, "heads (batch x heads sequences)")->capture_default_str()->check(CLI::Range(1, 4096));
  ab->add_option("--head-dim", ao->head_dim, "head dimension")->capture_default_str()->check(CLI::Range(1, 4096));
  ab->add_option("--batch", ao->batch, "batch")->capture_default_str()->check(CLI::Range(1, 4096));
  ab->add_option("--reps", ao->reps, "timed runs per kernel (median)")->capture_default_str()->check(CLI::Range(1, 10000));
  ab->add_flag("--causal,!--full", ao->causal, "causal mask (default) or full attention");
  out.push_back({ab, [=] {
                   for (int64_t t : ao->lengths)
                     if (t < 1 || t > (1 << 16))
                       throw InvalidArgument("--lengths", fmt::format("length {}", t), "use lengths from 1 to 65536");
                   print_config("bench attention", {{"lengths", fmt::format("{}", fmt::join(ao->lengths, ","))},
                                                    {"heads", std::to_string(ao->heads)},
                                                    {"head_dim", std::to_string(ao->head_dim)}});
                   fmt::print("{}", bench::format_attention_bench(bench::run_attention_bench(*ao), *ao));
                   return 0;
                 }});

  auto po = std::make_shared<bench::PipelineBenchOptions>();
  auto* pb = bench_cmd->add_subcommand(
      "pipeline", "pipeline schedules (gpipe, 1f1b, interleaved, zb) on stages of equal cost: the measured bubble "
                  "beside the theory, with Chrome-trace and SVG timelines (--out)");
  pb->add_option("--ranks", po->ranks, "pipeline ranks (threads engine)")->capture_default_str()->check(CLI::Range(1, 64));
  pb->add_option("--micro-batches", po->micro_batches, "micro-batches per step")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  pb->add_option("--virtual-stages", po->virtual_stages, "chunks per rank for interleaved")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  pb->add_option("--schedules", po->schedules, "comma list of gpipe, 1f1b, interleaved, zb")
      ->delimiter(',')
      ->capture_default_str();
  pb->add_option("--blocks-per-stage", po->blocks_per_stage, "GPT blocks per stage")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  pb->add_option("--width", po->width, "block width")->capture_default_str()->check(CLI::Range(1, 65536));
  pb->add_option("--heads", po->heads, "attention heads")->capture_default_str()->check(CLI::Range(1, 1024));
  pb->add_option("--context", po->context, "tokens per sequence")->capture_default_str()->check(CLI::Range(1, 65536));
  pb->add_option("--rows", po->rows, "sequences per micro-batch")->capture_default_str()->check(CLI::Range(1, 65536));
  pb->add_option("--steps", po->steps, "timed steps (median)")->capture_default_str()->check(CLI::Range(1, 10000));
  pb->add_option("--warmup", po->warmup, "untimed steps first")->capture_default_str()->check(CLI::Range(0, 10000));
  pb->add_option("--out", po->out_dir, "write each schedule's timeline here (pipeline_<name>.json and .svg)");
  out.push_back({pb, [=] {
                   print_config("bench pipeline", {{"ranks", std::to_string(po->ranks)},
                                                   {"micro_batches", std::to_string(po->micro_batches)},
                                                   {"schedules", fmt::format("{}", fmt::join(po->schedules, ","))},
                                                   {"out", po->out_dir.empty() ? "-" : po->out_dir}});
                   fmt::print("{}", bench::format_pipeline_bench(bench::run_pipeline_bench(*po), *po));
                   return 0;
                 }});

  auto gpt_opts = std::make_shared<bench::GptBenchOptions>();
  gpt_opts->torch_script = MESHTRAIN_TORCH_GPT_SCRIPT;
  auto* gpt_cmd = bench_cmd->add_subcommand(
      "gpt", "GPT training step (default: GPT-2 124M, T = 64, batch 4, fp32, AdamW): time, tokens/s, GFLOP/s beside "
             "the sgemm rate, PyTorch's step in the same run, and where the time goes per kernel; with --mesh, "
             "the step on tensor- and data-parallel ranks and its communication share");
  gpt_cmd->add_option("--layers", gpt_opts->layers, "transformer blocks")->capture_default_str()->check(CLI::Range(1, 1024));
  gpt_cmd->add_option("--heads", gpt_opts->heads, "attention heads")->capture_default_str()->check(CLI::Range(1, 1024));
  gpt_cmd->add_option("--width", gpt_opts->width, "model width (divisible by --heads)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  gpt_cmd->add_option("--vocab", gpt_opts->vocab, "vocabulary")->capture_default_str()->check(CLI::Range(2, 1 << 22));
  gpt_cmd->add_option("--context", gpt_opts->context, "tokens per sample T")->capture_default_str()->check(CLI::Range(1, 65536));
  gpt_cmd->add_option("--batch", gpt_opts->batch, "samples per step (with --mesh, split over a data axis)")->capture_default_str()->check(CLI::Range(1, 65536));
  gpt_cmd->add_option("--steps", gpt_opts->steps, "timed steps (median)")->capture_default_str()->check(CLI::Range(1, 100000));
  gpt_cmd->add_option("--warmup", gpt_opts->warmup, "untimed steps first")->capture_default_str()->check(CLI::Range(0, 1000));
  auto gpt_precisions = std::make_shared<std::vector<std::string>>(std::vector<std::string>{"fp32"});
  gpt_cmd->add_option("--precision", *gpt_precisions, "fp32 and/or bf16 (comma-separated: both in one run)")
      ->delimiter(',')
      ->capture_default_str();
  gpt_cmd->add_option("--threads", gpt_opts->threads, "BLAS threads (and PyTorch's); with --mesh, split over the ranks")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  gpt_cmd->add_option("--torch-script", gpt_opts->torch_script,
                 "the PyTorch peer run with /usr/bin/python3 (needs Debian's python3-torch)")
      ->capture_default_str();
  gpt_cmd->add_flag_callback("--no-torch", [gpt_opts] { gpt_opts->torch_script.clear(); }, "skip the PyTorch peer");
  auto gpt_meshes = std::make_shared<std::vector<std::string>>();
  gpt_cmd->add_option("--mesh", *gpt_meshes,
                      "run the step on a mesh of threads-engine ranks sharing --threads: none (one rank), tensor=N "
                      "(tensor parallelism), data=N (data parallelism over --batch), context=N (the sequence split: "
                      "ring attention; +a2a: all_to_all), or several (data=2,tensor=2); +sp after a tensor axis adds "
                      "sequence parallelism (tensor=2+sp), +overlap its communication overlap (tensor=2+sp+overlap, "
                      "tensor=2+overlap). Several meshes (--mesh none --mesh data=2 --mesh "
                      "tensor=2, or --mesh none data=2 tensor=2) are compared in one table: step time, tokens/s, the "
                      "share of the step in tensor- and context-parallel communication and in the data-parallel "
                      "gradient wait, parameter and activation memory per rank. Default: one rank, no table");
  gpt_cmd->add_option("--time-budget", gpt_opts->time_budget_s,
                      "seconds the whole benchmark may take: later runs are skipped and PyTorch's peer is stopped at "
                      "it, saying so (0: no limit)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  auto gpt_gemm = std::make_shared<std::vector<std::string>>();
  gpt_cmd->add_option("--gemm", *gpt_gemm,
                      "GEMM backend policies to run side by side (comma list of auto, onednn, openblas, fixed; "
                      "default: the process's, MESHTRAIN_GEMM_BACKEND or auto)")
      ->delimiter(',');
  gpt_cmd->add_flag("--deterministic", gpt_opts->deterministic,
                    "also time each fp32 run on a data-only mesh in the deterministic mode (docs/determinism.md)");
  auto gpt_sequence_parallel = std::make_shared<bool>(false);
  gpt_cmd->add_flag("--sequence-parallel", *gpt_sequence_parallel,
                    "sequence parallelism on every --mesh with a tensor axis (as +sp)");
  out.push_back({gpt_cmd, [=] {
                   if (gpt_opts->width % gpt_opts->heads != 0)
                     throw InvalidArgument("--width", fmt::format("width {} with {} heads", gpt_opts->width, gpt_opts->heads),
                                           "use a width divisible by --heads");
                   if (*gpt_sequence_parallel && gpt_meshes->empty())
                     throw InvalidArgument("--sequence-parallel", "no --mesh",
                                           "add a mesh with a tensor axis, e.g. --mesh tensor=2");
                   gpt_opts->precisions.clear();
                   for (const std::string& p : *gpt_precisions)
                     gpt_opts->precisions.push_back(layout::parse_precision(p, "--precision"));
                   gpt_opts->gemm_policies.clear();
                   for (const std::string& p : *gpt_gemm)
                     gpt_opts->gemm_policies.push_back(parse_gemm_policy(p, "--gemm"));
                   gpt_opts->meshes.clear();
                   for (const std::string& spec : *gpt_meshes) {
                     bench::GptBenchMesh m = bench::parse_gpt_bench_mesh(spec);
                     m.sequence_parallel = m.sequence_parallel || (*gpt_sequence_parallel && m.tensor > 1);
                     gpt_opts->meshes.push_back(m);
                   }
                   std::vector<std::string> mesh_names;
                   for (const bench::GptBenchMesh& m : gpt_opts->meshes) mesh_names.push_back(m.name());
                   print_config("bench gpt",
                                {{"layers", std::to_string(gpt_opts->layers)}, {"heads", std::to_string(gpt_opts->heads)},
                                 {"width", std::to_string(gpt_opts->width)}, {"vocab", std::to_string(gpt_opts->vocab)},
                                 {"context", std::to_string(gpt_opts->context)}, {"batch", std::to_string(gpt_opts->batch)},
                                 {"steps", std::to_string(gpt_opts->steps)}, {"threads", std::to_string(gpt_opts->threads)},
                                 {"time_budget", fmt::format("{:g} s", gpt_opts->time_budget_s)},
                                 {"precision", fmt::format("{}", fmt::join(*gpt_precisions, ","))},
                                 {"gemm", gpt_gemm->empty() ? std::string(gemm_policy_name(gemm_policy()))
                                                            : fmt::format("{}", fmt::join(*gpt_gemm, ","))},
                                 {"mesh", mesh_names.empty() ? "none" : fmt::format("{}", fmt::join(mesh_names, " "))},
                                 {"torch_script", gpt_opts->torch_script.empty() ? "none" : gpt_opts->torch_script}});
                   fmt::print("{}", bench::format_gpt_bench(bench::run_gpt_bench(*gpt_opts), *gpt_opts));
                   return 0;
                 }});

  auto g = std::make_shared<GenerateFlags>();
  auto* gen = app.add_subcommand("generate", "continue a prompt with a GPT trained by meshtrain train (a run directory)");
  gen->add_option("--run-dir", g->run_dir, "the run directory (config.toml, model.safetensors, tokenizer.model)")
      ->required();
  gen->add_option("--prompt", g->sample.prompt, "the text to continue")->capture_default_str();
  gen->add_option("--tokens", g->sample.tokens, "new tokens to generate")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  gen->add_option("--temperature", g->sample.temperature, "softmax temperature (0: always the most likely token)")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  gen->add_option("--top-k", g->sample.top_k, "draw among the k most likely tokens (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  gen->add_option("--seed", g->sample.seed, "seed of the draws (default: the run's, which reproduces sample.txt)")
      ->each([g](const std::string&) { g->seed_given = true; });
  out.push_back({gen, [=] { return run_generate(*g); }});

  auto k = std::make_shared<ChecksumFlags>();
  auto* sums = app.add_subcommand("checksums",
                                  "compare two runs' parameter checksums (--checksum-every): the first step where "
                                  "they differ, or that they are identical (exit 1 when they differ)");
  sums->add_option("a", k->a, "a run directory (or its metrics.jsonl)")->required();
  sums->add_option("b", k->b, "the other run")->required();
  out.push_back({sums, [=] { return run_checksums(*k); }});

  auto e = std::make_shared<ExportFlags>();
  auto* exp = app.add_subcommand("export",
                                 "write a run's model (its newest checkpoint, or model.safetensors) as one safetensors "
                                 "file in PyTorch's names and layout (docs/checkpoints.md); --init-from reads it back");
  exp->add_option("--run-dir", e->run_dir, "the run directory (an interrupted run's too)")->required();
  exp->add_option("--out", e->out, "the safetensors file to write")->required();
  exp->add_option("--step", e->step, "the checkpoint of this step (default: the newest)")
      ->check(CLI::NonNegativeNumber);
  out.push_back({exp, [=] { return run_export(*e); }});

  auto f = std::make_shared<TrainFlags>();
  auto* cmd = app.add_subcommand(
      "train", "train a model recipe (mlp, vae on Fashion-MNIST), data parallel (or fully sharded: --fsdp) over the mesh");
  f->app = cmd;
  cmd->add_option("--config", f->config, "TOML file with [train] and [distributed] sections (examples/*.toml)");
  cmd->add_option("--engine", f->engine,
                  fmt::format("{} (threads by default; mpi under mpirun; gloo under meshtrain launch or torchrun)",
                              fmt::join(comm::engines().names(), " | ")))
      ->check(CLI::IsMember(comm::engines().names()));
  cmd->add_option("--devices", f->devices,
                  fmt::format("simulated devices (threads engine, 1 to {})", comm::kMaxThreadsRanks));
  cmd->add_option("--mesh", f->mesh,
                  "device mesh over data, fsdp, context, tensor and pipeline axes, e.g. data=4, data=2,fsdp=2, "
                  "data=2,tensor=2, context=2 (the GPT's sequence split: --cp-comm) or data=2,pipeline=2 "
                  "(threads engine: sets the number of devices unless --devices is given)");
  cmd->add_option("--mixed-precision", f->mixed_precision,
                  "no | bf16 | fp16: parameters gathered and computed from that dtype, gradients reduced in it "
                  "(fp16 adds dynamic loss scaling); without --fsdp it runs as --fsdp no_shard")
      ->check(one_of(layout::kMixedPrecisionNames));
  cmd->add_option("--precision", f->precision, "fp32 | bf16 | fp16: the same as --mixed-precision (fp32 = no)")
      ->check(one_of(layout::kPrecisionNames));
  cmd->add_option("--timeout", f->timeout, std::string(kTimeoutHelp))->capture_default_str();
  const train::TrainConfig defaults;
  for (const auto& field : train::train_config_fields()) {
    const std::string key(field.key);
    // --seq-len: what context parallelism's users call the sequence length.
    const std::string names = key == "context" ? std::string(field.flag) + ",--seq-len" : std::string(field.flag);
    CLI::Option* o = cmd->add_option(names, f->values[key],
                                     fmt::format("{} (default {})", field.help,
                                                 field.format(defaults).empty() ? "\"\"" : field.format(defaults)));
    if (field.kind == train::TrainFieldKind::boolean) o->expected(0, 1);  // --overwrite alone means true
  }
  out.push_back({cmd, [=] { return run_train(*f); }});
  return out;
}

}  // namespace meshtrain::cli
