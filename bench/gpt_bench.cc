#include "bench/gpt_bench.h"

#include <sys/wait.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <utility>

#include "meshtrain/comm/launch.h"
#include "meshtrain/core/cpu_isa.h"
#include "meshtrain/core/error.h"
#include "meshtrain/core/memory.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/core/parallel_for.h"
#include "meshtrain/core/random.h"
#include "meshtrain/layout/vocabulary.h"
#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/nn/parallel/context_parallel.h"
#include "meshtrain/nn/deterministic.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/parallel/tensor_parallel.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "meshtrain/parallel/parallelism.h"
#include "meshtrain/plan/mesh_planning.h"

namespace meshtrain::bench {

namespace {

namespace F = nn::functional;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Tensor random_ids(int64_t b, int64_t t, int64_t vocab, uint64_t key) {
  std::vector<int64_t> ids(static_cast<size_t>(b * t));
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = std::min<int64_t>(vocab - 1, static_cast<int64_t>(uniform_at(5, key, i, 0.0, static_cast<double>(vocab))));
  return Tensor::from_vector(ids, {b, t});
}

// Median GFLOP/s of out = a b for (m, k) x (k, n) through core matmul.
double sgemm_gflops(int64_t m, int64_t k, int64_t n) {
  Tensor a = Tensor::empty({m, k}, DType::f32), b = Tensor::empty({k, n}, DType::f32),
         c = Tensor::empty({m, n}, DType::f32);
  fill_normal(a, 1, 1, 0.0, 1.0);
  fill_normal(b, 1, 2, 0.0, 1.0);
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    const auto t0 = Clock::now();
    matmul(a, b, c);
    if (i >= 2) t.push_back(ms_since(t0));
  }
  return 2.0 * static_cast<double>(m * k * n) / (median(t) * 1e6);
}

// A run's precision as its flag spells it ("fp32", "bf16").
std::string label(const GptBenchRun& r) {
  std::string s(layout::precision_name(r.precision));
  if (!r.gemm.empty()) s += " " + r.gemm;
  if (r.deterministic) s += " deterministic";
  return s;
}

// Runs the PyTorch peer at `precision`; fills torch_step_ms or says why not.
// Seconds left of the time budget (o.time_budget_s from `start`), or a
// negative value without a budget.
double budget_left(const GptBenchOptions& o, std::chrono::steady_clock::time_point start) {
  if (o.time_budget_s <= 0) return -1;
  return o.time_budget_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void run_torch(const GptBenchOptions& o, GptBenchRun& r, double seconds_left) {
  if (o.torch_script.empty()) {
    r.torch_note = "not run (--no-torch)";
    return;
  }
  if (r.skipped) {
    r.torch_note = "not run (the time budget was spent)";
    return;
  }
  if (o.time_budget_s > 0 && seconds_left < 1) {
    r.torch_note = fmt::format("not run: the time budget ({:g} s) was spent", o.time_budget_s);
    return;
  }
  if (!native_gemm_dtype(r.precision)) {  // PyTorch's bf16 autocast ran for over 10 minutes on such a CPU
    r.torch_note = fmt::format("not run: {}; PyTorch's bf16 autocast takes many times its fp32 step there",
                               gemm_dtype_note(r.precision));
    return;
  }
  // Past the budget `timeout` kills the peer (exit 137).
  const std::string limit =
      o.time_budget_s > 0 ? fmt::format("timeout --signal=KILL {:.0f} ", std::max(1.0, seconds_left)) : "";
  const std::string cmd = fmt::format(
      "{}/usr/bin/python3 '{}' --layers {} --heads {} --width {} --vocab {} --context {} --batch {} --steps {} "
      "--warmup {} --threads {} --dtype {} 2>&1",
      limit, o.torch_script, o.layers, o.heads, o.width, o.vocab, o.context, o.batch, o.steps, o.warmup, o.threads,
      layout::precision_name(r.precision));
  std::FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    r.torch_note = "not run (popen failed)";
    return;
  }
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = std::fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
  const int status = ::pclose(pipe);
  const size_t brace = out.rfind('{');
  const nlohmann::json j = brace == std::string::npos ? nlohmann::json()
                                                       : nlohmann::json::parse(out.substr(brace), nullptr, false);
  if (!limit.empty() && WIFEXITED(status) && WEXITSTATUS(status) == 137) {
    r.torch_note = fmt::format("stopped at the time budget ({:g} s) before it finished", o.time_budget_s);
    return;
  }
  if (status != 0 || !j.is_object() || !j.contains("median_step_ms")) {
    const std::string last = out.substr(out.rfind('\n', out.size() >= 2 ? out.size() - 2 : 0) + 1);
    r.torch_note = fmt::format("not measured: {} exited {} ({})", o.torch_script, status,
                               last.empty() ? "no output" : last.substr(0, last.find('\n')));
    return;
  }
  r.torch_step_ms = j["median_step_ms"].get<double>();
  r.torch_note = fmt::format("PyTorch {} (bench/torch_gpt.py, same shapes and step{})", j.value("torch", "?"),
                             r.precision == DType::bf16 ? ", bf16 autocast" : "");
}

// The model's parameter count (a tensor-parallel block counts its global
// tensor) and the bytes of the values this rank holds.
std::pair<int64_t, double> parameter_sizes(const std::vector<nn::Parameter*>& params) {
  int64_t count = 0;
  double bytes = 0;
  for (const nn::Parameter* p : params) {
    int64_t n = 1;
    for (int64_t d : p->placement.shape) n *= d;
    count += n;
    bytes += static_cast<double>(p->value.numel()) * static_cast<double>(dtype_size(p->value.dtype()));
  }
  return {count, bytes};
}

// What each rank reports: its step times and op profile.
struct RankTimes {
  double activation_bytes = 0;
  std::vector<double> step_ms;
  std::vector<F::OpTime> profile;
};

// One rank's step at one precision (world null: one rank, no mesh): the
// model split over the mesh's tensor axis, its batch rows by its data
// coordinate; the step as the trainer runs it (parallel/parallelism.h).
RankTimes run_rank(const GptBenchOptions& o, const GptBenchMesh& m, DType precision, bool deterministic,
                   comm::Communicator* world, int64_t* parameters, double* parameter_bytes) {
  std::optional<mesh::DeviceMesh> grid;
  nn::TensorParallelGroup tp{.comm = nullptr, .sequence_parallel = m.sequence_parallel, .overlap = m.overlap};
  nn::ContextParallelGroup cp{nullptr, m.all_to_all ? nn::ContextComm::all_to_all : nn::ContextComm::ring};
  comm::Communicator* dp_comm = nullptr;  // gradient sums: data x context
  int data_rank = 0;
  if (world != nullptr) {
    grid.emplace(*world, std::vector<int>{m.data, m.context, m.tensor},
                 std::vector<std::string>{std::string(mesh::kData), std::string(mesh::kContext),
                                          std::string(mesh::kTensor)});
    if (m.tensor > 1) tp.comm = &grid->comm(mesh::kTensor);
    if (m.context > 1) cp.comm = &grid->comm(mesh::kContext);
    if (m.data * m.context > 1) dp_comm = &grid->comm({mesh::kData, mesh::kContext});
    data_rank = grid->comm(mesh::kData).rank();
  }
  nn::GPT gpt(nn::GPTConfig{.vocab = o.vocab, .block_size = o.context, .layers = o.layers, .heads = o.heads,
                            .width = o.width, .seed = 1, .tensor = tp, .context = cp});
  MemoryTracker memory;
  gpt.set_memory_tracker(&memory);
  std::tie(*parameters, *parameter_bytes) = parameter_sizes(gpt.parameters());
  std::vector<std::string> partial;  // sequence parallelism: gradients summed over the tensor axis per step
  for (const nn::Parameter* p : gpt.parameters())
    if (p->sequence_parallel) partial.push_back(p->name);
  // Gradients summed over the replicas: the loss is normalized by the global
  // batch's tokens. bf16 is the trainer's mixed precision (run_meshtrain
  // gives it a mesh even on one rank): the wrapper sets the compute dtype.
  std::unique_ptr<parallel::Parallelism> wrapper;
  const std::vector<nn::Module*> units = gpt.fsdp_units();  // the trainer's units
  if (precision == DType::bf16)
    wrapper = std::make_unique<parallel::FullyShardedDataParallel>(
        gpt, dp_comm != nullptr ? *dp_comm : grid->comm(mesh::kData), nullptr,
        parallel::FullyShardedOptions{.stage = parallel::ZeroStage::no_shard,
                                      .param_dtype = DType::bf16,
                                      .reduce_dtype = DType::f32,
                                      .reduce = parallel::GradReduce::sum,
                                      .unit_modules = units});
  else if (dp_comm != nullptr)
    wrapper = std::make_unique<parallel::DataParallel>(
        gpt, *dp_comm,
        parallel::DataParallelOptions{.reduce = parallel::GradReduce::sum, .deterministic = deterministic});
  const std::vector<nn::Parameter*> params = wrapper ? wrapper->optimizer_parameters() : gpt.parameters();
  optim::AdamW opt(params, 1e-4, {0.9, 0.999}, 1e-8, 0.1);
  nn::CrossEntropyLoss ce;
  std::optional<nn::VocabParallelCrossEntropy> vce;
  if (tp.size() > 1) vce.emplace(tp, o.vocab);
  const int64_t rows = o.batch / m.data, first = data_rank * rows;
  const Tensor x = random_ids(o.batch, o.context, o.vocab, 1).narrow(0, first, rows).contiguous();
  const Tensor ys = nn::shard_sequence(random_ids(o.batch, o.context, o.vocab, 2).narrow(0, first, rows), cp, 1);
  const Tensor y = ys.view({ys.numel()});  // this rank's chunks' targets
  const double tokens = static_cast<double>(o.batch * o.context);
  // The deterministic mode as the trainer runs it: blocks of the fewest
  // samples of at least 32 rows, this rank's samples a node of their tree.
  int64_t block = 1;
  while (block * o.context < 32) block *= 2;
  std::optional<F::DeterministicRowsScope> mode;
  if (deterministic) {
    if (o.batch % block != 0 || rows % block != 0)
      throw InvalidArgument("bench gpt --deterministic",
                            fmt::format("{} samples per rank in blocks of {}", rows, block), "use a larger --batch");
    mode.emplace(block * o.context);
    gpt.set_batch_context(0, first);
  }
  const auto step = [&] {
    if (deterministic) nn::begin_deterministic_step(block, o.batch / block, {first / block, rows / block});
    if (wrapper) wrapper->begin_micro_batch(0, 1);
    const Tensor logits = gpt.forward(x);
    if (vce) {
      vce->forward(logits, y, tokens);
      gpt.backward(vce->backward());
    } else {
      ce.forward(logits, y, tokens);
      gpt.backward(ce.backward());
    }
    if (wrapper) {
      const F::ProfileScope scope("dp finish");
      wrapper->finish();
    } else if (deterministic) {  // one rank: the tied table's head and embedding sums, added as DataParallel does
      for (nn::Parameter* p : gpt.parameters())
        for (const Tensor& other : nn::take_other_users(*p)) add(p->grad, other, p->grad);
    }
    nn::reduce_sequence_parallel_grads(params, partial, tp);
    opt.step();
    if (wrapper) {
      const F::ProfileScope scope("dp after_step");  // mixed precision: the masters rounded to bf16
      wrapper->after_step();
    }
    const F::ProfileScope scope("zero_grad");
    if (wrapper)
      wrapper->zero_grad();
    else
      opt.zero_grad();
  };
  for (int i = 0; i < o.warmup; ++i) step();
  if (world != nullptr) world->barrier();  // every rank starts timing together
  RankTimes r;
  F::reset_op_profile();
  F::set_op_profiling(true);
  for (int i = 0; i < o.steps; ++i) {
    const auto t0 = Clock::now();
    step();
    r.step_ms.push_back(ms_since(t0));
  }
  F::set_op_profiling(false);
  r.activation_bytes = static_cast<double>(memory.peak(MemoryCategory::activations));
  r.profile = F::op_profile();
  F::reset_op_profile();
  return r;
}

// Fills the run's times from rank 0's and the tensor-parallel time of every rank.
void summarize(const GptBenchOptions& o, const std::vector<RankTimes>& ranks, GptBenchRun& r) {
  const RankTimes& zero = ranks[0];
  double total_ms = 0, profiled_ms = 0;
  for (double t : zero.step_ms) total_ms += t;
  for (const F::OpTime& op : zero.profile) {
    const double ms = op.seconds * 1e3 / o.steps;
    profiled_ms += ms;
    std::string name = op.op;
    if (name.rfind("functional::", 0) == 0) name = name.substr(12);
    if (name.rfind("tp ", 0) == 0) r.tp_ms += ms;
    if (name == "dp finish") r.dp_finish_ms += ms;
    if (name.rfind("cp ", 0) == 0) r.cp_ms += ms;
    r.profile.push_back({name, op.calls / o.steps, ms});
  }
  r.mean_step_ms = total_ms / o.steps;
  r.profile.push_back({"other (outside the profiled ops)", 0, r.mean_step_ms - profiled_ms});
  r.step_ms = median(zero.step_ms);
  r.activation_bytes = zero.activation_bytes;
  for (const RankTimes& rank : ranks) {
    double ms = 0;
    for (const F::OpTime& op : rank.profile)
      if (op.op.rfind("tp ", 0) == 0) ms += op.seconds * 1e3 / o.steps;
    r.tp_ms_per_rank.push_back(ms);
  }
}

// One mesh at one precision: in the calling thread for one rank, else on
// that many threads-engine ranks sharing o.threads GEMM threads.
GptBenchRun run_meshtrain(const GptBenchOptions& o, const GptBenchMesh& m, DType precision, bool deterministic,
                          int64_t* parameters) {
  GptBenchRun r;
  r.mesh = m;
  r.precision = precision;
  r.deterministic = deterministic;
  r.threads_per_rank = std::max(1, o.threads / m.ranks());
  std::vector<RankTimes> ranks(static_cast<size_t>(m.ranks()));
  if (m.ranks() == 1 && precision == DType::f32) {
    ranks[0] = run_rank(o, m, precision, deterministic, nullptr, parameters, &r.parameter_bytes);
  } else {
    set_blas_threads(r.threads_per_rank);
    std::mutex mu;
    // One core per rank when each rank has one thread (a rank's GEMM threads
    // would share its core otherwise).
    comm::launch({.engine = comm::Engine::threads, .ranks = m.ranks(), .bind_to_cores = r.threads_per_rank == 1},
                 [&](comm::Communicator& world) {
                   int64_t count = 0;
                   double bytes = 0;
                   RankTimes t = run_rank(o, m, precision, deterministic, &world, &count, &bytes);
                   std::lock_guard lock(mu);
                   ranks[static_cast<size_t>(world.rank())] = std::move(t);
                   if (world.rank() == 0) {
                     *parameters = count;
                     r.parameter_bytes = bytes;
                   }
                 });
    set_blas_threads(o.threads);
  }
  summarize(o, ranks, r);
  return r;
}

}  // namespace

std::string GptBenchMesh::name() const {
  std::vector<std::string> axes;
  if (data > 1) axes.push_back(fmt::format("data={}", data));
  if (context > 1) axes.push_back(fmt::format("context={}", context));
  if (tensor > 1) axes.push_back(fmt::format("tensor={}", tensor));
  if (axes.empty()) return "none";
  return fmt::format("{}{}{}{}", fmt::join(axes, ","), sequence_parallel ? "+sp" : "", overlap ? "+overlap" : "",
                     all_to_all ? "+a2a" : "");
}

GptBenchMesh parse_gpt_bench_mesh(const std::string& spec) {
  const char* op = "--mesh";
  const char* hint = "write none, or data, context and tensor axes (tensor=2, data=2,context=2), with +sp for "
                     "sequence parallelism (tensor=2+sp), +overlap for tensor parallelism's communication overlap "
                     "(tensor=2+sp+overlap) or +a2a for all_to_all context attention (context=2+a2a)";
  GptBenchMesh m;
  std::string axes = spec;
  for (bool more = true; more;) {
    more = false;
    for (auto [suffix, flag] : {std::pair<std::string, bool*>{"+sp", &m.sequence_parallel},
                                {"+overlap", &m.overlap}, {"+a2a", &m.all_to_all}})
      if (axes.size() > suffix.size() && axes.compare(axes.size() - suffix.size(), suffix.size(), suffix) == 0) {
        *flag = true;
        axes.resize(axes.size() - suffix.size());
        more = true;
      }
  }
  if (axes == "none") {
    if (m.sequence_parallel || m.overlap)
      throw InvalidArgument(op, fmt::format("'{}': one rank has no tensor axis", spec), hint);
    return m;
  }
  const mesh::NamedShape shape = mesh::parse_mesh_spec(axes);
  std::vector<std::string> seen;
  for (size_t i = 0; i < shape.shape.size(); ++i) {
    const std::string& name = shape.axis_names[i];
    if (name != mesh::kData && name != mesh::kContext && name != mesh::kTensor)
      throw InvalidArgument(op, fmt::format("'{}': axis '{}'", spec, name), hint);
    if (std::find(seen.begin(), seen.end(), name) != seen.end())
      throw InvalidArgument(op, fmt::format("'{}': axis '{}' twice", spec, name), hint);
    seen.push_back(name);
    (name == mesh::kData ? m.data : name == mesh::kContext ? m.context : m.tensor) = shape.shape[i];
  }
  if (m.sequence_parallel && m.tensor == 1)
    throw InvalidArgument(op, fmt::format("'{}': sequence parallelism without a tensor axis", spec), hint);
  if (m.overlap && m.tensor == 1)
    throw InvalidArgument(op, fmt::format("'{}': communication overlap without a tensor axis", spec), hint);
  if (m.all_to_all && m.context == 1)
    throw InvalidArgument(op, fmt::format("'{}': all_to_all without a context axis", spec), hint);
  return m;
}

GptBenchResult run_gpt_bench(const GptBenchOptions& o) {
  const int previous_threads = blas_threads();
  set_blas_threads(o.threads);
  GptBenchResult r;
  const double tokens = static_cast<double>(o.batch * o.context);
  const double matrix_params = static_cast<double>(o.layers * 12 * o.width * o.width + o.vocab * o.width);
  r.flops_per_step = 6 * matrix_params * tokens +
                     12.0 * static_cast<double>(o.layers * o.context) * static_cast<double>(o.width) * tokens;
  const std::vector<GptBenchMesh> meshes = o.meshes.empty() ? std::vector<GptBenchMesh>{GptBenchMesh{}} : o.meshes;
  for (const DType p : o.precisions)  // before any run: what it cannot run fails at once
    if (p != DType::f32 && p != DType::bf16)
      throw InvalidArgument("--precision", fmt::format("{}", layout::precision_name(p)),
                            "bench gpt runs fp32 and bf16 (the trainer's mixed precision): use fp32, bf16 or both");
  for (const GptBenchMesh& m : meshes)  // before any run: a bad mesh fails at once
    if (o.batch % m.data != 0)
      throw InvalidArgument("bench gpt", fmt::format("batch {} over mesh {}", o.batch, m.name()),
                            fmt::format("use a --batch divisible by the data axis ({})", m.data));
  const GemmPolicy previous_policy = gemm_policy();
  const std::vector<std::optional<GemmPolicy>> policies =
      o.gemm_policies.empty() ? std::vector<std::optional<GemmPolicy>>{std::nullopt}
                              : std::vector<std::optional<GemmPolicy>>(o.gemm_policies.begin(), o.gemm_policies.end());
  const auto start = std::chrono::steady_clock::now();
  for (const GptBenchMesh& m : meshes)
    for (const DType precision : o.precisions)
      for (const std::optional<GemmPolicy>& policy : policies) {
        if (o.time_budget_s > 0 && budget_left(o, start) <= 0) {
          GptBenchRun skipped;
          skipped.mesh = m;
          skipped.precision = precision;
          skipped.skipped = true;
          skipped.note = fmt::format("not run: the time budget ({:g} s) was spent", o.time_budget_s);
          if (policy) skipped.gemm = fmt::format("gemm {}", gemm_policy_name(*policy));
          r.runs.push_back(std::move(skipped));
          continue;
        }
        if (policy) set_gemm_policy(*policy);
        const bool both = o.deterministic && precision == DType::f32 && m.tensor == 1 && m.context == 1;
        for (const bool deterministic : both ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
          GptBenchRun run = run_meshtrain(o, m, precision, deterministic, &r.parameters);
          if (policy) run.gemm = fmt::format("gemm {}", gemm_policy_name(*policy));
          run.tokens_per_s = tokens / (run.step_ms / 1e3);
          run.gflops = r.flops_per_step / (run.step_ms * 1e6);
          r.runs.push_back(std::move(run));
        }
      }
  if (!o.gemm_policies.empty()) set_gemm_policy(previous_policy);
  r.sgemm_shape = fmt::format("({}, {}) x ({}, {})", o.batch * o.context, o.width, o.width, 4 * o.width);
  r.sgemm_gflops = sgemm_gflops(o.batch * o.context, o.width, 4 * o.width);
  r.peak = measure_fma_peak(o.threads);
  set_blas_threads(previous_threads);
  for (GptBenchRun& run : r.runs)
    if (run.mesh.ranks() == 1 && !run.deterministic) run_torch(o, run, budget_left(o, start));
  return r;
}

namespace {

// The meshes' comparison table and what its communication columns mean.
std::string format_meshes(const GptBenchResult& r, const GptBenchOptions& o) {
  std::string s =
      "| mesh | ranks x threads | precision | step ms (median) | tokens/s | GFLOP/s | tp comm ms | tp comm share | "
      "tp exposed share | cp comm share | dp finish share | parameter MiB / rank | activation MiB / rank |\n"
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  const auto share = [](bool has, double ms, double step) {
    return has ? fmt::format("{:.1f}%", 100 * ms / step) : std::string("-");
  };
  int most_ranks = 1;
  for (const GptBenchRun& run : r.runs) {
    if (run.skipped) {
      s += fmt::format("| {} | {} | {} | {} |\n", run.mesh.name(), run.mesh.ranks(), label(run), run.note);
      continue;
    }
    const bool tp = run.mesh.tensor > 1, dp = run.mesh.data * run.mesh.context > 1, cp = run.mesh.context > 1;
    most_ranks = std::max(most_ranks, run.mesh.ranks());
    const double least = run.tp_ms_per_rank.empty()
                             ? 0.0
                             : *std::min_element(run.tp_ms_per_rank.begin(), run.tp_ms_per_rank.end());
    s += fmt::format("| {} | {} x {} | {} | {:.1f} | {:.0f} | {:.1f} | {} | {} | {} | {} | {} | {:.2f} | {:.2f} |\n",
                     run.mesh.name(), run.mesh.ranks(), run.threads_per_rank, label(run), run.step_ms,
                     run.tokens_per_s, run.gflops, tp ? fmt::format("{:.2f}", run.tp_ms) : "-",
                     share(tp, run.tp_ms, run.mean_step_ms), share(tp, least, run.mean_step_ms),
                     share(cp, run.cp_ms, run.mean_step_ms),
                     share(dp, run.dp_finish_ms, run.mean_step_ms), run.parameter_bytes / (1 << 20),
                     run.activation_bytes / (1 << 20));
  }
  s += fmt::format(
      "\ntp comm: rank 0's time per step in tensor-parallel collectives (the profile's \"tp ...\" entries: waits, "
      "copies and the reordering of blocks); tp exposed: the least such time of any rank (the rank that arrives last "
      "at a collective waits for no one: its time is the communication's own cost, the other ranks' extra is load "
      "imbalance); cp "
      "comm: in context-parallel communication (\"cp ...\": waits for the ring's next K/V block, all-to-alls); dp "
      "finish: its time in DataParallel::finish(), the gradient all-reduce not hidden under backward; shares of "
      "rank 0's mean step. activation MiB: rank 0's peak of activation buffers. tokens/s: the whole mesh ({} tokens "
      "per step).\n",
      o.batch * o.context);
  for (const GptBenchRun& run : r.runs)
    if (run.mesh.tensor > 1 && !run.skipped)
      s += fmt::format("tp comm ms per step by rank, {} {}: {:.2f}\n", run.mesh.name(), label(run),
                       fmt::join(run.tp_ms_per_rank, " / "));
  if (most_ranks > 1)
    s += fmt::format(
        "Communication times are wall time on the threads engine, whose collectives are memory copies within one "
        "process: a rank's time in a collective includes waiting for the other ranks to reach it (load imbalance: "
        "a rank whose core ran another thread or process arrives late), so it overstates the copies, most on a "
        "machine with few cores ({} here, for up to {} ranks).\n",
        available_cores(), most_ranks);
  return s;
}

}  // namespace

std::string format_gpt_bench(const GptBenchResult& r, const GptBenchOptions& o) {
  const double tokens = static_cast<double>(o.batch * o.context);
  std::string s = fmt::format("GEMMs {}\n", gemm_policy_summary());
  if (const std::string note = openblas_core_note(); !note.empty()) s += "note: " + note + "\n";
  s += fmt::format(
      "GPT {} layers x {} width, {} heads, vocab {}, T = {}, batch {}: {:.1f}M parameters, {:.1f} GFLOP per step, "
      "AdamW, {} thread{}{}\n\n",
      o.layers, o.width, o.heads, o.vocab, o.context, o.batch, r.parameters / 1e6, r.flops_per_step / 1e9, o.threads,
      o.threads == 1 ? "" : "s", o.meshes.empty() ? "" : " split over each mesh's ranks");
  if (!o.meshes.empty()) {
    s += format_meshes(r, o);
  } else {
    s += "| | precision | step ms (median) | tokens/s | GFLOP/s | vs FMA peak | vs f32 sgemm rate |\n"
         "|---|---|---:|---:|---:|---:|---:|\n";
    for (const GptBenchRun& run : r.runs) {
      if (run.skipped) {
        s += fmt::format("| meshtrain | {} | {} | | | | |\n", label(run), run.note);
        continue;
      }
      const double peak = r.peak.for_dtype(run.precision == DType::bf16);
      const auto row = [&](const char* who, double ms) {
        const double g = r.flops_per_step / (ms * 1e6);
        return fmt::format("| {} | {} | {:.1f} | {:.0f} | {:.1f} | {} | {:.0f}% |\n", who, label(run), ms,
                           tokens / (ms / 1e3), g, peak > 0 ? fmt::format("{:.0f}%", 100 * g / peak) : "-",
                           100 * g / r.sgemm_gflops);
      };
      s += row("meshtrain", run.step_ms);
      if (run.torch_step_ms > 0) s += row("PyTorch", run.torch_step_ms);
    }
  }
  s += fmt::format("\nFMA peak now ({} loop, {} thread{}): f32 {:.1f} GFLOP/s{}\n", r.peak.isa, o.threads,
                   o.threads == 1 ? "" : "s", r.peak.f32_gflops,
                   r.peak.bf16_gflops > 0 ? fmt::format(", bf16 dot product {:.1f} GFLOP/s", r.peak.bf16_gflops)
                                          : std::string(", no bf16 instructions (bf16 rows against f32's)"));
  s += fmt::format("sgemm rate now: {:.1f} GFLOP/s on {} (core matmul, f32, {} thread{})\n", r.sgemm_gflops,
                   r.sgemm_shape, o.threads, o.threads == 1 ? "" : "s");
  for (const GptBenchRun& run : r.runs) {
    if (run.mesh.ranks() > 1 || run.deterministic) continue;  // PyTorch runs one rank, its own mode
    if (run.torch_step_ms > 0)
      s += fmt::format("{}: meshtrain / PyTorch step time {:.2f}x ({})\n", label(run),
                       run.step_ms / run.torch_step_ms, run.torch_note);
    else
      s += fmt::format("{}: PyTorch {}\n", label(run), run.torch_note);
  }
  if (o.meshes.empty() && r.runs.size() == 2 && o.gemm_policies.size() <= 1 && !r.runs[0].skipped &&
      !r.runs[1].skipped)
    s += fmt::format("{} / {} step time: {:.2f}x\n", label(r.runs[1]), label(r.runs[0]),
                     r.runs[1].step_ms / r.runs[0].step_ms);
  for (const GptBenchRun& run : r.runs) {
    if (run.skipped) continue;
    s += fmt::format("\nwhere a meshtrain {} step goes{} (per step, over the timed steps):\n\n"
                     "| op | calls | ms | share |\n|---|---:|---:|---:|\n",
                     label(run),
                     o.meshes.empty() ? "" : fmt::format(" on rank 0 of mesh {}", run.mesh.name()));
    double total = 0;
    for (const auto& op : run.profile) total += op.ms_per_step;
    for (const auto& op : run.profile)
      s += fmt::format("| {} | {} | {:.1f} | {:.1f}% |\n", op.op,
                       op.calls_per_step ? std::to_string(op.calls_per_step) : "", op.ms_per_step,
                       100 * op.ms_per_step / total);
  }
  return s;
}

}  // namespace meshtrain::bench
