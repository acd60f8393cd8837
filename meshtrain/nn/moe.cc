#include "meshtrain/nn/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "meshtrain/core/error.h"
#include "meshtrain/core/ops.h"
#include "meshtrain/nn/functional.h"
#include "meshtrain/nn/internal/buffers.h"
#include "meshtrain/nn/linear.h"

namespace meshtrain::nn {

// What one forward keeps for its backward. An assignment is (token n,
// slot j), numbered n * top_k + j; the dispatch order lists the kept ones
// by expert, then token.
struct MoE::State {
  int64_t tokens = 0, steps = 0;   // rows, and steps per sequence
  Tensor x;                        // (tokens, width) the input rows
  Tensor scores;                   // (tokens, experts) s
  std::vector<int32_t> expert;     // per assignment
  std::vector<float> weight;       // per assignment: w (before dropping)
  std::vector<int64_t> row;        // per assignment: index in the dispatch order, -1 if dropped
  std::vector<int64_t> order;      // the dispatch order (assignment ids)
  std::vector<int64_t> send_rows;  // [rank][local expert]: rows this rank sends each expert
  std::vector<int64_t> recv_rows;  // [rank][local expert]: rows each rank sends this one's experts
  std::vector<float> aux_grad;     // (sequences, experts): d L_aux / d p_{t,e}, the same for every t
  Tensor out;                      // (kept, width) the experts' outputs, dispatch order
};

namespace {

const MoEConfig& checked(const MoEConfig& c) {
  auto require = [&](bool ok, const std::string& what, const std::string& hint) {
    if (!ok) throw InvalidArgument("MoE", fmt::format("'{}': {}", c.prefix, what), hint);
  };
  require(c.width >= 1 && c.moe.expert_hidden >= 1,
          fmt::format("width {}, expert_hidden {}", c.width, c.moe.expert_hidden),
          "both must be >= 1");
  require(c.moe.experts >= 1 && c.moe.top_k >= 1 && c.moe.top_k <= c.moe.experts,
          fmt::format("experts {}, top_k {}", c.moe.experts, c.moe.top_k), "need 1 <= top_k <= experts");
  require(c.moe.shared_experts >= 0, fmt::format("shared_experts {}", c.moe.shared_experts), "must be >= 0");
  require(c.moe.aux_loss_coef >= 0.0 && c.moe.capacity_factor >= 0.0,
          fmt::format("aux_loss_coef {}, capacity_factor {}", c.moe.aux_loss_coef, c.moe.capacity_factor),
          "both must be >= 0 (capacity_factor 0: no dropping)");
  require(c.moe.experts % c.expert.size() == 0,
          fmt::format("{} experts over {} expert-parallel ranks", c.moe.experts, c.expert.size()),
          "the expert axis must divide the number of experts");
  require(!c.tensor.splits_sequence(), "sequence parallelism",
          "run the MoE layers without +sp (tensor parallelism alone splits the experts)");
  return c;
}

SwiGLUConfig expert_config(const MoEConfig& c, const std::string& name, int64_t hidden) {
  return {.width = c.width, .hidden = hidden, .prefix = internal::join_name(c.prefix, name), .seed = c.seed,
          .init_std = c.init_std, .out_std = c.out_std, .defer_init = c.defer_init, .tensor = c.tensor};
}

// Rows `rows` of src (width floats each) copied to dst in order.
void gather_rows(const float* src, const std::vector<int64_t>& rows, int64_t width, float* dst) {
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(dst + static_cast<int64_t>(i) * width, src + rows[i] * width, sizeof(float) * width);
}

}  // namespace

MoE::MoE(const MoEConfig& config) : config_(checked(config)) {
  const int local = config_.moe.experts / config_.expert.size();
  first_ = config_.expert.rank() * local;
  LinearOptions router{.bias = false, .defer_init = config_.defer_init, .init_std = config_.init_std};
  router_ = std::make_unique<Linear>(config_.width, config_.moe.experts, internal::join_name(config_.prefix, "gate"),
                                     config_.seed, router);
  for (int e = first_; e < first_ + local; ++e) {
    experts_.push_back(
        std::make_unique<SwiGLUMLP>(expert_config(config_, fmt::format("experts.{}", e), config_.moe.expert_hidden)));
    for (Parameter* p : experts_.back()->parameters()) p->info.expert = e, p->info.experts = config_.moe.experts;
  }
  if (config_.moe.shared_experts > 0)
    shared_ = std::make_unique<SwiGLUMLP>(
        expert_config(config_, "shared_experts", config_.moe.shared_experts * config_.moe.expert_hidden));
  bias_ = Tensor::zeros({config_.moe.experts}, DType::f32);
  load_.tokens.assign(static_cast<size_t>(config_.moe.experts), 0);
}

std::vector<Module*> MoE::children() {
  std::vector<Module*> out = {router_.get()};
  for (auto& e : experts_) out.push_back(e.get());
  if (shared_) out.push_back(shared_.get());
  return out;
}

std::vector<Parameter*> MoE::parameters() {
  std::vector<Parameter*> ps;
  for (Module* m : children())
    for (Parameter* p : m->parameters()) ps.push_back(p);
  return ps;
}

MoELoad MoE::take_load() {
  MoELoad out = load_;
  load_ = {};
  load_.tokens.assign(static_cast<size_t>(config_.moe.experts), 0);
  return out;
}

void MoE::update_bias(std::span<const int64_t> load, double rate) {
  const auto experts = static_cast<size_t>(config_.moe.experts);
  if (load.size() != experts)
    throw InvalidArgument("MoE::update_bias", fmt::format("'{}': {} loads for {} experts", config_.prefix,
                                                          load.size(), experts),
                          "pass one count per expert (every rank's take_load().tokens summed)");
  double mean = 0;
  for (int64_t l : load) mean += static_cast<double>(l);
  mean /= static_cast<double>(load.size());
  float* b = bias_.data<float>();
  for (size_t e = 0; e < experts; ++e) {
    const double l = static_cast<double>(load[e]);
    const double sign = l < mean ? 1.0 : (l > mean ? -1.0 : 0.0);
    b[e] = static_cast<float>(static_cast<double>(b[e]) + rate * sign);
  }
}

std::string MoE::bias_name() const { return internal::join_name(config_.prefix, "gate.e_score_correction_bias"); }

void MoE::set_bias(std::span<const float> bias) {
  if (bias.size() != static_cast<size_t>(config_.moe.experts))
    throw InvalidArgument("MoE::set_bias", fmt::format("'{}': {} values for {} experts", config_.prefix,
                                                       bias.size(), config_.moe.experts),
                          "pass one value per expert");
  std::copy(bias.begin(), bias.end(), bias_.data<float>());
}

std::vector<Tensor> MoE::dispatch(State& st, const Tensor& rows) {
  const int ranks = config_.expert.size(), local = local_experts();
  const int64_t width = config_.width;
  // The rows per local expert arrive as [source rank][expert][rows].
  std::vector<int64_t> per_expert(static_cast<size_t>(local), 0);
  for (int src = 0; src < ranks; ++src)
    for (int e = 0; e < local; ++e) per_expert[e] += st.recv_rows[src * local + e];
  Tensor received = rows;
  if (ranks > 1) {
    std::vector<size_t> send(ranks, 0), recv(ranks, 0);
    for (int p = 0; p < ranks; ++p)
      for (int e = 0; e < local; ++e) {
        send[p] += static_cast<size_t>(st.send_rows[p * local + e] * width);
        recv[p] += static_cast<size_t>(st.recv_rows[p * local + e] * width);
      }
    int64_t total = 0;
    for (int64_t n : per_expert) total += n;
    received = Tensor::empty({total, width}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
    const functional::ProfileScope scope("ep all_to_all");
    config_.expert.comm->all_to_all_v(rows.data<float>(), send, received.data<float>(), recv, DType::f32);
  }
  std::vector<Tensor> out;
  for (int e = 0; e < local; ++e)
    out.push_back(Tensor::empty({per_expert[e], width}, DType::f32, Device{}, tracker_, MemoryCategory::activations));
  std::vector<int64_t> filled(static_cast<size_t>(local), 0);
  const float* in = received.data<float>();
  for (int src = 0; src < ranks; ++src)
    for (int e = 0; e < local; ++e) {
      const int64_t n = st.recv_rows[src * local + e];
      if (n > 0) std::memcpy(out[e].data<float>() + filled[e] * width, in, sizeof(float) * n * width);
      filled[e] += n;
      in += n * width;
    }
  return out;
}

Tensor MoE::combine(State& st, const std::vector<Tensor>& per_expert) {
  const int ranks = config_.expert.size(), local = local_experts();
  const int64_t width = config_.width;
  int64_t total = 0;
  for (const Tensor& t : per_expert) total += t.size(0);
  // Back in [source rank][expert][rows], as dispatch received them.
  Tensor back = Tensor::empty({total, width}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  std::vector<int64_t> taken(static_cast<size_t>(local), 0);
  float* at = back.data<float>();
  for (int src = 0; src < ranks; ++src)
    for (int e = 0; e < local; ++e) {
      const int64_t n = st.recv_rows[src * local + e];
      if (n > 0) std::memcpy(at, per_expert[e].data<float>() + taken[e] * width, sizeof(float) * n * width);
      taken[e] += n;
      at += n * width;
    }
  if (ranks == 1) return back;
  std::vector<size_t> send(ranks, 0), recv(ranks, 0);
  for (int p = 0; p < ranks; ++p)
    for (int e = 0; e < local; ++e) {
      send[p] += static_cast<size_t>(st.recv_rows[p * local + e] * width);
      recv[p] += static_cast<size_t>(st.send_rows[p * local + e] * width);
    }
  Tensor mine = Tensor::empty({static_cast<int64_t>(st.order.size()), width}, DType::f32, Device{}, tracker_,
                              MemoryCategory::activations);
  {
    const functional::ProfileScope scope("ep all_to_all");
    config_.expert.comm->all_to_all_v(back.data<float>(), send, mine.data<float>(), recv, DType::f32);
  }
  return mine;
}

Tensor MoE::do_forward(const Tensor& x, Saved& saved) {
  if (x.dim() != 3 || x.size(2) != config_.width)
    throw InvalidArgument("MoE::forward",
                          fmt::format("'{}': input shape {}", config_.prefix, shape_to_string(x.shape())),
                          fmt::format("pass (batch, steps, {})", config_.width));
  State& st = saved.state<State>();
  const int64_t batch = x.size(0), steps = x.size(1), width = config_.width, n = batch * steps;
  const int E = config_.moe.experts, k = config_.moe.top_k;
  st.tokens = n;
  st.steps = steps;
  st.x = x.contiguous().view({n, width});

  // Scores and selection.
  const Tensor logits = router_->forward(st.x, saved.child(0)).contiguous();
  st.scores = Tensor::empty({n, E}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  const float* lg = logits.data<float>();
  float* s = st.scores.data<float>();
  st.expert.assign(static_cast<size_t>(n * k), 0);
  st.weight.assign(static_cast<size_t>(n * k), 0.0f);
  std::vector<float> choice(static_cast<size_t>(E));
  const float* bias = bias_.data<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* l = lg + t * E;
    float* st_row = s + t * E;
    if (config_.moe.score == RouterScore::softmax) {
      const float m = *std::max_element(l, l + E);
      double z = 0;
      for (int e = 0; e < E; ++e) z += std::exp(static_cast<double>(l[e] - m));
      for (int e = 0; e < E; ++e) st_row[e] = static_cast<float>(std::exp(static_cast<double>(l[e] - m)) / z);
    } else {
      for (int e = 0; e < E; ++e) st_row[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(l[e]))));
    }
    for (int e = 0; e < E; ++e) choice[e] = st_row[e] + bias[e];
    double sum = 0;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || st.expert[t * k + i] == e;
        if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
      }
      st.expert[t * k + j] = best;
      sum += st_row[best];
    }
    for (int j = 0; j < k; ++j) {
      const float w = st_row[st.expert[t * k + j]];
      st.weight[t * k + j] = config_.moe.normalize_top_k ? static_cast<float>(w / sum) : w;
    }
  }

  // Capacity, per sequence: slot 0 of every step first, then slot 1, ...
  std::vector<char> kept(static_cast<size_t>(n * k), 1);
  int64_t dropped = 0;
  if (config_.moe.capacity_factor > 0.0) {
    const auto cap = static_cast<int64_t>(
        std::ceil(config_.moe.capacity_factor * static_cast<double>(steps) * static_cast<double>(k) / E));
    std::vector<int64_t> used(static_cast<size_t>(E));
    for (int64_t b = 0; b < batch; ++b) {
      std::fill(used.begin(), used.end(), 0);
      for (int j = 0; j < k; ++j)
        for (int64_t t = b * steps; t < (b + 1) * steps; ++t) {
          const int64_t a = t * k + j;
          if (used[st.expert[a]]++ >= cap) kept[a] = 0, ++dropped;
        }
    }
  }

  // Dispatch order: by expert, then token; rows per (rank, local expert).
  const int ranks = config_.expert.size(), local = local_experts();
  std::vector<std::vector<int64_t>> by_expert(static_cast<size_t>(E));
  for (int64_t a = 0; a < n * k; ++a)
    if (kept[a]) by_expert[st.expert[a]].push_back(a);
  st.order.clear();
  st.row.assign(static_cast<size_t>(n * k), -1);
  st.send_rows.assign(static_cast<size_t>(ranks * local), 0);
  for (int e = 0; e < E; ++e) {
    st.send_rows[e] = static_cast<int64_t>(by_expert[e].size());  // e = rank * local + local index
    for (int64_t a : by_expert[e]) {
      st.row[a] = static_cast<int64_t>(st.order.size());
      st.order.push_back(a);
    }
  }
  st.recv_rows = st.send_rows;
  if (ranks > 1) {
    std::vector<int64_t> got(st.send_rows.size());
    const functional::ProfileScope scope("ep all_to_all");
    config_.expert.comm->all_to_all(st.send_rows.data(), got.data(), static_cast<size_t>(local), DType::i64);
    st.recv_rows = std::move(got);
  }

  // Experts.
  std::vector<int64_t> tokens_of(st.order.size());
  for (size_t i = 0; i < st.order.size(); ++i) tokens_of[i] = st.order[i] / k;
  Tensor rows = Tensor::empty({static_cast<int64_t>(st.order.size()), width}, DType::f32, Device{}, tracker_,
                              MemoryCategory::activations);
  gather_rows(st.x.data<float>(), tokens_of, width, rows.data<float>());
  std::vector<Tensor> outs = dispatch(st, rows);
  for (int e = 0; e < local; ++e) outs[e] = experts_[e]->forward(outs[e], saved.child(1 + e)).contiguous();
  st.out = combine(st, outs);

  // y = sum_j w_j expert_j(x) in slot order, + shared(x).
  Tensor y = Tensor::zeros({n, width}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  float* yp = y.data<float>();
  const float* op = st.out.data<float>();
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const int64_t r = st.row[t * k + j];
      if (r < 0) continue;
      const float w = st.weight[t * k + j];
      for (int64_t c = 0; c < width; ++c) yp[t * width + c] += w * op[r * width + c];
    }
  if (shared_) add(y, shared_->forward(st.x, saved.child(1 + local)).contiguous(), y);

  // The auxiliary loss's value and gradient per sequence.
  const double norm = batch_context().global_samples > 0 ? batch_context().global_samples
                                                         : static_cast<double>(batch);
  st.aux_grad.assign(static_cast<size_t>(batch * E), 0.0f);
  const bool counts = training() && !batch_context().replay;  // a recompute replay counted already
  double aux = 0;
  std::vector<double> count(static_cast<size_t>(E)), mean_p(static_cast<size_t>(E));
  for (int64_t b = 0; b < batch; ++b) {
    std::fill(count.begin(), count.end(), 0.0);
    std::fill(mean_p.begin(), mean_p.end(), 0.0);
    for (int64_t t = b * steps; t < (b + 1) * steps; ++t) {
      for (int j = 0; j < k; ++j) count[st.expert[t * k + j]] += 1;
      double z = 1;
      if (config_.moe.score == RouterScore::sigmoid) {
        z = 0;
        for (int e = 0; e < E; ++e) z += s[t * E + e];
      }
      for (int e = 0; e < E; ++e) mean_p[e] += s[t * E + e] / z;
    }
    const double scale = config_.moe.aux_loss_coef * E / (static_cast<double>(k) * static_cast<double>(steps));
    for (int e = 0; e < E; ++e) {
      aux += scale * count[e] * mean_p[e] / static_cast<double>(steps);
      st.aux_grad[b * E + e] = static_cast<float>(scale * count[e] / (static_cast<double>(steps) * norm));
      if (counts) load_.tokens[e] += static_cast<int64_t>(count[e]);
    }
  }
  if (counts) {
    load_.assignments += n * k;
    load_.dropped += dropped;
    load_.aux_loss += aux;
    load_.sequences += batch;
  }
  return y.view({batch, steps, width});
}

Tensor MoE::do_backward_input(const Tensor& grad_out, Saved& saved) {
  State& st = saved.state<State>();
  const int64_t n = st.tokens, width = config_.width;
  const int E = config_.moe.experts, k = config_.moe.top_k, local = local_experts();
  const Tensor dy = grad_out.contiguous().view({n, width});
  const float* dyp = dy.data<float>();
  const float* op = st.out.data<float>();

  // d w per assignment, and the experts' output gradients w dy (dispatch order).
  std::vector<double> dw(static_cast<size_t>(n * k), 0.0);
  Tensor drows = Tensor::empty({static_cast<int64_t>(st.order.size()), width}, DType::f32, Device{}, tracker_,
                               MemoryCategory::activations);
  float* dr = drows.data<float>();
  for (size_t i = 0; i < st.order.size(); ++i) {
    const int64_t a = st.order[i], t = a / k;
    const float w = st.weight[a];
    double dot = 0;
    for (int64_t c = 0; c < width; ++c) {
      dot += static_cast<double>(dyp[t * width + c]) * op[static_cast<int64_t>(i) * width + c];
      dr[static_cast<int64_t>(i) * width + c] = w * dyp[t * width + c];
    }
    dw[a] = dot;
  }
  std::vector<Tensor> grads = dispatch(st, drows);
  for (int e = 0; e < local; ++e)
    grads[e] = experts_[e]->backward_input(grads[e], saved.child(1 + e)).contiguous();
  const Tensor dx_rows = combine(st, grads);

  // Router: d s from the weights (and their normalization) and L_aux, then
  // through softmax or sigmoid.
  Tensor dlogits = Tensor::empty({n, E}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  const float* s = st.scores.data<float>();
  float* dl = dlogits.data<float>();
  std::vector<double> ds(static_cast<size_t>(E));
  for (int64_t t = 0; t < n; ++t) {
    const float* sr = s + t * E;
    const int64_t b = t / st.steps;
    std::fill(ds.begin(), ds.end(), 0.0);
    if (config_.moe.normalize_top_k) {
      double sum = 0, wdw = 0;
      for (int j = 0; j < k; ++j) sum += sr[st.expert[t * k + j]], wdw += dw[t * k + j] * st.weight[t * k + j];
      for (int j = 0; j < k; ++j) ds[st.expert[t * k + j]] += (dw[t * k + j] - wdw) / sum;
    } else {
      for (int j = 0; j < k; ++j) ds[st.expert[t * k + j]] += dw[t * k + j];
    }
    const float* g = st.aux_grad.data() + b * E;
    if (config_.moe.score == RouterScore::softmax) {
      for (int e = 0; e < E; ++e) ds[e] += g[e];
      double dot = 0;
      for (int e = 0; e < E; ++e) dot += sr[e] * ds[e];
      for (int e = 0; e < E; ++e) dl[t * E + e] = static_cast<float>(sr[e] * (ds[e] - dot));
    } else {
      double z = 0, gp = 0;
      for (int e = 0; e < E; ++e) z += sr[e];
      for (int e = 0; e < E; ++e) gp += g[e] * sr[e] / z;
      for (int e = 0; e < E; ++e) ds[e] += (g[e] - gp) / z;
      for (int e = 0; e < E; ++e) dl[t * E + e] = static_cast<float>(ds[e] * sr[e] * (1.0 - sr[e]));
    }
  }
  const Tensor dx_router = router_->backward_input(dlogits, saved.child(0)).contiguous();

  // dx = router's + the experts' in slot order + shared's.
  Tensor dx = Tensor::empty({n, width}, DType::f32, Device{}, tracker_, MemoryCategory::activations);
  std::memcpy(dx.data<float>(), dx_router.data<float>(), sizeof(float) * n * width);
  float* dxp = dx.data<float>();
  const float* back = dx_rows.data<float>();
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const int64_t r = st.row[t * k + j];
      if (r < 0) continue;
      for (int64_t c = 0; c < width; ++c) dxp[t * width + c] += back[r * width + c];
    }
  if (shared_) add(dx, shared_->backward_input(dy, saved.child(1 + local)).contiguous(), dx);
  st.out = Tensor();
  st.scores = Tensor();
  return dx.view(grad_out.shape());
}

// Reverse definition order: shared, experts (last first), router.
void MoE::do_backward_weight(Saved& saved) {
  const int local = local_experts();
  if (shared_) shared_->backward_weight(saved.child(1 + local));
  for (int e = local - 1; e >= 0; --e) experts_[e]->backward_weight(saved.child(1 + e));
  router_->backward_weight(saved.child(0));
  State& st = saved.state<State>();
  st.x = Tensor();
}

}  // namespace meshtrain::nn
