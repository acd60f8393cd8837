#include "bench/gpt_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/optim/adamw.h"

namespace meshtrain::bench {

namespace {

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

// Runs the PyTorch peer at `precision`; fills torch_step_ms or says why not.
void run_torch(const GptBenchOptions& o, GptBenchRun& r) {
  if (o.torch_script.empty()) {
    r.torch_note = "not run (--no-torch)";
    return;
  }
  const std::string cmd = fmt::format(
      "/usr/bin/python3 '{}' --layers {} --heads {} --width {} --vocab {} --context {} --batch {} --steps {} "
      "--warmup {} --threads {} --dtype {} 2>&1",
      o.torch_script, o.layers, o.heads, o.width, o.vocab, o.context, o.batch, o.steps, o.warmup, o.threads,
      r.precision);
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
  if (status != 0 || !j.is_object() || !j.contains("median_step_ms")) {
    const std::string last = out.substr(out.rfind('\n', out.size() >= 2 ? out.size() - 2 : 0) + 1);
    r.torch_note = fmt::format("not measured: {} exited {} ({})", o.torch_script, status,
                               last.empty() ? "no output" : last.substr(0, last.find('\n')));
    return;
  }
  r.torch_step_ms = j["median_step_ms"].get<double>();
  r.torch_note = fmt::format("PyTorch {} (bench/torch_gpt.py, same shapes and step{})", j.value("torch", "?"),
                             r.precision == "bf16" ? ", bf16 autocast" : "");
}

// meshtrain's step at one precision: median time and the op profile.
GptBenchRun run_meshtrain(const GptBenchOptions& o, const std::string& precision, int64_t* parameters) {
  namespace F = nn::functional;
  GptBenchRun r;
  r.precision = precision;
  nn::GPT gpt(nn::GPTConfig{.vocab = o.vocab, .block_size = o.context, .layers = o.layers, .heads = o.heads,
                            .width = o.width, .seed = 1});
  if (precision == "bf16") gpt.set_compute_dtype(DType::bf16);
  const std::vector<nn::Parameter*> params = gpt.parameters();
  *parameters = 0;
  for (nn::Parameter* p : params) *parameters += p->value.numel();
  optim::AdamW opt(params, 1e-4, {0.9, 0.999}, 1e-8, 0.1);
  nn::CrossEntropyLoss ce;
  const Tensor x = random_ids(o.batch, o.context, o.vocab, 1);
  const Tensor y = random_ids(o.batch, o.context, o.vocab, 2).view({o.batch * o.context});
  const auto step = [&] {
    opt.zero_grad();
    ce.forward(gpt.forward(x), y);
    gpt.backward(ce.backward());
    opt.step();
  };
  for (int i = 0; i < o.warmup; ++i) step();
  F::reset_op_profile();
  F::set_op_profiling(true);
  std::vector<double> times;
  for (int i = 0; i < o.steps; ++i) {
    const auto t0 = Clock::now();
    step();
    times.push_back(ms_since(t0));
  }
  F::set_op_profiling(false);
  double total_ms = 0, kernels_ms = 0;
  for (double t : times) total_ms += t;
  for (const F::OpTime& op : F::op_profile()) {
    const double ms = op.seconds * 1e3 / o.steps;
    kernels_ms += ms;
    std::string name = op.op;
    if (name.rfind("functional::", 0) == 0) name = name.substr(12);
    r.profile.push_back({name, op.calls / o.steps, ms});
  }
  r.profile.push_back({"other (outside the kernels)", 0, total_ms / o.steps - kernels_ms});
  F::reset_op_profile();
  r.step_ms = median(times);
  return r;
}

}  // namespace

GptBenchResult run_gpt_bench(const GptBenchOptions& o) {
  const int previous_threads = blas_threads();
  set_blas_threads(o.threads);
  GptBenchResult r;
  const double tokens = static_cast<double>(o.batch * o.context);
  const double matrix_params = static_cast<double>(o.layers * 12 * o.width * o.width + o.vocab * o.width);
  r.flops_per_step = 6 * matrix_params * tokens +
                     12.0 * static_cast<double>(o.layers * o.context) * static_cast<double>(o.width) * tokens;
  for (const std::string& precision : o.precisions) {
    GptBenchRun run = run_meshtrain(o, precision, &r.parameters);
    run.tokens_per_s = tokens / (run.step_ms / 1e3);
    run.gflops = r.flops_per_step / (run.step_ms * 1e6);
    r.runs.push_back(std::move(run));
  }
  r.sgemm_shape = fmt::format("({}, {}) x ({}, {})", o.batch * o.context, o.width, o.width, 4 * o.width);
  r.sgemm_gflops = sgemm_gflops(o.batch * o.context, o.width, 4 * o.width);
  set_blas_threads(previous_threads);
  for (GptBenchRun& run : r.runs) run_torch(o, run);
  return r;
}

std::string format_gpt_bench(const GptBenchResult& r, const GptBenchOptions& o) {
  const double tokens = static_cast<double>(o.batch * o.context);
  std::string s = fmt::format(
      "GPT {} layers x {} width, {} heads, vocab {}, T = {}, batch {}: {:.1f}M parameters, {:.1f} GFLOP per step, "
      "AdamW, {} thread{}\n\n",
      o.layers, o.width, o.heads, o.vocab, o.context, o.batch, r.parameters / 1e6, r.flops_per_step / 1e9, o.threads,
      o.threads == 1 ? "" : "s");
  s += "| | precision | step ms (median) | tokens/s | GFLOP/s | vs f32 sgemm rate |\n|---|---|---:|---:|---:|---:|\n";
  for (const GptBenchRun& run : r.runs) {
    s += fmt::format("| meshtrain | {} | {:.1f} | {:.0f} | {:.1f} | {:.0f}% |\n", run.precision, run.step_ms,
                     run.tokens_per_s, run.gflops, 100 * run.gflops / r.sgemm_gflops);
    if (run.torch_step_ms > 0) {
      const double g = r.flops_per_step / (run.torch_step_ms * 1e6);
      s += fmt::format("| PyTorch | {} | {:.1f} | {:.0f} | {:.1f} | {:.0f}% |\n", run.precision, run.torch_step_ms,
                       tokens / (run.torch_step_ms / 1e3), g, 100 * g / r.sgemm_gflops);
    }
  }
  s += fmt::format("\nsgemm rate now: {:.1f} GFLOP/s on {} (core matmul, f32, {} thread{})\n", r.sgemm_gflops,
                   r.sgemm_shape, o.threads, o.threads == 1 ? "" : "s");
  for (const GptBenchRun& run : r.runs) {
    if (run.torch_step_ms > 0)
      s += fmt::format("{}: meshtrain / PyTorch step time {:.2f}x ({})\n", run.precision,
                       run.step_ms / run.torch_step_ms, run.torch_note);
    else
      s += fmt::format("{}: PyTorch {}\n", run.precision, run.torch_note);
  }
  if (r.runs.size() == 2)
    s += fmt::format("{} / {} step time: {:.2f}x\n", r.runs[1].precision, r.runs[0].precision,
                     r.runs[1].step_ms / r.runs[0].step_ms);
  for (const GptBenchRun& run : r.runs) {
    s += fmt::format("\nwhere a meshtrain {} step goes (per step, over the timed steps):\n\n"
                     "| op | calls | ms | share |\n|---|---:|---:|---:|\n",
                     run.precision);
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
