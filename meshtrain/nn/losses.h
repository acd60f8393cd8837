// Losses with explicit forward and backward: softmax cross-entropy with
// integer labels, MSE, BCE-with-logits and the Gaussian KL(q || N(0, 1)).
//
//   nn::CrossEntropyLoss ce;
//   double loss = ce.forward(logits, labels);            // mean over the B samples
//   Tensor dlogits = ce.backward();                       // (B, C) d loss / d logits
//   // Data parallelism: each rank divides by the GLOBAL batch instead, so the
//   // sum of the ranks' losses (and of their gradients) is the global mean.
//   double part = ce.forward(local_logits, local_labels, /*normalizer=*/global_batch);
//
// Normalizer: every loss is sum(per-element terms) / normalizer. Omitted, the
// normalizer is the PyTorch default of the reduction written next to each
// class (the local count); given, it must be finite and > 0. Because each term
// depends only on its own sample, passing the global count on every rank
// makes all_reduce(sum) of the local losses and gradients equal the
// single-device mean exactly (up to f32 summation order).
//
// backward(grad_output) returns d(grad_output * loss) / d input; grad_output
// (default 1) is where a loss scale goes. Per-call state follows the modules'
// contract (module.h): forward(..., saved) keeps what backward(saved, ...)
// needs in a Saved, so several micro-batches' losses can be in flight; the
// forms without a Saved use the loss object's own. Returned gradients and
// forward's state live in buffers there, reused across calls when the caller
// no longer holds the previous result. backward may be called more than once
// per forward. The element loops are nn::functional's.
// Sums are accumulated in double; gradients are f32.
// Thread-safety: one thread at a time per loss object.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "meshtrain/core/tensor.h"
#include "meshtrain/nn/saved.h"

namespace meshtrain::nn {

// Softmax cross-entropy: per sample logsumexp(z) - z[label] (log-sum-exp with
// the row max subtracted: no overflow). Default normalizer: N (the mean over
// samples, PyTorch's reduction='mean' without weights).
class CrossEntropyLoss {
 public:
  // logits (N, C) f32, C >= 1; labels (N) i64 or i32, each in [0, C).
  double forward(const Tensor& logits, const Tensor& labels, Saved& saved,
                 std::optional<double> normalizer = std::nullopt);
  // (N, C): (softmax(z) - onehot(label)) * grad_output / normalizer.
  Tensor backward(Saved& saved, double grad_output = 1.0);
  double forward(const Tensor& logits, const Tensor& labels, std::optional<double> normalizer = std::nullopt) {
    return forward(logits, labels, own_, normalizer);
  }
  Tensor backward(double grad_output = 1.0) { return backward(own_, grad_output); }

 private:
  struct State {
    Tensor probs;             // (N, C) softmax of the forward
    Tensor labels;            // (N) i64
    double normalizer = 0.0;  // 0: no forward yet
    Tensor grad;              // (N, C)
  };
  Saved own_;
};

// Mean squared error: (x - t)^2 per element. Default normalizer: numel (the
// mean over all elements, PyTorch's reduction='mean'); for a data-parallel
// mean pass global_batch * elements_per_sample.
class MSELoss {
 public:
  // input and target: the same shape, f32.
  double forward(const Tensor& input, const Tensor& target, Saved& saved,
                 std::optional<double> normalizer = std::nullopt);
  // Same shape as input: 2 (x - t) * grad_output / normalizer.
  Tensor backward(Saved& saved, double grad_output = 1.0);
  double forward(const Tensor& input, const Tensor& target, std::optional<double> normalizer = std::nullopt) {
    return forward(input, target, own_, normalizer);
  }
  Tensor backward(double grad_output = 1.0) { return backward(own_, grad_output); }

 private:
  struct State {
    Tensor diff;  // x - t
    double normalizer = 0.0;
    Tensor grad;
  };
  Saved own_;
};

// Binary cross-entropy on logits: max(x, 0) - x t + log1p(exp(-|x|)) per
// element (stable for any x; t may be any value in [0, 1]). Default
// normalizer: numel (PyTorch's reduction='mean'); a VAE sums over pixels and
// averages over samples, i.e. passes the batch size.
class BCEWithLogitsLoss {
 public:
  // input (logits) and target: the same shape, f32.
  double forward(const Tensor& input, const Tensor& target, Saved& saved,
                 std::optional<double> normalizer = std::nullopt);
  // Same shape as input: (sigmoid(x) - t) * grad_output / normalizer.
  Tensor backward(Saved& saved, double grad_output = 1.0);
  double forward(const Tensor& input, const Tensor& target, std::optional<double> normalizer = std::nullopt) {
    return forward(input, target, own_, normalizer);
  }
  Tensor backward(double grad_output = 1.0) { return backward(own_, grad_output); }

 private:
  struct State {
    Tensor grad_unscaled;  // sigmoid(x) - t
    double normalizer = 0.0;
    Tensor grad;
  };
  Saved own_;
};

// KL(N(mu, exp(logvar)) || N(0, 1)) = -0.5 (1 + logvar - mu^2 - exp(logvar))
// per latent element, summed. Default normalizer: N = mu.size(0) (sum over
// latent dims, mean over samples, the VAE convention).
class GaussianKLLoss {
 public:
  struct Grads {
    Tensor mu;      // mu * grad_output / normalizer
    Tensor logvar;  // 0.5 (exp(logvar) - 1) * grad_output / normalizer
  };
  // mu and logvar: the same shape (N, ...), f32, N = size(0).
  double forward(const Tensor& mu, const Tensor& logvar, Saved& saved,
                 std::optional<double> normalizer = std::nullopt);
  Grads backward(Saved& saved, double grad_output = 1.0);
  double forward(const Tensor& mu, const Tensor& logvar, std::optional<double> normalizer = std::nullopt) {
    return forward(mu, logvar, own_, normalizer);
  }
  Grads backward(double grad_output = 1.0) { return backward(own_, grad_output); }

 private:
  struct State {
    Tensor mu_unscaled;      // mu
    Tensor logvar_unscaled;  // 0.5 (exp(logvar) - 1)
    double normalizer = 0.0;
    Grads grads;
  };
  Saved own_;
};

// Number of rows of logits (N, C) whose argmax (first on ties) equals the
// label; labels (N) i64 or i32. For accuracy metrics.
int64_t count_correct(const Tensor& logits, const Tensor& labels);

}  // namespace meshtrain::nn
