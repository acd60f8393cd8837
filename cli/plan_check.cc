#include "cli/plan_check.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/attention_bench.h"
#include "meshtrain/comm/launch.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/matmul.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/random.h"
#include "meshtrain/core/tensor.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/plan/mesh_planning.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kOp = "meshtrain plan --check";
constexpr double kMemoryTolerance = 0.05;  // issue 18's acceptance

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Seconds of `fn`, median of `reps` after one warm-up.
template <typename F>
double time_median(int reps, F&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(t);
}

// The trainer prints its progress; the check prints its own table.
class Quiet {
 public:
  Quiet() {
    std::fflush(stdout);
    std::fflush(stderr);
    saved_out_ = dup(1);
    saved_err_ = dup(2);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    close(null);
  }
  ~Quiet() {
    std::fflush(stdout);
    std::fflush(stderr);
    dup2(saved_out_, 1);
    dup2(saved_err_, 2);
    close(saved_out_);
    close(saved_err_);
  }
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;

 private:
  int saved_out_, saved_err_;
};

// One layout of the check.
struct Layout {
  std::string mesh = "";  // "" = one device
  std::string fsdp = "";
  bool sequence_parallel = false;
  int micro_batches = 1;
  std::string name() const {
    return (mesh.empty() ? "one device" : mesh) + (fsdp.empty() ? "" : " " + fsdp) +
           (sequence_parallel ? " sp" : "") + (micro_batches > 1 ? fmt::format(" m={}", micro_batches) : "");
  }
};

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> kLayouts = {
      {""},
      {"data=2"},
      {"data=2", "zero1"},
      {"data=2", "zero2"},
      {"fsdp=2", "zero3"},
      {"tensor=2"},
      {"tensor=2", "", true},
      {"pipeline=2", "", false, 4},
      {"context=2"},
      {"pipeline=2,data=2,tensor=2", "", false, 2},
      {"expert=2"},  // models with experts (--experts) only
      {"fsdp=2,expert=2", "zero3"},
  };
  return kLayouts;
}

struct Measured {
  double step = 0;    // seconds, median of the timed steps
  double memory = 0;  // the largest rank's peak, bytes
  plan::TrainingLayout layout;
};

Measured train_layout(const CheckOptions& o, const Layout& x, int threads_per_rank = 0) {
  train::TrainConfig tc;
  tc.model = "gpt";
  tc.corpus = o.corpus;
  tc.text_cache = o.text_cache;
  tc.vocab = static_cast<int>(o.shape.vocab);
  tc.context = static_cast<int>(o.shape.seq);
  tc.layers = static_cast<int>(o.shape.layers);
  tc.heads = static_cast<int>(o.shape.heads);
  tc.width = static_cast<int>(o.shape.width);
  tc.arch = o.shape.arch;
  tc.kv_heads = o.shape.kv_heads;
  tc.ffn_hidden = o.shape.ffn_hidden;
  tc.moe = o.shape.moe;
  tc.dropout = 0;
  tc.batch_size = static_cast<int>(o.batch);
  tc.micro_batches = x.micro_batches;
  tc.sequence_parallel = x.sequence_parallel;
  tc.max_steps = o.steps;
  tc.epochs = 1;
  tc.log_every = 1;  // every step's MoE load in metrics.jsonl (expert layouts)
  tc.threads_per_rank = threads_per_rank;
  tc.run_dir = (std::filesystem::temp_directory_path() / "meshtrain_plan_check").string();
  tc.overwrite = true;
  tc.set("fsdp", x.fsdp, "the check's layout");
  config::DistributedConfig dc;
  const mesh::NamedShape mesh =
      x.mesh.empty() ? mesh::NamedShape{{1}, {std::string(mesh::kData)}} : mesh::parse_mesh_spec(x.mesh);
  dc.world_size = 1;
  for (int s : mesh.shape) dc.world_size *= s;
  dc.num_processes_per_node = dc.world_size;
  dc.set_mesh(mesh);
  // Resolved once: the run and the planner read the same layout.
  const train::ResolvedTraining resolved = train::resolve_training(tc, dc);
  train::TrainResult r;
  {
    Quiet quiet;
    r = train::run_training(resolved, dc, {.engine = comm::Engine::threads, .ranks = dc.world_size});
  }
  Measured m;
  std::vector<double> timed(r.step_seconds.begin() + std::min<size_t>(2, r.step_seconds.size()), r.step_seconds.end());
  m.step = median(timed);
  for (const auto& peaks : r.train_memory_by_rank) m.memory = std::max(m.memory, static_cast<double>(peaks.back()));
  m.layout = {.batch = o.batch, .bucket_bytes = tc.bucket_mb * (1 << 20)};
  m.layout.set_layout(resolved.layout);
  // Over an expert axis the run's routing: from each step's expert shares
  // (metrics.jsonl, summed over the MoE layers) the fullest expert rank's
  // rows over the even share, the most uneven step's.
  if (const int p = m.layout.expert; p > 1) {
    std::ifstream metrics(tc.run_dir + "/metrics.jsonl");
    const int experts = o.shape.moe.experts, local = experts / p;
    for (std::string line; std::getline(metrics, line);) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_object() || !j.contains("moe_expert_0_share")) continue;
      for (int r = 0; r < p; ++r) {
        double share = 0;
        for (int e = r * local; e < (r + 1) * local; ++e)
          share += j[fmt::format("moe_expert_{}_share", e)].get<double>();
        m.layout.expert_imbalance = std::max(m.layout.expert_imbalance, share * p);
      }
    }
  }
  return m;
}

// time = flops / rate + overhead / rate, fitted by least squares.
std::pair<double, double> fit_line(const std::vector<std::pair<double, double>>& xy) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = static_cast<double>(xy.size());
  for (auto [x, y] : xy) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  return {slope, (sy - slope * sx) / n};
}

// The three products of a linear layer of m rows, k -> n, as a training
// step runs them (x W, dy W^T, x^T dy: each on the library matmul routes it
// to, whose rates differ by layout and CPU: OpenBLAS's x^T dy ran at half
// oneDNN's x W rate on one machine and at the same rate on another), timed
// together: 3 calls of 2 m k n flops.
double linear_gemms_seconds(int64_t m, int64_t k, int64_t n) {
  Tensor x = Tensor::empty({m, k}, DType::f32), w = Tensor::empty({k, n}, DType::f32),
         y = Tensor::empty({m, n}, DType::f32), dx = Tensor::empty({m, k}, DType::f32),
         dw = Tensor::empty({k, n}, DType::f32);
  fill_normal(x, 1, 1, 0.0, 1.0);
  fill_normal(w, 1, 2, 0.0, 1.0);
  fill_normal(y, 1, 3, 0.0, 1.0);
  return time_median(9, [&] {
    matmul(x, w, y);
    matmul(y, w, dx, false, true);
    matmul(x, y, dw, true, false);
  });
}

}  // namespace

std::string hardware_json(const plan::Hardware& h) {
  nlohmann::json j = {{"name", h.name},
                      {"gemm_flops", h.gemm_flops},
                      {"gemm_flops_bf16", h.gemm_flops_bf16},
                      {"gemm_overhead_flops", h.gemm_overhead_flops},
                      {"attention_efficiency", h.attention_efficiency},
                      {"elementwise_bandwidth", h.elementwise_bandwidth},
                      {"devices_per_node", h.devices_per_node},
                      {"intra", {{"latency", h.intra.latency}, {"bandwidth", h.intra.bandwidth}}},
                      {"inter", {{"latency", h.inter.latency}, {"bandwidth", h.inter.bandwidth}}},
                      {"overlap", h.overlap},
                      {"cores", h.cores},
                      {"thread_efficiency", h.thread_efficiency},
                      {"other_thread_efficiency", h.other_thread_efficiency},
                      {"source", h.source}};
  return j.dump(2);
}

plan::Hardware load_hardware(const std::string& name) {
  const auto presets = plan::hardware_preset_names();
  if (std::find(presets.begin(), presets.end(), name) != presets.end()) return plan::hardware_preset(name);
  std::ifstream in(name);
  if (!in)
    throw InvalidArgument("meshtrain plan", fmt::format("--hardware {}: neither a preset nor a readable file", name),
                          "use A100 or H100, or a file written by meshtrain plan --calibrate FILE");
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    plan::Hardware h;
    h.name = j.at("name").get<std::string>();
    h.gemm_flops = j.at("gemm_flops");
    h.gemm_flops_bf16 = j.at("gemm_flops_bf16");
    h.gemm_overhead_flops = j.at("gemm_overhead_flops");
    h.attention_efficiency = j.at("attention_efficiency");
    h.elementwise_bandwidth = j.at("elementwise_bandwidth");
    h.devices_per_node = j.at("devices_per_node");
    h.intra = {j.at("intra").at("latency"), j.at("intra").at("bandwidth")};
    h.inter = {j.at("inter").at("latency"), j.at("inter").at("bandwidth")};
    h.overlap = j.at("overlap");
    h.cores = j.at("cores");
    h.thread_efficiency = j.at("thread_efficiency");
    h.other_thread_efficiency = j.at("other_thread_efficiency");
    h.source = j.value("source", name);
    return h;
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument("meshtrain plan", fmt::format("--hardware {}: {}", name, e.what()),
                          "write it again with meshtrain plan --calibrate FILE");
  }
}

plan::Hardware calibrate_this_machine(const CheckOptions& o) {
  plan::Hardware h;
  h.name = "this machine";
  h.cores = available_cores();
  h.devices_per_node = 1 << 20;  // one process: every group is intra-node
  h.overlap = false;             // copies and compute share the same cores
  const int previous = blas_threads();
  // GEMMs on one thread, at the shapes of the check's GPT and smaller.
  set_blas_threads(1);
  const int64_t C = o.shape.width;
  std::vector<std::pair<double, double>> xy;
  for (int64_t rows : {int64_t{64}, o.batch * o.shape.seq / 4, o.batch * o.shape.seq})
    for (auto [k, n] : {std::pair{C, C}, std::pair{C, 4 * C}, std::pair{4 * C, C}, std::pair{C, o.shape.vocab}})
      xy.emplace_back(3 * 2.0 * static_cast<double>(rows * k * n), linear_gemms_seconds(rows, k, n));
  const auto [slope, intercept] = fit_line(xy);
  h.gemm_flops = 1 / slope;
  h.gemm_overhead_flops = std::max(0.0, intercept / slope / 3);  // per call
  const int64_t rows = o.batch * o.shape.seq;
  if (h.cores > 1) {
    set_blas_threads(h.cores);
    const double f = 3 * 2.0 * static_cast<double>(rows * C * 4 * C);
    const double all = (f + 3 * h.gemm_overhead_flops) / linear_gemms_seconds(rows, C, 4 * C);
    h.thread_efficiency = all / (h.cores * h.gemm_flops);
    set_blas_threads(1);
  }
  // Attention: forward and backward of the check's heads and length.
  bench::AttentionBenchOptions ao{.batch = std::max<int64_t>(1, o.batch / 4), .heads = o.shape.heads,
                                  .head_dim = C / o.shape.heads, .lengths = {o.shape.seq}, .causal = true, .reps = 5};
  const bench::AttentionBenchRow a = bench::run_attention_bench(ao).at(0);
  const double T = static_cast<double>(o.shape.seq);
  const double fwd = 4.0 * static_cast<double>(ao.batch * C) * T * (T + 1) / 2;
  h.attention_efficiency = 3.5 * fwd / ((a.forward_ms + a.backward_ms) / 1e3) / h.gemm_flops;
  set_blas_threads(previous);
  // The threads engine's all_reduce on 2 ranks: latency and bandwidth.
  std::vector<std::pair<double, double>> comm_xy;
  for (size_t bytes : {size_t{4} << 10, size_t{1} << 20, size_t{16} << 20}) {
    std::vector<double> seconds(2);
    comm::launch({.engine = comm::Engine::threads, .ranks = 2}, [&](comm::Communicator& c) {
      std::vector<float> buf(bytes / 4, 1.0f);
      const double s = time_median(
          9, [&] { c.all_reduce(buf.data(), buf.data(), buf.size(), DType::f32, comm::ReduceOp::sum); });
      seconds[static_cast<size_t>(c.rank())] = s;
    });
    comm_xy.emplace_back(static_cast<double>(bytes), seconds[0]);  // wire bytes = bytes at 2 ranks
  }
  const auto [per_byte, latency] = fit_line(comm_xy);
  h.intra = h.inter = {.latency = std::max(0.0, latency), .bandwidth = 1 / per_byte};
  // Elementwise: what one measured step on one device and one thread
  // leaves after the GEMMs and attention, over the bytes the model counts;
  // then the same step on every core gives the rest's thread efficiency.
  const Measured one = train_layout(o, Layout{}, 1);
  const plan::Hardware single = [&] {
    plan::Hardware s = h;
    s.cores = 1;
    s.elementwise_bandwidth = 1e9;  // any rate: only the bytes (DeviceTime::bytes) are read
    return s;
  }();
  const plan::DeviceTime d = plan::predict_time(o.shape, one.layout, single).devices.at(0);
  const double rest = one.step - d.gemm - d.attention;
  if (rest <= 0)
    throw Error(kOp,
                fmt::format("the one-device step ({:.1f} ms) is shorter than its GEMMs and attention alone "
                            "({:.1f} ms: GEMMs {:.1f} ms at {:.1f} GFLOP/s and {:.2f} MFLOP per call, attention "
                            "{:.1f} ms at {:.0f}% of that rate)",
                            one.step * 1e3, (d.gemm + d.attention) * 1e3, d.gemm * 1e3, h.gemm_flops / 1e9,
                            h.gemm_overhead_flops / 1e6, d.attention * 1e3, 100 * h.attention_efficiency),
                "run again on a quiet machine");
  h.elementwise_bandwidth = d.bytes / rest;
  double all_cores_step = one.step;
  if (h.cores > 1) {
    all_cores_step = train_layout(o, Layout{}, h.cores).step;
    // GEMMs at thread_efficiency; the rest takes what remains of the step.
    const double gemm_all = d.gemm / (h.cores * h.thread_efficiency);
    const double other = all_cores_step - gemm_all;
    h.other_thread_efficiency = std::clamp((d.attention + rest) / other / h.cores, 0.05, 1.0);
  }
  h.source = fmt::format("measured by meshtrain plan --calibrate, {} cores", h.cores);
  fmt::print("calibration ({} cores):\n", h.cores);
  fmt::print("  GEMM, one thread        {:.1f} GFLOP/s sustained, {:.2f} MFLOP per call of overhead ({} shapes)\n",
             h.gemm_flops / 1e9, h.gemm_overhead_flops / 1e6, xy.size());
  fmt::print("  GEMM, {} threads         {:.0f}% of {} x one thread\n", h.cores, 100 * h.thread_efficiency, h.cores);
  fmt::print("  attention (T = {})      {:.0f}% of the GEMM rate\n", o.shape.seq, 100 * h.attention_efficiency);
  fmt::print("  all_reduce, 2 ranks     {:.1f} us + {:.2f} GB/s\n", h.intra.latency * 1e6, h.intra.bandwidth / 1e9);
  fmt::print("  elementwise             {:.2f} GB/s, fitted to one step on one device and thread ({:.1f} ms)\n",
             h.elementwise_bandwidth / 1e9, one.step * 1e3);
  fmt::print("  the rest on {} threads   {:.0f}% of {} x one thread (that step on {} threads: {:.1f} ms)\n", h.cores,
             100 * h.other_thread_efficiency, h.cores, h.cores, all_cores_step * 1e3);
  return h;
}

int run_plan_check(const CheckOptions& o) {
  const plan::Hardware hw = calibrate_this_machine(o);
  fmt::print("\n{:<32} {:>5} {:>10} {:>10} {:>7}   {:>10} {:>10} {:>7}   {}\n", "layout", "ranks", "step ms",
             "predicted", "error", "memory MiB", "predicted", "error",
             "predicted step: compute + exposed comm + bubble");
  int missed = 0, memory_missed = 0;
  for (const Layout& x : layouts()) {
    if (!o.only.empty() && x.name().find(o.only) == std::string::npos) continue;
    Measured m;
    try {
      m = train_layout(o, x);
    } catch (const InvalidArgument& e) {  // refused at start-up for this model (an expert axis without experts, ...)
      fmt::print("{:<32} refused: {}\n", x.name(), e.detail());
      continue;
    }
    const plan::TimePrediction t = plan::predict_time(o.shape, m.layout, hw);
    const plan::MemoryPrediction mem = plan::predict_memory(o.shape, m.layout);
    const plan::DeviceTime& s = t.slowest();
    const double err = t.step / m.step - 1, mem_err = mem.worst().total() / m.memory - 1;
    if (std::abs(err) > o.tolerance) ++missed;
    if (std::abs(mem_err) > kMemoryTolerance) ++memory_missed;
    fmt::print("{:<32} {:>5} {:>10.1f} {:>10.1f} {:>+6.1f}%   {:>10.2f} {:>10.2f} {:>+6.1f}%   {:.1f} + {:.1f} + {:.1f}\n",
               x.name() + (m.layout.expert > 1 ? fmt::format(" load {:.2f}", m.layout.expert_imbalance) : ""),
               m.layout.devices(), m.step * 1e3, t.step * 1e3, 100 * err, m.memory / (1 << 20),
               mem.worst().total() / (1 << 20), 100 * mem_err, s.compute() * 1e3, s.comm_exposed * 1e3,
               s.bubble * 1e3);
    std::fflush(stdout);
  }
  fmt::print("step time: {} within {:.0f}% of the measured median; memory: {} within {:.0f}% of the measured peak\n",
             missed == 0 ? "all" : fmt::format("{} not", missed), 100 * o.tolerance,
             memory_missed == 0 ? "all" : fmt::format("{} not", memory_missed), 100 * kMemoryTolerance);
  return missed == 0 && memory_missed == 0 ? 0 : 1;
}

}  // namespace meshtrain::cli
