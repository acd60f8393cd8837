#include "meshtrain/nn/functional.h"

#include "meshtrain/core/matmul.h"

#include <fmt/format.h>

#include <cmath>

#include <algorithm>
#include <array>
#include <chrono>
#include <initializer_list>
#include <mutex>
#include <string>
#include <utility>

#include "meshtrain/core/error.h"
#include "meshtrain/nn/internal/cpu_backend.h"

namespace meshtrain::nn::functional {

namespace {

struct Registry {
  std::mutex mu;
  std::array<std::unique_ptr<Backend>, 2> backends;  // by DeviceType
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: kernels may run during static destruction
    reg->backends[static_cast<size_t>(DeviceType::cpu)] = internal::make_cpu_backend();
    return reg;
  }();
  return *r;
}

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return fmt::format("{} {}", dtype_name(t.dtype()), shape_to_string(t.shape()));
}

// Every operand: defined, contiguous, of `dtype`.
void check(const char* op, const char* what, const Tensor& t, DType dtype = DType::f32) {
  if (!t.defined() || t.dtype() != dtype || !t.is_contiguous())
    throw InvalidArgument(op, fmt::format("{} is {}", what, describe(t)),
                          fmt::format("pass a contiguous {} tensor", dtype_name(dtype)));
}

void check_shape(const char* op, const char* what, const Tensor& t, const std::vector<int64_t>& want) {
  if (t.shape() != want)
    throw InvalidArgument(op, fmt::format("{} has shape {}, expected {}", what, shape_to_string(t.shape()),
                                          shape_to_string(want)),
                          "see nn/functional.h for each operand's shape");
}

void check_matrix(const char* op, const char* what, const Tensor& t) {
  check(op, what, t);
  if (t.dim() != 2) throw InvalidArgument(op, fmt::format("{} is {}", what, describe(t)), "pass a 2-d (rows, features) tensor");
}

// A GEMM operand pair: 2-d, contiguous, both f32 or both bf16/f16 of one
// dtype (half-precision operands, f32 accumulation and outputs).
void check_gemm_pair(const char* op, const char* wa, const Tensor& a, const char* wb, const Tensor& b) {
  const DType d = a.defined() ? a.dtype() : DType::f32;
  if (d != DType::f32 && d != DType::bf16 && d != DType::f16)
    throw InvalidArgument(op, fmt::format("{} is {}", wa, describe(a)), "pass f32, bf16 or f16 GEMM operands");
  check(op, wa, a, d);
  if (a.dim() != 2) throw InvalidArgument(op, fmt::format("{} is {}", wa, describe(a)), "pass a 2-d (rows, features) tensor");
  if (!b.defined() || b.dtype() != d)
    throw InvalidArgument(op, fmt::format("{} is {} but {} is {}", wa, describe(a), wb, describe(b)),
                          "GEMM operands share one dtype: f32, or bf16/f16 for a half-precision product");
  check(op, wb, b, d);
  if (b.dim() != 2) throw InvalidArgument(op, fmt::format("{} is {}", wb, describe(b)), "pass a 2-d (rows, features) tensor");
}

// This thread's op profile (set_op_profiling), by op name.
struct Profile {
  bool on = false;
  std::vector<OpTime> ops;
};
thread_local Profile t_profile;
// This thread's deterministic mode (set_deterministic_rows): 0 off.
thread_local int64_t t_deterministic_rows = 0;

// The backend an op runs on, and the op's timer: a temporary that lives to
// the end of the call expression `dispatch(...)->kernel(...)`.
struct Dispatched {
  const Backend& backend;
  ProfileScope timer;
  const Backend* operator->() const { return &backend; }
};

// One device for all defined operands; returns its backend.
Dispatched dispatch(const char* op, std::initializer_list<const Tensor*> operands) {
  const Tensor* first = nullptr;
  for (const Tensor* t : operands) {
    if (!t->defined()) continue;
    if (first == nullptr) {
      first = t;
    } else if (!(t->device() == first->device())) {
      throw InvalidArgument(op, "operands live on different devices", "move them to one device first");
    }
  }
  return {backend_for(first != nullptr ? first->device() : Device{}), ProfileScope(op)};
}

// Token ids: 1-d i64 or i32, each in [0, rows).
void check_ids(const char* op, const Tensor& ids, int64_t rows) {
  if (!ids.defined() || ids.dim() != 1 || !ids.is_contiguous() ||
      (ids.dtype() != DType::i64 && ids.dtype() != DType::i32))
    throw InvalidArgument(op, fmt::format("ids are {}", describe(ids)), "pass a contiguous 1-d i64 or i32 tensor");
  for (int64_t i = 0; i < ids.size(0); ++i) {
    const int64_t id = ids.dtype() == DType::i64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i];
    if (id < 0 || id >= rows)
      throw InvalidArgument(op, fmt::format("id {} at position {} is outside [0, {})", id, i, rows),
                            "token ids must be below the vocabulary size (check the tokenizer and the model)");
  }
}

void check_labels(const char* op, const Tensor& labels, int64_t n, int64_t classes) {
  check(op, "labels", labels, DType::i64);
  check_shape(op, "labels", labels, {n});
  const int64_t* y = labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (y[i] < 0 || y[i] >= classes)
      throw InvalidArgument(op, fmt::format("label {} of row {} is outside [0, {})", y[i], i, classes),
                            "labels are class indices");
}

// Kernels with no deterministic form yet refuse to run in the mode rather
// than give bits that depend on the layout.
void no_deterministic_form(const char* op) {
  if (t_deterministic_rows > 0)
    throw Unsupported(op, "this kernel has no deterministic form yet",
                      "train without --deterministic (docs/determinism.md lists what the mode supports)");
}

}  // namespace

void set_op_profiling(bool on) { t_profile.on = on; }

void set_deterministic_rows(int64_t rows) {
  if (rows < 0)
    throw InvalidArgument("functional::set_deterministic_rows", fmt::format("rows {}", rows),
                          "use 0 (off) or the rows of one block");
  t_deterministic_rows = rows;
  set_deterministic_products(rows > 0);  // attention's tiles and every other product here
}

int64_t deterministic_rows() { return t_deterministic_rows; }

ProfileScope::ProfileScope(const char* op) : op_(t_profile.on ? op : nullptr) {
  if (op_ != nullptr) t0_ = std::chrono::steady_clock::now();
}

ProfileScope::~ProfileScope() {
  if (op_ == nullptr) return;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  auto it = std::find_if(t_profile.ops.begin(), t_profile.ops.end(), [&](const OpTime& o) { return o.op == op_; });
  if (it == t_profile.ops.end()) it = t_profile.ops.insert(it, OpTime{op_, 0, 0});
  ++it->calls;
  it->seconds += s;
}

std::vector<OpTime> op_profile() {
  std::vector<OpTime> out = t_profile.ops;
  std::stable_sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

void reset_op_profile() { t_profile.ops.clear(); }

void register_backend(DeviceType device, std::unique_ptr<Backend> backend) {
  if (!backend) throw InvalidArgument("register_backend", "backend is null", "pass a Backend");
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  r.backends[static_cast<size_t>(device)] = std::move(backend);
}

const Backend& backend_for(Device device) {
  Registry& r = registry();
  const Backend* b = r.backends[static_cast<size_t>(device.type)].get();
  if (b == nullptr)
    throw Unsupported("nn::functional", fmt::format("no kernels registered for device {}",
                                                    device.type == DeviceType::cuda ? "cuda" : "cpu"),
                      "build with that device's backend, or move the tensors to the cpu");
  return *b;
}

void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  const char* op = "functional::linear_forward";
  check_gemm_pair(op, "x", x, "w", w);
  check_shape(op, "w", w, {x.size(1), w.size(1)});
  check_shape(op, "y", y, {x.size(0), w.size(1)});
  check(op, "y", y);
  if (b.defined()) {
    check(op, "b", b);
    check_shape(op, "b", b, {w.size(1)});
  }
  dispatch(op, {&x, &w, &b, &y})->linear_forward(x, w, b, y);
}

void linear_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx) {
  const char* op = "functional::linear_backward_input";
  check_gemm_pair(op, "dy", dy, "w", w);
  check_shape(op, "w", w, {w.size(0), dy.size(1)});
  check(op, "dx", dx);
  check_shape(op, "dx", dx, {dy.size(0), w.size(0)});
  dispatch(op, {&dy, &w, &dx})->linear_backward_input(dy, w, dx);
}

void linear_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw, const Tensor& db) {
  const char* op = "functional::linear_backward_weight";
  check_gemm_pair(op, "x", x, "dy", dy);
  check_shape(op, "dy", dy, {x.size(0), dy.size(1)});
  check(op, "dw", dw);
  check_shape(op, "dw", dw, {x.size(1), dy.size(1)});
  if (db.defined()) {
    check(op, "db", db);
    check_shape(op, "db", db, {dy.size(1)});
  }
  dispatch(op, {&x, &dy, &dw, &db})->linear_backward_weight(x, dy, dw, db);
}

void bias_add(const Tensor& b, const Tensor& y) {
  const char* op = "functional::bias_add";
  check_matrix(op, "y", y);
  check(op, "b", b);
  check_shape(op, "b", b, {y.size(1)});
  dispatch(op, {&b, &y})->bias_add(b, y);
}

void bias_backward(const Tensor& dy, const Tensor& db) {
  const char* op = "functional::bias_backward";
  check_gemm_pair(op, "dy", dy, "dy", dy);
  check(op, "db", db);
  check_shape(op, "db", db, {dy.size(1)});
  dispatch(op, {&dy, &db})->bias_backward(dy, db);
}

void activation_forward(ActivationKind kind, const Tensor& x, const Tensor& y) {
  const char* op = "functional::activation_forward";
  check(op, "x", x);
  check(op, "y", y);
  check_shape(op, "y", y, x.shape());
  dispatch(op, {&x, &y})->activation_forward(kind, x, y);
}

void activation_backward(ActivationKind kind, const Tensor& x, const Tensor& y, const Tensor& dy, const Tensor& dx) {
  const char* op = "functional::activation_backward";
  for (auto [what, t] : {std::pair{"x", &x}, {"y", &y}, {"dy", &dy}, {"dx", &dx}}) {
    check(op, what, *t);
    check_shape(op, what, *t, x.shape());
  }
  dispatch(op, {&x, &y, &dy, &dx})->activation_backward(kind, x, y, dy, dx);
}

void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, const Tensor& y,
                        const Tensor& xhat, const Tensor& rstd) {
  const char* op = "functional::layer_norm_forward";
  check_matrix(op, "x", x);
  const int64_t rows = x.size(0), dim = x.size(1);
  check(op, "y", y);
  check_shape(op, "y", y, x.shape());
  check(op, "xhat", xhat);
  check_shape(op, "xhat", xhat, x.shape());
  check(op, "rstd", rstd);
  check_shape(op, "rstd", rstd, {rows});
  if (gamma.defined() != beta.defined())
    throw InvalidArgument(op, "gamma and beta: one is undefined", "pass both (affine) or neither");
  if (gamma.defined()) {
    check(op, "gamma", gamma);
    check_shape(op, "gamma", gamma, {dim});
    check(op, "beta", beta);
    check_shape(op, "beta", beta, {dim});
  }
  dispatch(op, {&x, &gamma, &beta, &y, &xhat, &rstd})->layer_norm_forward(x, gamma, beta, eps, y, xhat, rstd);
}

void layer_norm_backward_input(const Tensor& dy, const Tensor& xhat, const Tensor& rstd, const Tensor& gamma,
                               const Tensor& dx) {
  const char* op = "functional::layer_norm_backward_input";
  check_matrix(op, "xhat", xhat);
  check(op, "dy", dy);
  check_shape(op, "dy", dy, xhat.shape());
  check(op, "dx", dx);
  check_shape(op, "dx", dx, xhat.shape());
  check(op, "rstd", rstd);
  check_shape(op, "rstd", rstd, {xhat.size(0)});
  if (gamma.defined()) {
    check(op, "gamma", gamma);
    check_shape(op, "gamma", gamma, {xhat.size(1)});
  }
  dispatch(op, {&dy, &xhat, &rstd, &gamma, &dx})->layer_norm_backward_input(dy, xhat, rstd, gamma, dx);
}

void layer_norm_backward_weight(const Tensor& dy, const Tensor& xhat, const Tensor& dgamma, const Tensor& dbeta) {
  const char* op = "functional::layer_norm_backward_weight";
  check_matrix(op, "xhat", xhat);
  check(op, "dy", dy);
  check_shape(op, "dy", dy, xhat.shape());
  for (auto [what, t] : {std::pair{"dgamma", &dgamma}, {"dbeta", &dbeta}}) {
    if (t == &dbeta && !dbeta.defined()) continue;  // RMSNorm's: gamma only
    check(op, what, *t);
    check_shape(op, what, *t, {xhat.size(1)});
  }
  dispatch(op, {&dy, &xhat, &dgamma, &dbeta})->layer_norm_backward_weight(dy, xhat, dgamma, dbeta);
}

void rms_norm_forward(const Tensor& x, const Tensor& gamma, double eps, const Tensor& y, const Tensor& xhat,
                      const Tensor& rstd) {
  const char* op = "functional::rms_norm_forward";
  check_matrix(op, "x", x);
  const int64_t rows = x.size(0), dim = x.size(1);
  for (auto [what, t] : {std::pair{"y", &y}, {"xhat", &xhat}}) {
    check(op, what, *t);
    check_shape(op, what, *t, x.shape());
  }
  check(op, "rstd", rstd);
  check_shape(op, "rstd", rstd, {rows});
  if (gamma.defined()) {
    check(op, "gamma", gamma);
    check_shape(op, "gamma", gamma, {dim});
  }
  if (!(eps > 0.0) || !std::isfinite(eps))
    throw InvalidArgument(op, fmt::format("eps = {}", eps), "use a finite eps > 0");
  dispatch(op, {&x, &gamma, &y, &xhat, &rstd})->rms_norm_forward(x, gamma, eps, y, xhat, rstd);
}

void rms_norm_backward_input(const Tensor& dy, const Tensor& xhat, const Tensor& rstd, const Tensor& gamma,
                             const Tensor& dx) {
  const char* op = "functional::rms_norm_backward_input";
  check_matrix(op, "xhat", xhat);
  for (auto [what, t] : {std::pair{"dy", &dy}, {"dx", &dx}}) {
    check(op, what, *t);
    check_shape(op, what, *t, xhat.shape());
  }
  check(op, "rstd", rstd);
  check_shape(op, "rstd", rstd, {xhat.size(0)});
  if (gamma.defined()) {
    check(op, "gamma", gamma);
    check_shape(op, "gamma", gamma, {xhat.size(1)});
  }
  dispatch(op, {&dy, &xhat, &rstd, &gamma, &dx})->rms_norm_backward_input(dy, xhat, rstd, gamma, dx);
}

void rotary_embedding(const Tensor& x, const Tensor& positions, double base, bool inverse, const Tensor& y) {
  const char* op = "functional::rotary_embedding";
  check(op, "x", x);
  if (x.dim() != 3 || x.size(2) % 2 != 0)
    throw InvalidArgument(op, fmt::format("x {}", shape_to_string(x.shape())),
                          "pass (batch x heads, T, head dim) with an even head dim");
  check(op, "y", y);
  check_shape(op, "y", y, x.shape());
  if (!positions.defined() || positions.dtype() != DType::i64 || positions.dim() != 1 ||
      positions.size(0) != x.size(1) || !positions.is_contiguous())
    throw InvalidArgument(op, fmt::format("positions {}", positions.defined() ? shape_to_string(positions.shape()) : "undefined"),
                          fmt::format("pass ({}) i64 positions, one per time step", x.size(1)));
  if (!(base > 1.0) || !std::isfinite(base))
    throw InvalidArgument(op, fmt::format("base {}", base), "use a finite base > 1 (Llama: 10000 or 500000)");
  dispatch(op, {&x, &y})->rotary_embedding(x, positions, base, inverse, y);
}

void dropout_mask(uint64_t seed, uint64_t key, uint64_t start, double p, const Tensor& scale) {
  const char* op = "functional::dropout_mask";
  check(op, "scale", scale);
  if (!(p >= 0.0 && p <= 1.0)) throw InvalidArgument(op, fmt::format("p = {}", p), "use 0 <= p <= 1");
  dispatch(op, {&scale})->dropout_mask(seed, key, start, p, scale);
}

double cross_entropy_forward(const Tensor& logits, const Tensor& labels, const Tensor& probs, double normalizer) {
  const char* op = "functional::cross_entropy_forward";
  check_matrix(op, "logits", logits);
  check_labels(op, labels, logits.size(0), logits.size(1));
  check(op, "probs", probs);
  check_shape(op, "probs", probs, logits.shape());
  if (!(normalizer > 0))
    throw InvalidArgument(op, fmt::format("normalizer {}", normalizer), "divide by a positive count");
  return dispatch(op, {&logits, &labels, &probs})->cross_entropy_forward(logits, labels, probs, normalizer);
}

void cross_entropy_backward(const Tensor& probs, const Tensor& labels, double factor, const Tensor& grad) {
  const char* op = "functional::cross_entropy_backward";
  check_matrix(op, "probs", probs);
  check_labels(op, labels, probs.size(0), probs.size(1));
  check(op, "grad", grad);
  check_shape(op, "grad", grad, probs.shape());
  dispatch(op, {&probs, &labels, &grad})->cross_entropy_backward(probs, labels, factor, grad);
}

void row_max(const Tensor& logits, const Tensor& max) {
  const char* op = "functional::row_max";
  check_matrix(op, "logits", logits);
  check(op, "max", max);
  check_shape(op, "max", max, {logits.size(0)});
  dispatch(op, {&logits, &max})->row_max(logits, max);
}

// Labels (N) i64, non-negative global ids (any may fall outside the shard
// that begins at vocabulary id `begin`).
void check_shard_labels(const char* op, const Tensor& labels, int64_t n, int64_t begin) {
  if (begin < 0)
    throw InvalidArgument(op, fmt::format("shard begins at column {}", begin), "begin is the shard's first vocabulary id");
  check(op, "labels", labels, DType::i64);
  check_shape(op, "labels", labels, {n});
  const int64_t* y = labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (y[i] < 0)
      throw InvalidArgument(op, fmt::format("label {} of row {} is negative", y[i], i), "labels are vocabulary ids");
}

void vocab_parallel_ce_partial(const Tensor& logits, const Tensor& labels, int64_t begin, const Tensor& max,
                               const Tensor& probs, const Tensor& stats) {
  const char* op = "functional::vocab_parallel_ce_partial";
  no_deterministic_form(op);
  check_matrix(op, "logits", logits);
  const int64_t n = logits.size(0);
  check_shard_labels(op, labels, n, begin);
  check(op, "max", max);
  check_shape(op, "max", max, {n});
  check(op, "probs", probs);
  check_shape(op, "probs", probs, logits.shape());
  check(op, "stats", stats, DType::f64);
  check_shape(op, "stats", stats, {n, 2});
  dispatch(op, {&logits, &labels, &max, &probs, &stats})->vocab_parallel_ce_partial(logits, labels, begin, max, probs, stats);
}

double vocab_parallel_ce_finish(const Tensor& stats, const Tensor& probs) {
  const char* op = "functional::vocab_parallel_ce_finish";
  no_deterministic_form(op);
  check_matrix(op, "probs", probs);
  check(op, "stats", stats, DType::f64);
  check_shape(op, "stats", stats, {probs.size(0), 2});
  return dispatch(op, {&stats, &probs})->vocab_parallel_ce_finish(stats, probs);
}

void vocab_parallel_ce_backward(const Tensor& probs, const Tensor& labels, int64_t begin, double factor,
                                const Tensor& grad) {
  const char* op = "functional::vocab_parallel_ce_backward";
  check_matrix(op, "probs", probs);
  check_shard_labels(op, labels, probs.size(0), begin);
  check(op, "grad", grad);
  check_shape(op, "grad", grad, probs.shape());
  dispatch(op, {&probs, &labels, &grad})->vocab_parallel_ce_backward(probs, labels, begin, factor, grad);
}

double mse_forward(const Tensor& x, const Tensor& t, const Tensor& diff) {
  const char* op = "functional::mse_forward";
  no_deterministic_form(op);
  for (auto [what, p] : {std::pair{"x", &x}, {"t", &t}, {"diff", &diff}}) {
    check(op, what, *p);
    check_shape(op, what, *p, x.shape());
  }
  return dispatch(op, {&x, &t, &diff})->mse_forward(x, t, diff);
}

double bce_with_logits_forward(const Tensor& x, const Tensor& t, const Tensor& grad_unscaled) {
  const char* op = "functional::bce_with_logits_forward";
  no_deterministic_form(op);
  for (auto [what, p] : {std::pair{"x", &x}, {"t", &t}, {"grad_unscaled", &grad_unscaled}}) {
    check(op, what, *p);
    check_shape(op, what, *p, x.shape());
  }
  return dispatch(op, {&x, &t, &grad_unscaled})->bce_with_logits_forward(x, t, grad_unscaled);
}

double gaussian_kl_forward(const Tensor& mu, const Tensor& logvar, const Tensor& dmu, const Tensor& dlogvar) {
  const char* op = "functional::gaussian_kl_forward";
  no_deterministic_form(op);
  for (auto [what, p] : {std::pair{"mu", &mu}, {"logvar", &logvar}, {"dmu", &dmu}, {"dlogvar", &dlogvar}}) {
    check(op, what, *p);
    check_shape(op, what, *p, mu.shape());
  }
  return dispatch(op, {&mu, &logvar, &dmu, &dlogvar})->gaussian_kl_forward(mu, logvar, dmu, dlogvar);
}

void scaled_copy(const Tensor& src, double factor, const Tensor& out) {
  const char* op = "functional::scaled_copy";
  check(op, "src", src);
  check(op, "out", out);
  check_shape(op, "out", out, src.shape());
  dispatch(op, {&src, &out})->scaled_copy(src, factor, out);
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  const char* op = "functional::count_correct";
  check_matrix(op, "logits", logits);
  if (logits.size(1) < 1) throw InvalidArgument(op, "logits have no classes", "pass (N, C), C >= 1");
  check_labels(op, labels, logits.size(0), logits.size(1));
  return dispatch(op, {&logits, &labels})->count_correct(logits, labels);
}

void reparameterize(const Tensor& mu, const Tensor& logvar, const Tensor& eps, const Tensor& std, const Tensor& z) {
  const char* op = "functional::reparameterize";
  for (auto [what, p] : {std::pair{"mu", &mu}, {"logvar", &logvar}, {"eps", &eps}, {"std", &std}, {"z", &z}}) {
    check(op, what, *p);
    check_shape(op, what, *p, mu.shape());
  }
  dispatch(op, {&mu, &logvar, &eps, &std, &z})->reparameterize(mu, logvar, eps, std, z);
}

void reparameterize_backward_logvar(const Tensor& dz, const Tensor& eps, const Tensor& std, const Tensor& dlogvar) {
  const char* op = "functional::reparameterize_backward_logvar";
  for (auto [what, p] : {std::pair{"dz", &dz}, {"eps", &eps}, {"std", &std}, {"dlogvar", &dlogvar}}) {
    check(op, what, *p);
    check_shape(op, what, *p, dz.shape());
  }
  dispatch(op, {&dz, &eps, &std, &dlogvar})->reparameterize_backward_logvar(dz, eps, std, dlogvar);
}

// The full vocabulary of a shard of `rows` starting at `begin`.
int64_t checked_vocab(const char* op, int64_t rows, int64_t begin, int64_t vocab) {
  if (vocab == 0) vocab = rows;
  if (begin < 0 || begin + rows > vocab)
    throw InvalidArgument(op, fmt::format("a shard of {} rows at id {} of a vocabulary of {}", rows, begin, vocab),
                          "the shard must lie inside the vocabulary");
  return vocab;
}

void embedding_forward(const Tensor& ids, const Tensor& weight, const Tensor& out, int64_t begin, int64_t vocab) {
  const char* op = "functional::embedding_forward";
  // The table may be bf16/f16 (mixed precision keeps it so): rows are widened to f32.
  const DType wd = weight.defined() ? weight.dtype() : DType::f32;
  check(op, "weight", weight, wd == DType::bf16 || wd == DType::f16 ? wd : DType::f32);
  if (weight.dim() != 2)
    throw InvalidArgument(op, fmt::format("weight is {}", describe(weight)), "pass a 2-d (rows, features) tensor");
  check_ids(op, ids, checked_vocab(op, weight.size(0), begin, vocab));
  check(op, "out", out);
  check_shape(op, "out", out, {ids.size(0), weight.size(1)});
  dispatch(op, {&ids, &weight, &out})->embedding_forward(ids, weight, out, begin);
}

void embedding_backward(const Tensor& ids, const Tensor& dy, const Tensor& dweight, int64_t begin, int64_t vocab) {
  const char* op = "functional::embedding_backward";
  check_matrix(op, "dweight", dweight);
  check_ids(op, ids, checked_vocab(op, dweight.size(0), begin, vocab));
  check(op, "dy", dy);
  check_shape(op, "dy", dy, {ids.size(0), dweight.size(1)});
  dispatch(op, {&ids, &dy, &dweight})->embedding_backward(ids, dy, dweight, begin);
}

void unembed_forward(const Tensor& x, const Tensor& w, const Tensor& y) {
  const char* op = "functional::unembed_forward";
  check_gemm_pair(op, "x", x, "w", w);
  check_shape(op, "w", w, {w.size(0), x.size(1)});
  check(op, "y", y);
  check_shape(op, "y", y, {x.size(0), w.size(0)});
  dispatch(op, {&x, &w, &y})->unembed_forward(x, w, y);
}

void unembed_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx) {
  const char* op = "functional::unembed_backward_input";
  check_gemm_pair(op, "dy", dy, "w", w);
  check_shape(op, "w", w, {dy.size(1), w.size(1)});
  check(op, "dx", dx);
  check_shape(op, "dx", dx, {dy.size(0), w.size(1)});
  dispatch(op, {&dy, &w, &dx})->unembed_backward_input(dy, w, dx);
}

void unembed_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dw) {
  const char* op = "functional::unembed_backward_weight";
  check_gemm_pair(op, "x", x, "dy", dy);
  check_shape(op, "dy", dy, {x.size(0), dy.size(1)});
  check(op, "dw", dw);
  check_shape(op, "dw", dw, {dy.size(1), x.size(1)});
  dispatch(op, {&x, &dy, &dw})->unembed_backward_weight(x, dy, dw);
}

namespace {

// q, k, v and the outputs (N, T, D), lse (N, T).
void check_attention(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> mats,
                     const Tensor& lse) {
  const Tensor& q = *mats.begin()->second;
  check(op, "q", q);
  if (q.dim() != 3)
    throw InvalidArgument(op, fmt::format("q is {}", describe(q)), "pass (batch x heads, T, head_dim)");
  for (auto [what, t] : mats) {
    check(op, what, *t);
    check_shape(op, what, *t, q.shape());
  }
  if (lse.defined()) {
    check(op, "lse", lse);
    check_shape(op, "lse", lse, {q.size(0), q.size(1)});
  }
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                       const Tensor& out, const Tensor& lse) {
  const char* op = "functional::attention_forward";
  if (!lse.defined()) throw InvalidArgument(op, "lse is undefined", "pass an (N, T) f32 tensor");
  check_attention(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, lse);
  dispatch(op, {&q, &k, &v, &out, &lse})->attention_forward(q, k, v, causal, scale, out, lse);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, bool causal, double scale, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, bool accumulate) {
  const char* op = "functional::attention_backward";
  if (!lse.defined()) throw InvalidArgument(op, "lse is undefined", "pass the forward's lse");
  check_attention(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout}, {"dq", &dq}, {"dk", &dk},
                       {"dv", &dv}},
                  lse);
  dispatch(op, {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv})
      ->attention_backward(q, k, v, out, lse, dout, causal, scale, dq, dk, dv, accumulate);
}

void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  const char* op = "functional::attention_merge";
  check_attention(op, {{"out", &out}, {"out_b", &out_b}}, lse);
  if (!lse.defined() || !lse_b.defined()) throw InvalidArgument(op, "lse or lse_b is undefined", "pass (N, T) f32 tensors");
  check(op, "lse_b", lse_b);
  check_shape(op, "lse_b", lse_b, lse.shape());
  dispatch(op, {&out, &lse, &out_b, &lse_b})->attention_merge(out, lse, out_b, lse_b);
}

void attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                         const Tensor& out) {
  const char* op = "functional::attention_reference";
  check_attention(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, Tensor());
  dispatch(op, {&q, &k, &v, &out})->attention_reference(q, k, v, causal, scale, out);
}

namespace {

void check_update(const char* op, const Tensor& value, const Tensor& grad,
                  std::initializer_list<std::pair<const char*, const Tensor*>> state) {
  check(op, "value", value);
  if (!grad.defined() || !grad.is_contiguous() ||
      (grad.dtype() != DType::f32 && grad.dtype() != DType::bf16 && grad.dtype() != DType::f16) ||
      grad.numel() != value.numel())
    throw InvalidArgument(op, fmt::format("grad is {} for a value of {} elements", describe(grad), value.numel()),
                          "pass a contiguous f32, bf16 or f16 gradient with the value's element count");
  for (auto [what, t] : state) {
    check(op, what, *t);
    if (t->numel() != value.numel())
      throw InvalidArgument(op, fmt::format("{} has {} elements, the value {}", what, t->numel(), value.numel()),
                            "keep optimizer state shaped like the parameter");
  }
}

// An optimizer's rounded copy: undefined, or contiguous bf16/f16 of value's numel.
void check_rounded(const char* op, const Tensor& value, const Tensor& rounded) {
  if (!rounded.defined()) return;
  if (!rounded.is_contiguous() || (rounded.dtype() != DType::bf16 && rounded.dtype() != DType::f16) ||
      rounded.numel() != value.numel())
    throw InvalidArgument(op, fmt::format("rounded is {} for a value of {} elements", describe(rounded), value.numel()),
                          "pass a contiguous bf16 or f16 tensor with the value's element count, or none");
}

}  // namespace

void adamw_step(const Tensor& value, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const AdamWStep& h, const Tensor& rounded) {
  const char* op = "functional::adamw_step";
  if (h.step < 1)
    throw InvalidArgument(op, fmt::format("step {} < 1", h.step),
                          "pass the 1-based number of this update (the state's step count after it)");
  check_update(op, value, grad, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  check_rounded(op, value, rounded);
  dispatch(op, {&value, &grad, &exp_avg, &exp_avg_sq, &rounded})->adamw_step(value, grad, exp_avg, exp_avg_sq, h, rounded);
}

void sgd_step(const Tensor& value, const Tensor& grad, const Tensor& momentum_buffer, const SgdStep& h,
              const Tensor& rounded) {
  const char* op = "functional::sgd_step";
  if (h.momentum != 0.0 && !momentum_buffer.defined())
    throw InvalidArgument(op, "momentum > 0 but no momentum buffer", "pass a zeroed f32 buffer like the value");
  if (momentum_buffer.defined())
    check_update(op, value, grad, {{"momentum_buffer", &momentum_buffer}});
  else
    check_update(op, value, grad, {});
  check_rounded(op, value, rounded);
  dispatch(op, {&value, &grad, &momentum_buffer, &rounded})->sgd_step(value, grad, momentum_buffer, h, rounded);
}

}  // namespace meshtrain::nn::functional
