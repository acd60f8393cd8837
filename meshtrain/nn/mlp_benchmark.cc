// Step time of the MLP classifier (forward + cross-entropy + backward) next to
// the time of its GEMMs alone, to show the step is dominated by them.
//
//   build/nn/meshtrain/nn/nn_mlp_benchmark [blas_threads=1] [batch=256] [iters=50]
//
// The GEMM-only loop runs the same products on the same shapes: 3 forward
// (x W), 3 weight gradients (x^T dy) and 2 input gradients (dy W^T; the first
// layer's is skipped). The two loops are interleaved; prints medians in
// milliseconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "meshtrain/core/ops.h"
#include "meshtrain/core/random.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/nn/mlp.h"

namespace {

using meshtrain::DType;
using meshtrain::Tensor;

double time_ms(const std::function<void()>& body) {
  const auto t0 = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 256;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 50;
  meshtrain::set_blas_threads(threads);
  const std::vector<int64_t> sizes = {784, 512, 512, 10};

  meshtrain::nn::MLP mlp(meshtrain::nn::MLPConfig{.sizes = sizes, .dropout = 0.0, .seed = 1, .prefix = ""});
  meshtrain::nn::CrossEntropyLoss ce;
  Tensor x = Tensor::empty({batch, sizes[0]}, DType::f32);
  meshtrain::fill_uniform(x, 2, 3, 0.0, 1.0);
  std::vector<int64_t> label_values(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) label_values[static_cast<size_t>(i)] = i % sizes.back();
  Tensor labels = Tensor::from_vector(label_values, {batch});
  auto step = [&] {
    ce.forward(mlp.forward(x), labels);
    mlp.backward(ce.backward());
  };

  // The same GEMMs on preallocated operands.
  std::vector<Tensor> w, acts, grads_w, grads_a;
  for (size_t l = 0; l + 1 < sizes.size(); ++l) {
    w.push_back(Tensor::zeros({sizes[l], sizes[l + 1]}, DType::f32));
    grads_w.push_back(Tensor::zeros({sizes[l], sizes[l + 1]}, DType::f32));
  }
  for (int64_t s : sizes) {
    acts.push_back(Tensor::zeros({batch, s}, DType::f32));
    grads_a.push_back(Tensor::zeros({batch, s}, DType::f32));
  }
  auto gemms = [&] {
    for (size_t l = 0; l < w.size(); ++l) meshtrain::matmul(acts[l], w[l], acts[l + 1]);  // (B, in) x (in, out)
    for (size_t l = w.size(); l-- > 0;) {
      meshtrain::matmul(acts[l], grads_a[l + 1], grads_w[l], true, false, 1.0, 1.0);  // dW += x^T dy
      if (l > 0) meshtrain::matmul(grads_a[l + 1], w[l], grads_a[l], false, true);    // dX = dy W^T
    }
  };

  for (int i = 0; i < 5; ++i) {
    step();
    gemms();
  }
  // Interleaved, so that load from other processes hits both alike.
  std::vector<double> step_times, gemm_times;
  for (int i = 0; i < iters; ++i) {
    step_times.push_back(time_ms(step));
    gemm_times.push_back(time_ms(gemms));
  }
  const double step_ms = median(step_times);
  const double gemm_ms = median(gemm_times);
  double flops = 0.0;
  for (size_t l = 0; l + 1 < sizes.size(); ++l) {
    const double per = 2.0 * static_cast<double>(batch) * static_cast<double>(sizes[l] * sizes[l + 1]);
    flops += per * (l == 0 ? 2 : 3);
  }
  std::printf("MLP 784-512-512-10, batch %lld, blas threads %d, %d iterations (medians)\n",
              static_cast<long long>(batch), threads, iters);
  std::printf("%-34s %10s %10s\n", "what", "ms", "GFLOP/s");
  std::printf("%-34s %10.3f %10.1f\n", "step (fwd + CE + bwd)", step_ms, flops / step_ms * 1e-6);
  std::printf("%-34s %10.3f %10.1f\n", "its 8 GEMMs alone", gemm_ms, flops / gemm_ms * 1e-6);
  std::printf("GEMM share of the step: %.1f%%\n", 100.0 * gemm_ms / step_ms);
  return 0;
}
