#include "meshtrain/train/internal/moe_report.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/nn/moe.h"

namespace meshtrain::train::internal {

MoeReport::MoeReport(MoELayers layers, comm::Communicator& world) : layers_(std::move(layers)) {
  int64_t shape[2] = {0, 0};  // blocks, experts
  for (const auto& [block, layer] : layers_)
    shape[0] = std::max(shape[0], block + 1), shape[1] = layer->config().moe.experts;
  world.all_reduce(shape, shape, 2, DType::i64, comm::ReduceOp::max);
  blocks_ = shape[0];
  experts_ = shape[1];
}

void MoeReport::step(int64_t step, bool applied, double bias_rate, comm::Communicator& tokens,
                     comm::Communicator* stages, bool record) {
  if (!active()) return;
  const size_t e = static_cast<size_t>(experts_), row = e + 4;  // tokens, assignments, dropped, aux, sequences
  std::vector<double> v(static_cast<size_t>(blocks_) * row, 0.0);
  for (const auto& [block, layer] : layers_) {
    const nn::MoELoad load = layer->take_load();
    double* r = v.data() + static_cast<size_t>(block) * row;
    for (size_t i = 0; i < e; ++i) r[i] = static_cast<double>(load.tokens[i]);
    r[e] = static_cast<double>(load.assignments);
    r[e + 1] = static_cast<double>(load.dropped);
    r[e + 2] = load.aux_loss;
    r[e + 3] = static_cast<double>(load.sequences);
  }
  tokens.all_reduce(v.data(), v.data(), v.size(), DType::f64, comm::ReduceOp::sum);
  if (stages != nullptr) stages->all_reduce(v.data(), v.data(), v.size(), DType::f64, comm::ReduceOp::sum);
  if (applied && bias_rate > 0)
    for (const auto& [block, layer] : layers_) {
      const double* r = v.data() + static_cast<size_t>(block) * row;
      std::vector<int64_t> counts(e);
      for (size_t i = 0; i < e; ++i) counts[i] = static_cast<int64_t>(r[i]);
      layer->update_bias(counts, bias_rate);
    }
  imbalance_ = aux_loss_ = 0;
  shares_.assign(e, 0.0);
  double assignments = 0, dropped = 0, all = 0;
  for (int64_t b = 0; b < blocks_; ++b) {
    const double* r = v.data() + static_cast<size_t>(b) * row;
    if (r[e + 3] == 0) continue;  // a dense block
    double most = 0, sum = 0;
    for (size_t i = 0; i < e; ++i) most = std::max(most, r[i]), sum += r[i], shares_[i] += r[i];
    if (sum > 0) imbalance_ = std::max(imbalance_, most / (sum / static_cast<double>(e)));
    assignments += r[e];
    dropped += r[e + 1];
    aux_loss_ += r[e + 2] / r[e + 3];
    all += sum;
  }
  dropped_ = assignments > 0 ? dropped / assignments : 0.0;
  for (double& x : shares_) x = all > 0 ? x / all : 0.0;
  if (!record) return;
  if (recorded_.empty())
    for (size_t i = 0; i < e; ++i) recorded_.push_back({fmt::format("expert {}", i), {}, {}});
  for (size_t i = 0; i < e; ++i) {
    recorded_[i].x.push_back(static_cast<double>(step));
    recorded_[i].y.push_back(shares_[i]);
  }
}

void MoeReport::add_progress(std::vector<std::pair<std::string, double>>& shown, bool dropping, bool aux) const {
  if (!active()) return;
  shown.emplace_back("imbalance", imbalance_);
  if (dropping) shown.emplace_back("dropped", dropped_);
  if (aux) shown.emplace_back("aux", aux_loss_);
}

void MoeReport::add_metrics(std::vector<std::pair<std::string, double>>& numbers) const {
  if (!active()) return;
  numbers.emplace_back("moe_imbalance", imbalance_);
  numbers.emplace_back("moe_dropped_fraction", dropped_);
  numbers.emplace_back("moe_aux_loss", aux_loss_);
  for (size_t i = 0; i < shares_.size(); ++i) numbers.emplace_back(fmt::format("moe_expert_{}_share", i), shares_[i]);
}

std::string MoeReport::picture(int64_t moe_layers) const {
  if (recorded_.empty()) return "";
  return line_chart_svg(fmt::format("share of the routed tokens per expert (all {} MoE layers; even: {:.3f})",
                                    moe_layers, 1.0 / static_cast<double>(experts_)),
                        "step", recorded_);
}

}  // namespace meshtrain::train::internal
