// Stateless kernels of nn: the only place that loops over elements for the
// modules (Linear, activations, LayerNorm, Dropout, losses, the VAE's
// reparameterization) and for the optimizers' updates (AdamW, SGD). Modules keep state and call these; tensor and
// pipeline parallel variants call the same ones.
//
//   namespace F = meshtrain::nn::functional;
//   F::linear_forward(x, w, b, y);              // y = x W + b, x (R, in), w (in, out)
//   F::linear_backward_input(dy, w, dx);        // dx = dy W^T
//   F::linear_backward_weight(x, dy, dw, db);   // dw += x^T dy, db += column sums of dy
//
// Dispatch: every function checks its operands (InvalidArgument naming the
// function and the operand) and runs the kernels of the backend registered
// for the operands' device (all operands must be on one device). The CPU
// backend is built in; a GPU backend registers its own (register_backend)
// without touching nn's modules. A device without a backend is Unsupported.
//
// Conventions: f32 operands, except the GEMM operands of linear and unembed
// (x, w, dy), which may instead be a bf16 (or f16) pair: half-precision
// products with f32 accumulation into f32 outputs (core/matmul.h); bias
// sums read a half-precision dy exactly. Matrices are 2-D and contiguous (rows R, a
// trailing feature dim); outputs are written, except where a name says
// "accumulate" (+=). Sums over rows are accumulated per column in f32 in
// row order and then added to the gradient, so a result does not depend on
// whether the call was split or fused. Loss values are accumulated in double.
// Thread-safety: functions may run concurrently on disjoint outputs.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/core/tensor.h"

namespace meshtrain::nn::functional {

enum class ActivationKind : uint8_t { relu, gelu, gelu_tanh, silu, tanh, sigmoid };

// ---- Linear (weights (in, out): y = x W + b) ----
// x (R, in), w (in, out), b (out) or undefined, y (R, out).
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y);
// dy (R, out), w (in, out) -> dx (R, in).
void linear_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx);
// Accumulates dw (in, out) += x^T dy and, when defined, db (out) += sum over rows of dy.
void linear_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw, const Tensor& db);
// y (R, out) += b (out) on every row: a bias added after the product (a
// row-parallel layer adds it once the partial products are reduced).
void bias_add(const Tensor& b, const Tensor& y);
// Accumulates db (out) += sum over rows of dy (R, out): the bias part alone,
// so a layer can report its bias gradient before the weight GEMM runs.
void bias_backward(const Tensor& dy, const Tensor& db);

// ---- element-wise activations (any shape, contiguous) ----
void activation_forward(ActivationKind kind, const Tensor& x, const Tensor& y);
// dx = dy * f'(x), given x and y = f(x).
void activation_backward(ActivationKind kind, const Tensor& x, const Tensor& y, const Tensor& dy, const Tensor& dx);

// ---- LayerNorm over the last dim ----
// x (R, D); gamma, beta (D) or both undefined; y, xhat (R, D); rstd (R) = 1/sqrt(var + eps).
void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, const Tensor& y,
                        const Tensor& xhat, const Tensor& rstd);
// dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy gamma (dy without gamma).
void layer_norm_backward_input(const Tensor& dy, const Tensor& xhat, const Tensor& rstd, const Tensor& gamma,
                               const Tensor& dx);
// Accumulates dgamma += sum over rows of dy xhat and dbeta += sum over rows
// of dy (dbeta undefined: RMSNorm's, gamma only).
void layer_norm_backward_weight(const Tensor& dy, const Tensor& xhat, const Tensor& dgamma, const Tensor& dbeta);

// ---- RMSNorm over the last dim (Llama's; torch.nn.RMSNorm) ----
// x (R, D); gamma (D) or undefined; y, xhat (R, D); rstd (R) =
// 1/sqrt(mean(x^2) + eps); xhat = x rstd, y = xhat gamma. The weight's
// gradient: layer_norm_backward_weight with dbeta undefined.
void rms_norm_forward(const Tensor& x, const Tensor& gamma, double eps, const Tensor& y, const Tensor& xhat,
                      const Tensor& rstd);
// dx = rstd (dxhat - xhat mean(dxhat xhat)), dxhat = dy gamma (dy without gamma).
void rms_norm_backward_input(const Tensor& dy, const Tensor& xhat, const Tensor& rstd, const Tensor& gamma,
                             const Tensor& dx);

// ---- Dropout ----
// scale[i] = keep ? 1 / (1 - p) : 0 (0 everywhere when p == 1), keep iff
// u >= p with u = uniform_at(seed, key, start + i, 0, 1) in f32.
void dropout_mask(uint64_t seed, uint64_t key, uint64_t start, double p, const Tensor& scale);

// ---- vocabulary-parallel cross-entropy (nn/parallel/tensor_parallel.h) ----
// A rank holds columns [begin, begin + C) of the logits (N, V); labels (N)
// i64 are global ids in [0, V). Three steps around two all-reduces:
// row_max (N) = each row's largest logit (of this shard).
void row_max(const Tensor& logits, const Tensor& max);
// Given the global row max m (N): probs (N, C) = exp(logits - m), and stats
// (N, 2) f64 = {row sum of probs, logits[i][label - begin] - m[i] when the
// label is in this shard, else 0}.
void vocab_parallel_ce_partial(const Tensor& logits, const Tensor& labels, int64_t begin, const Tensor& max,
                               const Tensor& probs, const Tensor& stats);
// With stats summed over the shards (S, t): probs /= S per row; returns the
// sum over rows of log S - t (the loss terms, each row's on every rank).
double vocab_parallel_ce_finish(const Tensor& stats, const Tensor& probs);
// grad (N, C) = (probs - onehot(label - begin)) * factor; labels outside
// the shard add no one-hot.
void vocab_parallel_ce_backward(const Tensor& probs, const Tensor& labels, int64_t begin, double factor,
                                const Tensor& grad);

// ---- losses: return the sum of per-element terms; the caller divides ----
// logits (N, C), labels (N) i64 in [0, C): sum of -log softmax(z)[label],
// divided by normalizer (> 0) here: once, or in the deterministic mode
// each block's sum before the tree, so that the shares of a global batch
// add up to the same bits; probs (N, C) = softmax(z).
double cross_entropy_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                             double normalizer = 1.0);
// grad (N, C) = (probs - onehot(label)) * factor.
void cross_entropy_backward(const Tensor& probs, const Tensor& labels, double factor, const Tensor& grad);
// sum (x - t)^2; diff = x - t.
double mse_forward(const Tensor& x, const Tensor& t, const Tensor& diff);
// sum max(x, 0) - x t + log1p(exp(-|x|)); grad_unscaled = sigmoid(x) - t.
double bce_with_logits_forward(const Tensor& x, const Tensor& t, const Tensor& grad_unscaled);
// sum -0.5 (1 + logvar - mu^2 - exp(logvar)); dmu = mu, dlogvar = 0.5 (exp(logvar) - 1).
double gaussian_kl_forward(const Tensor& mu, const Tensor& logvar, const Tensor& dmu, const Tensor& dlogvar);
// out = src * factor (f32 product, like scale()).
void scaled_copy(const Tensor& src, double factor, const Tensor& out);
// Rows of logits (N, C) whose argmax (first on ties) equals labels (N) i64.
int64_t count_correct(const Tensor& logits, const Tensor& labels);

// ---- reparameterization z = mu + exp(0.5 logvar) eps ----
// std = exp(0.5 logvar); z = mu + std * eps.
void reparameterize(const Tensor& mu, const Tensor& logvar, const Tensor& eps, const Tensor& std, const Tensor& z);
// dlogvar = dz * eps * 0.5 * std (d z / d logvar), elementwise.
void reparameterize_backward_logvar(const Tensor& dz, const Tensor& eps, const Tensor& std, const Tensor& dlogvar);

// ---- embedding ----
// ids (N) i64 or i32, each in [0, vocab) (vocab 0: the weight's rows);
// weight (rows, C) holds ids [begin, begin + rows) (a vocabulary shard under
// tensor parallelism; begin 0 and vocab = rows otherwise); out (N, C) = the
// id's row, or zeros for an id outside the shard. weight is f32, or bf16/f16
// (mixed precision's parameter views: rows widened exactly to f32).
void embedding_forward(const Tensor& ids, const Tensor& weight, const Tensor& out, int64_t begin = 0,
                       int64_t vocab = 0);
// Accumulates dweight[ids[i] - begin] += dy[i] (dy (N, C)) for the ids in
// the shard, in row order (deterministic).
void embedding_backward(const Tensor& ids, const Tensor& dy, const Tensor& dweight, int64_t begin = 0,
                        int64_t vocab = 0);

// ---- unembedding: logits against a (V, C) weight stored like an embedding ----
// y (R, V) = x (R, C) w^T: a language model's output head tied to its token
// embedding.
void unembed_forward(const Tensor& x, const Tensor& w, const Tensor& y);
// dx (R, C) = dy (R, V) w.
void unembed_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx);
// Accumulates dw (V, C) += dy^T x.
void unembed_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw);

// ---- rotary position embedding (RoPE; Llama's, Hugging Face's rotate_half pairing) ----
// x, y (N, T, D) f32 contiguous (N = batch x heads), D even; positions (T)
// i64, each token's global position p (context parallelism passes its
// chunks' positions). For i < D/2, theta = p base^(-2i/D) (in double,
// rounded once to f32 cos and sin):
//   y[i] = x[i] cos - x[i + D/2] sin,  y[i + D/2] = x[i + D/2] cos + x[i] sin.
// inverse: the rotation by -theta, which is the backward (dx from dy). y may be x.
void rotary_embedding(const Tensor& x, const Tensor& positions, double base, bool inverse, const Tensor& y);

// ---- attention ----
// q, k, v, out (N, T, D) contiguous f32 (N = batch x heads); lse (N, T).
// out = softmax(scale q k^T, keys after the query masked when causal) v,
// computed blockwise with an online softmax (flash-attention style): memory
// grows with T, not T^2. lse[n][i] = log sum_j exp(scale q_i . k_j) over the
// keys row i sees: what the backward (and a context-parallel merge) needs.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                       const Tensor& out, const Tensor& lse);
// dq, dk, dv (N, T, D), written (accumulate: added to): the gradients
// given dout and the forward's out and lse (the probabilities are rebuilt
// tile by tile, never stored). Given the out and lse of a query block's
// attention over more keys than k holds (a context-parallel merge of
// several blocks), this is that block pair's exact share of the gradients.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, bool causal, double scale, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, bool accumulate = false);
// Merges the attention of the same queries over another block of keys into
// (out, lse) by the log-sum-exp rule, per row: L = log(e^lse + e^lse_b),
// out = out e^(lse - L) + out_b e^(lse_b - L), lse = L. A row whose lse is
// -inf (nothing merged yet) takes the block's as they are. out, out_b
// (N, T, D); lse, lse_b (N, T).
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b);
// The plain reference: the whole T x T probability matrix per (n); for
// tests and the kernel benchmark.
void attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                         const Tensor& out);

// ---- optimizer updates (PyTorch's single-tensor formulas, f32 arithmetic) ----
// The gradient may be f32, bf16 or f16; it is read as float(g) * float(grad_scale)
// (widened a chunk at a time when it is not f32 at scale 1). Updates are
// element-wise: a slice's update equals that slice of the whole update (a
// ZeRO rank updates the shard it owns).
struct AdamWStep {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;  // 0 for parameters that are not decayed
  int64_t step = 1;           // this update's 1-based number (bias correction), >= 1
  double grad_scale = 1.0;
};
// value, exp_avg, exp_avg_sq: f32, contiguous, one numel with grad; in place.
// rounded (both updates): undefined, or a contiguous bf16/f16 tensor of
// value's numel that receives the updated value rounded to its dtype in the
// same pass (mixed precision's working copy: nn::Parameter::rounded).
void adamw_step(const Tensor& value, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const AdamWStep& h, const Tensor& rounded = Tensor());
struct SgdStep {
  double lr = 1e-3, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false;
  bool first = true;  // the momentum buffer is initialized from this gradient
  double grad_scale = 1.0;
};
// momentum_buffer: f32 like value, or undefined when momentum == 0; in place.
void sgd_step(const Tensor& value, const Tensor& grad, const Tensor& momentum_buffer, const SgdStep& h,
              const Tensor& rounded = Tensor());

// The kernels one device provides (the CPU's are built in). Operands have
// been checked by the functions above.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) const = 0;
  virtual void linear_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx) const = 0;
  virtual void linear_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                      const Tensor& db) const = 0;
  virtual void bias_backward(const Tensor& dy, const Tensor& db) const = 0;
  virtual void bias_add(const Tensor& b, const Tensor& y) const = 0;
  virtual void activation_forward(ActivationKind kind, const Tensor& x, const Tensor& y) const = 0;
  virtual void activation_backward(ActivationKind kind, const Tensor& x, const Tensor& y, const Tensor& dy,
                                   const Tensor& dx) const = 0;
  virtual void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                  const Tensor& y, const Tensor& xhat, const Tensor& rstd) const = 0;
  virtual void layer_norm_backward_input(const Tensor& dy, const Tensor& xhat, const Tensor& rstd,
                                         const Tensor& gamma, const Tensor& dx) const = 0;
  virtual void layer_norm_backward_weight(const Tensor& dy, const Tensor& xhat, const Tensor& dgamma,
                                          const Tensor& dbeta) const = 0;
  virtual void rms_norm_forward(const Tensor& x, const Tensor& gamma, double eps, const Tensor& y,
                                const Tensor& xhat, const Tensor& rstd) const = 0;
  virtual void rms_norm_backward_input(const Tensor& dy, const Tensor& xhat, const Tensor& rstd,
                                       const Tensor& gamma, const Tensor& dx) const = 0;
  virtual void rotary_embedding(const Tensor& x, const Tensor& positions, double base, bool inverse,
                                const Tensor& y) const = 0;
  virtual void dropout_mask(uint64_t seed, uint64_t key, uint64_t start, double p, const Tensor& scale) const = 0;
  virtual double cross_entropy_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                                       double normalizer) const = 0;
  virtual void cross_entropy_backward(const Tensor& probs, const Tensor& labels, double factor,
                                      const Tensor& grad) const = 0;
  virtual double mse_forward(const Tensor& x, const Tensor& t, const Tensor& diff) const = 0;
  virtual double bce_with_logits_forward(const Tensor& x, const Tensor& t, const Tensor& grad_unscaled) const = 0;
  virtual double gaussian_kl_forward(const Tensor& mu, const Tensor& logvar, const Tensor& dmu,
                                     const Tensor& dlogvar) const = 0;
  virtual void scaled_copy(const Tensor& src, double factor, const Tensor& out) const = 0;
  virtual int64_t count_correct(const Tensor& logits, const Tensor& labels) const = 0;
  virtual void reparameterize(const Tensor& mu, const Tensor& logvar, const Tensor& eps, const Tensor& std,
                              const Tensor& z) const = 0;
  virtual void reparameterize_backward_logvar(const Tensor& dz, const Tensor& eps, const Tensor& std,
                                              const Tensor& dlogvar) const = 0;
  virtual void unembed_forward(const Tensor& x, const Tensor& w, const Tensor& y) const = 0;
  virtual void unembed_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx) const = 0;
  virtual void unembed_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw) const = 0;
  virtual void embedding_forward(const Tensor& ids, const Tensor& weight, const Tensor& out, int64_t begin) const = 0;
  virtual void embedding_backward(const Tensor& ids, const Tensor& dy, const Tensor& dweight,
                                  int64_t begin) const = 0;
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                                 const Tensor& out, const Tensor& lse) const = 0;
  virtual void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, const Tensor& dout, bool causal, double scale, const Tensor& dq,
                                  const Tensor& dk, const Tensor& dv, bool accumulate) const = 0;
  virtual void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b,
                               const Tensor& lse_b) const = 0;
  virtual void attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                                   const Tensor& out) const = 0;
  virtual void row_max(const Tensor& logits, const Tensor& max) const = 0;
  virtual void vocab_parallel_ce_partial(const Tensor& logits, const Tensor& labels, int64_t begin, const Tensor& max,
                                         const Tensor& probs, const Tensor& stats) const = 0;
  virtual double vocab_parallel_ce_finish(const Tensor& stats, const Tensor& probs) const = 0;
  virtual void vocab_parallel_ce_backward(const Tensor& probs, const Tensor& labels, int64_t begin, double factor,
                                          const Tensor& grad) const = 0;
  virtual void adamw_step(const Tensor& value, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                          const AdamWStep& h, const Tensor& rounded) const = 0;
  virtual void sgd_step(const Tensor& value, const Tensor& grad, const Tensor& momentum_buffer, const SgdStep& h,
                        const Tensor& rounded) const = 0;
};

// ---- The deterministic mode (docs/determinism.md), per calling thread ----
// rows > 0: the rows of one block of the canonical reduction tree
// (core/reduction_tree.h). While set, the products of linear and unembed
// run as fixed blocks of that many rows (core/matmul.h: a row's result does
// not depend on the other rows of the call or the thread count), and every
// sum over rows (weight and bias gradients, loss totals) sums each block in
// row order and the blocks in the canonical tree, so the sum over a call
// that holds whole blocks is a node of the tree over the global batch's
// blocks. Every call's rows must then be a whole number of blocks. Kernels
// that have no deterministic form yet throw Unsupported while it is set.
// 0 (the default) turns it off.
void set_deterministic_rows(int64_t rows);
int64_t deterministic_rows();
// Sets the calling thread's rows while it lives, then restores them.
class DeterministicRowsScope {
 public:
  explicit DeterministicRowsScope(int64_t rows) : previous_(deterministic_rows()) { set_deterministic_rows(rows); }
  ~DeterministicRowsScope() { set_deterministic_rows(previous_); }
  DeterministicRowsScope(const DeterministicRowsScope&) = delete;
  DeterministicRowsScope& operator=(const DeterministicRowsScope&) = delete;

 private:
  int64_t previous_;
};

// Per-op wall time, for benchmarks: while a thread profiles, every function
// above that it calls adds its kernel's time under its name
// ("functional::linear_forward"), and so does every ProfileScope it opens
// (code outside the kernels: the tensor-parallel collectives time
// themselves as "tp all_reduce", "tp all_gather", "tp reduce_scatter").
// Per thread: a rank profiles its own calls.
//   set_op_profiling(true);  /* steps */  for (auto& o : op_profile()) ...;
struct OpTime {
  std::string op;
  int64_t calls = 0;
  double seconds = 0;
};
void set_op_profiling(bool on);
// This thread's times, the largest first.
std::vector<OpTime> op_profile();
void reset_op_profile();

// Adds its lifetime's wall time, and one call, to `op`'s entry of this
// thread's profile when the thread profiles at construction (otherwise it
// costs one thread-local read). `op` must outlive the scope (a string
// literal). Do not nest a scope in another or around a kernel above: each
// would count the inner time, so the profile's sum would exceed the step.
//   { functional::ProfileScope scope("tp all_reduce"); comm.all_reduce(...); }
class ProfileScope {
 public:
  explicit ProfileScope(const char* op);
  ~ProfileScope();
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  const char* op_;  // null: this thread was not profiling
  std::chrono::steady_clock::time_point t0_;
};

// Installs the kernels for one device type (replacing any; the CPU's may be
// replaced too, e.g. by a oneDNN backend). Call at start-up, before kernels run.
void register_backend(DeviceType device, std::unique_ptr<Backend> backend);
// The backend for `device`; Unsupported when none is registered.
const Backend& backend_for(Device device);

}  // namespace meshtrain::nn::functional
